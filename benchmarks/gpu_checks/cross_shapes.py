"""Attention whose query and key lengths differ (cross-attention, few queries over many keys),
as users run it, against SDPA's default and its pinned backends (issue 27: swapping
flash_attention in must not make training slower; the peer grid has only self-attention).

Per problem (bf16): our output and gradients and cuDNN's against float64 (SDPA's math path;
max abs error of each), ``do_bench`` medians of the forward (no grad) and forward+backward in
``--rounds`` rounds of alternating order, the GPU time of one fwd+bwd (the union of its kernels,
torch.profiler) and the kernels ours ran (which path took it); the host's wall microseconds per fwd+bwd call of an
unsynchronized loop, and for ours the portable backward's fast launches per call (2 when it
runs: none fell back to Triton's JIT), the Hopper launch keys planned during that loop, and
our kernel backward's host us per call when called directly (no autograd).

    PYTHONPATH=. python3 benchmarks/gpu_checks/cross_shapes.py [--rounds 3] [--only I,J]
        [--shapes 8x16/16x256:8192x64,...] [--impls ours,ours fused,...] [--no-host]
        [--out cross_shapes_h100.csv]

``--shapes``: ``BxH/HKVxNQ:NKxD[c]`` items instead of :data:`CASES`. ``--impls``: of
:data:`IMPLS`; ``ours fused`` / ``ours portable`` run our Hopper fused backward wherever it can
take the problem (``_sm90.FUSED_ALL``) / the portable backward (``FUSED_ENABLED`` off), for the
length rule; ``ours portable dkdv=BMxBNxWxS`` (or ``dq=``) the portable backward with that
tile; ``ours without kv grads`` without the dQ kernel's dK/dV (KV_GRADS), ``ours kv=BMxBNxWxS``
with that KV_GRADS tile. ``--no-host``: without the host loops.
"""

from __future__ import annotations

import contextlib
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks import _peers
from benchmarks._harness import (
    _merged,
    bench,
    device_kernels,
    host_us,
    markdown_table,
    profiled,
    write_results,
)
from torch_flashsys import flash_attention
from torch_flashsys.attention import _ops, _sm90, _triton_bwd
from torch_flashsys.attention._extras import CAUSAL, PLAIN
from torch_flashsys.attention._kernel_config import _arch, load_table
from torch_flashsys.attention._triton_bwd import _launch_dkdv, _launch_dq

# batch, heads, kv heads, query length, key length, head dim, causal (top-left, as SDPA)
CASES = [
    (2, 10, 10, 4096, 77, 64, False),  # text-conditioned diffusion (SDXL-like) cross-attention
    (8, 10, 10, 1024, 77, 64, False),
    (8, 20, 20, 448, 1500, 64, False),  # speech decoder over encoder frames (Whisper-like)
    (4, 16, 16, 4096, 1024, 64, False),
    (4, 16, 16, 1024, 4096, 64, False),
    (8, 16, 16, 256, 8192, 64, False),  # few queries, many keys (latents, Perceiver-like)
    (4, 16, 16, 2048, 256, 128, False),
    (4, 32, 8, 1024, 4096, 128, False),
    (2, 16, 16, 4096, 2048, 64, True),
]
IMPLS = ("ours", "ours fused", "ours portable", "ours without kv grads", "sdpa default", "cudnn",
         "flash")  # fmt: skip
# The switches each of our variants runs under (its calls, backwards included): module attributes
SWITCHES = {
    "ours fused": {(_sm90, "FUSED_ALL"): True},
    "ours portable": {(_sm90, "FUSED_ENABLED"): False},
    "ours without kv grads": {(_triton_bwd, "KV_GRADS_MAX_Q"): 0},  # the dK/dV kernel runs
}


def _tile_override(name: str) -> tuple[str, tuple] | None:
    """``ours portable dkdv=32x128x4x3`` -> ("dkdv", (32, 128, 4, 3)); ``ours kv=256x32x8x3``
    -> ("kv", ...): the KV_GRADS tile of that many query rows; else None."""
    for prefix in ("ours portable ", "ours "):
        if name.startswith(prefix) and "=" in name:
            kernel, tile = name.removeprefix(prefix).split("=")
            return kernel, tuple(int(x) for x in tile.split("x"))
    return None


