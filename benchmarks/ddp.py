r"""Data parallelism: the training loop people run, ours beside torch's options, in one run.

Every variant trains the reference LM from the same weights on the same data: AdamW(lr=1e-4),
fp32 parameters, bf16 autocast on GPUs, ``loss.backward(); opt.step(); opt.zero_grad()``. Rounds
are interleaved; a variant that cannot run is an ``n/a`` row. Variants and columns:
docs/benchmarking.md, section 5. On CUDA the rows go to docs/data/ddp_<N>x<gpu>.csv by default.

    torchrun --nproc_per_node=2 benchmarks/ddp.py --preset 2.0B    # -> docs/data/ddp_2xh200.csv
    torchrun --nproc_per_node=1 benchmarks/ddp.py --preset 2.0B --profile prof --variants plain,ours-ddp
    torchrun --nproc_per_node=2 benchmarks/ddp.py --preset sharded --out sharded.csv \
        --variants torch-ddp,torch-ddp-zero,torch-ddp-zero-view,torch-ddp-sharded
    python benchmarks/ddp.py --size small --device cpu --nproc 2       # CPU, gloo
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import (
    comm_overlap,
    csv_list,
    device_kernels,
    parser,
    percentiles,
    profiled,
    report,
    run_ranks,
    samples_ms,
    timeline_plot,
    top_ops,
    why,
)
from torch_flashsys import BucketedDDP, ShardedOptimizer
from torch_flashsys.models import ATTENTION_CHOICES, MODEL_SIZES, build_model

# variant: (wrapper, optimizer, the torch peer of its ratios); the first ten run by default
VARIANTS = {
    "plain": ("none", "adamw", None),
    "torch-ddp": ("ddp", "adamw", None),
    "torch-ddp-zero": ("ddp", "zero", None),
    **{f"torch-fsdp2{s}": (f"fsdp2{s}", "adamw", None)
       for s in ("", "-noreshard", "-bf16", "-bf16-noreshard")},
    "ours-ddp": ("ours", "adamw", "torch-ddp"),
    "ours-ddp-zero1": ("ours", "sharded1", "torch-ddp-zero"),
    "ours-ddp-zero2": ("ours", "sharded2", "torch-ddp-zero"),
    "ours-ddp-copy": ("ours-copy", "adamw", "torch-ddp"),  # BucketedDDP's copy path
    # BucketedDDP keeping its gradient buffers between steps (as before issue 30)
    "ours-ddp-keep": ("ours-keep", "adamw", "torch-ddp"),
    "ours-ddp-zero1-keep": ("ours-keep", "sharded1", "torch-ddp-zero"),
    "ours-ddp-zero2-keep": ("ours-keep", "sharded2", "torch-ddp-zero"),
    "torch-ddp-copy": ("ddp-copy", "adamw", None),  # gradient_as_bucket_view=False
    "torch-ddp-zero-view": ("ddp", "zero-view", None),
    "torch-ddp-sharded": ("ddp", "sharded1", "torch-ddp-zero"),
}  # fmt: skip
PRESETS = {  # issue 18: 2.0B LM, batch 4 x 512 per rank; ShardedOptimizer: xl, 4 x 256, fp32
    "2.0B": {"size": "2.0B", "context": 512, "batch": 4, "warmup": 3, "steps": 8, "rounds": 2},
    "sharded": {"size": "xl", "context": 256, "batch": 4, "warmup": 3, "steps": 10, "rounds": 1,
                "autocast": "none"},
}  # fmt: skip
GIB = 2**30
COLUMNS = ["variant", "step_ms", "p20_ms", "p80_ms", "peak_gib", "reserved_gib", "state_gib"]
COLUMNS += ["vs_peer"]
COLUMNS += ["peak_vs_peer", "saved_over_state", "vs_plain", "loss", "status"]
PHASES = ("forward", "backward", "optimizer.step", "zero_grad")
_MESH: list = []  # the FSDP2 variants' DeviceMesh
_TIMELINES: dict = {}  # --profile on CUDA: variant -> rank 0's GPU kernels, for the plot
_PHASE_PEAKS: dict = {}  # --profile on CUDA: phase -> peak GiB of the variant being profiled
OVERLAP = ["comm_ms", "hidden_ms", "exposed_comm_ms", "hidden_frac", "compute_ms"]


def _is_comm(kernel: str) -> bool:
    """NCCL's kernels (all-reduce, reduce-scatter, all-gather, broadcast)."""
    return kernel.lower().startswith("nccl")


