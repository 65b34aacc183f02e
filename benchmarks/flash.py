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
    python benchmarks/flash.py --preset varlen --out docs/data/attention_varlen_h100.csv
    python benchmarks/flash.py --first-call --out docs/data/attention_startup_h100.csv
                                   # first calls in a fresh process, empty Triton cache
    python benchmarks/flash.py --smoke                        # tiny, CPU, seconds
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

from benchmarks._harness import (
    bench_gpu,
    line_plot,
    print_report,
    progress,
    time_fn,
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
    "cpu": dict(
        shapes="2x8x512x64,4x8x1024x64",
        dtype="fp32",
        modes="fwd+bwd",
        reps=5,
        impls="flash_attention,sdpa (default backend choice)",
    ),
}


def naive_attention(q, k, v, is_causal, nvtx_ranges=True):
    """Scores, softmax and the final matmul as three PyTorch ops (NVTX ranges for nsys)."""
    nvtx = torch.cuda.nvtx.range if q.is_cuda and nvtx_ranges else _null_range
    with nvtx("scores"):
        s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        if is_causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
            s = s.masked_fill(mask, float("-inf"))
    with nvtx("softmax"):
        p = torch.softmax(s, dim=-1)
    with nvtx("final matmul"):
        return p @ v


class _null_range:
    def __init__(self, *_):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, is_causal):
        # SDPA's fused kernels want 4-D; a 3-D (B, L, E) problem is (B, 1, L, E) (a view).
        squeeze = q.dim() == 3
        if squeeze:
            q, k, v = (t.unsqueeze(1) for t in (q, k, v))
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return out.squeeze(1) if squeeze else out

    return run


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
        impls["sdpa (default backend choice)"] = lambda q, k, v, c: F.scaled_dot_product_attention(
            q, k, v, is_causal=c
        )
    return impls


