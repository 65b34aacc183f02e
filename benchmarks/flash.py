r"""Attention benchmark: flash_attention beside naive PyTorch, torch.compile'd naive and SDPA's backends.

fwd, bwd and fwd+bwd times (do_bench median, 20th/80th percentiles), TFLOP/s, memory before the
backward; OOM is a row. --seq x --dim is a sweep. Modes and columns: docs/benchmarking.md.

    python benchmarks/flash.py --preset cs336                 # bf16, causal, (16, 16384, 64)
    python benchmarks/flash.py --preset sweep --out sweep.csv --plot sweep.png   # 4 d x 5 seq
    python benchmarks/flash.py --preset peers --out peers.csv # vs SDPA backends, FlexAttention
    python benchmarks/flash.py --preset features              # masks, dropout, window vs SDPA
    python benchmarks/flash.py --preset varlen                # packed batches, decoding
    python benchmarks/flash.py --first-call                   # fresh process, empty Triton cache
    python benchmarks/flash.py --profile --shapes 4x16x4096x128 --features float-mask,dropout
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
    profiled,
    progress,
    report,
    top_ops,
    why,
    write_results,
)
from benchmarks._peers import fwd_bwd, inputs, sdpa_call
from torch_flashsys import flash_attention
from torch_flashsys.attention import _sm90

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRESETS = {
    # The CS336 (2025) FlashAttention-2 leaderboard setting.
    "cs336": dict(batch=16, heads=0, seq="16384", dim="64", dtype="bf16", causal=True),
    # The attention sweep (seed 1.2.1 / 1.3): batch 8, one head, d x seq; --dtype still applies.
    "sweep": dict(batch=8, heads=1, seq="256,1024,4096,8192,16384", dim="16,32,64,128"),
    # The peer grid, the feature table and varlen (benchmarks/_peers.py).
    "peers": dict(dtype="bf16"),
    "features": dict(dtype="bf16"),
    "varlen": dict(dtype="bf16"),
    # What backend="auto" costs on a CPU-only machine against SDPA there (issue 25).
    "cpu": dict(shapes="2x8x512x64,4x8x1024x64", dtype="fp32", modes="fwd+bwd", reps=5,
                impls="flash_attention,sdpa (default backend choice)"),
}  # fmt: skip
HOST_TITLE = "Host overhead: one eager fwd+bwd call, 1x4x128x64, no synchronization"
HOST_COLUMNS = ["impl", "host us/call (wall)", "host us/call (process CPU)"]
FEATURE_COLUMNS = [
    "feature",
    "impl",
    "shape",
    "fwd+bwd ms",
    "vs without",
    "vs fastest SDPA",
    "note",
]


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


def implementations(device: str, causal: bool) -> dict:
    """name -> ``fn(q, k, v)``: the impls the sweep can time on ``device``."""
    impls = {
        "flash_attention": lambda q, k, v: flash_attention(q, k, v, is_causal=causal),
        "naive": lambda q, k, v: naive_attention(q, k, v, causal),
    }
    if device != "cuda":
        impls["flash_attention (torch)"] = lambda q, k, v: flash_attention(
            q, k, v, is_causal=causal, backend="torch"
        )
        return impls | {
            "sdpa math": sdpa_call("MATH", is_causal=causal),
            "sdpa (default backend choice)": _sdpa_default(causal),
        }
    # A sweep recompiles per shape and grad mode: 40 graphs for --preset sweep, past dynamo's 8.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 64))
    import torch._functorch.config as functorch_config  # bwd retains the graph: no donation

    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    # No NVTX inside the compiled function: a range would break the graph into eager pieces.
    impls["naive (compiled)"] = torch.compile(
        lambda q, k, v: naive_attention(q, k, v, causal, nvtx_ranges=False), fullgraph=True
    )
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        impls[f"sdpa {name.lower()}"] = sdpa_call(name, is_causal=causal)
    if _sm90.AVAILABLE:  # both forwards, whatever TORCH_FLASHSYS_SM90 says
        impls["flash_attention (hopper)"] = _switched(impls["flash_attention"], True)
        impls["flash_attention (portable)"] = _switched(impls["flash_attention"], False)
    return impls


def _switched(fn, on: bool):
    """``fn`` with the Hopper forward on or off (``TORCH_FLASHSYS_SM90=1/0``) for its duration."""

    def run(q, k, v):
        saved, _sm90.ENABLED = _sm90.ENABLED, on
        try:
            return fn(q, k, v)
        finally:
            _sm90.ENABLED = saved

    return run


def _sdpa_default(causal: bool):
    """SDPA as models call it: no backend pinning, no context manager per call."""
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def host_overhead_rows(impls, dtype, causal, device, smoke=False):
    """Host cost of one eager fwd+bwd (1x4x128x64: the GPU keeps up, the loop's wall time is the
    host's) of our impls, SDPA as models call it and a floor (one trivial op and its backward)."""
    candidates = {n: f for n, f in impls.items() if n.startswith("flash_attention")}
    candidates["sdpa (default backend choice)"] = _sdpa_default(causal)
    candidates["floor: q * 1.0 and its backward"] = lambda q, k, v: q * 1.0
    q, k, v, dout = inputs((1, 4, 128, 64), dtype, device)
    rows = []
    for name, impl in candidates.items():
        try:
            res = host_us(fwd_bwd(impl, (q, k, v), dout), calls=50 if smoke else 300)
            rows.append({"impl": name, "host us/call (wall)": res["wall_us"],
                         "host us/call (process CPU)": res["cpu_us"]})  # fmt: skip
        except Exception as exc:
            rows.append({"impl": name, "host us/call (wall)": f"n/a ({exc})"[:60]})
    return rows


def profile_host(impl, dtype, device, calls=200, top=18):
    """cProfile of eager fwd+bwd calls (the main thread: CUDA backwards run on a worker)."""
    import cProfile
    import io
    import pstats

    q, k, v, dout = inputs((1, 4, 128, 64), dtype, device)
    step = fwd_bwd(impl, (q, k, v), dout)
    host_us(step, calls=5)
    prof = cProfile.Profile()
    prof.enable()
    host_us(step, calls=calls, warmup=0)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def profile_one(fn, q, k, v, dout, iters: int) -> tuple[str, list[dict]]:
    """Markdown and rows of the top six kernels (on CPU: operators) of ``iters`` fwd+bwd under
    torch.profiler after three warm ones."""
    prof, wall_ms = profiled(fwd_bwd(fn, (q, k, v), dout), iters, warmup=3)
    events = prof.key_averages()
    if q.is_cuda:  # kernels: device time and no CPU time of their own
        kernels = [e for e in events if getattr(e, "device_time_total", 0) > 0]
        kernels = [e for e in kernels if e.cpu_time_total == 0] or kernels
        time_of = lambda e: e.device_time_total
    else:
        kernels, time_of = list(events), lambda e: e.self_cpu_time_total
    kernels.sort(key=lambda e: -time_of(e))
    total_ms = sum(time_of(e) for e in kernels) / iters / 1e3
    rows = [{"kernel": e.key if len(e.key) < 70 else e.key[:67] + "...",
             "calls_per_iter": e.count / iters, "ms_per_iter": time_of(e) / iters / 1e3,
             "wall_ms": wall_ms, "kernels_ms": total_ms} for e in kernels[:6]]  # fmt: skip
    lines = [f"wall {wall_ms:.3f} ms/iter, kernels {total_ms:.3f} ms/iter", ""]
    lines += ["| kernel | calls/iter | ms/iter | share |", "|---|---|---|---|"]
    lines += [f"| `{r['kernel']}` | {r['calls_per_iter']:g} | {r['ms_per_iter']:.3f} | "
              f"{100 * r['ms_per_iter'] / max(total_ms, 1e-12):.0f}% |" for r in rows]  # fmt: skip
    cpu = top_ops(events, "self_cpu_time_total", iters, scale=1.0)
    return "\n".join([*lines, "", f"top self-CPU ops (us/iter): {cpu}"]), rows


def run_profile(args, device, dtype) -> None:
    """--profile: per shape and feature, ours beside SDPA cuDNN and flash under torch.profiler."""
    rows, summary = [], []
    backends = ("CUDNN_ATTENTION", "FLASH_ATTENTION") if device == "cuda" else ("MATH",)
    for shape, feature in itertools.product(_shapes(args), args.features.split(",")):
        q, k, v, dout = inputs(shape, dtype, device)
        gen = torch.Generator(device=device).manual_seed(1)
        ours, _, sdpa = _peers.feature_kwargs(feature.replace("-", " "), *shape[:3], device,
                                              dtype, gen)  # fmt: skip
        impls = {"flash_attention": lambda q, k, v, kw=ours: flash_attention(q, k, v, **kw)}
        impls |= {f"sdpa {b.split('_')[0].lower()}": sdpa_call(b, **sdpa) for b in backends}
        for impl, fn in impls.items():
            print(f"### {impl} {shape} {feature}\n")
            base = {"impl": impl, "shape": "x".join(map(str, shape)), "feature": feature}
            try:
                text, kernel_rows = profile_one(fn, q, k, v, dout, args.iters)
            except Exception as exc:  # a peer that cannot run: a line
                print(f"cannot run: {why(exc, 100)}\n")
                summary.append({**base, "note": type(exc).__name__})
                continue
            print(text + "\n")
            rows += [{**base, **r} for r in kernel_rows]
            top = kernel_rows[0] if kernel_rows else {}
            summary.append({**base, **top, "top kernel": top.get("kernel")})
    write_results(args.out, rows)
    columns = ["impl", "shape", "feature", "wall_ms", "kernels_ms", "top kernel", "note"]
    report("torch.profiler, fwd+bwd", summary, columns)


def check_correctness(shape, dtype, causal, device):
    """Our output and gradients against SDPA's math path in float64 on a slice of the problem."""
    small = (min(shape[0], 2), *shape[1:-2], min(shape[-2], 1024), shape[-1])
    q, k, v, _ = inputs(small, dtype, device, seed=1)
    out = flash_attention(q, k, v, is_causal=causal)
    out.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    ref.sum().backward()
    pairs = [(out, ref), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)]
    return max((a.double() - b).abs().max().item() for a, b in pairs)


