"""Data parallelism: the training loop people run, ours beside torch's options, in one run.

Every variant trains the reference LM from the same weights on the same data (each rank its own
batch): ``torch.optim.AdamW(lr=1e-4)``, fp32 parameters, bf16 ``torch.autocast`` on GPUs
(``--autocast none``: fp32), ``loss.backward(); opt.step(); opt.zero_grad()``. Variants (what each
wraps, and every column: docs/benchmarking.md, section 6): plain, torch-ddp, torch-ddp-zero, the
torch-fsdp2 family, ours-ddp, ours-ddp-zero1, ours-ddp-zero2; only when named: ours-ddp-copy,
torch-ddp-copy, torch-ddp-zero-view, torch-ddp-sharded. Rounds are interleaved; a variant that
cannot run is a row marked ``n/a``. ``--profile DIR``: torch.profiler of a few steps per variant on
rank 0 instead of timing. On CUDA the rows go to docs/data/ddp_<N>x<gpu>.csv unless --out is given.

    torchrun --nproc_per_node=2 benchmarks/ddp.py --preset 2.0B    # -> docs/data/ddp_2xh200.csv
    torchrun --nproc_per_node=1 benchmarks/ddp.py --preset 2.0B --profile prof --variants plain,ours-ddp
    torchrun --nproc_per_node=2 benchmarks/ddp.py --preset sharded --out sharded.csv \\
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
    add_lm_args,
    csv_list,
    parser,
    percentiles,
    print_report,
    profiled,
    report,
    run_ranks,
    samples_ms,
    top_ops,
    write_results,
)
from torch_flashsys import BucketedDDP, ShardedOptimizer
from torch_flashsys.models import build_model

VARIANTS = (
    "plain", "torch-ddp", "torch-ddp-zero", "torch-fsdp2", "torch-fsdp2-noreshard",
    "torch-fsdp2-bf16", "torch-fsdp2-bf16-noreshard", "ours-ddp", "ours-ddp-zero1",
    "ours-ddp-zero2",
)  # fmt: skip
EXTRA = ("ours-ddp-copy", "torch-ddp-copy", "torch-ddp-zero-view", "torch-ddp-sharded")
PEER = {
    "ours-ddp": "torch-ddp",
    "ours-ddp-copy": "torch-ddp",
    "torch-ddp-sharded": "torch-ddp-zero",
}
PEER |= {"ours-ddp-zero1": "torch-ddp-zero", "ours-ddp-zero2": "torch-ddp-zero"}
PRESETS = {  # issue 18: 2.0B LM, batch 4 x 512 per rank; ShardedOptimizer: xl, 4 x 256, fp32
    "2.0B": {"size": "2.0B", "context": 512, "batch": 4, "warmup": 3, "steps": 8, "rounds": 2},
    "sharded": {"size": "xl", "context": 256, "batch": 4, "warmup": 3, "steps": 10, "rounds": 1,
                "autocast": "none"},
}  # fmt: skip
GIB = 2**30
COLUMNS = ["variant", "step_ms", "p20_ms", "p80_ms", "peak_gib", "state_gib", "vs_peer"]
COLUMNS += ["peak_vs_peer", "saved_over_state", "vs_plain", "loss", "status"]


def parse_args(argv=None):
    p = parser(__doc__, smoke="tiny model on CPU (gloo), seconds")
    add_lm_args(p)
    p.add_argument("--preset", choices=list(PRESETS), help="named setup (explicit options win)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant and round (8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all variants (2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; see above")
    p.add_argument("--autocast", choices=["bf16", "none"], help="default: bf16 on CUDA, else none")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="BucketedDDP bucket_size_mb (25)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if any")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: cores/ranks)")
    p.add_argument("--nproc", type=int, default=2, help="processes when not under torchrun (2)")
    p.add_argument("--time-budget", type=float, help="seconds: start no round that would not fit")
    p.add_argument("--profile", help="directory: profile instead of timing")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per variant (3)")
    preset = p.parse_known_args(argv)[0].preset
    if preset:  # the preset's values become the defaults: options given explicitly still win
        p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.batch, args.context, args.vocab = "tiny", 2, 32, 512
        args.steps, args.warmup, args.rounds, args.device = 2, 1, 1, "cpu"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.autocast = args.autocast or ("bf16" if args.device == "cuda" else "none")
    args.names = csv_list(p, args.variants, "--variants", choices=VARIANTS + EXTRA)
    if min(args.steps, args.rounds, args.profile_steps) < 1 or args.warmup < 0:
        p.error("--steps, --rounds and --profile-steps must be >= 1 and --warmup >= 0")
    return args


class _Mesh:
    """One DeviceMesh over all ranks for the FSDP2 variants, made on first use."""

    mesh = None

    @classmethod
    def get(cls, device: torch.device):
        if cls.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            cls.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return cls.mesh


def _fsdp2(name: str, model, device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if "bf16" in name else None)
    kw = {"mesh": _Mesh.get(device), "reshard_after_forward": "noreshard" not in name}
    for module in (*model.layers, model):
        fully_shard(module, mp_policy=policy, **kw)
    return model


def build(name: str, model: torch.nn.Module, args, device: torch.device):
    """(the module to call, the optimizer) for variant ``name`` around a fresh ``model``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    adamw = torch.optim.AdamW
    if name == "plain":
        module = model
    elif name.startswith("torch-fsdp2"):
        module = _fsdp2(name, model, device)
    elif name.startswith("torch-ddp"):
        ids = [device.index] if device.type == "cuda" else None
        view = name != "torch-ddp-copy"
        module = torch.nn.parallel.DistributedDataParallel(model, ids, gradient_as_bucket_view=view)
    else:
        module = BucketedDDP(model, args.bucket_mb)
        if name == "ours-ddp-copy":
            module._prepoint = False  # the copy path, for comparison
    params = module.parameters()
    if name.startswith("torch-ddp-zero"):
        view = name == "torch-ddp-zero-view"
        return module, ZeroRedundancyOptimizer(
            params, adamw, parameters_as_bucket_view=view, lr=1e-4
        )
    if name.startswith("ours-ddp-zero") or name == "torch-ddp-sharded":
        return module, ShardedOptimizer(params, adamw, shard_gradients=name.endswith("2"), lr=1e-4)
    return module, adamw(params, lr=1e-4)


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
    """A step function for a fresh variant, and its (module, optimizer)."""
    torch.manual_seed(0)
    model = build_model(args.size, context_length=args.context, attention=args.attention,
                        vocab_size=args.vocab, device=device, dtype=torch.float32)  # fmt: skip
    module, opt = build(name, model, args, device)
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    amp = args.autocast == "bf16"

    def step(labelled: bool = False) -> torch.Tensor:
        label = torch.profiler.record_function if labelled else (lambda _: contextlib.nullcontext())
        with label("forward"), torch.autocast(device.type, torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(module(x).flatten(0, 1).float(), y.flatten())
        with label("backward"):
            loss.backward()
        with label("optimizer.step"):
            opt.step()
        with label("zero_grad"):
            opt.zero_grad()
        return loss.detach()

    return step, (module, opt)


def _agree(failed: bool, device: torch.device) -> bool:
    """Whether any rank failed (so every rank reports the variant the same way)."""
    flag = torch.tensor([float(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _reason(exc: BaseException) -> str:
    text = re.sub(r"\s+", " ", str(exc)).strip()
    return f"n/a: {type(exc).__name__}: {text[:120]}"


def _timed(name: str, args, device: torch.device) -> tuple[list[float], float, float]:
    """Step times (ms), final loss and optimizer-state GiB of a fresh variant (freed on return)."""
    step, (_, opt) = _steps(name, args, device)
    losses = []
    times = samples_ms(lambda: losses.append(step()), args.warmup, args.steps)
    return times, float(losses[-1]), _state_gib(opt)


def run_variant(name: str, args, device: torch.device) -> dict:
    """Warm-up then timed steps; the per-step times are the slowest rank's."""
    leftover = _free(device)
    status, times, loss, state = "ok", [0.0] * args.steps, float("nan"), 0.0
    try:
        times, loss, state = _timed(name, args, device)
    except Exception as exc:  # a variant this torch / backend cannot run: an n/a row
        status = _reason(exc)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    _free(device)
    if _agree(status != "ok", device) and status == "ok":
        status = "n/a: failed on another rank"
    stats = torch.tensor([*times, peak, state], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {"times": stats[:-2].tolist(), "peak_gib": stats[-2].item() if device.type == "cuda" else None,
            "state_gib": stats[-1].item(), "loss": loss, "leftover_gib": leftover,
            "status": status}  # fmt: skip


def profile_variant(name: str, args, device: torch.device) -> dict:
    """Warm-up, then ``--profile-steps`` steps under torch.profiler (rank 0 records)."""
    _free(device)
    row: dict = {"variant": name}
    try:
        prof, row["step_ms"] = _profiled(name, args, device)
        if prof is not None:
            row.update(_summarize(name, prof, args, device.type == "cuda"))
        row["status"] = "ok"
    except Exception as exc:
        row["status"] = _reason(exc)
    _free(device)
    _agree(row["status"] != "ok", device)
    return row


def _profiled(name: str, args, device: torch.device):
    step, _ = _steps(name, args, device)
    run = lambda: step(labelled=True)
    return profiled(run, args.profile_steps, max(args.warmup, 1), record=dist.get_rank() == 0)


def _summarize(name: str, prof, args, cuda: bool) -> dict:
    n = args.profile_steps
    events = prof.key_averages()
    phases = {
        e.key: e for e in events if e.key in ("forward", "backward", "optimizer.step", "zero_grad")
    }
    ops = [e for e in events if e.key not in phases and not e.key.startswith("ProfilerStep")]
    row = {f"{k}_cpu_ms": phases[k].cpu_time_total / 1e3 / n for k in phases}
    row["self_cpu_ms"] = sum(e.self_cpu_time_total for e in ops) / 1e3 / n
    row["top_cpu"] = top_ops(ops, "self_cpu_time_total", n)
    if cuda:
        row["self_cuda_ms"] = sum(getattr(e, "self_device_time_total", 0) for e in ops) / 1e3 / n
        row["top_cuda"] = top_ops(ops, "self_device_time_total", n)
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"profile_{name}.txt"), "w") as f:
        f.write(f"{name}: {n} steps, rank 0 of {dist.get_world_size()}; times are totals\n\n")
        for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
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
        res, t, peer = pooled[name], percentiles(pooled[name]["times"]), PEER.get(name)
        good = name in ok
        saved = ""
        if good and peak.get("torch-ddp") and adamw_state:
            saved = f"{(peak['torch-ddp'] - peak[name]) / adamw_state:.3f}"
        rows.append({
            "variant": name,
            "step_ms": mean[name] if good else "n/a",
            "median_ms": t["median_ms"] if good else "",
            "p20_ms": t["p20_ms"] if good else "",
            "p80_ms": t["p80_ms"] if good else "",
            "peak_gib": ("" if res["peak_gib"] is None else res["peak_gib"]) if good else "n/a",
            "vs_peer": _ratio(mean, name, peer),
            "peak_vs_peer": _ratio(peak, name, peer),
            "vs_plain": _ratio(mean, name, "plain"),
            "loss": res["loss"],
            "leftover_gib": res["leftover_gib"],
            "status": res["status"],
            "size": args.size, "batch": args.batch, "context": args.context,
            "autocast": args.autocast, "world": world, "backend": dist.get_backend(),
            "samples": len(res["times"]) if good else 0,
            "state_gib": res["state_gib"] if good else "", "saved_over_state": saved,
        })  # fmt: skip
    return rows


def _each(names, args, device, run, start, per=0.0):
    """``run(name)`` per name while the time budget allows (decided alike on every rank)."""
    for name in names:
        late = args.time_budget is not None and time.monotonic() - start + per > args.time_budget
        if _agree(late, device):
            return
        t0 = time.monotonic()
        yield name, run(name)
        per = max(per, time.monotonic() - t0)


PROFILE_COLUMNS = [
    "variant",
    "step_ms",
    "forward_cpu_ms",
    "backward_cpu_ms",
    "optimizer.step_cpu_ms",
]
PROFILE_COLUMNS += ["zero_grad_cpu_ms", "self_cpu_ms", "self_cuda_ms", "status"]


def _profile(args, device, world):
    start = time.monotonic()
    run = lambda n: profile_variant(n, args, device)
    rows = [row for _, row in _each(args.names, args, device, run, start)]
    if dist.get_rank() == 0:
        for row in rows:
            print(f"- {row['variant']} top CPU ms/step: {row.get('top_cpu', '')}")
            if "top_cuda" in row:
                print(f"  top CUDA ms/step: {row['top_cuda']}")
        title = f"torch.profiler, {args.size} LM, {args.profile_steps} steps, rank 0 of {world}"
        columns = [c for c in PROFILE_COLUMNS if c != "self_cuda_ms" or device.type == "cuda"]
        report(args, title, rows, columns)


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
        start = time.monotonic()
        rounds = lambda r: _round(r, args, device, pooled)
        list(_each(range(args.rounds), args, device, rounds, start))
    finally:
        _Mesh.mesh = None  # its process groups go before the default one
        gc.collect()
    if rank == 0:
        rows = _rows(pooled, args, world)
        write_results(args.out or default_out(world, device), rows)
        amp = "bf16 autocast" if args.autocast == "bf16" else "fp32"
        title = (f"Step time, {args.size} LM, batch {args.batch}x{args.context} per rank, {world} "
                 f"ranks ({dist.get_backend()}), {amp}, AdamW, zero_grad() to None, "
                 f"{rows[0]['samples']} timed steps per variant")  # fmt: skip
        print_report(title, rows, COLUMNS)


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
        acc["leftover_gib"] = max(acc["leftover_gib"], res["leftover_gib"])


def main(argv=None) -> None:
    args = parse_args(argv)
    run_ranks(worker, args, args.nproc, "nccl" if args.device == "cuda" else "gloo")


if __name__ == "__main__":
    main()
