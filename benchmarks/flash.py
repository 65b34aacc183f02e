r"""Attention benchmark: flash_attention beside naive PyTorch, torch.compile'd naive and SDPA's backends.

Times forward, backward and forward+backward (``triton.testing.do_bench`` median with 20th/80th
percentiles on CUDA), reports TFLOP/s and the memory in use before the backward; out-of-memory is a
row marked OOM, not a crash. ``--seq``/``--dim`` take comma-separated lists: their product is a
sweep. Examples::

    python benchmarks/flash.py --preset cs336                 # bf16, causal, (16, 16384, 64)
    python benchmarks/flash.py --preset sweep --out sweep.csv --plot sweep.png   # 4 d x 5 seq
    python benchmarks/flash.py --batch 8 --heads 1 --dim 16,32,64,128 \
        --seq 256,1024,4096,8192,16384 --dtype bf16 --out sweep.csv --plot sweep.png
    python benchmarks/flash.py --preset peers --out docs/data/attention_peers_h100.csv
                                   # ours vs SDPA flash/cuDNN/efficient and FlexAttention
    python benchmarks/flash.py --preset features      # masks, dropout, window vs SDPA
    python benchmarks/flash.py --preset varlen --out docs/data/attention_varlen_h100.csv
    python benchmarks/flash.py --first-call --out docs/data/attention_startup_h100.csv
                                   # first calls in a fresh process, empty Triton cache
    python benchmarks/flash.py --profile --shapes 4x16x4096x128 --features float-mask,dropout
                                   # torch.profiler: CUDA time per kernel, ours vs cuDNN/flash
    python benchmarks/flash.py --preset cpu --no-causal       # "auto" against SDPA on a CPU
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _peers
from benchmarks._harness import (
    host_us,
    is_oom,
    line_plot,
    nvtx_range,
    parser,
    print_report,
    profiled,
    progress,
    report,
    top_ops,
    write_results,
)
from torch_flashsys import flash_attention

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRESETS = {
    # The CS336 (2025) FlashAttention-2 leaderboard setting.
    "cs336": dict(batch=16, heads=0, seq="16384", dim="64", dtype="bf16", causal=True),
    # The attention sweep (seed 1.2.1 / 1.3): batch 8, one head, d x seq; --dtype still applies.
    "sweep": dict(batch=8, heads=1, seq="256,1024,4096,8192,16384", dim="16,32,64,128"),
    # The peer grid (its own shapes, see benchmarks/_peers.py): bf16, causal and not, d 64/128.
    "peers": dict(dtype="bf16"),
    # Masks, dropout and windows against the same call without them and SDPA (benchmarks/_peers.py).
    "features": dict(dtype="bf16"),
    # Packed batches and KV-cache decoding beside their peers (benchmarks/_varlen.py).
    "varlen": dict(dtype="bf16"),
    # What backend="auto" costs on a CPU-only machine against SDPA there (issue 25; --causal or
    # --no-causal; run it with and without TRITON_INTERPRET=1 in the environment).
    "cpu": dict(shapes="2x8x512x64,4x8x1024x64", dtype="fp32", modes="fwd+bwd", reps=5,
                impls="flash_attention,sdpa (default backend choice)"),
}  # fmt: skip
HOST_TITLE = "Host overhead: one eager fwd+bwd call, 1x4x128x64, no synchronization"
HOST_COLUMNS = ["impl", "host us/call (wall)", "host us/call (process CPU)"]


def naive_attention(q, k, v, is_causal, nvtx_ranges=True):
    """Scores, softmax and the final matmul as three PyTorch ops (NVTX ranges for nsys)."""
    with nvtx_range("scores", nvtx_ranges):
        s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        if is_causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
            s = s.masked_fill(mask, float("-inf"))
    with nvtx_range("softmax", nvtx_ranges):
        p = torch.softmax(s, dim=-1)
    with nvtx_range("final matmul", nvtx_ranges):
        return p @ v


def _sdpa(backend: str):
    run = _peers.sdpa_call(backend)
    return lambda q, k, v, c: run(q, k, v, is_causal=c)


def implementations(device: str) -> dict:
    impls = {
        "flash_attention": lambda q, k, v, c: flash_attention(q, k, v, is_causal=c),
        "naive": naive_attention,
    }
    if device == "cuda":
        # A sweep recompiles per shape and grad mode (forward under no_grad, backward with
        # grad): 40 graphs for --preset sweep, past dynamo's default limit of 8.
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), 64))
        # measure() times backward with retain_graph=True, which donated buffers forbid.
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        # No NVTX inside the compiled function: a range would break the graph into eager pieces.
        impls["naive (compiled)"] = torch.compile(
            lambda q, k, v, c: naive_attention(q, k, v, c, nvtx_ranges=False), fullgraph=True
        )
        for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            impls[f"sdpa {name.lower()}"] = _sdpa(name)
    else:
        impls["flash_attention (torch)"] = lambda q, k, v, c: flash_attention(
            q, k, v, is_causal=c, backend="torch"
        )
        impls["sdpa math"] = _sdpa("MATH")
        impls["sdpa (default backend choice)"] = _sdpa_default
    return impls


def _sdpa_default(q, k, v, causal):
    """SDPA as models call it: no backend pinning, no context manager per call."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _fwd_bwd(impl, q, k, v, dout, causal):
    """One eager fwd+bwd of ``impl``, gradients set to None first."""

    def step():
        for t in (q, k, v):
            t.grad = None
        impl(q, k, v, causal).backward(dout)

    return step


