"""The attention peer grid (``benchmarks/flash.py --preset peers``): flash_attention beside SDPA's
flash, cuDNN and efficient backends and compiled FlexAttention, bf16, same run, same inputs.

Compiling FlexAttention takes seconds per shape and grad mode (40 graphs for the grid), so the
cases are spread over worker processes that compile in parallel and take turns on the GPU: a
lock is held around every timing (and around our kernels' first call, which autotunes), so no
two measurements overlap. One row per (impl, case, mode); ``ms`` is None where an impl cannot run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

# (batch, heads, seq) x head_dim x causal
SHAPES = [(4, 16, 1024), (4, 16, 2048), (4, 16, 4096), (1, 16, 8192), (1, 16, 16384)]
DIMS = (64, 128)
IMPLS = ("flash_attention", "sdpa flash", "sdpa cudnn", "sdpa efficient", "flex (compiled)")
MODES = ("fwd", "fwd+bwd")

_LOCK = None


def cases(smoke: bool = False) -> list[tuple[int, int, int, int, bool]]:
    if smoke:
        return [(1, 2, 128, 16, True)]
    return [(b, h, n, d, c) for (b, h, n) in SHAPES for d in DIMS for c in (True, False)]


def flops(batch, heads, seq, dim, causal, mode) -> float:
    fwd = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    return fwd if mode == "fwd" else 3.5 * fwd


def _impl(name: str, seq: int, causal: bool, device: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torch_flashsys import flash_attention

    if name == "flash_attention":
        return lambda q, k, v: flash_attention(q, k, v, is_causal=causal)
    if name.startswith("sdpa"):
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}[name.split()[1]]  # fmt: skip

        def sdpa(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return sdpa
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if causal:
        block_mask = create_block_mask(
            lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq, device=device
        )
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _time(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    from benchmarks._harness import time_fn

    return time_fn(fn, warmup=1, reps=2)["median_ms"]


def run_case(case, dtype=torch.bfloat16, device="cuda") -> list[dict]:
    """Every impl and mode on one case; compiles outside the GPU lock, times inside it."""
    batch, heads, seq, dim, causal = case
    gen = torch.Generator(device=device).manual_seed(seq + dim + causal)
    shape = (batch, heads, seq, dim)
    q, k, v, dout = (
        torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_()
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
            timings = _locked(_measure, fn, q, k, v, dout, device)
            for mode in MODES:
                ms = timings[mode]
                rows.append({**base, "mode": mode, "ms": ms,
                             "tflops": flops(batch, heads, seq, dim, causal, mode) / ms / 1e9})  # fmt: skip
        except Exception as exc:  # this impl cannot run this case: an empty ms, and why
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}" if str(exc) else ""
            rows += [{**base, "mode": mode, "ms": None, "note": reason} for mode in MODES]
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _measure(fn, q, k, v, dout, device):
    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(dout)

    with torch.no_grad():
        fn(q, k, v)  # first call: our kernels autotune here, under the lock
        fwd = _time(lambda: fn(q, k, v), device)
    fwd_bwd()
    return {"fwd": fwd, "fwd+bwd": _time(fwd_bwd, device)}


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
    lock = ctx.Lock()
    # Longest cases first, so the last worker to finish is not the one holding a 16k case.
    todo.sort(key=lambda c: -c[0] * c[2] * c[2] * c[3])
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(lock,)) as pool:  # fmt: skip
        results = list(pool.map(run_case, todo, chunksize=1))
    order = {c: i for i, c in enumerate(cases(smoke))}
    results.sort(key=lambda rows: order[tuple(rows[0][k] for k in
                                              ("batch", "heads", "seq", "head_dim", "causal"))])  # fmt: skip
    return [row for rows in results for row in rows]


def summary(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per case and mode: ours, each peer, ours / fastest peer; and the geometric means."""
    table, ratios = [], {m: [] for m in MODES}
    keys = sorted({(r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"], r["mode"])
                   for r in rows}, key=lambda k: (k[5], k[3], not k[4], k[2], k[0]))  # fmt: skip
    for key in keys:
        case = {r["impl"]: r["ms"] for r in rows
                if (r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"], r["mode"]) == key}  # fmt: skip
        ours = case.get("flash_attention")
        peers = {n: ms for n, ms in case.items() if n != "flash_attention" and ms is not None}
        line = {"mode": key[5], "shape": f"{key[0]}x{key[1]}x{key[2]}x{key[3]}",
                "causal": key[4], **{n: case.get(n) for n in IMPLS}}  # fmt: skip
        if ours is not None and peers:
            best = min(peers, key=peers.get)
            line["fastest peer"] = best
            line["ours / fastest"] = ours / peers[best]
            ratios[key[5]].append(ours / peers[best])
        table.append(line)
    totals = [
        {
            "mode": m,
            "cases": len(r),
            "geomean ours / fastest peer": statistics.geometric_mean(r),
            "worst": max(r),
            "cases above 1.3": sum(x > 1.3 for x in r),
        }
        for m, r in ratios.items()
        if r
    ]
    return table, totals


# The score-modification targets: ours with a feature beside ours without it and beside every SDPA
# backend that accepts the same call, fwd+bwd, bf16.
FEATURES = ["key padding", "float mask", "dropout 0.1", "window (256, 0)"]


def _feature_inputs(name: str, device: str, dtype, smoke: bool):
    b, h, n, d = (1, 2, 256, 16) if smoke else (4, 16, 4096, 128)
    if name.startswith("window"):
        b, n = (1, 2048) if smoke else (1, 16384)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen)
                     for _ in range(4))  # fmt: skip
    ours, plain, sdpa = {}, {}, None
    if name == "key padding":  # each sequence keeps 50-90% of its keys (10-50% padding)
        keep = torch.rand(b, generator=gen, device=device) * 0.4 + 0.5
        mask = (torch.arange(n, device=device)[None, :] < (keep * n)[:, None]).view(b, 1, 1, n)
        ours = sdpa = {"attn_mask": mask}
    elif name == "float mask":
        mask = torch.randn(b, h, n, n, device=device, dtype=dtype, generator=gen)
        ours = sdpa = {"attn_mask": mask}
    elif name == "dropout 0.1":
        ours = sdpa = {"dropout_p": 0.1}
    else:
        ours, plain = {"window_size": (256, 0), "is_causal": True}, {"is_causal": True}
    return (q, k, v, dout), ours, plain, sdpa


def _sdpa_call(backend_name: str, kwargs: dict):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return run


def run_features(smoke: bool = False) -> list[dict]:
    from torch_flashsys import flash_attention

    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for name in FEATURES:
        (q, k, v, dout), ours, plain, sdpa = _feature_inputs(name, device, dtype, smoke)
        for t in (q, k, v):
            t.requires_grad_()
        impls = {
            "flash_attention": lambda q, k, v, kw=ours: flash_attention(q, k, v, **kw),
            "flash_attention without it": lambda q, k, v, kw=plain: flash_attention(q, k, v, **kw),
        }
        if sdpa is not None:
            for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                impls[f"sdpa {backend.split('_')[0].lower()}"] = _sdpa_call(backend, sdpa)
        for impl, fn in impls.items():
            row = {"feature": name, "impl": impl, "shape": "x".join(map(str, q.shape))}
            try:
                row["fwd+bwd ms"] = _measure(fn, q, k, v, dout, device)["fwd+bwd"]
            except Exception as exc:  # SDPA backends refuse some of these calls
                row["fwd+bwd ms"] = None
                row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"
            rows.append(row)
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows
