"""The Hopper backward kernels against the portable ones, SDPA's cuDNN in the same run (H100/H200).

    python3 benchmarks/sm90_bwd.py [--out sm90_bwd_h100.csv] [--smoke]

Per shape (bf16): backward-only and fwd+bwd ``do_bench`` medians of flash_attention with the
portable backward (the deterministic one), with the Hopper dK/dV kernel after the portable dQ
kernel, with the fused Hopper backward (head dim 64; the split kernel at 128), and of SDPA's cuDNN
backend; then the CUDA time of each variant's backward kernels (torch.profiler; the fused one's preprocessing and
dQ conversion included) and TFLOP/s over the backward's five matmuls. The gradients of the
Hopper variants are checked against the portable ones on the way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import bench, parser, report
from benchmarks._peers import sdpa_call
from torch_flashsys import flash_attention
from torch_flashsys.attention import _sm90
from torch_flashsys.attention._extras import CAUSAL, PLAIN
from torch_flashsys.attention._ops import _forward

SHAPES = [  # batch, query heads, key/value heads, length, head dim, causal
    (1, 16, 16, 16384, 64, True),
    (1, 16, 16, 16384, 128, True),
    (4, 16, 16, 4096, 128, True),
    (4, 16, 16, 4096, 64, False),
    (4, 32, 8, 2048, 64, True),
]
SMOKE_SHAPES = [(1, 4, 2, 96, 64, True)]
# --rule: where the fused kernel runs by default (head dim 64, or --head-dim 128): 16384 tokens a
# step at 1k-16k, causal or not, without and with GQA (4 query heads per key/value head).
# Self-attention, 16384 tokens a problem; GQA 2:1 (kv 8) only at the lengths where the rule for
# MHA (kv 16) and GQA 4:1 differ.
RULE_SHAPES = [(16384 // n, 16, kv, n, 64, causal) for causal in (True, False) for kv in (16, 8, 4)
               for n in (1024, 2048, 4096, 8192, 16384)
               if kv != 8 or (causal and n <= 2048)]  # fmt: skip
VARIANTS = {  # name: (the dK/dV kernel on, the fused kernel on)
    "portable": (False, False),
    "hopper dK/dV": (True, False),
    "hopper fused": (False, True),
}
COLUMNS = ("shape", "impl", "bwd_ms", "fwd_bwd_ms", "bwd_kernels_ms", "bwd_tflops",
           "max_grad_diff_vs_portable")  # fmt: skip
KERNELS = ("attn_bwd", "direct_copy_kernel")  # our backward kernels, the fused one's dQ convert


def _grads(fn, q, k, v, dout):
    return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


def _kernel_ms(fn, q, k, v, dout, name_parts, iters: int = 5) -> float:
    """CUDA time per backward of the kernels whose name contains one of ``name_parts``."""
    out = fn(q, k, v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages()
                if any(part in e.key for part in name_parts))  # fmt: skip
    return total / iters / 1000


def _timings(fn, q, k, v, dout, device) -> dict:
    out = fn(q, k, v)
    bwd = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), device)
    both = bench(lambda: _grads(fn, q, k, v, dout), device)
    return {"bwd_ms": bwd["median_ms"], "fwd_bwd_ms": both["median_ms"]}


def _problem(shape, device: str = "cuda"):
    """``(q, k, v, dout, label, ours)`` for a ``(batch, heads, kv heads, length, head dim,
    causal)`` shape: fresh random bf16 tensors (float32 off the GPU) and flash_attention on them."""
    b, h, hk, n, d, causal = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, n, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)
    label = f"{b}x{h}/{hk}x{n}x{d}{' causal' if causal else ''}"

    def ours(q, k, v):
        return flash_attention(q, k, v, is_causal=causal, enable_gqa=h != hk)

    return q, k, v, dout, label, ours


@contextlib.contextmanager
def _deterministic_algorithms(on: bool):
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved)


def rows_for(shape, device: str, variants=None, deterministic: bool = False,
             cudnn: bool = True) -> list[dict]:  # fmt: skip
    """One row per backward variant (and SDPA's cuDNN unless ``cudnn`` is False); with
    ``deterministic``, the variants run under ``torch.use_deterministic_algorithms(True)``
    (cuDNN not), their names say so, and each row says whether two backward passes gave the
    same bits."""
    b, h, hk, n, d, causal = shape
    q, k, v, dout, label, ours = _problem(shape, device)
    flops = 5 * 2 * b * h * n * n * d / (2 if causal else 1)  # the backward's five matmuls
    ex = CAUSAL if causal else PLAIN
    hopper = device == "cuda" and _sm90.forward_takes(q, k, v, d**-0.5, ex)
    rows, reference = [], None
    saved = _sm90.BWD_ENABLED, _sm90.FUSED_ENABLED, _sm90.FUSED_ALL
    try:
        for name, (dkdv, fused) in (variants or VARIANTS).items():
            # (the fused kernel for full attention too, to measure it there)
            _sm90.BWD_ENABLED, _sm90.FUSED_ENABLED, _sm90.FUSED_ALL = dkdv, fused, fused
            if (dkdv or fused) and not hopper:  # no Hopper GPU (or the forward's rule says no)
                continue
            with _deterministic_algorithms(deterministic):
                if fused and not _sm90.fused_takes(q, k, v, dout, d**-0.5, ex):  # e.g. d 128
                    continue
                grads = _grads(ours, q, k, v, dout)
                reference = grads if reference is None else reference
                diff = max(
                    (a - r).abs().max().item() for a, r in zip(grads, reference, strict=True)
                )
                row = {"shape": label, "impl": name + (" (deterministic)" if deterministic else ""),
                       **_timings(ours, q, k, v, dout, device),
                       "max_grad_diff_vs_portable": diff}  # fmt: skip
                if deterministic:
                    again = _grads(ours, q, k, v, dout)
                    row["bitwise_repeat"] = all(
                        torch.equal(a, r) for a, r in zip(grads, again, strict=True)
                    )
                if device == "cuda":
                    row["bwd_kernels_ms"] = _kernel_ms(ours, q, k, v, dout, KERNELS)
                    row["bwd_tflops"] = flops / row["bwd_kernels_ms"] / 1e9
            rows.append(row)
    finally:
        _sm90.BWD_ENABLED, _sm90.FUSED_ENABLED, _sm90.FUSED_ALL = saved
    if device == "cuda" and cudnn:
        sdpa = sdpa_call("CUDNN_ATTENTION", is_causal=causal, enable_gqa=h != hk)
        rows.append({"shape": label, "impl": "sdpa cudnn", **_timings(sdpa, q, k, v, dout, device)})
    return rows


# --deterministic: the target problem of issue 27 (deterministic fwd+bwd <= 1.10x cuDNN's) and
# the rule's kinds, causal or not, GQA or not, 1k-16k.
DETERMINISTIC_SHAPES = [(1, 16, 16, 16384, 64, True), (4, 16, 16, 4096, 64, True),
                        (16, 16, 16, 1024, 64, True), (8, 16, 16, 2048, 64, True),
                        (4, 32, 8, 2048, 64, True), (2, 16, 4, 8192, 64, True),
                        (4, 16, 16, 4096, 64, False), (8, 16, 16, 2048, 64, False),
                        (16, 16, 4, 1024, 64, False), (1, 16, 16, 16384, 64, False)]  # fmt: skip
# Kernel-only variants of the ordered (deterministic) fused kernel: dQ copies (chains), the
# counter's signal a step late or at once, and (causal) the lightest key tiles of every head first
# instead of one head's tiles after another.
DETERMINISTIC_VARIANTS = {
    "1 chain, signal at once": {"DETERMINISTIC": True, "CHAINS": 1, "SIGNAL_LAG": 0},
    "2 chains, signal lag 1": {"DETERMINISTIC": True, "CHAINS": 2, "SIGNAL_LAG": 1},
    "2 chains, signal lag 2": {"DETERMINISTIC": True, "CHAINS": 2, "SIGNAL_LAG": 2},
    "4 chains, signal lag 2": {"DETERMINISTIC": True, "CHAINS": 4, "SIGNAL_LAG": 2},
    "unordered (default)": {},
}  # fmt: skip
# (causal only: the unordered kernel in the ordered one's program order, which isolates what the
# order costs)
DETERMINISTIC_CAUSAL_VARIANTS = {
    "unordered, lightest first": {"ORDER": _sm90.LIGHTEST_FIRST | _sm90.KEYS_FIRST},
}  # fmt: skip
DETERMINISTIC_VARIANT_SHAPES = [(1, 16, 16, 16384, 64, True), (4, 16, 16, 4096, 64, True),
                                (4, 32, 8, 2048, 64, True), (4, 16, 16, 4096, 64, False)]  # fmt: skip


def deterministic_rows(shape) -> list[dict]:
    """Portable and fused backward under deterministic algorithms, the unordered fused kernel
    and cuDNN beside them (one process, same tensors)."""
    pick = {name: VARIANTS[name] for name in ("portable", "hopper fused")}
    rows = rows_for(shape, "cuda", pick, deterministic=True, cudnn=False)
    return rows + rows_for(shape, "cuda", {"hopper fused": VARIANTS["hopper fused"]})


# Compile-time variants of the fused kernel (--variants): the program order, atomics for the dQ
# sums, dS^T as the dK product's register operand, and a measurement-only cut (PROBE 2: no dQ
# work at all; wrong dQ).
# Causal program orders beside the default chunks of about 128 programs (both kernels).
CHUNK_VARIANTS = {"chunks of 64 programs": {"ORDER": _sm90.chunked(64)},
                  "chunks of 256 programs": {"ORDER": _sm90.chunked(256)}}  # fmt: skip
FUSED_VARIANTS = {
    "default": {},
    "keys first": {"ORDER": _sm90.KEYS_FIRST},
    "heads first": {"ORDER": _sm90.HEADS_FIRST},
    "atomic dQ": {"DQ_TMA": False},
    "rs dK": {"DK_RS": True},
    "pinned dP wait": {"PIN_WAIT": True},  # _sm90.BWD_PIN_WAIT
    "no dQ (probe)": {"PROBE": 2},
    **CHUNK_VARIANTS,
}
VARIANT_SHAPES = [(1, 16, 16, 16384, 64, True), (4, 16, 16, 4096, 64, False),
                  (4, 32, 8, 2048, 64, True)]  # fmt: skip
SPLIT_VARIANTS = {"default": {}, "keys first": {"ORDER": _sm90.KEYS_FIRST},
                  "heads first": {"ORDER": _sm90.HEADS_FIRST},
                  # one dS^T buffer pair (with two float32 dQ tiles: 214 KB, 128 bytes spilled;
                  # the two tiles fit beside two pairs too, the "2 dQ tiles" variant below)
                  "1 dS pair": {"NBUF": 1},
                  "1 dS pair, 2 dQ tiles": {"NBUF": 1, "DQ_BUFS": 2},
                  "pinned dP wait": {"PIN_WAIT": True},
                  # three dS^T buffer pairs (214 KB): a consumer may run further ahead
                  "3 dS pairs": {"NBUF": 3},
                  # two float32 dQ tiles per consumer beside two dS^T pairs (230,864 bytes of
                  # shared memory, under the H100's 232,448): a step's reduction overlaps the next
                  "2 dQ tiles": {"DQ_BUFS": 2},
                  # measurement-only cuts (wrong dQ): no wait for the other consumer's dS^T; no
                  # dQ reductions; no dQ work at all
                  "no dS wait (probe)": {"PROBE": 1}, "no dQ sums (probe)": {"PROBE": 2},
                  "no dQ (probe)": {"PROBE": 3}, **CHUNK_VARIANTS}  # fmt: skip


def _fused_kernel(q, k, v, dout, o2, lse, causal: bool, extra: dict):
    """The fused kernel alone, as `_sm90.backward` launches it (fresh D and zeroed dQ buffer;
    constexprs ``extra`` over the defaults): ``(launch, delta, dq_acc, dk, dv, grid)``, where
    ``launch()`` runs it once on those buffers."""
    d = k.shape[-1]
    kernel = _sm90.fused_kernel(d)
    deterministic = extra.get("DETERMINISTIC", False)
    meta = {**_sm90.fused_constexprs(d, causal, q.dtype, deterministic), **extra}
    copies = meta.get("CHAINS", 1)
    delta, dq_acc, sem = _sm90.backward_prep(o2, dout, lse, None, deterministic, copies)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args = _sm90.fused_launch_args(q, k, v, dout, lse, delta, dk, dv, dq_acc, d**-0.5, sem)
    grid = _sm90.backward_grid(k)

    def launch():
        if sem is not None:  # the ordered sums' counters start from zero every time
            sem.zero_()
        kernel[grid](*args, **meta)

    return launch, delta, dq_acc, dk, dv, grid


def variant_rows(shape, variants_override: dict | None = None) -> list[dict]:
    """Kernel-only ``do_bench`` medians of each fused variant (the preprocessing and the dQ
    conversion excluded), with its largest gradient difference from the portable backward."""
    from triton.testing import do_bench

    b, h, _, n, d, causal = shape
    q, k, v, dout, label, ours = _problem(shape)
    out = ours(q, k, v)
    saved = _sm90.FUSED_ENABLED
    _sm90.FUSED_ENABLED = False
    try:
        ref = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    finally:
        _sm90.FUSED_ENABLED = saved
    o2, lse = _forward(q, k, v, d**-0.5, CAUSAL if causal else PLAIN)  # flash_attention's own
    flops = 5 * 2 * b * h * n * n * d / (2 if causal else 1)
    rows = []
    variants = SPLIT_VARIANTS if d in _sm90.SPLIT_HEAD_DIMS else FUSED_VARIANTS
    if variants_override is not None:
        variants = variants_override
    for name, extra in variants.items():
        launch, _, dq_acc, dk, dv, _ = _fused_kernel(q, k, v, dout, o2, lse, causal, extra)
        launch()
        got = (dq_acc.view(-1, *q.shape).sum(0).to(q.dtype), dk, dv)  # (dQ copies: CHAINS)
        diff = max(
            (a.float() - r.float()).abs().max().item() for a, r in zip(got, ref, strict=True)
        )
        ms = do_bench(launch, warmup=25, rep=200)
        rows.append({"shape": label, "variant": name, "kernel_ms": ms,
                     "tflops": flops / ms / 1e9, "max_grad_diff_vs_portable": diff})  # fmt: skip
    return rows


BREAKDOWN_SHAPES = [(16, 16, 4, 1024, 64, True), (8, 16, 4, 2048, 64, True),
                    (1, 16, 4, 16384, 64, True)]  # fmt: skip


def _each_backward(shape, modes):
    """For the portable and then the fused backward (the latter switched on for every problem
    it can run; the switches restored after), yield ``(label, backward name, mode, fn)`` for each
    of ``modes``: "fwd", "bwd" (of one kept forward), "fwd+bwd" (a fresh forward each call)."""
    q, k, v, dout, label, ours = _problem(shape)
    saved = _sm90.FUSED_ENABLED, _sm90.FUSED_ALL
    try:
        for name, fused in (("portable", False), ("hopper fused", True)):
            _sm90.FUSED_ENABLED = _sm90.FUSED_ALL = fused
            out = ours(q, k, v)
            loops = {"fwd": lambda: ours(q, k, v),
                     "bwd": lambda o=out: torch.autograd.grad(o, (q, k, v), dout,
                                                               retain_graph=True),
                     "fwd+bwd": lambda: _grads(ours, q, k, v, dout)}  # fmt: skip
            for mode in modes:
                yield label, name, mode, loops[mode]
    finally:
        _sm90.FUSED_ENABLED, _sm90.FUSED_ALL = saved


def breakdown_rows(shape, iters: int = 10) -> list[dict]:
    """CUDA time per call of every kernel (torch.profiler) in a loop of fwd+bwd and in a loop of
    backward only, portable and fused backward: which kernel a fresh forward slows down."""
    rows = []
    for label, name, mode, fn in _each_backward(shape, ("fwd+bwd", "bwd")):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
        rows.append({"shape": label, "impl": name, "mode": mode, "kernel": "(wall)",
                     "ms": start.elapsed_time(end) / iters})  # fmt: skip
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if e.device_time_total > 0:
                rows.append({"shape": label, "impl": name, "mode": mode, "kernel": e.key[:60],
                             "ms": e.device_time_total / iters / 1000})  # fmt: skip
    return rows


METHOD_SHAPES = [(1, 16, 16, 16384, 64, True), (1, 16, 4, 16384, 64, True),
                 (2, 16, 16, 8192, 64, True)]  # fmt: skip


def method_rows(shape, iters: int = 30) -> list[dict]:
    """The same forward+backward and backward timed three ways, portable and fused backward:
    ``do_bench`` (L2 flushed before each call), ``iters`` calls back to back between two events
    (as a training loop runs them), and each call alone after an L2 flush and a synchronize
    (median). Where the fused kernel's forward+backward differs from its backward plus the
    forward, this says whether the timing method is the cause. Phases are stamped with
    ``time.time()`` for matching against a clock/power log."""
    import statistics
    import time

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def timed(fn) -> tuple[float, float, float]:
        do_bench_ms = bench(fn, "cuda")["median_ms"]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        loop_ms = start.elapsed_time(end) / iters
        alone = []
        for _ in range(iters):
            flush.zero_()
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            alone.append(start.elapsed_time(end))
        return do_bench_ms, loop_ms, statistics.median(alone)

    rows = []
    for label, name, mode, fn in _each_backward(shape, ("fwd", "bwd", "fwd+bwd")):
        t0 = time.time()
        a, loop, alone = timed(fn)
        rows.append({"shape": label, "impl": name, "mode": mode, "do_bench_ms": a,
                     "loop_ms": loop, "alone_ms": alone, "t_start": round(t0, 2),
                     "t_end": round(time.time(), 2)})  # fmt: skip
    return rows


TIMELINE_SHAPES = [(1, 16, 16, 16384, 64, True), (4, 32, 8, 2048, 64, True)]
CONSUMER_PHASES = ("wait Q/dO", "S^T+dP^T issue, wait S^T", "P^T (exp), to A layout",
                   "wait dP^T, dV issue, dS^T", "wait dS buffer free", "dS^T store+fence+bar+arrive",
                   "dK issue, wait dV/dK, release")  # fmt: skip
DQ_PHASES = ("wait dS^T", "dQ product, wait, release", "wait tile free (TMA)",
             "store tile, fence, bar, reduce", "(ordered) wait turn",
             "(ordered) sums landed, count up")  # fmt: skip


def timeline_rows(shape, extra: dict | None = None) -> list[dict]:
    """%clock64 cycles per step and phase of each partition of the fused kernel (PROBE == 3;
    summed over programs, divided by their steps), and the kernel time with and without the
    probes (they write into Delta: wrong gradients)."""
    from triton.testing import do_bench

    _, _, _, _, d, causal = shape
    q, k, v, dout, label, _ = _problem(shape)
    o2, lse = _forward(q, k, v, d**-0.5, CAUSAL if causal else PLAIN)
    rows = []
    for probe in (0, 3):
        launch, delta, _, _, _, grid = _fused_kernel(q, k, v, dout, o2, lse, causal,
                                                     {**(extra or {}), "PROBE": probe})  # fmt: skip
        assert delta.numel() >= 48 * grid[0], "Delta too small for the probes' 48 floats each"
        ms = do_bench(launch, warmup=25, rep=200)
        rows.append({"shape": label, "partition": f"kernel (PROBE={probe})", "phase": "ms",
                     "value": ms})  # fmt: skip
        if probe == 3:
            launch()
            torch.cuda.synchronize()
            t = delta.reshape(-1)[: grid[0] * 48].reshape(grid[0], 3, 16).double()
            for i, (part, phases) in enumerate((("consumer 0", CONSUMER_PHASES),
                                                ("consumer 1", CONSUMER_PHASES),
                                                ("dQ", DQ_PHASES))):  # fmt: skip
                steps = t[:, i, 7].sum().item()
                for j, phase in enumerate(phases):
                    rows.append({"shape": label, "partition": part, "phase": phase,
                                 "value": t[:, i, j].sum().item() / steps})  # fmt: skip
                rows.append({"shape": label, "partition": part, "phase": "sum (cycles/step)",
                             "value": t[:, i, : len(phases)].sum().item() / steps})  # fmt: skip
    return rows


def _shapes(text: str) -> list[tuple]:
    """``4x16/16x2048x64c,...`` -> [(batch, heads, kv heads, length, head dim, causal), ...]."""
    shapes = []
    for item in text.split(","):
        causal = item.endswith("c")
        try:
            b, heads, n, d = item.rstrip("c").split("x")
            h, hk = heads.split("/")
            shapes.append((int(b), int(h), int(hk), int(n), int(d), causal))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected BxH/HKxLxD[c] items, e.g. 4x16/16x2048x64c; got {item!r}"
            ) from None
    return shapes


def main() -> None:
    p = parser(__doc__, smoke="one tiny shape, portable backward only (CPU without a GPU)")
    p.add_argument("--variants", action="store_true",
                   help="time compile-time variants of the fused kernel (kernel only; GPU)")  # fmt: skip
    p.add_argument("--rule", action="store_true",
                   help="portable against fused backward, 1k-16k, GQA or not, causal or not")  # fmt: skip
    p.add_argument("--head-dim", type=int, default=64, choices=(64, 128),
                   help="--rule, --variants: the head dim (128: the split kernel)")  # fmt: skip
    p.add_argument("--breakdown", action="store_true",
                   help="kernel times in fwd+bwd and bwd-only loops, portable and fused (GPU)")  # fmt: skip
    p.add_argument("--methods", action="store_true",
                   help="fwd, bwd, fwd+bwd timed three ways (do_bench, back to back, alone; GPU)")  # fmt: skip
    p.add_argument("--timeline", action="store_true",
                   help="cycles per step and phase of each partition of the fused kernel (GPU)")  # fmt: skip
    p.add_argument("--shapes", type=_shapes,
                   help="default mode: these problems instead, e.g. 4x16/16x2048x64c,1x16/4x16384x128 "
                        "(batch x heads/kv heads x length x head dim, c: causal)")  # fmt: skip
    p.add_argument("--only",
                   help="--variants: these variants alone (names, comma-separated)")  # fmt: skip
    p.add_argument("--deterministic", action="store_true",
                   help="portable against fused backward under deterministic algorithms, the "
                        "unordered one and cuDNN beside them; then the ordered kernel's program "
                        "orders (kernel only; GPU)")  # fmt: skip
    args = p.parse_args()
    if args.deterministic and not args.timeline:
        shapes = args.shapes or DETERMINISTIC_SHAPES
        if not args.variants:
            rows = [r for shape in shapes for r in deterministic_rows(shape)]
            report("Deterministic backward: portable against the ordered fused kernel", rows,
                   (*COLUMNS, "bitwise_repeat"), args.out)  # fmt: skip
        rows = [r for shape in (args.shapes or DETERMINISTIC_VARIANT_SHAPES)
                for r in variant_rows(shape, {**DETERMINISTIC_VARIANTS,
                                              **(DETERMINISTIC_CAUSAL_VARIANTS if shape[5]
                                                 else {})})]  # fmt: skip
        report("Ordered fused kernel: chains, signal lag, program order (kernel only)", rows,
               ("shape", "variant", "kernel_ms", "tflops", "max_grad_diff_vs_portable"),
               args.out and args.out.replace(".csv", "_orders.csv"))  # fmt: skip
        return
    if args.timeline:
        extra = {"DETERMINISTIC": True} if args.deterministic else None
        rows = [r for shape in TIMELINE_SHAPES for r in timeline_rows(shape, extra)]
        report("Fused kernel: %clock64 cycles per step and phase", rows,
               ("shape", "partition", "phase", "value"), args.out)  # fmt: skip
        return
    if args.methods:
        rows = [r for shape in METHOD_SHAPES for r in method_rows(shape)]
        report("Timing methods: do_bench, back-to-back loop, single call after a flush",
               rows, ("shape", "impl", "mode", "do_bench_ms", "loop_ms", "alone_ms", "t_start",
                      "t_end"), args.out)  # fmt: skip
        return
    if args.breakdown:
        rows = [r for shape in BREAKDOWN_SHAPES for r in breakdown_rows(shape)]
        report("Kernel times per call: fwd+bwd against backward only (causal GQA 4:1, d 64)",
               rows, ("shape", "impl", "mode", "kernel", "ms"), args.out)  # fmt: skip
        return
    if args.rule:
        pick = {name: VARIANTS[name] for name in ("portable", "hopper fused")}
        shapes = [(*shape[:4], args.head_dim, shape[5]) for shape in RULE_SHAPES]
        rows = [r for shape in shapes for r in rows_for(shape, "cuda", pick)]
        report(f"Fused Hopper backward against the portable one (d {args.head_dim})", rows,
               COLUMNS, args.out)  # fmt: skip
        return
    if args.variants:
        shapes = args.shapes or [(*shape[:4], args.head_dim, shape[5])
                                 for shape in VARIANT_SHAPES]  # fmt: skip
        rows = []
        for shape in shapes:
            variants = SPLIT_VARIANTS if shape[4] in _sm90.SPLIT_HEAD_DIMS else FUSED_VARIANTS
            if args.only:
                variants = {name: variants[name] for name in args.only.split(",")}
            rows += variant_rows(shape, variants)
        columns = ("shape", "variant", "kernel_ms", "tflops", "max_grad_diff_vs_portable")
        report("Fused Hopper backward: compile-time variants", rows, columns, args.out)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SMOKE_SHAPES if args.smoke else args.shapes or SHAPES
    rows = [r for shape in shapes for r in rows_for(shape, device)]
    report("Hopper backward kernels against the portable ones", rows, COLUMNS, args.out)


if __name__ == "__main__":
    main()