@contextlib.contextmanager
def _switched(name: str):
    """The switches of impl ``name`` (:data:`SWITCHES`; none for the others) set, then
    restored; an ``ours portable KERNEL=BMxBNxWxS`` impl: the portable backward with that tile
    for KERNEL (``dq`` or ``dkdv``) at every length of the committed table; ``ours
    kv=BMxBNxWxS``: that KV_GRADS tile for BM query rows. Our plans are made afresh."""
    override = _tile_override(name)
    switches = SWITCHES.get("ours portable" if override and override[0] != "kv" else name, {})
    saved = {key: getattr(*key) for key in switches}
    table = load_table(_arch(torch.cuda.current_device()))
    saved_tiles, saved_kv = dict(table), dict(_triton_bwd.KV_GRADS_TILES)
    try:
        for (module, attr), value in switches.items():
            setattr(module, attr, value)
        if override and override[0] == "kv":
            for key in _triton_bwd.KV_GRADS_TILES:
                if key[1] == override[1][0]:
                    _triton_bwd.KV_GRADS_TILES[key] = override[1]
        elif override:
            for key in table:
                if key.startswith(override[0] + "/"):
                    table[key] = override[1]
        if name.startswith("ours"):
            _triton_bwd._PLANS.clear()
        yield
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)
        table.update(saved_tiles)
        _triton_bwd.KV_GRADS_TILES.update(saved_kv)
        if name.startswith("ours"):
            _triton_bwd._PLANS.clear()


def _shapes(text: str) -> list[tuple]:
    """``8x16/16x256:8192x64c,...`` -> :data:`CASES`-like tuples."""
    cases = []
    for item in text.split(","):
        b, heads, lengths, d = item.rstrip("c").split("x")
        (h, hk), (nq, nk) = heads.split("/"), lengths.split(":")
        cases.append((int(b), int(h), int(hk), int(nq), int(nk), int(d), item.endswith("c")))
    return cases


def _fn(name: str, causal: bool):
    if name.startswith("ours"):
        return lambda q, k, v: flash_attention(q, k, v, is_causal=causal, enable_gqa=True)
    if name == "sdpa default":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                              enable_gqa=True)  # fmt: skip
    backend = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}[name]
    return _peers.sdpa_call(backend, is_causal=causal, enable_gqa=True)


def _inputs(case, seed: int = 0):
    b, h, hk, nq, nk, d, _ = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(b, h, nq, d), (b, hk, nk, d), (b, hk, nk, d), (b, h, nq, d)]
    ts = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) for s in shapes]
    return [t.requires_grad_(i < 3) for i, t in enumerate(ts)]


def _errors(fn, case) -> float:
    """Max abs error of fn's output and gradients against float64 (on two batch rows)."""
    small = (min(case[0], 2), *case[1:])
    q, k, v, dout = _inputs(small, seed=1)
    out = fn(q, k, v)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=case[-1], enable_gqa=True)
    ref.backward(dout.double())
    pairs = [(out, ref), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)]
    return max((a.double() - b).abs().max().item() for a, b in pairs)


def _gpu_ms(step, iters: int = 10) -> tuple[float, list[str]]:
    """GPU ms per call of ``step`` (the union of its kernels) and its kernels' names with their
    ms per call."""
    prof, _ = profiled(step, iters, warmup=2)
    kernels = device_kernels(prof)
    spans = _merged([(s, e) for _, s, e in kernels])
    per: dict[str, float] = {}
    for name, s, e in kernels:
        per[name[:40]] = per.get(name[:40], 0.0) + (e - s) / 1e3 / iters
    names = [f"{name} {ms:.3f}" for name, ms in sorted(per.items())]
    return sum(e - s for s, e in spans) / 1e3 / iters, names


def _backward_alone_us(q, k, v, dout, causal: bool) -> float:
    """Host us per call of our kernel backward called directly (the calling thread, no
    autograd), with the forward's out and lse."""
    ex, scale = (CAUSAL if causal else PLAIN), q.shape[-1] ** -0.5
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = _ops._forward(qd, kd, vd, scale, ex)
    return host_us(lambda: _ops._backward(dout, qd, kd, vd, out, lse, None, scale, ex), 200)[
        "wall_us"
    ]


