"""Attention peers: SDPA pinned to a backend, the per-mode timer, the peer grid
(``flash.py --preset peers``) and the feature table (``--preset features``).

The grid puts flash_attention beside SDPA's flash, cuDNN and efficient backends and compiled
FlexAttention, bf16, same run, same inputs. Compiling FlexAttention takes seconds per shape and
grad mode (40 graphs), so the cases are spread over worker processes that compile in parallel and
take turns on the GPU: a lock is held around every timing, so no two measurements overlap. One row
per (impl, case, mode); ``ms`` is None where an impl cannot run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

from benchmarks._harness import bench

# (batch, heads, seq) x head_dim x causal
SHAPES = [(4, 16, 1024), (4, 16, 2048), (4, 16, 4096), (1, 16, 8192), (1, 16, 16384)]
DIMS = (64, 128)
IMPLS = ("flash_attention", "sdpa flash", "sdpa cudnn", "sdpa efficient", "flex (compiled)")
MODES = ("fwd", "fwd+bwd")
SDPA = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
# The score-modification targets: ours with a feature beside ours without it and beside every SDPA
# backend that accepts the same call, fwd+bwd, bf16.
FEATURES = ["key padding", "float mask", "dropout 0.1", "window (256, 0)"]

_LOCK = None


def sdpa_call(backend: str, **kwargs):
    """SDPA pinned to ``backend`` (an ``SDPBackend`` name) with ``kwargs``: ``fn(q, k, v, **more)``.
    A 3-D problem (B, L, E) runs as (B, 1, L, E) (a view): SDPA's fused kernels want 4-D."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [getattr(SDPBackend, backend)]

    def run(q, k, v, **more):
        squeeze = q.dim() == 3
        if squeeze:
            q, k, v = (t.unsqueeze(1) for t in (q, k, v))
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs, **more)
        return out.squeeze(1) if squeeze else out

    return run


def time_modes(fn, q, k, v, dout, device, modes, reps: int = 2) -> dict:
    """``fn(q, k, v)`` per mode with the harness timer: ``fwd`` (under no_grad), ``bwd`` (the
    backward of one forward, graph retained), ``fwd+bwd``; on CUDA also the MiB allocated before
    the backward (``mem_before_bwd_MiB``)."""

    def zero():
        for t in (q, k, v):
            t.grad = None

    res = {}
    if "fwd" in modes:
        with torch.no_grad():
            res["fwd"] = bench(lambda: fn(q, k, v), device, reps)
    if "bwd" in modes:
        out = fn(q, k, v)
        if device == "cuda":
            torch.cuda.synchronize()
            res["mem_before_bwd_MiB"] = torch.cuda.memory_allocated() / 2**20
        res["bwd"] = bench(lambda: (zero(), out.backward(dout, retain_graph=True)), device, reps)
        del out
    if "fwd+bwd" in modes:
        res["fwd+bwd"] = bench(lambda: (zero(), fn(q, k, v).backward(dout)), device, reps)
    return res


def cases(smoke: bool = False) -> list[tuple[int, int, int, int, bool]]:
    if smoke:
        return [(1, 2, 128, 16, True)]
    return [(b, h, n, d, c) for (b, h, n) in SHAPES for d in DIMS for c in (True, False)]


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


def _reason(exc: Exception, width: int = 80) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:width]}" if str(exc) else ""


def run_case(case, dtype=torch.bfloat16, device="cuda") -> list[dict]:
    """Every impl and mode on one case; compiles outside the GPU lock, times inside it."""
    batch, heads, seq, dim, causal = case
    gen = torch.Generator(device=device).manual_seed(seq + dim + causal)
    q, k, v, dout = (torch.randn(batch, heads, seq, dim, device=device, dtype=dtype, generator=gen)
                     for _ in range(4))  # fmt: skip
    for t in (q, k, v):
        t.requires_grad_()
    fwd = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    rows = []
    for name in IMPLS:
        base = {"impl": name, "batch": batch, "heads": heads, "seq": seq, "head_dim": dim,
                "causal": causal}  # fmt: skip
        try:
            fn = _impl(name, seq, causal, device)
            if name.startswith("flex"):  # compile both graphs before queueing for the GPU
                with torch.no_grad():
                    fn(q, k, v)
                fn(q, k, v).backward(dout)
            timings = _locked(time_modes, fn, q, k, v, dout, device, MODES)
            for mode in MODES:
                ms = timings[mode]["median_ms"]
                flops = fwd if mode == "fwd" else 3.5 * fwd
                rows.append({**base, "mode": mode, "ms": ms, "tflops": flops / ms / 1e9})
        except Exception as exc:  # this impl cannot run this case: an empty ms, and why
            rows += [{**base, "mode": mode, "ms": None, "note": _reason(exc)} for mode in MODES]
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _locked(fn, *args):
    if _LOCK is None:
        return fn(*args)
    with _LOCK:
        return fn(*args)


def _init_worker(lock) -> None:
    global _LOCK
    _LOCK = lock
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    torch._dynamo.config.cache_size_limit = 256


def run_grid(smoke: bool = False, workers: int = 8) -> list[dict]:
    """All cases; in ``workers`` processes on CUDA (one process when smoke or on CPU)."""
    todo = cases(smoke)
    if smoke or not torch.cuda.is_available() or workers <= 1:
        device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return [row for case in todo for row in run_case(case, dtype, device)]
    ctx = mp.get_context("spawn")
    # Longest cases first, so the last worker to finish is not the one holding a 16k case.
    order = sorted(todo, key=lambda c: -c[0] * c[2] * c[2] * c[3])
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(ctx.Lock(),)) as pool:  # fmt: skip
        results = dict(zip(order, pool.map(run_case, order, chunksize=1), strict=True))
    return [row for case in todo for row in results[case]]


def summary(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per case and mode: ours, each peer, ours / fastest peer; and the geometric means."""
    key = lambda r: (r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"], r["mode"])
    table, ratios = [], {m: [] for m in MODES}
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
        table.append(line)
    totals = [{"mode": m, "cases": len(r), "geomean ours / fastest peer": statistics.geometric_mean(r),
               "worst": max(r), "cases above 1.3": sum(x > 1.3 for x in r)}
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

    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for name in FEATURES:
        b, h, n, d = (1, 2, 256, 16) if smoke else (4, 16, 4096, 128)
        if name.startswith("window"):
            b, n = (1, 2048) if smoke else (1, 16384)
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen)
                         for _ in range(4))  # fmt: skip
        for t in (q, k, v):
            t.requires_grad_()
        ours, plain, sdpa = feature_kwargs(name, b, h, n, device, dtype, gen)
        impls = {
            "flash_attention": lambda q, k, v, kw=ours: flash_attention(q, k, v, **kw),
            "flash_attention without it": lambda q, k, v, kw=plain: flash_attention(q, k, v, **kw),
        }
        if sdpa is not None:
            impls |= {
                f"sdpa {s}": sdpa_call(SDPA[s], **sdpa) for s in ("flash", "cudnn", "efficient")
            }
        for impl, fn in impls.items():
            row = {"feature": name, "impl": impl, "shape": "x".join(map(str, q.shape))}
            try:
                ms = time_modes(fn, q, k, v, dout, device, ("fwd+bwd",))["fwd+bwd"]["median_ms"]
                row["fwd+bwd ms"] = ms
            except Exception as exc:  # SDPA backends refuse some of these calls
                row["fwd+bwd ms"], row["note"] = None, _reason(exc, 70)
            rows.append(row)
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows
