"""Sweep the split-KV decode kernel's launch settings at the varlen preset's decode cases.

For each (BLOCK_N, num_warps, num_stages, programs per SM) of a small grid it times
``flash_attention(q, k_cache, v_cache, cache_seqlens=...)`` (``triton.testing.do_bench`` median) at
batch 8 / cache 32768 and batch 64 / cache 1024 (32 query heads, 8 KV heads, d 128, bf16), beside
SDPA's cuDNN backend and half a copy of the cache (reading K and V once). Markdown table, best
first; the current ``_triton_decode.CONFIG`` is marked::

    python benchmarks/tune_decode.py
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_flashsys import flash_attention
from torch_flashsys.attention import _triton_decode

CASES = [(8, 32768), (64, 1024)]
GRID = {
    "BLOCK_N": [64, 128],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4],
    "programs_per_sm": [1, 2, 4],
}


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        sys.exit("tune_decode.py needs a CUDA device")
    default = dict(_triton_decode.CONFIG)
    inputs = {}
    for batch, cache in CASES:
        q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (
            torch.randn(batch, 8, cache, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)
        )
        lens = torch.full((batch,), cache, device="cuda", dtype=torch.int32)
        inputs[(batch, cache)] = (q, kc, vc, lens)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, 32/8 heads, d 128\n")
    refs = []
    for (batch, cache), (q, kc, vc, _) in inputs.items():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cudnn = do_bench(
                lambda q=q, kc=kc, vc=vc: F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
            )
        dst = torch.empty_like(kc)
        copy = do_bench(lambda dst=dst, kc=kc, vc=vc: (dst.copy_(kc), dst.copy_(vc))) / 2
        refs.append(f"b{batch} c{cache}: SDPA cuDNN {cudnn:.4f} ms, copy bandwidth {copy:.4f} ms")
    results = []
    for values in itertools.product(*GRID.values()):
        config = dict(zip(GRID, values, strict=True))
        _triton_decode.CONFIG.update(config)
        times = []
        for q, kc, vc, lens in inputs.values():
            try:
                with torch.no_grad():
                    times.append(
                        do_bench(
                            lambda q=q, kc=kc, vc=vc, lens=lens: flash_attention(
                                q, kc, vc, cache_seqlens=lens, enable_gqa=True
                            )
                        )
                    )
            except Exception:  # a config that does not compile or fit: no time
                times.append(float("inf"))
        results.append((times, config))
    _triton_decode.CONFIG.update(default)
    results.sort(key=lambda r: sum(r[0]))
    print("\n".join(refs) + "\n")
    print(
        "| BLOCK_N | warps | stages | programs/SM | "
        + " | ".join(f"b{b} c{c} ms" for b, c in CASES)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(CASES))
    for times, config in results[:12] + [r for r in results[12:] if r[1] == default]:
        mark = " (current)" if config == default else ""
        print(
            f"| {config['BLOCK_N']} | {config['num_warps']} | {config['num_stages']} | "
            f"{config['programs_per_sm']}{mark} | " + " | ".join(f"{t:.4f}" for t in times) + " |"
        )


if __name__ == "__main__":
    main()
