"""GPU box: the Hopper kernels with and without pinned product waits (``_sm90.FWD_PIN_WAIT``,
``BWD_PIN_WAIT``) on the peer grid's problems, cuDNN beside them.

Offline SASS (``python -m tests.attention.sm90_offline schedule``) shows ptxas hoisting the
consumers' wait for ``P V`` (forward) and for ``dP^T`` (fused backward) above the exponentials
written to overlap it; a clock read before the wait keeps it in place. This measures what that
is worth: per problem, the forward's outputs and the backward's dK/dV (and dQ under
deterministic algorithms) compared bit for bit between the two builds, then, interleaved over
two rounds, ``do_bench`` medians of fwd (no grad) and fwd+bwd and the CUDA time of one fwd+bwd's
kernels (torch.profiler), for unpinned, pinned and SDPA's cuDNN.

    PYTHONPATH=. python3 benchmarks/gpu_checks/pin_wait_ab.py [--out pin_wait_ab.csv]
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks import _peers
from benchmarks._harness import bench, kernel_ms, parser, report
from torch_flashsys import flash_attention
from torch_flashsys.attention import _sm90

CASES = [(b, h, n, d, c) for (b, h, n) in _peers.SHAPES for d in (64, 128) for c in (True, False)]


@contextlib.contextmanager
def pinned(on: bool):
    """Both pins set to ``on`` (the forward's for every head dim and mask), the kept launches
    dropped before and after (a kept launch would keep the other build: the pins are
    compile-time and not in the launch keys)."""
    saved = (_sm90.FWD_PIN_WAIT, _sm90.BWD_PIN_WAIT)
    _sm90.FWD_PIN_WAIT, _sm90.BWD_PIN_WAIT = dict.fromkeys(saved[0], on), on
    _sm90.forget_launches()
    try:
        yield
    finally:
        _sm90.FWD_PIN_WAIT, _sm90.BWD_PIN_WAIT = saved
        _sm90.forget_launches()


def _results(q, k, v, dout, causal: bool) -> tuple:
    """out, and the gradients under deterministic algorithms (dQ in a fixed order where the
    fused kernel runs deterministically; the portable backward elsewhere, equal anyway)."""
    with torch.no_grad():
        out = flash_attention(q, k, v, is_causal=causal)
    torch.use_deterministic_algorithms(True)
    try:
        grads = torch.autograd.grad(flash_attention(q, k, v, is_causal=causal), (q, k, v), dout)
    finally:
        torch.use_deterministic_algorithms(False)
    return (out, *grads)


def same_bits(case) -> dict:
    b, h, n, d, causal = case
    q, k, v, dout = _peers.inputs((b, h, n, d), torch.bfloat16, "cuda", seed=n + d + causal)
    runs = []
    for on in (False, True):
        with pinned(on):
            runs.append(_results(q, k, v, dout, causal))
    equal = [torch.equal(a, b) for a, b in zip(*runs, strict=True)]
    return {"case": _label(case), "out": equal[0], "dq (det.)": equal[1], "dk": equal[2],
            "dv": equal[3]}  # fmt: skip


def _label(case) -> str:
    b, h, n, d, causal = case
    return f"{b}x{h}x{n}x{d}{' causal' if causal else ''}"


def timed_rows(case, round_: int) -> list[dict]:
    b, h, n, d, causal = case
    q, k, v, dout = _peers.inputs((b, h, n, d), torch.bfloat16, "cuda", seed=n + d + causal)
    cudnn = _peers.sdpa_call("CUDNN_ATTENTION", is_causal=causal)
    rows = []
    for name in ("unpinned", "pinned", "sdpa cudnn"):
        fn = cudnn if name == "sdpa cudnn" else (lambda q, k, v: flash_attention(
            q, k, v, is_causal=causal))  # fmt: skip
        with pinned(name == "pinned") if name != "sdpa cudnn" else contextlib.nullcontext():
            step = _peers.fwd_bwd(fn, (q, k, v), dout)

            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(q, k, v)

            fwd(), step()  # compile and keep the launches before timing
            rows.append({"round": round_, "case": _label(case), "impl": name,
                         "fwd_ms": bench(fwd, "cuda")["median_ms"],
                         "fwd_bwd_ms": bench(step, "cuda")["median_ms"],
                         "fwd_bwd_kernels_ms": kernel_ms(step)})  # fmt: skip
    return rows


def main() -> None:
    args = parser(__doc__, smoke="(none: GPU only)").parse_args()
    bits = [same_bits(case) for case in CASES]
    report("Pinned against unpinned waits: equal bits", bits, list(bits[0]), None)
    rows = [r for round_ in (1, 2) for case in CASES for r in timed_rows(case, round_)]
    report("Pinned product waits: fwd, fwd+bwd and fwd+bwd kernel time (bf16, ms)", rows,
           ("round", "case", "impl", "fwd_ms", "fwd_bwd_ms", "fwd_bwd_kernels_ms"), args.out)  # fmt: skip
    by = {(r["case"], r["impl"]): [] for r in rows}
    for r in rows:
        by[(r["case"], r["impl"])].append(r)
    summary = []
    for case in dict.fromkeys(r["case"] for r in rows):
        mean = {impl: {key: sum(r[key] for r in by[(case, impl)]) / len(by[(case, impl)])
                       for key in ("fwd_ms", "fwd_bwd_ms", "fwd_bwd_kernels_ms")}
                for impl in ("unpinned", "pinned", "sdpa cudnn")}  # fmt: skip
        summary.append({"case": case,
                        "fwd pinned/unpinned": mean["pinned"]["fwd_ms"] / mean["unpinned"]["fwd_ms"],
                        "fwd+bwd pinned/unpinned": mean["pinned"]["fwd_bwd_ms"]
                        / mean["unpinned"]["fwd_bwd_ms"],
                        "kernels pinned/unpinned": mean["pinned"]["fwd_bwd_kernels_ms"]
                        / mean["unpinned"]["fwd_bwd_kernels_ms"],
                        "fwd pinned/cudnn": mean["pinned"]["fwd_ms"] / mean["sdpa cudnn"]["fwd_ms"],
                        "fwd+bwd pinned/cudnn": mean["pinned"]["fwd_bwd_ms"]
                        / mean["sdpa cudnn"]["fwd_bwd_ms"]})  # fmt: skip
    report("Means of the two rounds: ratios", summary, list(summary[0]), None)


if __name__ == "__main__":
    main()
