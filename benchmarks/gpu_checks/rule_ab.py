"""GPU box: a default rule of the Hopper path against an alternative, through flash_attention as
users call it (the library's launches, host path included), cuDNN beside them.

Each study names problems and builds: ``_sm90`` switches set for a build (the kept launches
dropped before and after, as the switches are read when a launch key is first planned). Per
problem: the builds' results compared (out and lse, dK and dV bit for bit; dQ's largest
difference, its float32 sums having no fixed order), then ``do_bench`` medians of fwd (no grad)
and fwd+bwd and the CUDA time of one fwd+bwd's kernels, over three rounds in alternating order
(a long problem's time drifts over a run), with the median and spread (max / min) of the rounds.

    PYTHONPATH=. python3 benchmarks/gpu_checks/rule_ab.py [--studies consumers,causal_order]
        [--out rule_ab.csv]

Studies: ``padded`` (head dims between the Hopper kernels' on the next kernels: the forward
alone, ``FWD_PADDED_DIMS``, the forward and the fused backward, ``BWD_PADDED_DIMS``, and the
portable kernels),
``consumers`` (three consumer warpgroups in the causal head-dim-64 forward from 8192 rows,
``FWD_CONSUMERS3_MIN``), ``causal_order`` (the head-dim-128 fused backward's causal program
order, ``CAUSAL_ORDER``: chunks of heads against one head's key tiles after another and the
heaviest key tiles of every head first).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks import _peers
from benchmarks._harness import bench, csv_list, kernel_ms, parser, report
from torch_flashsys import flash_attention
from torch_flashsys.attention import _sm90

_PADDED = frozenset({32, 48, 80, 96, 112})
_PADDED_BUILDS = {  # the padded forward alone (the portable backward), and with the backward
    "padded forward": {"FWD_PADDED_DIMS": _PADDED, "BWD_PADDED_DIMS": frozenset()},
    "padded forward and backward": {"FWD_PADDED_DIMS": _PADDED, "BWD_PADDED_DIMS": _PADDED},
}
STUDIES = {  # name: (problems (batch, heads, kv heads, length, head dim, causal), builds)
    "consumers": (
        [(1, 16, 16, 16384, 64, True), (1, 32, 8, 8192, 64, True), (1, 16, 16, 8192, 64, True),
         (2, 16, 16, 8192, 64, True)],
        {"two (default)": {},
         "three from 8192": {"FWD_CONSUMERS3_MIN": {**_sm90.FWD_CONSUMERS3_MIN,
                                                    (64, True): 8192}}},
    ),
    "causal_order": (
        [(4, 16, 16, 2048, 128, True), (8, 16, 16, 2048, 128, True),
         (4, 16, 16, 4096, 128, True), (1, 16, 16, 16384, 128, True)],
        {"chunks of heads (default)": {}, "keys first": {"CAUSAL_ORDER": _sm90.KEYS_FIRST},
         "heads first": {"CAUSAL_ORDER": _sm90.HEADS_FIRST}},
    ),
    "padded": (
        [(2, 32, 32, 4096, 96, True), (4, 16, 16, 2048, 96, True), (2, 16, 16, 4096, 96, False),
         (4, 32, 32, 2048, 80, True), (1, 32, 8, 8192, 80, True), (4, 16, 16, 2048, 112, True),
         (4, 16, 16, 2048, 48, True), (4, 16, 16, 4096, 32, False), (8, 16, 16, 1024, 96, True)],
        {**_PADDED_BUILDS,
         "portable": {"FWD_PADDED_DIMS": frozenset(), "BWD_PADDED_DIMS": frozenset()}},
    ),
    "padded_bwd": (  # (the padded backward alone, fewer problems)
        [(2, 32, 32, 4096, 96, True), (2, 16, 16, 4096, 96, False), (4, 32, 32, 2048, 80, True),
         (1, 32, 8, 8192, 80, True), (4, 16, 16, 2048, 112, True)],
        _PADDED_BUILDS,
    ),
}  # fmt: skip


@contextlib.contextmanager
def build(switches: dict):
    """``_sm90``'s ``switches`` set, the kept launches dropped before and after."""
    saved = {name: getattr(_sm90, name) for name in switches}
    for name, value in switches.items():
        setattr(_sm90, name, value)
    _sm90.forget_launches()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(_sm90, name, value)
        _sm90.forget_launches()


def _inputs(problem):
    b, h, hk, n, d, _ = problem
    gen = torch.Generator(device="cuda").manual_seed(n + d + h + hk)
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))  # fmt: skip
    dout = torch.randn_like(q)
    return [t.requires_grad_(i < 3) for i, t in enumerate((q, k, v))] + [dout]


