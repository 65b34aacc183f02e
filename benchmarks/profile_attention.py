"""Where the time of one attention fwd+bwd goes: torch.profiler (CPU and CUDA) per kernel.

For each shape, ours beside SDPA's cuDNN and flash backends: a few warm fwd+bwd iterations under
``torch.profiler``, then per implementation the CUDA time of each kernel per iteration, the
kernels' total, the wall time per iteration (events; the GPU idles when this exceeds the kernel
total) and the CPU time the profiler saw. Markdown tables on stdout::

    python benchmarks/profile_attention.py                      # (1, 16, 16384, 64) and (1, 16, 4096, 64)
    python benchmarks/profile_attention.py --shapes 4x16x4096x128 --iters 10
    python benchmarks/profile_attention.py --shapes 4x16x4096x128 --features float-mask,dropout
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_flashsys import flash_attention


def _feature_kwargs(feature: str, shape) -> dict:
    """The call's arguments: ``causal`` (plain causal) or one of the issue-12 features (not causal)."""
    b, h, n, _ = shape
    if feature == "causal":
        return {"is_causal": True}
    if feature == "float-mask":
        return {"attn_mask": torch.randn(b, h, n, n, device="cuda", dtype=torch.bfloat16)}
    if feature == "key-padding":
        keep = torch.rand(b, device="cuda") * 0.4 + 0.5
        mask = torch.arange(n, device="cuda")[None, :] < (keep * n)[:, None]
        return {"attn_mask": mask.view(b, 1, 1, n)}
    if feature == "dropout":
        return {"dropout_p": 0.1}
    raise SystemExit(f"--features: unknown feature {feature!r}")


def _impls(kwargs: dict):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)

        return run

    return {
        "flash_attention": lambda q, k, v: flash_attention(q, k, v, **kwargs),
        "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }


def profile_one(fn, shape, iters: int) -> str:
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    g = torch.randn_like(q)

    def step():
        out = fn(q, k, v)
        out.backward(g)

    for _ in range(3):  # compile, autotune, warm caches
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / iters
    events = prof.key_averages()
    kernels = [
        e for e in events if getattr(e, "device_time_total", 0) > 0 and e.cpu_time_total == 0
    ]
    if (
        not kernels
    ):  # older profilers attribute kernels differently: take every event with CUDA time
        kernels = [e for e in events if getattr(e, "device_time_total", 0) > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    total_us = sum(e.device_time_total for e in kernels) / iters
    top_cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:4]
    lines = [f"wall {wall_ms:.3f} ms/iter, kernels {total_us / 1e3:.3f} ms/iter", ""]
    lines += ["| kernel | calls/iter | CUDA ms/iter | share |", "|---|---|---|---|"]
    for e in kernels[:6]:
        name = e.key if len(e.key) < 70 else e.key[:67] + "..."
        ms = e.device_time_total / iters / 1e3
        lines.append(
            f"| `{name}` | {e.count / iters:g} | {ms:.3f} | {100 * ms * 1e3 / max(total_us, 1e-9):.0f}% |"
        )
    lines += ["", "top self-CPU ops (us/iter): " + ", ".join(
        f"{e.key} {e.self_cpu_time_total / iters:.0f}" for e in top_cpu
    )]  # fmt: skip
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shapes", default="1x16x16384x64,1x16x4096x64", help="BxHxLxD, comma-separated"
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--features",
        default="causal",
        help="comma-separated: causal, float-mask, key-padding, dropout",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_attention.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, fwd+bwd\n")
    for spec, feature in itertools.product(args.shapes.split(","), args.features.split(",")):
        shape = tuple(int(x) for x in spec.split("x"))
        for name, fn in _impls(_feature_kwargs(feature, shape)).items():
            print(f"### {name} {shape} {feature}\n")
            try:
                print(profile_one(fn, shape, args.iters) + "\n")
            except Exception as exc:  # a peer that cannot run: a line
                print(f"cannot run: {type(exc).__name__}: {str(exc)[:100]}\n")


if __name__ == "__main__":
    main()