def attention_flops(batch, heads, seq, dim, causal, mode):
    fwd = 4 * batch * max(heads, 1) * seq * seq * dim * (0.5 if causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (
        torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4)
    )
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def measure(impl, shape, dtype, causal, device, modes, reps):
    q, k, v, dout = _inputs(shape, dtype, device)
    fn = lambda q, k, v: impl(q, k, v, causal)
    return _peers.time_modes(fn, q, k, v, dout, device, modes, reps)


def host_overhead_rows(impls, dtype, causal, device, smoke=False):
    """Host cost of one eager fwd+bwd call (1x4x128x64: the GPU keeps up, so the loop's wall time
    is the host's) for the fused impls, SDPA as models call it (no backend pinning, no context
    manager per call) and a floor: one trivial differentiable op and its backward."""
    candidates = {n: f for n, f in impls.items() if n.startswith("flash_attention")}
    candidates["sdpa (default backend choice)"] = _sdpa_default
    candidates["floor: q * 1.0 and its backward"] = lambda q, k, v, c: q * 1.0
    q, k, v, dout = _inputs((1, 4, 128, 64), dtype, device)
    rows = []
    for name, impl in candidates.items():
        try:
            res = host_us(_fwd_bwd(impl, q, k, v, dout, causal), calls=50 if smoke else 300)
            rows.append({"impl": name, "host us/call (wall)": res["wall_us"],
                         "host us/call (process CPU)": res["cpu_us"]})  # fmt: skip
        except Exception as exc:
            rows.append({"impl": name, "host us/call (wall)": f"n/a ({exc})"[:60]})
    return rows


def profile_host(impl, dtype, causal, device, calls=200, top=18):
    """Where the host time of one eager call goes: cProfile of fwd+bwd calls (the main thread
    only: autograd runs CUDA backwards on a worker thread)."""
    import cProfile
    import io
    import pstats

    q, k, v, dout = _inputs((1, 4, 128, 64), dtype, device)
    step = _fwd_bwd(impl, q, k, v, dout, causal)
    host_us(step, calls=5)
    prof = cProfile.Profile()
    prof.enable()
    host_us(step, calls=calls, warmup=0)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def profile_one(fn, q, k, v, dout, iters: int) -> tuple[str, list[dict]]:
    """Markdown section and rows (the top six kernels, or CPU operators) of ``iters`` fwd+bwd
    under torch.profiler after three warm ones (compile, autotune, warm caches)."""
    cuda = q.is_cuda
    prof, wall_ms = profiled(lambda: fn(q, k, v).backward(dout), iters, warmup=3)
    events = prof.key_averages()
    if cuda:  # kernels: device time and no CPU time of their own
        kernels = [e for e in events if getattr(e, "device_time_total", 0) > 0]
        kernels = [e for e in kernels if e.cpu_time_total == 0] or kernels
        time_of = lambda e: e.device_time_total
    else:  # CPU: the operators' own time
        kernels, time_of = list(events), lambda e: e.self_cpu_time_total
    kernels.sort(key=lambda e: -time_of(e))
    total_ms = sum(time_of(e) for e in kernels) / iters / 1e3
    lines = [f"wall {wall_ms:.3f} ms/iter, kernels {total_ms:.3f} ms/iter", ""]
    lines += ["| kernel | calls/iter | ms/iter | share |", "|---|---|---|---|"]
    rows = []
    for e in kernels[:6]:
        name = e.key if len(e.key) < 70 else e.key[:67] + "..."
        ms = time_of(e) / iters / 1e3
        lines.append(
            f"| `{name}` | {e.count / iters:g} | {ms:.3f} | {100 * ms / max(total_ms, 1e-12):.0f}% |"
        )
        rows.append({"kernel": name, "calls_per_iter": e.count / iters, "ms_per_iter": ms,
                     "wall_ms": wall_ms, "kernels_ms": total_ms})  # fmt: skip
    cpu = top_ops(events, "self_cpu_time_total", iters, scale=1.0)
    return "\n".join([*lines, "", f"top self-CPU ops (us/iter): {cpu}"]), rows