def parse_args(argv=None):
    p = parser(__doc__, smoke="tiny sizes on CPU, a few seconds", plot=True)
    p.add_argument("--preset", choices=sorted(PRESETS), help="named setting (overrides shapes)")
    p.add_argument("--batch", type=int, default=8, help="batch size")
    p.add_argument("--heads", type=int, default=1, help="heads; 0: 3-D inputs (batch, seq, dim)")
    p.add_argument("--seq", default="1024", help="sequence length(s), comma-separated")
    p.add_argument("--dim", default="64", help="head dim(s), comma-separated")
    p.add_argument("--shapes", help="comma-separated BxHxLxD (or BxLxD), instead of the above")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype")
    causal = argparse.BooleanOptionalAction
    p.add_argument("--causal", action=causal, default=True, help="top-left aligned causal mask")
    p.add_argument("--impls", default="all", help="comma-separated implementation names, or all")
    p.add_argument("--modes", default="fwd,bwd,fwd+bwd", help="subset of fwd,bwd,fwd+bwd")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions on CPU (CUDA: do_bench)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 correctness check")
    p.add_argument("--time-budget", type=float, default=0, help="sweep seconds (0: no limit)")
    p.add_argument("--host-overhead", action="store_true", help="also host us per eager call")
    p.add_argument("--profile-host", action="store_true", help="cProfile of our eager calls")
    p.add_argument("--profile", action="store_true", help="torch.profiler per kernel, fwd+bwd")
    p.add_argument("--features", default="causal", help="--profile: e.g. key-padding,dropout")
    p.add_argument("--iters", type=int, default=5, help="--profile: profiled iterations")
    p.add_argument("--workers", type=int, default=8, help="--preset peers: compiling processes")
    p.add_argument("--first-call", action="store_true", help="cold start in fresh processes")
    args = p.parse_args(argv)
    for key, value in PRESETS.get(args.preset, {}).items():
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
        title = "Attention features (fwd+bwd, do_bench median; bf16)"
        return report(title, _peers.run_features(args.smoke), FEATURE_COLUMNS, args.out)
    if args.preset == "varlen":
        columns = ["impl", "case", "ms", "TFLOP/s", "GB/s", "note"]
        title = "Packed batches and KV-cache decoding (do_bench median)"
        return report(title, _peers.run_varlen(args.smoke), columns, args.out)
    if args.first_call:
        from benchmarks._startup import first_call_rows

        dtypes = ["bfloat16", "float16", "float32"] if device == "cuda" else ["float32"]
        title = "Cold start: fwd+bwd seconds in a fresh process, empty Triton cache"
        rows = first_call_rows(dtypes, device, smoke=args.smoke)
        return report(title, rows, ["impl", "dtype", "case", "seconds"], args.out)
    if args.profile:
        return run_profile(args, device, dtype)
    run_sweep(args, device, dtype)