def parse_args(argv=None):
    p = parser(__doc__, smoke="tiny model on CPU (gloo), seconds")
    p.add_argument("--size", default="xl", choices=list(MODEL_SIZES), help="reference LM size")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--context", type=int, default=256, help="sequence length")
    p.add_argument("--attention", default="sdpa", choices=list(ATTENTION_CHOICES), help="LM's")
    p.add_argument("--preset", choices=list(PRESETS), help="named setup (explicit options win)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all variants")
    p.add_argument("--variants", default=",".join(list(VARIANTS)[:10]), help="comma-separated")
    p.add_argument("--autocast", choices=["bf16", "none"], help="default: bf16 on CUDA, else none")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="BucketedDDP bucket_size_mb")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if any")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: cores/ranks)")
    p.add_argument("--nproc", type=int, default=2, help="processes when not under torchrun")
    p.add_argument("--time-budget", type=float, help="seconds: start no round that would not fit")
    p.add_argument("--profile", help="directory: torch.profiler on rank 0 instead of timing")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per variant")
    p.add_argument(
        "--trace",
        action="store_true",
        help="with --profile: also save each variant's trace (trace_<variant>.json.gz)",
    )
    preset = p.parse_known_args(argv)[0].preset
    if preset:  # the preset's values become the defaults: options given explicitly still win
        p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    args.vocab = 512 if args.smoke else 10_000
    if args.smoke:
        args.size, args.batch, args.context = "tiny", 2, 32
        args.steps, args.warmup, args.rounds, args.device = 2, 1, 1, "cpu"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.autocast = args.autocast or ("bf16" if args.device == "cuda" else "none")
    args.names = csv_list(p, args.variants, "--variants", choices=VARIANTS)
    if min(args.steps, args.rounds, args.profile_steps) < 1 or args.warmup < 0:
        p.error("--steps, --rounds and --profile-steps must be >= 1 and --warmup >= 0")
    return args


def _wrap(kind: str, model, args, device: torch.device):
    if kind == "none":
        return model
    if kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not _MESH:  # one mesh over all ranks, made on first use
            _MESH.append(init_device_mesh(device.type, (dist.get_world_size(),)))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if "bf16" in kind else None)
        for module in (*model.layers, model):
            fully_shard(module, mesh=_MESH[0], mp_policy=policy,
                        reshard_after_forward="noreshard" not in kind)  # fmt: skip
        return model
    if kind.startswith("ddp"):
        ids = [device.index] if device.type == "cuda" else None
        view = kind != "ddp-copy"
        return torch.nn.parallel.DistributedDataParallel(model, ids, gradient_as_bucket_view=view)
    module = BucketedDDP(model, args.bucket_mb)
    if kind == "ours-copy":
        module._prepoint = False  # the copy path, for comparison
    if kind == "ours-keep":
        module._reducer.release_between_steps = False  # the buffers stay through the forward
    return module


def _optimizer(kind: str, params):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    adamw = torch.optim.AdamW
    if kind.startswith("zero"):
        view = kind == "zero-view"
        return ZeroRedundancyOptimizer(params, adamw, parameters_as_bucket_view=view, lr=1e-4)
    if kind.startswith("sharded"):
        return ShardedOptimizer(params, adamw, shard_gradients=kind == "sharded2", lr=1e-4)
    return adamw(params, lr=1e-4)


def _free(device: torch.device) -> float:
    """Collect the previous variant and reset the peak; returns the GiB still allocated."""
    gc.collect()
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / GIB


def _state_gib(opt) -> float:
    """This rank's optimizer state (ZeroRedundancyOptimizer/ShardedOptimizer: its shard)."""
    local = getattr(opt, "optim", opt)
    tensors = [v for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) / GIB


