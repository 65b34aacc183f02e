"""Sweep the split-KV decode kernel's launch settings at the varlen preset's decode cases.

For each (BLOCK_N, num_warps, num_stages, programs per SM) of a small grid it times
``flash_attention(q, k_cache, v_cache, cache_seqlens=...)`` (``triton.testing.do_bench`` median) at
batch 8 / cache 32768 and batch 64 / cache 1024 (32 query heads, 8 KV heads, d 128, bf16), beside
SDPA's cuDNN backend and half a copy of the cache (reading K and V once). Markdown table, best
first; the current ``_triton_decode.CONFIG`` is marked::

    python benchmarks/tune_decode.py
    python benchmarks/tune_decode.py --smoke --out rows.json     # CPU, seconds
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import time_fn, write_results
from benchmarks._peers import _sdpa_call
from torch_flashsys import flash_attention
from torch_flashsys.attention import _triton_decode

CASES = [(8, 32768), (64, 1024)]
GRID = {
    "BLOCK_N": [64, 128],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4],
    "programs_per_sm": [1, 2, 4],
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--smoke", action="store_true", help="tiny cases and grid on CPU (the torch backend)"
    )
    p.add_argument("--out", help="write one row per (config, case) to .json or .csv")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device != "cuda" and not args.smoke:
        sys.exit("tune_decode.py needs a CUDA device (or --smoke)")
    cases, grid = CASES, GRID
    heads, kv_heads, dim, dtype = 32, 8, 128, torch.bfloat16
    if args.smoke:
        cases, grid = [(2, 256)], {"BLOCK_N": [64], "num_warps": [4], "num_stages": [2],
                                   "programs_per_sm": [1, 2]}  # fmt: skip
        heads, kv_heads, dim, dtype = 4, 2, 16, torch.float32

    def timed(fn) -> float:
        if device == "cuda":
            from triton.testing import do_bench

            return do_bench(fn)
        return time_fn(fn, warmup=1, reps=3)["median_ms"]

    default = dict(_triton_decode.CONFIG)
    inputs = {}
    for batch, cache in cases:
        q = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype)
        kc, vc = (
            torch.randn(batch, kv_heads, cache, dim, device=device, dtype=dtype) for _ in range(2)
        )
        lens = torch.full((batch,), cache, device=device, dtype=torch.int32)
        inputs[(batch, cache)] = (q, kc, vc, lens)
    refs = []
    for (batch, cache), (q, kc, vc, _) in inputs.items():
        backend = "CUDNN_ATTENTION" if device == "cuda" else "MATH"
        sdpa_fn = _sdpa_call(backend, {"enable_gqa": True})
        sdpa = timed(lambda q=q, kc=kc, vc=vc, f=sdpa_fn: f(q, kc, vc))
        dst = torch.empty_like(kc)
        copy = timed(lambda dst=dst, kc=kc, vc=vc: (dst.copy_(kc), dst.copy_(vc))) / 2
        refs.append(
            f"b{batch} c{cache}: SDPA {backend} {sdpa:.4f} ms, copy bandwidth {copy:.4f} ms"
        )
    results, rows = [], []
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid, values, strict=True))
        _triton_decode.CONFIG.update(config)
        times = []
        for (batch, cache), (q, kc, vc, lens) in inputs.items():
            try:
                with torch.no_grad():
                    ms = timed(
                        lambda q=q, kc=kc, vc=vc, lens=lens: flash_attention(
                            q, kc, vc, cache_seqlens=lens, enable_gqa=True
                        )
                    )
            except Exception:  # a config that does not compile or fit: no time
                ms = float("inf")
            times.append(ms)
            rows.append({**config, "case": f"b{batch} c{cache}", "ms": ms})
        results.append((times, config))
    _triton_decode.CONFIG.update(default)
    results.sort(key=lambda r: sum(r[0]))
    write_results(args.out, rows)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (torch backend)"
    print(f"{name}, torch {torch.__version__}, {heads}/{kv_heads} heads, d {dim}\n")
    print("\n".join(refs) + "\n")
    print(
        "| BLOCK_N | warps | stages | programs/SM | "
        + " | ".join(f"b{b} c{c} ms" for b, c in cases)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(cases))
    for times, config in results[:12] + [r for r in results[12:] if r[1] == default]:
        mark = " (current)" if config == default else ""
        print(
            f"| {config['BLOCK_N']} | {config['num_warps']} | {config['num_stages']} | "
            f"{config['programs_per_sm']}{mark} | " + " | ".join(f"{t:.4f}" for t in times) + " |"
        )


if __name__ == "__main__":
    main()
