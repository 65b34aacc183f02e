"""Host time of an eager no-grad forward (the peer grid's ``fwd`` rows at 1024 tokens are bound
by it): wall microseconds per call of flash_attention and of SDPA's default in loops where the
GPU keeps up, then a cProfile of ours (cumulative and own time).

    PYTHONPATH=. python3 benchmarks/gpu_checks/host_fwd.py [--shape 4x16x1024x64c] [--top 25]
"""

import argparse
import cProfile
import io
import pstats

import torch
import torch.nn.functional as F

from benchmarks._harness import host_us
from torch_flashsys import flash_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="4x16x1024x64c")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    causal = args.shape.endswith("c")
    b, h, n, d = map(int, args.shape.rstrip("c").split("x"))
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fns = {"flash_attention": lambda: flash_attention(q, k, v, is_causal=causal),
           "sdpa default": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
           "floor: q * 1.0": lambda: q * 1.0}  # fmt: skip
    with torch.no_grad():
        wall_us = lambda fn: host_us(fn, args.calls, 20, synchronized=True)["wall_us"]
        for rnd in range(3):
            print(f"round {rnd}: " + ", ".join(
                f"{name} {wall_us(fn):.1f} us" for name, fn in fns.items()))  # fmt: skip
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fns["flash_attention"]()
        prof.disable()
        torch.cuda.synchronize()
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(out.getvalue()[-6000:])


if __name__ == "__main__":
    main()