def _steps(name: str, args, device: torch.device):
    """A step function for a fresh variant, and its optimizer."""
    torch.manual_seed(0)
    model = build_model(args.size, context_length=args.context, attention=args.attention,
                        vocab_size=args.vocab, device=device, dtype=torch.float32)  # fmt: skip
    wrapper, optimizer, _ = VARIANTS[name]
    module = _wrap(wrapper, model, args, device)
    opt = _optimizer(optimizer, module.parameters())
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    amp = args.autocast == "bf16"

    def step(labelled: bool = False) -> torch.Tensor:
        label = _phase if labelled else (lambda _, __: contextlib.nullcontext())
        with label("forward", device), torch.autocast(device.type, torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(module(x).flatten(0, 1).float(), y.flatten())
        with label("backward", device):
            loss.backward()
        with label("optimizer.step", device):
            opt.step()
        with label("zero_grad", device):
            opt.zero_grad()
        return loss.detach()

    return step, opt


@contextlib.contextmanager
def _phase(name: str, device: torch.device):
    """A profiled step's phase: a torch.profiler range and, on CUDA, the phase's peak memory
    (GiB, the largest over the profiled steps) in ``_PHASE_PEAKS``."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with torch.profiler.record_function(name):
        yield
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) / GIB
        _PHASE_PEAKS[name] = max(_PHASE_PEAKS.get(name, 0.0), peak)


def _agree(failed: bool, device: torch.device) -> bool:
    """Whether any rank failed (so every rank reports the variant the same way)."""
    flag = torch.tensor([float(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _timed(name: str, args, device: torch.device) -> dict:
    """Step times (ms), final loss and optimizer-state GiB of a fresh variant (freed on return)."""
    step, opt = _steps(name, args, device)
    losses = []
    times = samples_ms(lambda: losses.append(step()), args.warmup, args.steps)
    return {"times": times, "loss": float(losses[-1]), "state_gib": _state_gib(opt)}


def _profiled(name: str, args, device: torch.device) -> dict:
    """Warm-up, then ``--profile-steps`` steps under torch.profiler (rank 0 records)."""
    step, _ = _steps(name, args, device)
    _PHASE_PEAKS.clear()
    rank0, run = dist.get_rank() == 0, lambda: step(labelled=True)
    prof, ms = profiled(run, args.profile_steps, max(args.warmup, 1), rank0)
    return {"step_ms": ms, **(_summarize(name, prof, args, device.type == "cuda") if rank0 else {})}


def run_variant(name: str, args, device: torch.device) -> dict:
    """A fresh variant timed (per step the slowest rank's time) or, with --profile, profiled."""
    res = {"variant": name, "times": [0.0] * args.steps, "loss": float("nan"), "state_gib": 0.0,
           "leftover_gib": _free(device), "status": "ok"}  # fmt: skip
    try:
        res |= (_profiled if args.profile else _timed)(name, args, device)
    except Exception as exc:  # a variant this torch / backend cannot run: an n/a row
        res["status"] = f"n/a: {why(exc, 120)}"
    cuda = device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) / GIB if cuda else 0.0
    _free(device)
    if _agree(res["status"] != "ok", device) and res["status"] == "ok":
        res["status"] = "n/a: failed on another rank"
    stats = [*res["times"], reserved, peak or 0.0, res["state_gib"]]
    stats = torch.tensor(stats, dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    res["times"], res["state_gib"] = stats[:-3].tolist(), stats[-1].item()
    res["peak_gib"] = None if peak is None else stats[-2].item()
    res["reserved_gib"] = stats[-3].item() if cuda else None
    return {k: v for k, v in res.items() if k != "times"} if args.profile else res


def _summarize(name: str, prof, args, cuda: bool) -> dict:
    n, events = args.profile_steps, prof.key_averages()
    phases = {}  # a phase's host range (its GPU-side span has the same key and no CPU time)
    for e in events:
        if e.key in PHASES and e.cpu_time_total >= getattr(phases.get(e.key), "cpu_time_total", 0):
            phases[e.key] = e
    ops = [
        e
        for e in events
        if e.key not in phases and not e.key.startswith("ProfilerStep") and not e.is_user_annotation
    ]  # ranges such as Optimizer.step#AdamW.step: not ops
    row = {f"{k}_cpu_ms": phases[k].cpu_time_total / 1e3 / n for k in phases}
    for col, key in [("cpu", "self_cpu_time_total")] + [("cuda", "self_device_time_total")] * cuda:
        row[f"self_{col}_ms"] = sum(getattr(e, key, 0) for e in ops) / 1e3 / n
        row[f"top_{col}"] = top_ops(ops, key, n)
    os.makedirs(args.profile, exist_ok=True)
    if cuda:  # communication beside computation on rank 0's GPU (docs/benchmarking.md, section 5)
        row |= {f"{k}_peak_gib": v for k, v in _PHASE_PEAKS.items()}
        _TIMELINES[name] = device_kernels(prof)
        row |= comm_overlap(_TIMELINES[name], n, _is_comm)
    if args.trace:
        prof.export_chrome_trace(os.path.join(args.profile, f"trace_{name}.json.gz"))
    with open(os.path.join(args.profile, f"profile_{name}.txt"), "w") as f:
        f.write(f"{name}: {n} steps, rank 0 of {dist.get_world_size()}; times are totals\n\n")
        for key in ["self_cuda_time_total"] * cuda + ["self_cpu_time_total"]:
            f.write(f"sorted by {key}\n{events.table(sort_by=key, row_limit=30)}\n\n")
    return row


def default_out(world: int, device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    words = re.split(r"[^a-z0-9]+", torch.cuda.get_device_name(device).lower())
    short = next((w for w in words if re.fullmatch(r"[a-z]+\d+[a-z]*", w)), "gpu")  # h200
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "docs", "data", f"ddp_{world}x{short}.csv")


def _ratio(values: dict, a: str, b: str | None) -> str:
    """``values[a] / values[b]`` to 3 decimals, or "" when either is missing."""
    if b is None or not values.get(a) or not values.get(b):
        return ""
    return f"{values[a] / values[b]:.3f}"


def _rows(pooled: dict, args, world: int) -> list[dict]:
    ok = {n for n, r in pooled.items() if r["status"] == "ok"}
    mean = {n: statistics.fmean(pooled[n]["times"]) for n in ok}
    peak = {n: pooled[n]["peak_gib"] for n in ok}
    adamw_state = pooled.get("torch-ddp", {}).get("state_gib")
    rows = []
    for name in args.names:
        res, peer = pooled[name], VARIANTS[name][2]
        t = percentiles(res["times"]) if name in ok else {}
        saved = ""
        if name in ok and peak.get("torch-ddp") and adamw_state:
            saved = f"{(peak['torch-ddp'] - peak[name]) / adamw_state:.3f}"
        rows.append({
            "variant": name, "step_ms": mean.get(name, "n/a"), **t,
            "peak_gib": ("" if res["peak_gib"] is None else res["peak_gib"]) if t else "n/a",
            "reserved_gib": (res.get("reserved_gib") or "") if t else "n/a",
            "vs_peer": _ratio(mean, name, peer), "peak_vs_peer": _ratio(peak, name, peer),
            "vs_plain": _ratio(mean, name, "plain"),
            **{k: res[k] for k in ("loss", "leftover_gib", "status")},
            "size": args.size, "batch": args.batch, "context": args.context,
            "autocast": args.autocast, "world": world, "backend": dist.get_backend(),
            "samples": len(res["times"]) if t else 0,
            "state_gib": res["state_gib"] if t else "", "saved_over_state": saved,
        })  # fmt: skip
    return rows


def _each(items, args, device, run, start, per=0.0):
    """``run(item)`` per item while the time budget allows (decided alike on every rank)."""
    for item in items:
        late = args.time_budget is not None and time.monotonic() - start + per > args.time_budget
        if _agree(late, device):
            return
        t0 = time.monotonic()
        yield run(item)
        per = max(per, time.monotonic() - t0)


def _profile(args, device, world):
    run = lambda n: run_variant(n, args, device)
    rows = list(_each(args.names, args, device, run, time.monotonic()))
    if dist.get_rank() == 0:
        for row in rows:
            print(f"- {row['variant']} top CPU ms/step: {row.get('top_cpu', '')}")
            if "top_cuda" in row:
                print(f"  top CUDA ms/step: {row['top_cuda']}")
        title = f"torch.profiler, {args.size} LM, {args.profile_steps} steps, rank 0 of {world}"
        columns = ["variant", "step_ms", *(f"{p}_cpu_ms" for p in PHASES), "self_cpu_ms"]
        cuda = [f"{p}_peak_gib" for p in PHASES[:3]] + ["self_cuda_ms", *OVERLAP]
        columns += (cuda if device.type == "cuda" else []) + ["status"]
        report(title, rows, columns, args.out)
        if _TIMELINES:
            timeline_plot(os.path.join(args.profile, "overlap.png"), _TIMELINES, _is_comm,
                          f"{title}: GPU kernels (blue) and NCCL (red)")  # fmt: skip


def worker(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    try:
        if args.profile:
            return _profile(args, device, world)
        pooled: dict[str, dict] = {}
        rounds = lambda r: _round(r, args, device, pooled)
        list(_each(range(args.rounds), args, device, rounds, time.monotonic()))
    finally:
        _MESH.clear()  # its process groups go before the default one
        gc.collect()
    if rank == 0:
        rows = _rows(pooled, args, world)
        amp = "bf16 autocast" if args.autocast == "bf16" else "fp32"
        title = (f"Step time, {args.size} LM, batch {args.batch}x{args.context} per rank, {world} "
                 f"ranks ({dist.get_backend()}), {amp}, AdamW, zero_grad() to None, "
                 f"{rows[0]['samples']} timed steps per variant")  # fmt: skip
        report(title, rows, COLUMNS, args.out or default_out(world, device))


def _round(r: int, args, device, pooled: dict) -> None:
    shift = r % len(args.names)
    for name in args.names[shift:] + args.names[:shift]:
        if dist.get_rank() == 0:
            print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
        res = run_variant(name, args, device)
        acc = pooled.setdefault(name, {**res, "times": []})
        acc["status"] = acc["status"] if res["status"] == "ok" else res["status"]
        acc["times"] += res["times"]
        if res["peak_gib"] is not None:
            acc["peak_gib"] = max(acc["peak_gib"] or 0.0, res["peak_gib"])
            acc["reserved_gib"] = max(acc["reserved_gib"] or 0.0, res["reserved_gib"])
        acc["leftover_gib"] = max(acc["leftover_gib"], res["leftover_gib"])


def main(argv=None) -> None:
    args = parse_args(argv)
    run_ranks(worker, args, args.nproc, "nccl" if args.device == "cuda" else "gloo")


if __name__ == "__main__":
    main()
