"""Attention peers for flash.py: SDPA pinned to a backend, inputs, the per-mode timer, the peer
grid (``--preset peers``), the feature table (``--preset features``) and packed batches and
KV-cache decoding beside their peers (``--preset varlen``; cases: docs/benchmarks.md).

The grid puts flash_attention beside SDPA's flash, cuDNN and efficient backends and compiled
FlexAttention, bf16, same inputs. The cases are dealt to parallel worker processes; each first
runs every impl of its cases once (FlexAttention's and our kernels' compiles), then waits until
every worker has done so, then times its cases taking turns on the GPU (a lock around every
timing): no timed call shares the CPU with other processes' compiles, which had slowed the rows
bound by host time per call (the 1024-token ones) by up to 1.7x from one run to the next. Each
case's impls are timed in ROUNDS rounds of alternating order (the median reported). One row per
(impl, case, mode).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import random
import statistics
import threading
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

from benchmarks._harness import bench, sync, why

# (batch, heads, seq) x head_dim x causal
SHAPES = [(4, 16, 1024), (4, 16, 2048), (4, 16, 4096), (1, 16, 8192), (1, 16, 16384)]
DIMS = (64, 128)
IMPLS = ("flash_attention", "sdpa flash", "sdpa cudnn", "sdpa efficient", "flex (compiled)")
MODES = ("fwd", "fwd+bwd")
SDPA = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
# Ours with a feature beside ours without it and every SDPA backend taking the same call.
FEATURES = ["key padding", "float mask", "dropout 0.1", "window (256, 0)"]
FLOPS_PER_FWD = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
# The summary's second geomean: sequences of at least this many tokens (on the H100 the shorter
# grid problems, under about 0.5 ms of GPU work, are bound by the host time per call).
LONG_SEQ = 2048

_LOCK = contextlib.nullcontext()  # the GPU lock in a worker process of the grid
_BARRIER = None  # the grid's workers meet there between compiling and timing
BARRIER_TIMEOUT_S = 300  # a worker that never arrives (it died) holds the others no longer


def sdpa_call(backend: str, **kwargs):
    """SDPA pinned to ``backend`` (an ``SDPBackend`` name) with ``kwargs``: ``fn(q, k, v, **more)``.
    A 3-D problem (B, L, E) runs as (B, 1, L, E) (a view): SDPA's fused kernels want 4-D."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v, **more):
        squeeze = q.dim() == 3
        if squeeze:
            q, k, v = (t.unsqueeze(1) for t in (q, k, v))
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs, **more)
        return out.squeeze(1) if squeeze else out

    return run


def device_dtype(smoke: bool) -> tuple[str, torch.dtype]:
    """bf16 on CUDA; fp32 on CPU (always with ``smoke``)."""
    cuda = torch.cuda.is_available() and not smoke
    return ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)


def inputs(shape, dtype, device, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v (requiring grad) and dout: random, of ``shape``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ts = [torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4)]
    return [t.requires_grad_(i < 3) for i, t in enumerate(ts)]


def fwd_bwd(fn, qkv, dout, retain_graph: bool = False):
    """A call of ``fn(*qkv).backward(dout)``, gradients set to None first."""

    def run():
        for t in qkv:
            t.grad = None
        fn(*qkv).backward(dout, retain_graph=retain_graph)

    return run


def flops(shape, causal: bool, mode: str = "fwd") -> float:
    """Attention FLOPs of ``mode`` on (batch, [heads,] seq, dim), counting the causal half only."""
    *batch, seq, dim = shape
    return 4 * math.prod(batch) * seq * seq * dim * (0.5 if causal else 1.0) * FLOPS_PER_FWD[mode]


def timed(row: dict, key: str, fn, device, scale: float = 1.0) -> dict:
    """``row`` with ``key`` the median ms of ``fn`` (times ``scale``), or None and a note on why
    (an impl that cannot run the case)."""
    try:
        row[key] = bench(fn, device)["median_ms"] * scale
    except Exception as exc:
        row[key], row["note"] = None, why(exc, 70)
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def time_modes(fn, q, k, v, dout, device, modes, reps: int = 2, rep_ms: int = 100) -> dict:
    """``fn(q, k, v)`` per mode with the harness timer (``rep_ms`` of calls on CUDA): ``fwd``
    (under no_grad), ``bwd`` (of one forward, graph retained; on CUDA also
    ``mem_before_bwd_MiB``), ``fwd+bwd``."""
    res = {}
    if "fwd" in modes:
        with torch.no_grad():
            res["fwd"] = bench(lambda: fn(q, k, v), device, reps, rep_ms=rep_ms)
    if "bwd" in modes:
        out = fn(q, k, v)
        if device == "cuda":
            torch.cuda.synchronize()
            res["mem_before_bwd_MiB"] = torch.cuda.memory_allocated() / 2**20
        res["bwd"] = bench(fwd_bwd(lambda *_: out, (q, k, v), dout, True), device, reps,
                           rep_ms=rep_ms)  # fmt: skip
        del out
    if "fwd+bwd" in modes:
        res["fwd+bwd"] = bench(fwd_bwd(fn, (q, k, v), dout), device, reps, rep_ms=rep_ms)
    return res


