"""Where the time of one attention fwd+bwd goes: torch.profiler (CPU and CUDA) per kernel.

For each shape, ours beside SDPA's cuDNN and flash backends: a few warm fwd+bwd iterations under
``torch.profiler``, then per implementation the CUDA time of each kernel per iteration, the
kernels' total, the wall time per iteration (synchronized; the GPU idles when this exceeds the kernel
total) and the CPU time the profiler saw. Markdown tables on stdout::

    python benchmarks/profile_attention.py                      # (1, 16, 16384, 64) and (1, 16, 4096, 64)
    python benchmarks/profile_attention.py --shapes 4x16x4096x128 --iters 10
    python benchmarks/profile_attention.py --shapes 4x16x4096x128 --features float-mask,dropout
    python benchmarks/profile_attention.py --smoke --out rows.json   # CPU, seconds (operators)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import print_report, write_results
from benchmarks._peers import _sdpa_call
from torch_flashsys import flash_attention


def _feature_kwargs(feature: str, shape, device: str = "cuda") -> dict:
    """The call's arguments: ``causal`` (plain causal) or one of the issue-12 features (not causal)."""
    b, h, n, _ = shape
    if feature == "causal":
        return {"is_causal": True}
    if feature == "float-mask":
        return {
            "attn_mask": torch.randn(
                b,
                h,
                n,
                n,
                device=device,
                dtype=torch.bfloat16 if device == "cuda" else torch.float32,
            )
        }
    if feature == "key-padding":
        keep = torch.rand(b, device=device) * 0.4 + 0.5
        mask = torch.arange(n, device=device)[None, :] < (keep * n)[:, None]
        return {"attn_mask": mask.view(b, 1, 1, n)}
    if feature == "dropout":
        return {"dropout_p": 0.1}
    raise SystemExit(f"--features: unknown feature {feature!r}")


def _impls(kwargs: dict, device: str = "cuda"):
    ours = {"flash_attention": lambda q, k, v: flash_attention(q, k, v, **kwargs)}
    backends = ("CUDNN_ATTENTION", "FLASH_ATTENTION") if device == "cuda" else ("MATH",)
    return ours | {f"sdpa {b.split('_')[0].lower()}": _sdpa_call(b, kwargs) for b in backends}


def profile_one(fn, shape, iters: int, device: str) -> tuple[str, list[dict]]:
    """Markdown section and rows (one per kernel, the top six) for ``iters`` profiled fwd+bwd."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)

    def step():
        out = fn(q, k, v)
        out.backward(g)

    for _ in range(3):  # compile, autotune, warm caches
        step()
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / iters
    events = prof.key_averages()
    if device == "cuda":  # kernels: device time and no CPU time of their own
        kernels = [e for e in events if getattr(e, "device_time_total", 0) > 0]
        kernels = [e for e in kernels if e.cpu_time_total == 0] or kernels
        time_of = lambda e: e.device_time_total
    else:  # CPU: the operators' own time
        kernels = list(events)
        time_of = lambda e: e.self_cpu_time_total
    kernels.sort(key=lambda e: -time_of(e))
    total_us = sum(time_of(e) for e in kernels) / iters
    lines = [f"wall {wall_ms:.3f} ms/iter, kernels {total_us / 1e3:.3f} ms/iter", ""]
    lines += ["| kernel | calls/iter | ms/iter | share |", "|---|---|---|---|"]
    rows = []
    for e in kernels[:6]:
        name = e.key if len(e.key) < 70 else e.key[:67] + "..."
        ms = time_of(e) / iters / 1e3
        share = 100 * ms * 1e3 / max(total_us, 1e-9)
        lines.append(f"| `{name}` | {e.count / iters:g} | {ms:.3f} | {share:.0f}% |")
        rows.append({"kernel": name, "calls_per_iter": e.count / iters, "ms_per_iter": ms,
                     "wall_ms": wall_ms, "kernels_ms": total_us / 1e3})  # fmt: skip
    top_cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:4]
    lines += ["", "top self-CPU ops (us/iter): " + ", ".join(
        f"{e.key} {e.self_cpu_time_total / iters:.0f}" for e in top_cpu
    )]  # fmt: skip
    return "\n".join(lines), rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shapes", default="1x16x16384x64,1x16x4096x64", help="BxHxLxD, comma-separated"
    )
    p.add_argument("--iters", type=int, default=5, help="profiled fwd+bwd iterations (default 5)")
    p.add_argument(
        "--features",
        default="causal",
        help="comma-separated: causal, float-mask, key-padding, dropout",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shape on CPU (operators, not kernels)"
    )
    p.add_argument(
        "--out", help="write one row per (impl, shape, feature, kernel) to .json or .csv"
    )
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.shapes, args.iters = "1x2x128x16", 2
    elif device != "cuda":
        sys.exit("profile_attention.py needs a CUDA device (or --smoke)")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, fwd+bwd\n")
    rows, summary = [], []
    for spec, feature in itertools.product(args.shapes.split(","), args.features.split(",")):
        shape = tuple(int(x) for x in spec.split("x"))
        for impl, fn in _impls(_feature_kwargs(feature, shape, device), device).items():
            print(f"### {impl} {shape} {feature}\n")
            base = {"impl": impl, "shape": spec, "feature": feature}
            try:
                text, kernel_rows = profile_one(fn, shape, args.iters, device)
            except Exception as exc:  # a peer that cannot run: a line
                print(f"cannot run: {type(exc).__name__}: {str(exc)[:100]}\n")
                summary.append({**base, "note": type(exc).__name__})
                continue
            print(text + "\n")
            rows += [{**base, **r} for r in kernel_rows]
            top = kernel_rows[0] if kernel_rows else {}
            summary.append({**base, "wall_ms": top.get("wall_ms"), "kernels_ms": top.get("kernels_ms"),
                            "top kernel": top.get("kernel")})  # fmt: skip
    write_results(args.out, rows)
    print_report(
        "Summary",
        summary,
        ["impl", "shape", "feature", "wall_ms", "kernels_ms", "top kernel", "note"],
    )


if __name__ == "__main__":
    main()