def measure(case, rounds: int, impls=IMPLS, host: bool = True) -> list[dict]:
    b, h, hk, nq, nk, d, causal = case
    label = f"{b}x{h}/{hk}x{nq}q{nk}k x{d}{' causal' if causal else ''}"
    q, k, v, dout = _inputs(case)
    fns, rows = {}, {}
    for name in impls:
        fn = _fn(name, causal)
        try:
            with _switched(name), torch.no_grad():
                fn(q, k, v)
            with _switched(name):
                _peers.fwd_bwd(fn, (q, k, v), dout)()
                rows[name] = {"case": label, "impl": name, "err": _errors(fn, case)}
            fns[name] = fn
        except Exception as exc:  # a backend that cannot run this problem
            rows[name] = {"case": label, "impl": name, "note": str(exc).splitlines()[0][:60]}
    times: dict = {}
    for r in range(rounds):
        for name, fn in list(fns.items())[:: 1 if r % 2 == 0 else -1]:
            with _switched(name), torch.no_grad():
                fwd = bench(lambda fn=fn: fn(q, k, v), "cuda", rep_ms=50)["median_ms"]
            with _switched(name):
                step = _peers.fwd_bwd(fn, (q, k, v), dout)
                both = bench(step, "cuda", rep_ms=50)["median_ms"]
            times.setdefault(name, []).append((fwd, both))
    for name, fn in fns.items():
        row = rows[name]
        step = _peers.fwd_bwd(fn, (q, k, v), dout)
        with _switched(name):
            if host:
                hits, planned = _launch_dq.hits + _launch_dkdv.hits, _sm90.planned
                row["host us"] = host_us(step, calls=200)["wall_us"]
            if host and name.startswith("ours"):  # the portable backward's fast launches
                row["bwd fast launches"] = (_launch_dq.hits + _launch_dkdv.hits - hits) / 230
                row["new keys"] = _sm90.planned - planned
                row["bwd alone us"] = _backward_alone_us(q, k, v, dout, causal)
            row["gpu fwd+bwd ms"], kernels = _gpu_ms(step)
        row["fwd ms"] = statistics.median(t[0] for t in times[name])
        row["fwd+bwd ms"] = statistics.median(t[1] for t in times[name])
        if name.startswith("ours"):
            row["kernels"] = "; ".join(kernels)
    base = rows.get("sdpa default", rows.get("cudnn", {}))
    for row in rows.values():
        if base.get("fwd+bwd ms") and row.get("fwd+bwd ms"):
            row["fwd / sdpa"] = row["fwd ms"] / base["fwd ms"]
            row["fwd+bwd / sdpa"] = row["fwd+bwd ms"] / base["fwd+bwd ms"]
            row["gpu / sdpa"] = row["gpu fwd+bwd ms"] / base["gpu fwd+bwd ms"]
    return list(rows.values())


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    arg = lambda name: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None
    cases = _shapes(arg("--shapes")) if arg("--shapes") else CASES
    if arg("--only"):
        cases = [cases[int(i)] for i in arg("--only").split(",")]
    impls = arg("--impls").split(",") if arg("--impls") else ("ours", "sdpa default", "cudnn",
                                                                 "flash")  # fmt: skip
    unknown = {i for i in impls if not _tile_override(i)} - set(IMPLS)
    if unknown:
        raise SystemExit(f"--impls: unknown {sorted(unknown)}; of {IMPLS} and tile overrides")
    rows = []
    for case in cases:
        rows += measure(case, rounds, impls, host="--no-host" not in sys.argv)
        torch.cuda.empty_cache()
    if "--out" in sys.argv:
        write_results(sys.argv[sys.argv.index("--out") + 1], rows)
    kernels = [f"{r['case']}: {r['kernels']}" for r in rows if r.get("kernels")]
    print("\n".join(kernels), file=sys.stderr)
    cols = ["case", "impl", "err", "fwd ms", "fwd+bwd ms", "gpu fwd+bwd ms", "host us",
            "fwd / sdpa", "fwd+bwd / sdpa", "gpu / sdpa", "bwd fast launches", "new keys",
            "bwd alone us", "note"]  # fmt: skip
    print(markdown_table(rows, cols))


if __name__ == "__main__":
    main()