def run_profile(args, device, dtype) -> None:
    """--profile: per shape and feature, ours beside SDPA cuDNN and flash under torch.profiler."""
    rows, summary = [], []
    backends = ("CUDNN_ATTENTION", "FLASH_ATTENTION") if device == "cuda" else ("MATH",)
    for shape, feature in itertools.product(_shapes(args), args.features.split(",")):
        q, k, v, dout = _inputs(shape, dtype, device)
        gen = torch.Generator(device=device).manual_seed(1)
        ours, _, sdpa = _peers.feature_kwargs(feature.replace("-", " "), shape[0], shape[1],
                                              shape[2], device, dtype, gen)  # fmt: skip
        impls = {"flash_attention": lambda q, k, v, kw=ours: flash_attention(q, k, v, **kw)}
        impls |= {f"sdpa {b.split('_')[0].lower()}": _peers.sdpa_call(b, **sdpa) for b in backends}
        for impl, fn in impls.items():
            print(f"### {impl} {shape} {feature}\n")
            base = {"impl": impl, "shape": "x".join(map(str, shape)), "feature": feature}
            try:
                text, kernel_rows = profile_one(fn, q, k, v, dout, args.iters)
            except Exception as exc:  # a peer that cannot run: a line
                print(f"cannot run: {type(exc).__name__}: {str(exc)[:100]}\n")
                summary.append({**base, "note": type(exc).__name__})
                continue
            print(text + "\n")
            rows += [{**base, **r} for r in kernel_rows]
            top = kernel_rows[0] if kernel_rows else {}
            summary.append({**base, "wall_ms": top.get("wall_ms"), "kernels_ms": top.get("kernels_ms"),
                            "top kernel": top.get("kernel")})  # fmt: skip
    write_results(args.out, rows)
    columns = ["impl", "shape", "feature", "wall_ms", "kernels_ms", "top kernel", "note"]
    print_report("torch.profiler, fwd+bwd", summary, columns)


def check_correctness(shape, dtype, causal, device):
    """Our output and gradients against SDPA's math path in float64 on a slice of the problem."""
    small = (min(shape[0], 2), *shape[1:-2], min(shape[-2], 1024), shape[-1])
    q, k, v, _ = _inputs(small, dtype, device, seed=1)
    out = flash_attention(q, k, v, is_causal=causal)
    out.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    ref.sum().backward()
    errs = [(out.double() - ref).abs().max().item()]
    errs += [
        (a.grad.double() - b.grad).abs().max().item() for a, b in ((q, q64), (k, k64), (v, v64))
    ]
    return max(errs)