def attention_flops(batch, heads, seq, dim, causal, mode):
    fwd = 4 * batch * max(heads, 1) * seq * seq * dim * (0.5 if causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


def measure(impl, shape, dtype, causal, device, modes, reps):
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    timer = bench_gpu if device == "cuda" else (lambda fn: time_fn(fn, warmup=1, reps=reps))
    results = {}
    if "fwd" in modes:
        with torch.no_grad():
            results["fwd"] = timer(lambda: impl(q, k, v, causal))
    if "bwd" in modes:
        out = impl(q, k, v, causal)
        if device == "cuda":
            torch.cuda.synchronize()
            results["mem_before_bwd_MiB"] = torch.cuda.memory_allocated() / 2**20

        def bwd():
            for t in (q, k, v):
                t.grad = None
            out.backward(dout, retain_graph=True)

        results["bwd"] = timer(bwd)
        del out

    if "fwd+bwd" in modes:

        def fwd_bwd():
            for t in (q, k, v):
                t.grad = None
            impl(q, k, v, causal).backward(dout)

        results["fwd+bwd"] = timer(fwd_bwd)
    return results


def host_overhead(impl, dtype, causal, device, calls=300, shape=(1, 4, 128, 64)):
    """CPU cost of one eager forward+backward call: a loop of calls without synchronizing.

    The shape is tiny so the GPU keeps up and the loop's wall time is the host's: microseconds of
    wall time per call, and of process CPU time per call (autograd runs CUDA backwards on a
    worker thread, so the whole process is counted).
    """
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn(shape, device=device, dtype=dtype, generator=gen)

    def step():
        for t in (q, k, v):
            t.grad = None
        impl(q, k, v, causal).backward(dout)

    for _ in range(30):  # autotune, compile, fill the launch caches
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    sync()
    return {"wall_us": wall / calls * 1e6, "cpu_us": cpu / calls * 1e6}


def host_overhead_rows(impls, dtype, causal, device, smoke=False):
    """:func:`host_overhead` for the fused impls, SDPA as models call it (no backend pinning, no
    context manager per call) and a floor: one trivial differentiable op and its backward."""
    candidates = {n: f for n, f in impls.items() if n.startswith("flash_attention")}
    candidates["sdpa (default backend choice)"] = lambda q, k, v, c: F.scaled_dot_product_attention(
        q, k, v, is_causal=c
    )
    candidates["floor: q * 1.0 and its backward"] = lambda q, k, v, c: q * 1.0
    rows = []
    for name, impl in candidates.items():
        try:
            res = host_overhead(impl, dtype, causal, device, calls=50 if smoke else 300)
            rows.append({"impl": name, "host us/call (wall)": res["wall_us"],
                         "host us/call (process CPU)": res["cpu_us"]})  # fmt: skip
        except Exception as exc:
            rows.append({"impl": name, "host us/call (wall)": f"n/a ({exc})"[:60]})
    return rows


def profile_host(impl, dtype, causal, device, calls=200, top=18):
    """Where the host time of one eager call goes: cProfile of fwd+bwd calls (the main thread
    only: autograd runs CUDA backwards on a worker thread), then the launch layers timed alone."""
    import cProfile
    import io
    import pstats

    from torch_flashsys.attention import _ops
    from torch_flashsys.attention._extras import CAUSAL, PLAIN

    host_overhead(impl, dtype, causal, device, calls=5)
    prof = cProfile.Profile()
    prof.enable()
    host_overhead(impl, dtype, causal, device, calls=calls)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    q, k, v, do = (torch.randn(1, 4, 128, 64, device=device, dtype=dtype) for _ in range(4))
    ex = CAUSAL if causal else PLAIN
    o, lse = _ops._forward(q, k, v, 0.125, ex)
    pieces = {
        "_ops._forward (kernel launch layer)": lambda: _ops._forward(q, k, v, 0.125, ex),
        "_ops._backward (kernel launch layer)": lambda: _ops._backward(
            do, q, k, v, o, lse, None, 0.125, ex
        ),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
    }
    for name, fn in pieces.items():
        for _ in range(20):
            fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        print(f"{name}: {(time.perf_counter() - start) / calls * 1e6:.1f} us/call", file=out)
    return out.getvalue()


def check_correctness(shape, dtype, causal, device):
    """Our output and gradients against SDPA's math path in float64 on a slice of the problem."""
    small = (min(shape[0], 2), *shape[1:-2], min(shape[-2], 1024), shape[-1])
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (
        torch.randn(small, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(3)
    )
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="named setting (overrides shape args)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument(
        "--heads", type=int, default=1,
        help="heads; 0 means 3-D inputs (batch, seq, dim) as in the cs336 preset (default 1)",
    )  # fmt: skip
    p.add_argument("--seq", default="1024", help="sequence length(s), comma-separated")
    p.add_argument("--dim", default="64", help="head dim(s), comma-separated")
    p.add_argument(
        "--shapes",
        help="comma-separated problems BxHxLxD (or BxLxD), instead of --batch/--heads/--seq/--dim",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="default bf16")
    p.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True,
        help="causal (top-left aligned) masking (default on)",
    )  # fmt: skip
    p.add_argument(
        "--impls", default="all",
        help="comma-separated implementation names to run, or 'all' (see the table for names)",
    )  # fmt: skip
    p.add_argument("--modes", default="fwd,bwd,fwd+bwd", help="subset of fwd,bwd,fwd+bwd")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions on CPU (CUDA: do_bench)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 correctness check")
    p.add_argument(
        "--time-budget", type=float, default=0,
        help="seconds for the whole sweep; configurations not started by then are rows marked "
        "'skipped (time budget)' (default 0: no limit)",
    )  # fmt: skip
    p.add_argument(
        "--host-overhead", action="store_true",
        help="also measure the CPU cost of one eager fwd+bwd call per impl (shape 1x4x128x64)",
    )  # fmt: skip
    p.add_argument(
        "--profile-host", action="store_true",
        help="print a cProfile of flash_attention's eager fwd+bwd calls (host time per function)",
    )  # fmt: skip
    p.add_argument(
        "--workers", type=int, default=8,
        help="--preset peers: processes that compile FlexAttention in parallel and take turns "
        "timing on the GPU (default 8)",
    )  # fmt: skip
    p.add_argument(
        "--first-call", action="store_true",
        help="cold start: per dtype (bf16, fp16, fp32), the first fwd+bwd in a fresh process with "
        "an empty Triton cache, the first call at 8 new lengths, a warm call; SDPA beside it",
    )  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, a few seconds")
    p.add_argument("--out", help="write rows to a .json or .csv file")
    p.add_argument("--plot", help="save a forward+backward time plot (PNG) to this path")
    args = p.parse_args(argv)

    if args.preset == "peers":
        return run_peers(args)
    if args.preset == "features":
        return run_features(args)
    if args.preset == "varlen":
        from benchmarks._varlen import run_varlen

        rows = run_varlen(smoke=args.smoke)
        write_results(args.out, rows)
        columns = ["impl", "case", "ms", "TFLOP/s", "GB/s", "note"]
        return print_report("Packed batches and KV-cache decoding (do_bench median)", rows, columns)
    if args.first_call:
        from benchmarks._startup import first_call_rows

        cuda = torch.cuda.is_available() and not args.smoke
        dtypes = ["bfloat16", "float16", "float32"] if cuda else ["float32"]
        rows = first_call_rows(dtypes, "cuda" if cuda else "cpu", smoke=args.smoke)
        write_results(args.out, rows)
        title = "Cold start: fwd+bwd seconds in a fresh process, empty Triton cache"
        return print_report(title, rows, ["impl", "dtype", "case", "seconds"])
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            setattr(args, key, value)
    if args.smoke:
        args.batch, args.heads, args.seq, args.dim, args.reps = 2, 2, "64,128", "16,32", 2
        args.shapes = None
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = DTYPES[args.dtype]
    if device == "cpu" and dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        dtype = torch.float32  # the Triton interpreter's bf16 dot is broken
    modes = [m for m in ("fwd", "bwd", "fwd+bwd") if m in args.modes.split(",")]
    impls = implementations(device)
    if args.impls != "all":
        impls = {n: f for n, f in impls.items() if n in args.impls.split(",")}

    rows = []
    start = time.perf_counter()
    for shape in progress(_shapes(args), desc="configs"):
        batch, heads, seq, dim = shape[0], (shape[1] if len(shape) == 4 else 0), *shape[-2:]
        if args.time_budget and time.perf_counter() - start > args.time_budget:
            rows += [{"impl": name, "shape": "x".join(map(str, shape)), "dtype": args.dtype,
                      "causal": args.causal, **status(modes, "skipped (time budget)")}
                     for name in impls]  # fmt: skip
            continue
        if not args.no_check:
            err = check_correctness(shape, dtype, args.causal, device)
            print(f"check {shape}: max abs error vs float64 = {err:.3g}", file=sys.stderr)
        for name, impl in progress(impls.items(), desc=f"d={dim} L={seq}", total=len(impls)):
            row = {"impl": name, "shape": "x".join(map(str, shape)), "dtype": args.dtype,
                   "causal": args.causal}  # fmt: skip
            try:
                res = measure(impl, shape, dtype, args.causal, device, modes, args.reps)
                for mode in modes:
                    row[f"{mode} ms"] = res[mode]["median_ms"]
                    row[f"{mode} p20-p80"] = f"{res[mode]['p20_ms']:.3g}-{res[mode]['p80_ms']:.3g}"
                    flops = attention_flops(batch, heads, seq, dim, args.causal, mode)
                    row[f"{mode} TFLOP/s"] = flops / (res[mode]["median_ms"] * 1e-3) / 1e12
                if "mem_before_bwd_MiB" in res:
                    row["mem before bwd MiB"] = res["mem_before_bwd_MiB"]
            except torch.cuda.OutOfMemoryError:
                row.update(status(modes, "OOM"))
            except Exception as exc:  # e.g. an SDPA backend that does not support this input
                if "out of memory" in str(exc).lower():
                    row.update(status(modes, "OOM"))
                else:
                    row.update(status(modes, f"n/a ({str(exc).splitlines()[0][:60]})"))
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)

    overhead_rows = []
    if args.host_overhead:
        overhead_rows = host_overhead_rows(impls, dtype, args.causal, device, args.smoke)
    write_results(args.out, rows + [{"mode": "host-overhead", **r} for r in overhead_rows])
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
    if overhead_rows:
        print_report(
            "Host overhead: one eager fwd+bwd call, 1x4x128x64, no synchronization",
            overhead_rows,
            ["impl", "host us/call (wall)", "host us/call (process CPU)"],
        )


