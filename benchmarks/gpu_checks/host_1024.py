"""Where the time of the peer grid's 1024-token rows goes (issue 27): per (4, 16, 1024, d) case,
ours and cuDNN in one plain process: the grid's ``do_bench`` fwd+bwd, host microseconds per
fwd+bwd call (no synchronization), GPU kernel time per fwd+bwd (profiler), our Python forward and
backward alone, a cProfile of our backward; then the grid itself on the 1024/2048 shapes.

    PYTHONPATH=. python3 benchmarks/gpu_checks/host_1024.py [--no-grid]
"""

import cProfile
import io
import pstats
import sys

import torch

from benchmarks import _peers
from benchmarks._harness import (
    _merged,
    bench,
    device_kernels,
    host_us,
    markdown_table,
    profiled,
)
from torch_flashsys import flash_attention
from torch_flashsys.attention import _ops
from torch_flashsys.attention._extras import CAUSAL, PLAIN

CASES = [(4, 16, 1024, d, c) for d in (64, 128) for c in (True, False)]


def gpu_ms(step, iters: int = 20) -> float:
    """Milliseconds of GPU activity (the union of kernels) per call of ``step``."""
    prof, _ = profiled(step, iters, warmup=3)
    spans = _merged([(s, e) for _, s, e in device_kernels(prof)])
    return sum(e - s for s, e in spans) / 1e3 / iters


def loop_us(fn, calls: int = 200) -> float:
    """Wall microseconds per call of ``fn`` (the harness's host_us, 10 warm-up calls)."""
    return host_us(fn, calls, warmup=10)["wall_us"]


def measure(case, cudnn, rows: list, profiles: list) -> None:
    """One case's rows (ours, cuDNN, our Python alone) and, at head dim 64, a cProfile."""
    b, h, n, d, causal = case
    q, k, v, dout = _peers.inputs((b, h, n, d), torch.bfloat16, "cuda", seed=n + d)
    label = f"{b}x{h}x{n}x{d} {'causal' if causal else 'full'}"
    impls = {"ours": lambda q, k, v: flash_attention(q, k, v, is_causal=causal),
             "cudnn": lambda q, k, v: cudnn(q, k, v, is_causal=causal)}  # fmt: skip
    for name, fn in impls.items():
        step = _peers.fwd_bwd(fn, (q, k, v), dout)
        step()
        row = {"case": label, "impl": name, "do_bench fwd+bwd ms": bench(step, "cuda")["median_ms"]}
        with torch.no_grad():
            row["do_bench fwd ms"] = bench(lambda fn=fn: fn(q, k, v), "cuda")["median_ms"]
        res = host_us(step, calls=300)
        row["host us/call"], row["cpu us/call"] = res["wall_us"], res["cpu_us"]
        row["gpu ms fwd+bwd"] = gpu_ms(step)
        rows.append(row)
    ex, scale = (CAUSAL if causal else PLAIN), d**-0.5
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = _ops._forward(qd, kd, vd, scale, ex)
    fwd = lambda: _ops._forward(qd, kd, vd, scale, ex)
    bwd = lambda: _ops._backward(dout, qd, kd, vd, out, lse, None, scale, ex)
    with torch.no_grad():
        plain = loop_us(lambda: impls["ours"](q, k, v))
    rows += [{"case": label, "impl": "ours: _ops._forward alone", "host us/call": loop_us(fwd)},
             {"case": label, "impl": "ours: _ops._backward alone", "host us/call": loop_us(bwd)},
             {"case": label, "impl": "ours: fwd under no_grad", "host us/call": plain}]  # fmt: skip
    if d == 64:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            bwd()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(16)
        profiles.append(f"## cProfile, 200 x _ops._backward, {label}\n"
                        + "\n".join(s.getvalue().splitlines()[-24:]))  # fmt: skip


def main() -> None:
    rows, profiles = [], []
    cudnn = _peers.sdpa_call("CUDNN_ATTENTION")
    for case in CASES:
        measure(case, cudnn, rows, profiles)
    for p in profiles:
        print(p, file=sys.stderr)
    if "--no-grid" not in sys.argv:
        _peers.SHAPES[:] = [(4, 16, 1024), (4, 16, 2048)]
        table, _ = _peers.summary(_peers.run_grid(workers=4))
        print(markdown_table(table, ["mode", "shape", "causal", *_peers.IMPLS, "ours / fastest"]))
    cols = ["case", "impl", "do_bench fwd+bwd ms", "do_bench fwd ms", "gpu ms fwd+bwd",
            "host us/call", "cpu us/call"]  # fmt: skip
    print(markdown_table(rows, cols))


if __name__ == "__main__":
    main()