def parse_args(argv=None):
    p = parser(__doc__, smoke="tiny sizes on CPU, a few seconds", plot=True)
    p.add_argument("--preset", choices=sorted(PRESETS), help="named setting (overrides shape args)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument(
        "--heads", type=int, default=1, help="heads; 0: 3-D inputs (batch, seq, dim) (1)"
    )
    p.add_argument("--seq", default="1024", help="sequence length(s), comma-separated")
    p.add_argument("--dim", default="64", help="head dim(s), comma-separated")
    p.add_argument("--shapes", help="comma-separated BxHxLxD (or BxLxD), instead of the above")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="default bf16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="causal (top-left aligned) masking (default on)")  # fmt: skip
    p.add_argument("--impls", default="all", help="comma-separated implementation names, or 'all'")
    p.add_argument("--modes", default="fwd,bwd,fwd+bwd", help="subset of fwd,bwd,fwd+bwd")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions on CPU (CUDA: do_bench)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 correctness check")
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds for the sweep; configurations not started by then are rows "
                   "marked 'skipped (time budget)' (default 0: no limit)")  # fmt: skip
    p.add_argument("--host-overhead", action="store_true",
                   help="also the host cost of one eager fwd+bwd call per impl (1x4x128x64)")  # fmt: skip
    p.add_argument("--profile-host", action="store_true",
                   help="print a cProfile of flash_attention's eager fwd+bwd calls")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler per kernel of fwd+bwd, ours beside SDPA cuDNN/flash "
                   "(default shapes 1x16x16384x64,1x16x4096x64)")  # fmt: skip
    p.add_argument("--features", default="causal",
                   help="--profile: comma-separated causal, key-padding, float-mask, dropout-0.1")  # fmt: skip
    p.add_argument("--iters", type=int, default=5, help="--profile: profiled iterations (5)")
    p.add_argument("--workers", type=int, default=8,
                   help="--preset peers: processes that compile FlexAttention in parallel (8)")  # fmt: skip
    p.add_argument("--first-call", action="store_true",
                   help="cold start: per dtype, the first fwd+bwd in a fresh process with an empty "
                   "Triton cache, the first call at 8 new lengths, a warm call; SDPA beside it")  # fmt: skip
    args = p.parse_args(argv)
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            setattr(args, key, value)
    if args.profile and not args.shapes:
        args.shapes = "1x16x16384x64,1x16x4096x64"
    if args.smoke:
        args.batch, args.heads, args.seq, args.dim, args.reps = 2, 2, "64,128", "16,32", 2
        args.shapes, args.iters = "1x2x128x16" if args.profile else None, 2
    return args


def main(argv=None):
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = DTYPES[args.dtype]
    if device == "cpu" and dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        dtype = torch.float32  # the Triton interpreter's bf16 dot is broken
    if args.preset == "peers":
        return run_peers(args, device, dtype)
    if args.preset == "features":
        return run_features(args)
    if args.preset == "varlen":
        from benchmarks._varlen import run_varlen

        title = "Packed batches and KV-cache decoding (do_bench median)"
        return report(
            args, title, run_varlen(args.smoke), ["impl", "case", "ms", "TFLOP/s", "GB/s", "note"]
        )
    if args.first_call:
        from benchmarks._startup import first_call_rows

        dtypes = ["bfloat16", "float16", "float32"] if device == "cuda" else ["float32"]
        title = "Cold start: fwd+bwd seconds in a fresh process, empty Triton cache"
        rows = first_call_rows(dtypes, device, smoke=args.smoke)
        return report(args, title, rows, ["impl", "dtype", "case", "seconds"])
    if args.profile:
        return run_profile(args, device, dtype)
    run_sweep(args, device, dtype)


def _row(name, impl, shape, dtype, args, device, modes) -> dict:
    row = {
        "impl": name,
        "shape": "x".join(map(str, shape)),
        "dtype": args.dtype,
        "causal": args.causal,
    }
    try:
        res = measure(impl, shape, dtype, args.causal, device, modes, args.reps)
        for mode in modes:
            row[f"{mode} ms"] = res[mode]["median_ms"]
            row[f"{mode} p20-p80"] = f"{res[mode]['p20_ms']:.3g}-{res[mode]['p80_ms']:.3g}"
            flops = attention_flops(
                shape[0], shape[1] if len(shape) == 4 else 0, *shape[-2:], args.causal, mode
            )
            row[f"{mode} TFLOP/s"] = flops / (res[mode]["median_ms"] * 1e-3) / 1e12
        if "mem_before_bwd_MiB" in res:
            row["mem before bwd MiB"] = res["mem_before_bwd_MiB"]
    except Exception as exc:  # OOM, or an SDPA backend that does not support this input
        row.update(
            status(modes, "OOM" if is_oom(exc) else f"n/a ({str(exc).splitlines()[0][:60]})")
        )
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def run_sweep(args, device, dtype) -> None:
    modes = [m for m in ("fwd", "bwd", "fwd+bwd") if m in args.modes.split(",")]
    impls = implementations(device)
    if args.impls != "all":
        impls = {n: f for n, f in impls.items() if n in args.impls.split(",")}
    rows = []
    start = time.perf_counter()
    for shape in progress(_shapes(args), desc="configs"):
        if args.time_budget and time.perf_counter() - start > args.time_budget:
            rows += [{"impl": name, "shape": "x".join(map(str, shape)), "dtype": args.dtype,
                      "causal": args.causal, **status(modes, "skipped (time budget)")}
                     for name in impls]  # fmt: skip
            continue
        if not args.no_check:
            err = check_correctness(shape, dtype, args.causal, device)
            print(f"check {shape}: max abs error vs float64 = {err:.3g}", file=sys.stderr)
        for name, impl in progress(impls.items(), desc=f"{shape}", total=len(impls)):
            rows.append(_row(name, impl, shape, dtype, args, device, modes))
    overhead = (
        host_overhead_rows(impls, dtype, args.causal, device, args.smoke)
        if args.host_overhead
        else []
    )
    write_results(args.out, rows + [{"mode": "host-overhead", **r} for r in overhead])
    if args.plot:
        _plot(rows, args.plot)
    columns = ["impl", "shape", "dtype"]
    for mode in modes:
        columns += [f"{mode} ms", f"{mode} TFLOP/s"]
    if device == "cuda" and "bwd" in modes:
        columns.append("mem before bwd MiB")
    print_report("Attention benchmark", rows, columns)
    if args.profile_host:
        print(profile_host(impls["flash_attention"], dtype, args.causal, device), file=sys.stderr)
    if overhead:
        print_report(HOST_TITLE, overhead, HOST_COLUMNS)


