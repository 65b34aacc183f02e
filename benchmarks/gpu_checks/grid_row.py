"""One peer-grid row as the grid's worker times it (its whole share prepared first) against the
same case alone in a fresh process, with each run's CUDA kernel times of our fwd+bwd (issue 27:
(4, 16, 4096, 128) without a causal mask measured 4.65-4.76 ms in the grid, 3.69 alone).

    PYTHONPATH=. python3 benchmarks/gpu_checks/grid_row.py [B H L D causal ...]

Default share: the grid's fifth worker's ((4, 16, 4096, 128) and (4, 16, 2048, 128), no mask).
"""

import subprocess
import sys

import torch

from benchmarks import _peers
from benchmarks._harness import markdown_table


def kernel_times(case) -> list[dict]:
    """CUDA microseconds per kernel of one of our fwd+bwd calls (after warm-up), and the total."""
    from torch.profiler import ProfilerActivity, profile

    from torch_flashsys import flash_attention

    b, h, n, d, causal = case
    q, k, v, dout = _peers.inputs((b, h, n, d), torch.bfloat16, "cuda", seed=n + d + causal)
    step = _peers.fwd_bwd(lambda q, k, v: flash_attention(q, k, v, is_causal=causal), (q, k, v),
                          dout)  # fmt: skip
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:60], "us per call": e.device_time_total / 5}
            for e in prof.key_averages() if e.device_time_total > 0]  # fmt: skip
    return sorted(rows, key=lambda r: -r["us per call"])


def timed(share, profile_case) -> list[dict]:
    rows = [r for part in _peers.run_share(share) for r in part]
    out = [{"impl": r["impl"], "case": f"{r['batch']}x{r['heads']}x{r['seq']}x{r['head_dim']}"
            f"{'c' if r['causal'] else ''}", "mode": r["mode"], "ms": r["ms"]}
           for r in rows if r["impl"] in ("flash_attention", "sdpa cudnn")]  # fmt: skip
    print(markdown_table(out, list(out[0])))
    ktimes = kernel_times(profile_case)
    print(markdown_table(ktimes, list(ktimes[0])))
    return out


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--alone":
        case = tuple(int(x) for x in args[1:5]) + (args[5] == "True",)
        print("== alone", case)
        timed([case], case)
        return
    share = [(4, 16, 4096, 128, False), (4, 16, 2048, 128, False)]
    print("== share", share)
    first = share[0]
    cmd = [sys.executable, __file__, "--alone", *map(str, first)]
    subprocess.run(cmd, check=True)  # a fresh process first, then the share in this one
    timed(share, first)
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
