"""GPU box: the fused Hopper backward with dQ converted inside the kernel (``_sm90.FUSED_CONVERT``,
the default) against the conversion kernel after it, and cuDNN's backward, in one process.

Per problem: ``do_bench`` of the whole Hopper backward (``_sm90.backward``: preprocessing, fused
kernel, and without the in-kernel conversion the conversion kernel) in both builds, in rounds of
alternating order (median of the rounds), cuDNN's backward (one forward kept), and the
fwd+bwd of ``flash_attention`` in both builds beside cuDNN's (the peer grid's measure). Then a
race check: the in-kernel build's dQ over ``--repeats`` calls against the other build's
(float32 sums added in no fixed order: equal up to rounding; a lost or doubled tile would
differ by its whole size).

    PYTHONPATH=. python3 benchmarks/gpu_checks/dq_convert_ab.py [--repeats 30] [--out ab.csv]
"""

from __future__ import annotations

import statistics

import torch
from triton.testing import do_bench

from benchmarks import _peers
from benchmarks._harness import parser, report
from torch_flashsys import flash_attention
from torch_flashsys.attention import _sm90
from torch_flashsys.attention._extras import CAUSAL, PLAIN
from torch_flashsys.attention._ops import _forward

PROBLEMS = [  # (batch, heads, kv heads, length, head dim, causal)
    (4, 16, 16, 1024, 64, True), (4, 16, 16, 1024, 128, False), (8, 32, 8, 1024, 128, True),
    (4, 16, 16, 2048, 64, True), (4, 16, 16, 2048, 64, False), (4, 16, 16, 2048, 128, True),
    (4, 16, 16, 2048, 128, False), (4, 32, 8, 2048, 64, True), (4, 16, 16, 4096, 128, True),
    (1, 16, 16, 8192, 64, True), (1, 32, 8, 8192, 64, True), (1, 16, 16, 16384, 128, True),
    (3, 5, 5, 1100, 64, True), (2, 6, 2, 1500, 128, False),
]  # fmt: skip
ROUNDS = 3
PROBE = False  # --probe


_CONSTEXPRS = _sm90.fused_constexprs


def build(convert: bool, probe: int = 0) -> None:
    """The kernel-after build, the in-kernel one, or (``probe``: measurement only, wrong dQ)
    the in-kernel one whose converter only drains its ring (2: no counts, no conversion) or
    does nothing, its ring unused (3), or counts but converts nothing (4)."""
    _sm90.FUSED_CONVERT = convert

    def constexprs(*args, **kwargs):
        meta = _CONSTEXPRS(*args, **kwargs)
        return {**meta, "CONVERT": probe} if probe and meta["CONVERT"] else meta

    _sm90.fused_constexprs = constexprs
    _sm90.forget_launches()


def row(problem, repeats: int) -> dict:
    b, h, hk, n, d, causal = problem
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))  # fmt: skip
    dout = torch.randn_like(q)
    ex = CAUSAL if causal else PLAIN
    scale = d**-0.5
    o, lse = _forward(q, k, v, scale, ex)
    assert _sm90.fused_takes(q, k, v, dout, scale, ex), problem

    def bwd():
        return _sm90.backward(dout, q, k, v, o, lse, None, scale, causal)

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def ours_fwd_bwd():
        for t in (qg, kg, vg):
            t.grad = None
        flash_attention(qg, kg, vg, is_causal=causal, enable_gqa=h != hk).backward(dout)

    times: dict[str, list[float]] = {}
    builds = [("in-kernel", True, 0), ("kernel after", False, 0)]
    if PROBE:
        builds += [("probe: ring only", True, 2), ("probe: no ring", True, 3),
                   ("probe: counts only", True, 4)]  # fmt: skip
    for r in range(ROUNDS):
        for name, convert, probe in builds if r % 2 == 0 else builds[::-1]:
            build(convert, probe)
            bwd()  # (compiles on the first round)
            times.setdefault(name + " bwd", []).append(do_bench(bwd, warmup=25, rep=100))
            if not probe:
                ours_fwd_bwd()
                times.setdefault(name + " fwd+bwd", []).append(
                    do_bench(ours_fwd_bwd, warmup=25, rep=100))  # fmt: skip
    build(False)
    ref = bwd()
    build(True)
    worst = 0.0
    for _ in range(repeats):
        got = bwd()
        for a, e in zip(got, ref, strict=True):
            err = (a.float() - e.float()).abs().max().item() / (e.float().abs().max().item() + 1e-6)
            worst = max(worst, err)
    cudnn = _peers.sdpa_call("CUDNN_ATTENTION", is_causal=causal)
    out = cudnn(qg, kg, vg) if h == hk else None
    res = {"problem": f"{b}x{h}/{hk}x{n}x{d}{'c' if causal else ''}"}
    res.update({key: statistics.median(val) for key, val in times.items()})
    if out is not None:  # (SDPA's cuDNN backend takes no GQA here)
        res["cudnn bwd"] = do_bench(lambda: torch.autograd.grad(out, (qg, kg, vg), dout,
                                                                retain_graph=True),
                                    warmup=25, rep=100)  # fmt: skip

        def cudnn_fwd_bwd():
            for t in (qg, kg, vg):
                t.grad = None
            cudnn(qg, kg, vg).backward(dout)

        res["cudnn fwd+bwd"] = do_bench(cudnn_fwd_bwd, warmup=25, rep=100)
    res["bwd in-kernel / after"] = res["in-kernel bwd"] / res["kernel after bwd"]
    res["max rel diff over repeats"] = worst
    return res


def main() -> None:
    p = parser(__doc__, smoke="(none: GPU only)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--probe", action="store_true", help="also the converter-drains-only build")
    p.add_argument("--problems", type=int, default=len(PROBLEMS), help="the first N problems")
    args = p.parse_args()
    global PROBE
    PROBE = args.probe
    rows = [row(problem, args.repeats) for problem in PROBLEMS[: args.problems]]
    cols = list(dict.fromkeys(key for r in rows for key in r))  # (in order of appearance)
    report("Hopper backward: dQ converted in the kernel or after it (bf16, ms)", rows, cols,
           args.out)  # fmt: skip


if __name__ == "__main__":
    main()
