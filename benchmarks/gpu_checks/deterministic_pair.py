"""Issue 27's deterministic target in one process: fwd+bwd of ``flash_attention`` under
``torch.use_deterministic_algorithms(True)``, its default (fastest) path, and SDPA's cuDNN
backend, in rounds of alternating order (``do_bench`` medians), plus a bitwise check that two
deterministic backwards give the same gradients.

    PYTHONPATH=. python3 benchmarks/gpu_checks/deterministic_pair.py --rounds 4
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from torch_flashsys import flash_attention


def _step(fn, q, k, v, g):
    def run():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(g)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1,16,16384,64", help="batch,heads,seq,head_dim (causal)")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g = (
        torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_()
    ours = _step(lambda q, k, v: flash_attention(q, k, v, is_causal=True), q, k, v, g)

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    theirs = _step(cudnn, q, k, v, g)
    times: dict[str, list[float]] = {"deterministic": [], "default": [], "cudnn": []}
    for r in range(args.rounds):
        order = list(times) if r % 2 == 0 else list(reversed(times))
        for name in order:
            torch.use_deterministic_algorithms(name == "deterministic", warn_only=True)
            times[name].append(do_bench(theirs if name == "cudnn" else ours, rep=200))
    torch.use_deterministic_algorithms(True, warn_only=True)
    grads = []
    for _ in range(2):
        ours()
        grads.append([t.grad.clone() for t in (q, k, v)])
    first, second = grads
    same = all(torch.equal(a, c) for a, c in zip(first, second, strict=True))
    torch.use_deterministic_algorithms(False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.shape} causal")
    print("| path | fwd+bwd ms (median of rounds) | rounds | / cuDNN |")
    print("|---|---|---|---|")
    base = statistics.median(times["cudnn"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {', '.join(f'{t:.3f}' for t in ts)} | {med / base:.3f} |")
    print(f"deterministic gradients bitwise equal across two backwards: {same}")


if __name__ == "__main__":
    main()