def _row(name, impl, shape, dtype, args, device, modes) -> dict:
    row = {"impl": name, "shape": "x".join(map(str, shape)), "dtype": args.dtype,
           "causal": args.causal}  # fmt: skip
    try:
        res = _peers.time_modes(impl, *inputs(shape, dtype, device), device, modes, args.reps)
        for mode in modes:
            ms = res[mode]["median_ms"]
            row[f"{mode} ms"] = ms
            row[f"{mode} p20-p80"] = f"{res[mode]['p20_ms']:.3g}-{res[mode]['p80_ms']:.3g}"
            row[f"{mode} TFLOP/s"] = _peers.flops(shape, args.causal, mode) / ms / 1e9
        if "mem_before_bwd_MiB" in res:
            row["mem before bwd MiB"] = res["mem_before_bwd_MiB"]
    except Exception as exc:  # OOM, or an SDPA backend that does not support this input
        row |= {f"{mode} ms": "OOM" if is_oom(exc) else f"n/a ({why(exc, 60)})" for mode in modes}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def run_sweep(args, device, dtype) -> None:
    modes = [m for m in ("fwd", "bwd", "fwd+bwd") if m in args.modes.split(",")]
    impls = implementations(device, args.causal)
    if args.impls != "all":
        impls = {n: f for n, f in impls.items() if n in args.impls.split(",")}
    rows = []
    start = time.perf_counter()
    for shape in progress(_shapes(args), desc="configs"):
        if args.time_budget and time.perf_counter() - start > args.time_budget:
            rows += [{"impl": name, "shape": "x".join(map(str, shape)), "dtype": args.dtype,
                      "causal": args.causal, **{f"{m} ms": "skipped (time budget)" for m in modes}}
                     for name in impls]  # fmt: skip
            continue
        if not args.no_check:
            err = check_correctness(shape, dtype, args.causal, device)
            print(f"check {shape}: max abs error vs float64 = {err:.3g}", file=sys.stderr)
        for name, impl in progress(impls.items(), desc=f"{shape}", total=len(impls)):
            rows.append(_row(name, impl, shape, dtype, args, device, modes))
    overhead = []
    if args.host_overhead:
        overhead = host_overhead_rows(impls, dtype, args.causal, device, args.smoke)
    write_results(args.out, rows + [{"mode": "host-overhead", **r} for r in overhead])
    if args.plot:
        _plot(rows, args.plot)
    columns = ["impl", "shape", "dtype", *(f"{m} {c}" for m in modes for c in ("ms", "TFLOP/s"))]
    if device == "cuda" and "bwd" in modes:
        columns.append("mem before bwd MiB")
    report("Attention benchmark", rows, columns)
    if args.profile_host:
        print(profile_host(impls["flash_attention"], dtype, device), file=sys.stderr)
    if overhead:
        report(HOST_TITLE, overhead, HOST_COLUMNS)


