"""GPU box: how the Hopper backward's time per program depends on its length (head dim 128, the
split kernel; 64, the fused one), against cuDNN's backward, at equal work.

Each series keeps the work fixed (batch x length^2 constant) while the length, and so the query
steps per program, changes: a fixed cost per program (its key/value loads, the pipeline's fill,
the dK/dV epilogue, the last dQ reductions) shows as time growing with the number of programs.
Per problem: the fused kernel alone (``do_bench``, as ``sm90_bwd.py --variants`` times it: no
preprocessing or dQ conversion), the preprocessing and conversion kernels, and cuDNN's backward
(one forward kept, ``do_bench`` of its backward, host included), with TFLOP/s over the
backward's five products and the fitted cost per program.

    PYTHONPATH=. python3 benchmarks/gpu_checks/bwd_overhead.py [--out bwd_overhead.csv]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks import _peers
from benchmarks._harness import parser, report
from benchmarks.sm90_bwd import _fused_kernel, _problem
from torch_flashsys.attention import _sm90
from torch_flashsys.attention._extras import CAUSAL, PLAIN
from torch_flashsys.attention._ops import _forward

SERIES = {  # (batch, heads, kv heads, length, head dim, causal): the first three of equal work
    "d128 full": [(64, 16, 16, 512, 128, False), (16, 16, 16, 1024, 128, False),
                  (4, 16, 16, 2048, 128, False), (1, 16, 16, 4096, 128, False)],
    "d128 causal": [(16, 16, 16, 1024, 128, True), (4, 16, 16, 2048, 128, True),
                    (1, 16, 16, 4096, 128, True), (1, 16, 16, 8192, 128, True)],
    "d64 causal": [(16, 16, 16, 1024, 64, True), (4, 16, 16, 2048, 64, True),
                   (1, 16, 16, 4096, 64, True), (1, 16, 16, 8192, 64, True)],
}  # fmt: skip


def row(series: str, shape) -> dict:
    from triton.testing import do_bench

    b, h, _, n, d, causal = shape
    q, k, v, dout, label, _ = _problem(shape)
    o2, lse = _forward(q, k, v, d**-0.5, CAUSAL if causal else PLAIN)
    launch, *_ = _fused_kernel(q, k, v, dout, o2, lse, causal, {})
    launch()
    kernel = do_bench(launch, warmup=25, rep=200)
    prep = do_bench(lambda: _sm90.backward_prep(o2, dout, lse, None), warmup=25, rep=100)
    dq_acc = torch.zeros(q.shape, device="cuda", dtype=torch.float32)
    convert = do_bench(lambda: torch.empty_like(q).copy_(dq_acc), warmup=25, rep=100)
    cudnn = _peers.sdpa_call("CUDNN_ATTENTION", is_causal=causal)
    out = cudnn(q, k, v)
    cudnn_bwd = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                         warmup=25, rep=200)  # fmt: skip
    programs = _sm90.backward_grid(k)[0]
    flops = 5 * 2 * b * h * n * n * d / (2 if causal else 1)
    return {"series": series, "problem": label, "programs": programs,
            "steps per program": n / 64 / (2 if causal else 1), "kernel_ms": kernel,
            "kernel TFLOP/s": flops / kernel / 1e9, "prep_ms": prep, "convert_ms": convert,
            "ours bwd_ms": kernel + prep + convert, "cudnn bwd_ms": cudnn_bwd,
            "cudnn TFLOP/s": flops / cudnn_bwd / 1e9,
            "ours / cudnn": (kernel + prep + convert) / cudnn_bwd}  # fmt: skip


def main() -> None:
    args = parser(__doc__, smoke="(none: GPU only)").parse_args()
    rows = [row(series, shape) for series, shapes in SERIES.items() for shape in shapes]
    fits = []
    for series in SERIES:
        pts = [(r["programs"], r["kernel_ms"]) for r in rows if r["series"] == series]
        (p0, t0), (p2, t2) = pts[0], pts[2]  # equal work, 8x the programs in the first
        per = (t0 - t2) / (p0 - p2) * 1e3 * _sm90._sm_count(0)
        fits.append({"series": series, "us per program on its SM (first vs third problem)": per})
    report("Hopper backward at equal work: kernel, preprocessing, conversion, cuDNN (bf16, ms)",
           rows, list(rows[0]), args.out)  # fmt: skip
    report("Cost per program", fits, list(fits[0]), None)


if __name__ == "__main__":
    main()