def _label(problem) -> str:
    b, h, hk, n, d, causal = problem
    return f"{b}x{h}/{hk}x{n}x{d}{' causal' if causal else ''}"


def _ours(causal: bool, gqa: bool):
    return lambda q, k, v: flash_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def compared(problem, builds: dict) -> dict:
    """Each build's out, lse and gradients against the first build's."""
    q, k, v, dout = _inputs(problem)
    causal, gqa = problem[5], problem[1] != problem[2]
    results = []
    for switches in builds.values():
        with build(switches):
            out, lse = flash_attention(q, k, v, is_causal=causal, enable_gqa=gqa, return_lse=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            results.append((out.detach(), lse.detach(), *grads))
    row = {"problem": _label(problem)}
    for name, got in list(zip(builds, results, strict=True))[1:]:
        ref = results[0]
        same = [torch.equal(a, b) for a, b in zip(got, ref, strict=True)]
        dq_diff = (got[2].float() - ref[2].float()).abs().max().item()
        row[f"{name}: out, lse, dk, dv equal"] = all(same[:2] + same[3:])
        row[f"{name}: dq max diff"] = dq_diff
    return row


def timed(problem, builds: dict, rounds: int = 3) -> list[dict]:
    q, k, v, dout = _inputs(problem)
    causal, gqa = problem[5], problem[1] != problem[2]
    cudnn = _peers.sdpa_call("CUDNN_ATTENTION", is_causal=causal, enable_gqa=gqa)
    names = [*builds, "sdpa cudnn"]
    times = {name: {"fwd": [], "fwd+bwd": [], "kernels": []} for name in names}
    for r in range(rounds):
        for name in names[:: 1 if r % 2 == 0 else -1]:
            fn = cudnn if name == "sdpa cudnn" else _ours(causal, gqa)
            with contextlib.nullcontext() if name == "sdpa cudnn" else build(builds[name]):
                step = _peers.fwd_bwd(fn, (q, k, v), dout)

                def fwd(fn=fn):
                    with torch.no_grad():
                        return fn(q, k, v)

                fwd(), step()  # compile (first round) and keep the launches before timing
                times[name]["fwd"].append(bench(fwd, "cuda")["median_ms"])
                times[name]["fwd+bwd"].append(bench(step, "cuda")["median_ms"])
                times[name]["kernels"].append(kernel_ms(step))
    rows = []
    for name in names:
        t = times[name]
        rows.append({"problem": _label(problem), "build": name,
                     **{f"{key}_ms": statistics.median(v) for key, v in t.items()},
                     **{f"{key}_spread": max(v) / min(v) for key, v in t.items()}})  # fmt: skip
    return rows


def main() -> None:
    p = parser(__doc__, smoke="(none: GPU only)")
    p.add_argument("--studies", default=",".join(STUDIES),
                   type=lambda s: csv_list(p, s, "--studies", choices=STUDIES))  # fmt: skip
    args = p.parse_args()
    all_rows, ratios = [], []
    for study in args.studies:
        problems, builds = STUDIES[study]
        bits = [compared(problem, builds) for problem in problems]
        report(f"{study}: the builds' results", bits, list(bits[0]), None)
        rows = [{"study": study, **r} for problem in problems for r in timed(problem, builds)]
        all_rows += rows
        first, *others = builds
        for problem in problems:
            by = {r["build"]: r for r in rows if r["problem"] == _label(problem)}
            for other in others:
                ratios.append({"study": study, "problem": _label(problem), "build": other,
                               **{f"{key} / {first}": by[other][f"{key}_ms"] / by[first][f"{key}_ms"]
                                  for key in ("fwd", "fwd+bwd", "kernels")},
                               "fwd+bwd / cudnn": by[other]["fwd+bwd_ms"]
                               / by["sdpa cudnn"]["fwd+bwd_ms"],
                               "default fwd+bwd / cudnn": by[first]["fwd+bwd_ms"]
                               / by["sdpa cudnn"]["fwd+bwd_ms"]})  # fmt: skip
    columns = ("study", "problem", "build", "fwd_ms", "fwd+bwd_ms", "kernels_ms", "fwd_spread",
               "fwd+bwd_spread", "kernels_spread")  # fmt: skip
    report("Rule A/B: medians of three rounds (bf16, ms)", all_rows, columns, args.out)
    report("Rule A/B: the alternative over the default", ratios, list(ratios[0]), None)


if __name__ == "__main__":
    main()
