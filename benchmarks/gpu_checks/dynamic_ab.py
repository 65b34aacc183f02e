"""GPU box: flash_attention with the forward's dynamic schedule on and off (``_sm90.FWD_DYNAMIC``)
on the peer grid's causal rows, cuDNN beside them: fwd and fwd+bwd ``do_bench`` medians, the
CUDA time of one fwd+bwd's kernels (torch.profiler) and the host time per fwd+bwd call (wall
time of 200 calls without synchronizing); the variants interleaved, two rounds.

    python3 benchmarks/gpu_checks/dynamic_ab.py [--out dynamic_ab.csv]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks._harness import bench, host_us, kernel_ms, parser, report
from benchmarks._peers import sdpa_call
from torch_flashsys import flash_attention
from torch_flashsys.attention import _sm90

SHAPES = [(4, 16, 1024, 64), (4, 16, 2048, 64), (4, 16, 2048, 128), (4, 16, 4096, 128),
          (1, 16, 16384, 128)]  # fmt: skip


def _host_us(step, calls: int = 200) -> float:
    return host_us(step, calls, warmup=10)["wall_us"]


def rows_for(shape, round_: int) -> list[dict]:
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    dout = torch.randn_like(q)
    cudnn = sdpa_call("CUDNN_ATTENTION", is_causal=True)
    impls = {"dynamic": (flash_attention, True), "one program per tile": (flash_attention, False),
             "sdpa cudnn": (cudnn, None)}  # fmt: skip
    rows = []
    for name, (fn, dynamic) in impls.items():
        saved = _sm90.FWD_DYNAMIC
        _sm90.FWD_DYNAMIC = bool(dynamic)
        try:

            def call(fn=fn):
                return fn(q, k, v, is_causal=True) if fn is flash_attention else fn(q, k, v)

            def fwd():
                with torch.no_grad():
                    return call()

            def step():
                return torch.autograd.grad(call(), (q, k, v), dout)

            rows.append({"round": round_, "shape": "x".join(map(str, shape)) + " causal",
                         "impl": name, "fwd_ms": bench(fwd, "cuda")["median_ms"],
                         "fwd_bwd_ms": bench(step, "cuda")["median_ms"],
                         "fwd_bwd_kernels_ms": kernel_ms(step),
                         "host_us_per_fwd_bwd": _host_us(step)})  # fmt: skip
        finally:
            _sm90.FWD_DYNAMIC = saved
    return rows


def main() -> None:
    args = parser(__doc__, smoke="(none: GPU only)").parse_args()
    rows = [r for round_ in (1, 2) for shape in SHAPES for r in rows_for(shape, round_)]
    report("Forward's dynamic schedule on and off, in fwd and fwd+bwd (causal, bf16)", rows,
           ("round", "shape", "impl", "fwd_ms", "fwd_bwd_ms", "fwd_bwd_kernels_ms",
            "host_us_per_fwd_bwd"), args.out)  # fmt: skip


if __name__ == "__main__":
    main()