def _shapes(args) -> list[tuple[int, ...]]:
    """The problems to time: ``--shapes``, else ``--dim`` x ``--seq`` at ``--batch``/``--heads``."""
    if args.shapes:
        return [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    dims, seqs = map(int, args.dim.split(",")), map(int, args.seq.split(","))
    heads = (args.heads,) if args.heads else ()
    return [(args.batch, *heads, seq, dim) for dim, seq in itertools.product(dims, seqs)]


def run_peers(args, device, dtype) -> None:
    rows = _peers.run_grid(smoke=args.smoke, workers=args.workers)
    write_results(args.out, rows)
    table, totals = _peers.summary(rows)
    columns = ["mode", "shape", "causal", *_peers.IMPLS, "fastest peer", "ours / fastest"]
    report("Attention peers (ms, do_bench median; bf16)", table, columns)
    report("Attention peers: summary", totals, list(totals[0]) if totals else [])
    if args.host_overhead:
        overhead = host_overhead_rows(
            implementations(device, True), dtype, True, device, args.smoke
        )
        report(HOST_TITLE, overhead, HOST_COLUMNS)


def _plot(rows, path):
    """Time per shape and implementation: fwd+bwd, else the last mode measured."""
    key = next((k for k in ("fwd+bwd ms", "bwd ms", "fwd ms")
                if any(isinstance(r.get(k), float) for r in rows)), "fwd+bwd ms")  # fmt: skip
    series: dict[str, list] = {}
    for r in rows:
        if isinstance(r.get(key), float):
            series.setdefault(r["impl"], []).append((r["shape"], r[key]))
    ylabel = f"{key.replace(' ms', '')} (ms, median)"
    line_plot(path, series, "shape", ylabel, "Attention benchmark", log="y")


if __name__ == "__main__":
    main()
