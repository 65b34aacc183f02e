"""The Hopper dK/dV kernel against the portable one, SDPA's cuDNN in the same run (H100/H200).

    python3 benchmarks/sm90_bwd.py [--out sm90_bwd_h100.csv]

Per shape (bf16): backward-only and fwd+bwd ``do_bench`` medians of flash_attention with the
portable backward, with the Hopper dK/dV kernel (pipelined and not), and of SDPA's cuDNN backend;
then each dK/dV kernel's own CUDA time (torch.profiler) and TFLOP/s over its four matmuls. The
gradients of the Hopper variants are checked against the portable ones on the way.
"""

from __future__ import annotations

import argparse
import csv
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from torch_flashsys import flash_attention
from torch_flashsys.attention import _sm90

SHAPES = [  # batch, query heads, key/value heads, length, head dim, causal
    (1, 16, 16, 16384, 64, True),
    (1, 16, 16, 16384, 128, True),
    (4, 16, 16, 4096, 128, True),
    (4, 16, 16, 4096, 64, False),
    (4, 32, 8, 2048, 64, True),
]
VARIANTS = {"portable": (False, True), "hopper": (True, True), "hopper, no pipeline": (True, False)}


def _grads(fn, q, k, v, dout):
    return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


def _kernel_ms(fn, q, k, v, dout, name_part: str, iters: int = 5) -> float:
    out = fn(q, k, v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if name_part in e.key)
    return total / iters / 1000


def rows_for(shape):
    b, h, hk, n, d, causal = shape
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)
    ours = lambda q, k, v: flash_attention(q, k, v, is_causal=causal, enable_gqa=h != hk)
    flops = 4 * 2 * b * h * n * n * d / (2 if causal else 1)  # dK/dV's four matmuls
    rows, reference = [], None
    for name, (on, pipeline) in VARIANTS.items():
        _sm90.BWD_ENABLED, _sm90.BWD_PIPELINE = on, pipeline
        grads = _grads(ours, q, k, v, dout)
        if reference is None:
            reference = grads
        diff = max((a.float() - r.float()).abs().max().item() for a, r in zip(grads, reference, strict=True))
        out = ours(q, k, v)
        bwd = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))  # noqa: B023
        both = do_bench(lambda: _grads(ours, q, k, v, dout))
        kernel = _kernel_ms(ours, q, k, v, dout, "dkdv")
        rows.append((name, bwd, both, kernel, flops / kernel / 1e9, diff))
    _sm90.BWD_ENABLED = False

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h != hk)

    out = cudnn(q, k, v)
    bwd = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    both = do_bench(lambda: _grads(cudnn, q, k, v, dout))
    rows.append(("sdpa cudnn", bwd, both, float("nan"), float("nan"), float("nan")))
    label = f"{b}x{h}/{hk}x{n}x{d}{' causal' if causal else ''}"
    return [(label, *r) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="CSV name, written under $OUT (or here)")
    args = parser.parse_args()
    rows = [r for shape in SHAPES for r in rows_for(shape)]
    header = ("shape", "impl", "bwd_ms", "fwd_bwd_ms", "dkdv_kernel_ms", "dkdv_tflops",
              "max_grad_diff_vs_portable")  # fmt: skip
    if args.out:
        with open(os.path.join(os.environ.get("OUT", "."), args.out), "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| " + " | ".join(header) + " |")
    for r in rows:
        print("| " + " | ".join(x if isinstance(x, str) else f"{x:.4g}" for x in r) + " |")


if __name__ == "__main__":
    main()
