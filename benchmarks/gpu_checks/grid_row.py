"""One peer-grid row as the grid's worker times it (its whole share prepared first) against the
same case alone in a fresh process, with each run's CUDA kernel times of our fwd+bwd, the
per-round medians the grid's row is the median of, and the wall time per call of a loop of our
eager fwd+bwd (synchronized once at its end: the host's time per call where it exceeds the
GPU's) with Python's garbage collector on and off (issue 27: (4, 16, 4096, 128) without a causal
mask measured 4.65-4.76 ms in the grid, 3.69 alone; (4, 16, 2048, 64) causal 0.38-0.42 ms in
some grids, 0.50-0.91 in others).

    PYTHONPATH=. python3 benchmarks/gpu_checks/grid_row.py [--share B,H,L,D,causal;...] [--case I]

Default share: the grid's fifth worker's ((4, 16, 4096, 128) and (4, 16, 2048, 128), no mask);
``--case``: which of the share's cases runs alone and is profiled (default 0).
"""

import gc
import subprocess
import sys

import torch

from benchmarks import _peers
from benchmarks._harness import host_us, markdown_table


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


def loop_us(case, calls: int = 300) -> list[dict]:
    """Wall microseconds per call of ``calls`` eager fwd+bwd calls of ours, synchronized once at
    the end, with the garbage collector on and off."""
    from torch_flashsys import flash_attention

    b, h, n, d, causal = case
    q, k, v, dout = _peers.inputs((b, h, n, d), torch.bfloat16, "cuda", seed=n + d + causal)
    step = _peers.fwd_bwd(lambda q, k, v: flash_attention(q, k, v, is_causal=causal), (q, k, v),
                          dout)  # fmt: skip
    rows = []
    for collector in ("on", "off", "on"):
        (gc.enable if collector == "on" else gc.disable)()
        wall = host_us(step, calls, warmup=1, synchronized=True)["wall_us"]
        rows.append({"gc": collector, "us per call": wall})
    gc.enable()
    return rows


def timed(share, profile_case) -> list[dict]:
    rows = [r for part in _peers.run_share(share) for r in part]
    out = [{"impl": r["impl"], "case": f"{r['batch']}x{r['heads']}x{r['seq']}x{r['head_dim']}"
            f"{'c' if r['causal'] else ''}", "mode": r["mode"], "ms": r["ms"],
            "spread": r.get("spread")}
           for r in rows if r["impl"] in ("flash_attention", "sdpa cudnn")]  # fmt: skip
    print(markdown_table(out, list(out[0])))
    ktimes = kernel_times(profile_case)
    print(markdown_table(ktimes, list(ktimes[0])))
    loops = loop_us(profile_case)
    print(markdown_table(loops, list(loops[0])))
    return out


def _case(text: str) -> tuple:
    b, h, n, d, causal = text.split(",")
    return int(b), int(h), int(n), int(d), causal in ("1", "True", "true")


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--alone":
        case = tuple(int(x) for x in args[1:5]) + (args[5] == "True",)
        print("== alone", case)
        timed([case], case)
        return
    share = [(4, 16, 4096, 128, False), (4, 16, 2048, 128, False)]
    index = 0
    if "--share" in args:
        share = [_case(c) for c in args[args.index("--share") + 1].split(";")]
    if "--case" in args:
        index = int(args[args.index("--case") + 1])
    print("== share", share)
    chosen = share[index]
    cmd = [sys.executable, __file__, "--alone", *map(str, chosen)]
    subprocess.run(cmd, check=True)  # a fresh process first, then the share in this one
    timed(share, chosen)
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