def _shapes(args) -> list[tuple[int, ...]]:
    """The problems to time: ``--shapes``, else ``--dim`` x ``--seq`` at ``--batch``/``--heads``."""
    if args.shapes:
        return [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    dims, seqs = map(int, args.dim.split(",")), map(int, args.seq.split(","))
    return [(args.batch, seq, dim) if args.heads == 0 else (args.batch, args.heads, seq, dim)
            for dim, seq in itertools.product(dims, seqs)]  # fmt: skip


def run_peers(args) -> None:
    from benchmarks import _peers

    rows = _peers.run_grid(smoke=args.smoke, workers=args.workers)
    write_results(args.out, rows)
    table, totals = _peers.summary(rows)
    columns = ["mode", "shape", "causal", *_peers.IMPLS, "fastest peer", "ours / fastest"]
    print_report("Attention peers (ms, do_bench median; bf16)", table, columns)
    print_report("Attention peers: summary", totals, list(totals[0]) if totals else [])
    if args.host_overhead:
        device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        overhead = host_overhead_rows(implementations(device), dtype, True, device, args.smoke)
        print_report(
            "Host overhead: one eager fwd+bwd call, 1x4x128x64, no synchronization",
            overhead,
            ["impl", "host us/call (wall)", "host us/call (process CPU)"],
        )


def run_features(args) -> None:
    from benchmarks import _peers

    rows = _peers.run_features(smoke=args.smoke)
    write_results(args.out, rows)
    base = {
        r["feature"]: r["fwd+bwd ms"] for r in rows if r["impl"] == "flash_attention without it"
    }
    peers: dict[str, float] = {}
    for r in rows:
        if r["impl"].startswith("sdpa") and r["fwd+bwd ms"] is not None:
            peers[r["feature"]] = min(peers.get(r["feature"], float("inf")), r["fwd+bwd ms"])
    for r in rows:
        if r["impl"] == "flash_attention" and r["fwd+bwd ms"] is not None:
            r["vs without"] = r["fwd+bwd ms"] / base[r["feature"]] if base.get(r["feature"]) else ""
            r["vs fastest SDPA"] = (
                r["fwd+bwd ms"] / peers[r["feature"]] if r["feature"] in peers else ""
            )
    columns = ["feature", "impl", "shape", "fwd+bwd ms", "vs without", "vs fastest SDPA", "note"]
    print_report("Attention features (fwd+bwd, do_bench median; bf16)", rows, columns)


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