def _shapes(args) -> list[tuple[int, ...]]:
    """The problems to time: ``--shapes``, else ``--dim`` x ``--seq`` at ``--batch``/``--heads``."""
    if args.shapes:
        return [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    dims, seqs = map(int, args.dim.split(",")), map(int, args.seq.split(","))
    return [(args.batch, seq, dim) if args.heads == 0 else (args.batch, args.heads, seq, dim)
            for dim, seq in itertools.product(dims, seqs)]  # fmt: skip


def run_peers(args, device, dtype) -> None:
    rows = _peers.run_grid(smoke=args.smoke, workers=args.workers)
    write_results(args.out, rows)
    table, totals = _peers.summary(rows)
    columns = ["mode", "shape", "causal", *_peers.IMPLS, "fastest peer", "ours / fastest"]
    print_report("Attention peers (ms, do_bench median; bf16)", table, columns)
    print_report("Attention peers: summary", totals, list(totals[0]) if totals else [])
    if args.host_overhead:
        overhead = host_overhead_rows(implementations(device), dtype, True, device, args.smoke)
        print_report(HOST_TITLE, overhead, HOST_COLUMNS)


def run_features(args) -> None:
    rows = _peers.run_features(smoke=args.smoke)
    by = lambda impl: {r["feature"]: r["fwd+bwd ms"] for r in rows if r["impl"] == impl}
    base, sdpa = by("flash_attention without it"), [by(f"sdpa {s}") for s in _peers.SDPA]
    for r in rows:
        ms, feature = r["fwd+bwd ms"], r["feature"]
        fastest = min((p[feature] for p in sdpa if p.get(feature) is not None), default=None)
        if r["impl"] == "flash_attention" and ms is not None:
            r["vs without"] = ms / base[feature] if base.get(feature) else ""
            r["vs fastest SDPA"] = ms / fastest if fastest else ""
    columns = ["feature", "impl", "shape", "fwd+bwd ms", "vs without", "vs fastest SDPA", "note"]
    report(args, "Attention features (fwd+bwd, do_bench median; bf16)", rows, columns)


def status(modes, text):
    """The time columns of a row that has no timings (OOM, unsupported, skipped)."""
    return {f"{mode} ms": text for mode in modes}


def _plot(rows, path):
    """Forward+backward time per shape and implementation (the last mode measured if not)."""
    key = next((k for k in ("fwd+bwd ms", "bwd ms", "fwd ms")
                if any(isinstance(r.get(k), float) for r in rows)), "fwd+bwd ms")  # fmt: skip
    series: dict[str, list] = {}
    for r in rows:
        if isinstance(r.get(key), float):
            series.setdefault(r["impl"], []).append((r["shape"], r[key]))
    line_plot(path, series, xlabel="shape", ylabel=f"{key.replace(' ms', '')} (ms, median)",
              title="Attention benchmark", logy=True, xtick_rotation=60)  # fmt: skip


if __name__ == "__main__":
    main()