def _impl(name: str, seq: int, causal: bool, device: str):
    from torch_flashsys import flash_attention

    if name == "flash_attention":
        return lambda q, k, v: flash_attention(q, k, v, is_causal=causal)
    if name.startswith("sdpa"):
        return sdpa_call(SDPA[name.split()[1]], is_causal=causal)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if causal:
        causal_mod = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        block_mask = create_block_mask(causal_mod, None, None, seq, seq, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def prepare_case(case, dtype=torch.bfloat16, device="cuda") -> tuple:
    """``(case, inputs, [(impl name, fn or the exception it raised)])``: every impl built and run
    once in each mode (compiled: FlexAttention's graphs, our and SDPA's kernels), untimed."""
    batch, heads, seq, dim, causal = case
    q, k, v, dout = inputs((batch, heads, seq, dim), dtype, device, seed=seq + dim + causal)
    impls = []
    for name in IMPLS:
        try:
            fn = _impl(name, seq, causal, device)
            with torch.no_grad():
                fn(q, k, v)
            fwd_bwd(fn, (q, k, v), dout)()
            impls.append((name, fn))
        except Exception as exc:  # this impl cannot run this case: reported as such
            impls.append((name, exc))
        if device == "cuda":
            torch.cuda.empty_cache()
    for t in (q, k, v):
        t.grad = None
    return case, (q, k, v, dout), impls


# Rounds per case: the impls timed in turn, in alternating order, each for ROUND_MS per mode, and
# the median of the rounds reported. On the H100 a long problem's time drifts by up to 10-25% over
# a run (one impl timed once after a run of heavy ones measured slow: docs/benchmarks.md), so one
# pass per impl compared impls at different points of that drift.
ROUNDS = 3
ROUND_MS = 50


def time_case(prepared, device="cuda", rounds: int = ROUNDS) -> list[dict]:
    """The rows of a :func:`prepare_case` result: each impl's modes timed under the GPU lock in
    ``rounds`` rounds of alternating impl order (the lock held for one impl at a time, the
    allocator's cache emptied inside it: no other worker's GPU work beside a timing); per mode
    the median of the rounds, and their spread (max / min)."""
    (batch, heads, seq, dim, causal), (q, k, v, dout), impls = prepared
    times: dict[str, dict[str, list[float]]] = {}
    failed = {name: fn for name, fn in impls if isinstance(fn, Exception)}
    for r in range(rounds):
        for name, fn in impls[:: 1 if r % 2 == 0 else -1]:
            if name in failed:
                continue
            try:
                with _LOCK:
                    try:
                        timings = time_modes(fn, q, k, v, dout, device, MODES, rep_ms=ROUND_MS)
                    finally:
                        if device == "cuda":
                            torch.cuda.empty_cache()
            except Exception as exc:  # this impl cannot run this case: an empty ms, and why
                failed[name] = exc
                continue
            for mode in MODES:
                times.setdefault(name, {}).setdefault(mode, []).append(
                    timings[mode]["median_ms"])  # fmt: skip
    rows = []
    for name, _ in impls:
        base = {"impl": name, "batch": batch, "heads": heads, "seq": seq, "head_dim": dim,
                "causal": causal}  # fmt: skip
        if name in failed:
            rows += [{**base, "mode": mode, "ms": None, "note": why(failed[name])}
                     for mode in MODES]  # fmt: skip
            continue
        for mode in MODES:
            ms = statistics.median(times[name][mode])
            rows.append({**base, "mode": mode, "ms": ms,
                         "tflops": flops(q.shape, causal, mode) / ms / 1e9,
                         "spread": max(times[name][mode]) / min(times[name][mode])})  # fmt: skip
    return rows


def run_case(case, dtype=torch.bfloat16, device="cuda") -> list[dict]:
    """Every impl and mode on one case: compiled first, then timed."""
    return time_case(prepare_case(case, dtype, device), device)


def run_share(cases, dtype=torch.bfloat16, device="cuda") -> list[list[dict]]:
    """A grid worker's share: compile every case, wait for the other workers to have compiled
    theirs (the barrier), then time the cases; their rows, case by case."""
    prepared = [prepare_case(case, dtype, device) for case in cases]
    sync()  # (our background compiles done before any worker times)
    if _BARRIER is not None:
        with contextlib.suppress(threading.BrokenBarrierError):
            _BARRIER.wait(timeout=BARRIER_TIMEOUT_S)
    return [time_case(p, device) for p in prepared]


def _init_worker(lock, barrier=None) -> None:
    global _LOCK, _BARRIER
    _LOCK, _BARRIER = lock, barrier
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    torch._dynamo.config.cache_size_limit = 256


def shares(cases, workers: int) -> list[list]:
    """``cases`` dealt to ``workers`` shares, most expensive first round-robin (even work)."""
    order = sorted(cases, key=lambda c: -c[0] * c[2] * c[2] * c[3])
    return [share for share in (order[i::workers] for i in range(workers)) if share]


def run_grid(smoke: bool = False, workers: int = 8) -> list[dict]:
    """All cases; in ``workers`` processes on CUDA (one process when smoke or on CPU)."""
    todo = [(b, h, n, d, c) for (b, h, n) in SHAPES for d in DIMS for c in (True, False)]
    todo = [(1, 2, 128, 16, True)] if smoke else todo
    if smoke or not torch.cuda.is_available() or workers <= 1:
        device, dtype = device_dtype(smoke)
        return [row for case in todo for row in run_case(case, dtype, device)]
    ctx = mp.get_context("spawn")
    parts = shares(todo, workers)
    with ProcessPoolExecutor(len(parts), mp_context=ctx, initializer=_init_worker,
                             initargs=(ctx.Lock(), ctx.Barrier(len(parts)))) as pool:  # fmt: skip
        done = pool.map(run_share, parts, chunksize=1)
        results = {case: rows for part, part_rows in zip(parts, done, strict=True)
                   for case, rows in zip(part, part_rows, strict=True)}  # fmt: skip
    return [row for case in todo for row in results[case]]


def summary(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per case and mode: ours, each peer, ours / fastest peer; and the geometric means."""
    key = lambda r: (r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"], r["mode"])
    table, ratios, long = [], {m: [] for m in MODES}, {m: [] for m in MODES}
    for k in sorted({key(r) for r in rows}, key=lambda k: (k[5], k[3], not k[4], k[2], k[0])):
        case = {r["impl"]: r["ms"] for r in rows if key(r) == k}
        ours = case.get("flash_attention")
        peers = {n: ms for n, ms in case.items() if n != "flash_attention" and ms is not None}
        line = {"mode": k[5], "shape": "x".join(map(str, k[:4])), "causal": k[4],
                **{n: case.get(n) for n in IMPLS}}  # fmt: skip
        if ours is not None and peers:
            best = min(peers, key=peers.get)
            line["fastest peer"], line["ours / fastest"] = best, ours / peers[best]
            ratios[k[5]].append(ours / peers[best])
            if k[2] >= LONG_SEQ:
                long[k[5]].append(ours / peers[best])
        table.append(line)
    totals = [{"mode": m, "cases": len(r), "geomean ours / fastest peer": statistics.geometric_mean(r),
               "worst": max(r), "cases above 1.3": sum(x > 1.3 for x in r),
               f"geomean from {LONG_SEQ} tokens": (statistics.geometric_mean(long[m])
                                                   if long[m] else None)}
              for m, r in ratios.items() if r]  # fmt: skip
    return table, totals


def feature_kwargs(name: str, b: int, h: int, n: int, device, dtype, gen):
    """The call's arguments for ``name`` (FEATURES, or "causal"): (ours, ours without it, SDPA's
    or None when SDPA has no equivalent)."""
    if name == "causal":
        return {"is_causal": True}, {"is_causal": True}, {"is_causal": True}
    if name == "key padding":  # each sequence keeps 50-90% of its keys (10-50% padding)
        keep = torch.rand(b, generator=gen, device=device) * 0.4 + 0.5
        mask = (torch.arange(n, device=device)[None, :] < (keep * n)[:, None]).view(b, 1, 1, n)
        return {"attn_mask": mask}, {}, {"attn_mask": mask}
    if name == "float mask":
        mask = torch.randn(b, h, n, n, device=device, dtype=dtype, generator=gen)
        return {"attn_mask": mask}, {}, {"attn_mask": mask}
    if name.startswith("dropout"):
        return {"dropout_p": 0.1}, {}, {"dropout_p": 0.1}
    if name == "window (256, 0)":
        return {"window_size": (256, 0), "is_causal": True}, {"is_causal": True}, None
    raise SystemExit(f"--features: unknown feature {name!r}; choose from causal, {FEATURES}")


def run_features(smoke: bool = False) -> list[dict]:
    from torch_flashsys import flash_attention

    device, dtype = device_dtype(smoke)
    rows = []
    for name in FEATURES:
        b, h, n, d = (1, 2, 256, 16) if smoke else (4, 16, 4096, 128)
        if name.startswith("window"):
            b, n = (1, 2048) if smoke else (1, 16384)
        q, k, v, dout = inputs((b, h, n, d), dtype, device)
        gen = torch.Generator(device=device).manual_seed(1)
        ours, plain, sdpa = feature_kwargs(name, b, h, n, device, dtype, gen)
        impls = {
            "flash_attention": lambda q, k, v, kw=ours: flash_attention(q, k, v, **kw),
            "flash_attention without it": lambda q, k, v, kw=plain: flash_attention(q, k, v, **kw),
        }
        if sdpa is not None:
            impls |= {f"sdpa {s}": sdpa_call(backend, **sdpa) for s, backend in SDPA.items()}
        for impl, fn in impls.items():
            row = {"feature": name, "impl": impl, "shape": "x".join(map(str, q.shape))}
            rows.append(timed(row, "fwd+bwd ms", fwd_bwd(fn, (q, k, v), dout), device))
    by = lambda impl: {r["feature"]: r["fwd+bwd ms"] for r in rows if r["impl"] == impl}
    base, sdpa = by("flash_attention without it"), [by(f"sdpa {s}") for s in SDPA]
    for r in rows:  # ours against ours without the feature and the fastest SDPA backend
        ms, feature = r["fwd+bwd ms"], r["feature"]
        fastest = min((p[feature] for p in sdpa if p.get(feature) is not None), default=None)
        if r["impl"] == "flash_attention" and ms is not None:
            r["vs without"] = ms / base[feature] if base.get(feature) else ""
            r["vs fastest SDPA"] = ms / fastest if fastest else ""
    return rows


def _lengths(smoke: bool) -> list[int]:
    if smoke:
        return [5, 17, 9]
    rng = random.Random(1)
    return [rng.randint(128, 8192) for _ in range(16)]


def _row(rows, impl, case, fn, device, ms_scale=1.0, **extra):
    """A varlen row: the median ms of ``fn`` (times ``ms_scale``), or None and why."""
    rows.append(timed({"impl": impl, "case": case, **extra}, "ms", fn, device, ms_scale))


def packed_rows(device: str, dtype, smoke: bool) -> list[dict]:
    from torch_flashsys import flash_attention

    lens = _lengths(smoke)
    heads, dim = (2, 16) if smoke else (16, 128)
    total, longest, n = sum(lens), max(lens), len(lens)
    q, k, v, dout = inputs((total, heads, dim), device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device,
                      dtype=torch.int32)  # fmt: skip
    work = sum(flops((heads, n_i, dim), True, "fwd+bwd") for n_i in lens)
    rows: list[dict] = []
    case = "packed"
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    ours = lambda q, k, v: flash_attention(q, k, v, is_causal=True, **packed)
    _row(rows, "ours", case, fwd_bwd(ours, (q, k, v), dout), device, flops=work)
    # the same batch as nested jagged tensors, (n, heads, j, dim) as SDPA takes them
    offsets = cu.long()
    as_nested = lambda t: torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)
    ours_nested = lambda q, k, v: (
        flash_attention(as_nested(q), as_nested(k), as_nested(v), is_causal=True)
        .transpose(1, 2)
        .values()
    )
    _row(rows, "ours nested jagged", case, fwd_bwd(ours_nested, (q, k, v), dout), device,
         flops=work)  # fmt: skip
    # padded to the longest: (n, heads, longest, dim) with a causal + key-padding mask
    pad = torch.zeros(n, heads, longest, dim, device=device, dtype=dtype)
    qp, kp, vp, dp = (pad.clone().requires_grad_(i < 3) for i in range(4))
    valid = (
        torch.arange(longest, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    )
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    mask = causal[None, None] & valid[:, None, None, :]
    for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        sdpa = sdpa_call(backend, attn_mask=mask)
        _row(rows, f"sdpa {backend.split('_')[0].lower()} padded", case,
             fwd_bwd(sdpa, (qp, kp, vp), dp), device, flops=work)  # fmt: skip
    key_pad = valid[:, None, None, :]
    ours_pad = lambda q, k, v: flash_attention(q, k, v, attn_mask=key_pad, is_causal=True)
    _row(rows, "ours padded", case, fwd_bwd(ours_pad, (qp, kp, vp), dp), device, flops=work)
    if device == "cuda":
        _row(rows, "flex document mask", case, _flex_packed(lens, q, k, v, dout), device,
             flops=work)  # fmt: skip
    # the equal-length batch of about the same number of tokens
    per = total // n
    qe, ke, ve, de = inputs((n, heads, per, dim), dtype, device, seed=1)
    eq_flops = flops(qe.shape, True, "fwd+bwd")
    eq_case = f"equal-length ({n}, {per})"
    _row(rows, "ours", eq_case,
         fwd_bwd(lambda q, k, v: flash_attention(q, k, v, is_causal=True), (qe, ke, ve), de),
         device, flops=eq_flops)  # fmt: skip
    return rows


def _flex_packed(lens, q, k, v, dout):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lens), device=q.device),
                                  torch.tensor(lens, device=q.device))  # fmt: skip

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block = create_block_mask(mask_mod, None, None, total, total, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0).detach().requires_grad_() for t in (q, k, v))
    df = dout.transpose(0, 1).unsqueeze(0)
    return fwd_bwd(lambda q, k, v: compiled(q, k, v, block_mask=block), (qf, kf, vf), df)


def _decode_case(rows, batch, cache, heads, kv_heads, dim, device, dtype, random_lengths):
    from torch_flashsys import flash_attention

    case = f"decode b{batch} c{cache}"
    gen = torch.Generator(device=device).manual_seed(batch)
    q = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype, generator=gen)
    kc, vc = (torch.randn(batch, kv_heads, cache, dim, device=device, dtype=dtype, generator=gen)
              for _ in range(2))  # fmt: skip
    full = torch.full((batch,), cache, device=device, dtype=torch.int32)
    nbytes = 2 * kc.numel() * kc.element_size()

    def ours(lens):
        return lambda: flash_attention(q, kc, vc, cache_seqlens=lens, enable_gqa=True)

    with torch.no_grad():
        _row(rows, "ours", case, ours(full), device, bytes=nbytes)
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            sdpa = sdpa_call(backend, enable_gqa=True)
            _row(rows, f"sdpa {backend.split('_')[0].lower()}", case, lambda f=sdpa: f(q, kc, vc),
                 device, bytes=nbytes)  # fmt: skip
        if device == "cuda":
            from torch.nn.attention.flex_attention import flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            _row(rows, "flex", case, lambda: flex(q, kc, vc, enable_gqa=True), device,
                 bytes=nbytes)  # fmt: skip
        dst = torch.empty_like(kc)
        # A copy reads and writes every byte: reading K and V once at the copy bandwidth takes
        # half the copy's time (the "copy-bandwidth time").
        _row(rows, "copy bandwidth (K and V read once)", case,
             lambda: (dst.copy_(kc), dst.copy_(vc)), device, ms_scale=0.5, bytes=nbytes)  # fmt: skip
        if random_lengths:
            lens = torch.randint(1, cache + 1, (batch,), device=device, generator=gen,
                                 dtype=torch.int32)  # fmt: skip
            used = int(lens.sum()) / (batch * cache)
            _row(rows, "ours", f"decode b{batch} random lengths (used {used:.2f} of the cache)",
                 ours(lens), device, bytes=nbytes * used)  # fmt: skip


def decode_rows(device: str, dtype, smoke: bool) -> list[dict]:
    rows: list[dict] = []
    configs = [(8, 32768), (64, 1024)] if not smoke else [(2, 256)]
    heads, kv_heads, dim = (32, 8, 128) if not smoke else (4, 2, 16)
    for batch, cache in configs:
        _decode_case(rows, batch, cache, heads, kv_heads, dim, device, dtype,
                     random_lengths=batch == 8 or smoke)  # fmt: skip
    return rows


def run_varlen(smoke: bool = False) -> list[dict]:
    device, dtype = device_dtype(smoke)
    rows = packed_rows(device, dtype, smoke) + decode_rows(device, dtype, smoke)
    for r in rows:
        if r.get("ms"):
            if "flops" in r:
                r["TFLOP/s"] = r["flops"] / r["ms"] / 1e9
            if "bytes" in r:
                r["GB/s"] = r["bytes"] / r["ms"] / 1e6
    return rows
