"""DDP benchmark: the training loop people run, ours beside torch's data-parallel options, one run.

Every variant trains the reference LM (``torch_flashsys.models.build_model``) from the same initial
weights on the same data (each rank its own batch) with ``torch.optim.AdamW(lr=1e-4)`` and its
defaults, fp32 parameters, bf16 ``torch.autocast`` on GPUs (``--autocast none``: fp32), and

    loss.backward(); opt.step(); opt.zero_grad()        # zero_grad(): set_to_none=True

Variants (``--variants``; default: all of these):

- ``plain``:                      the model alone: no wrapper, no communication
- ``torch-ddp``:                  ``DistributedDataParallel(gradient_as_bucket_view=True)``
- ``torch-ddp-zero``:             torch DDP + ``ZeroRedundancyOptimizer(AdamW)``
- ``torch-fsdp2``:                ``fully_shard`` per block and root, fp32 parameters
- ``torch-fsdp2-noreshard``:      the same, ``reshard_after_forward=False``
- ``torch-fsdp2-bf16``:           ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``
- ``torch-fsdp2-bf16-noreshard``: the same, ``reshard_after_forward=False``
- ``ours-ddp``:                   ``BucketedDDP``
- ``ours-ddp-zero1``:             ``BucketedDDP`` + ``ShardedOptimizer(AdamW)``
- ``ours-ddp-zero2``:             ``BucketedDDP`` + ``ShardedOptimizer(AdamW, shard_gradients=True)``

and, only when named: ``ours-ddp-copy`` (BucketedDDP copying each fresh gradient into its bucket
instead of pointing ``.grad`` at the bucket before the backward: the previous way) and
``torch-ddp-copy`` (torch DDP with ``gradient_as_bucket_view=False``, its default).

Rounds are interleaved (round r starts at variant r). Reported per variant: mean step time after
warm-up over all rounds (the slowest rank's, per step), median and 20th/80th percentiles, peak
memory per rank (``max_memory_allocated``, max over ranks and rounds), ratios to the peer the
issue compares with (``vs_peer``: ours-ddp vs torch-ddp, ours zero1/zero2 vs torch-ddp-zero) and
to ``plain``, and the final loss. A variant that cannot run here is a row marked ``n/a``.

``--profile DIR``: instead of timing, profile ``--profile-steps`` steps of each variant with
``torch.profiler`` (CPU and CUDA) on rank 0, write the top operators by self CUDA and self CPU
time to ``DIR/profile_<variant>.txt``, and print a summary (time per step in forward, backward,
optimizer step and zero_grad, and the top operators).

    torchrun --nproc_per_node=1 benchmarks/ddp.py --preset 2.0B       # -> docs/data/ddp_1xh200.csv
    torchrun --nproc_per_node=2 benchmarks/ddp.py --preset 2.0B       # -> docs/data/ddp_2xh200.csv
    torchrun --nproc_per_node=1 benchmarks/ddp.py --preset 2.0B --profile prof --variants plain,ours-ddp
    python benchmarks/ddp.py --size small --device cpu --nproc 2       # CPU, gloo
    python benchmarks/ddp.py --smoke                   # tiny, CPU, gloo, 2 processes, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import (
    add_lm_args,
    free_port,
    percentiles,
    print_report,
    set_spawn_env,
    under_torchrun,
    write_results,
)
from torch_flashsys import BucketedDDP, ShardedOptimizer
from torch_flashsys.models import build_model

VARIANTS = (
    "plain", "torch-ddp", "torch-ddp-zero", "torch-fsdp2", "torch-fsdp2-noreshard",
    "torch-fsdp2-bf16", "torch-fsdp2-bf16-noreshard", "ours-ddp", "ours-ddp-zero1",
    "ours-ddp-zero2",
)  # fmt: skip
EXTRA = ("ours-ddp-copy", "torch-ddp-copy")  # only when named
PEER = {"ours-ddp": "torch-ddp", "ours-ddp-copy": "torch-ddp"}
PEER |= {"ours-ddp-zero1": "torch-ddp-zero", "ours-ddp-zero2": "torch-ddp-zero"}
PRESETS = {  # the issue-18 setup: 2.0B LM, batch 4 x 512 per rank, modest step counts
    "2.0B": {"size": "2.0B", "context": 512, "batch": 4, "warmup": 3, "steps": 8, "rounds": 2},
}
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_lm_args(p)
    p.add_argument(
        "--preset", default=None, choices=list(PRESETS),
        help="2.0B: --size 2.0B --context 512 --batch 4 --warmup 3 --steps 8 --rounds 2 "
        "(explicit options win)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant and round (8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all variants (2)")
    p.add_argument(
        "--variants", default=None,
        help=f"comma-separated, from {list(VARIANTS + EXTRA)} (default: {','.join(VARIANTS)})",
    )  # fmt: skip
    p.add_argument(
        "--autocast", default=None, choices=["bf16", "none"],
        help="bf16 torch.autocast around forward and loss (default: bf16 on CUDA, none on CPU)",
    )  # fmt: skip
    p.add_argument("--bucket-mb", type=float, default=25.0, help="BucketedDDP bucket_size_mb (25)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if any")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: cores/ranks)")
    p.add_argument("--nproc", type=int, default=2, help="processes when not under torchrun (2)")
    p.add_argument(
        "--time-budget", type=float, default=None,
        help="seconds: start no round (or profiled variant) that would not finish in time",
    )  # fmt: skip
    p.add_argument("--profile", default=None, help="directory: profile instead of timing")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per variant (3)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo), seconds")
    p.add_argument(
        "--out", default=None,
        help="write the rows to a .json or .csv file (default on CUDA: "
        "docs/data/ddp_<N>x<gpu>.csv)",
    )  # fmt: skip
    preset = p.parse_known_args(argv)[0].preset
    if preset:  # the preset's values become the defaults: options given explicitly still win
        p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.batch, args.context, args.vocab = "tiny", 2, 32, 512
        args.steps, args.warmup, args.rounds, args.device = 2, 1, 1, "cpu"
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.autocast is None:
        args.autocast = "bf16" if args.device == "cuda" else "none"
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS + EXTRA))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS + EXTRA)}")
    if min(args.steps, args.warmup + args.steps, args.rounds) < 1 or args.profile_steps < 1:
        p.error("--steps, --rounds and --profile-steps must be >= 1 and --warmup >= 0")
    args.names = names
    return args


# ----------------------------------------------------------------- variants


class _Mesh:
    """One DeviceMesh over all ranks for the FSDP2 variants, made on first use."""

    mesh = None

    @classmethod
    def get(cls, device: torch.device):
        if cls.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            cls.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return cls.mesh


def build(name: str, model: torch.nn.Module, args, device: torch.device):
    """(the module to call, the optimizer) for variant ``name`` around a fresh ``model``."""
    adamw = torch.optim.AdamW
    ids = [device.index] if device.type == "cuda" else None
    if name == "plain":
        return model, adamw(model.parameters(), lr=1e-4)
    if name.startswith("torch-ddp"):
        view = name != "torch-ddp-copy"
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=ids, gradient_as_bucket_view=view
        )
        if name == "torch-ddp-zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ddp, ZeroRedundancyOptimizer(ddp.parameters(), adamw, lr=1e-4)
        return ddp, adamw(ddp.parameters(), lr=1e-4)
    if name.startswith("torch-fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = "bf16" in name
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
        kw = {
            "mesh": _Mesh.get(device),
            "reshard_after_forward": "noreshard" not in name,
            "mp_policy": policy,
        }
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model, adamw(model.parameters(), lr=1e-4)
    ddp = BucketedDDP(model, args.bucket_mb)
    if name == "ours-ddp-copy":
        ddp._prepoint = False  # the copy path, for comparison
    if name == "ours-ddp" or name == "ours-ddp-copy":
        return ddp, adamw(ddp.parameters(), lr=1e-4)
    zero2 = name == "ours-ddp-zero2"
    return ddp, ShardedOptimizer(ddp.parameters(), adamw, shard_gradients=zero2, lr=1e-4)


def _free(device: torch.device) -> float:
    """Collect the previous variant and reset the peak; returns the GiB still allocated."""
    gc.collect()
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / GIB


def _steps(name: str, args, device: torch.device) -> tuple[Callable[[bool], torch.Tensor], tuple]:
    """A step function for a fresh variant, and what keeps it alive (model, optimizer)."""
    torch.manual_seed(0)
    model = build_model(
        args.size,
        context_length=args.context,
        attention=args.attention,
        vocab_size=args.vocab,
        device=device,
        dtype=torch.float32,
    )
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agree(failed: bool, device: torch.device) -> bool:
    """Whether any rank failed (so every rank reports the variant the same way)."""
    flag = torch.tensor([float(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _reason(exc: BaseException) -> str:
    text = re.sub(r"\s+", " ", str(exc)).strip()
    return f"n/a: {type(exc).__name__}: {text[:120]}"


def run_variant(name: str, args, device: torch.device) -> dict:
    """Warm-up then timed steps; the per-step times are the slowest rank's."""
    leftover = _free(device)
    status, times, loss = "ok", [], float("nan")
    try:
        step, keep = _steps(name, args, device)
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            loss_t = step()
            _sync(device)
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        loss = float(loss_t)
        del step, keep
    except Exception as exc:  # a variant this torch / backend cannot run: an n/a row
        status, times = _reason(exc), [0.0] * args.steps
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    _free(device)
    if _agree(status != "ok", device) and status == "ok":
        status = "n/a: failed on another rank"
    stats = torch.tensor([*times, peak], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {
        "times": stats[:-1].tolist(),
        "peak_gib": stats[-1].item() if device.type == "cuda" else None,
        "loss": loss,
        "leftover_gib": leftover,
        "status": status,
    }


# ----------------------------------------------------------------- profile


def _top(events, key: str, steps: int, n: int = 4) -> str:
    rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:n]
    return "; ".join(f"{e.key} {getattr(e, key, 0) / 1e3 / steps:.1f}" for e in rows)


def profile_variant(name: str, args, device: torch.device) -> dict:
    """Warm-up, then ``--profile-steps`` steps under torch.profiler (rank 0 records)."""
    from torch.profiler import ProfilerActivity, profile

    _free(device)
    row: dict = {"variant": name}
    try:
        step, keep = _steps(name, args, device)
        for _ in range(max(args.warmup, 1)):
            step()
        _sync(device)
        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        recording = profile(activities=activities) if dist.get_rank() == 0 else None
        t0 = time.perf_counter()
        with recording if recording is not None else contextlib.nullcontext():
            for _ in range(args.profile_steps):
                step(labelled=True)
            _sync(device)
        row["step_ms"] = (time.perf_counter() - t0) * 1e3 / args.profile_steps
        del step, keep
        if recording is not None:
            row.update(_summarize(name, recording, args, cuda))
        row["status"] = "ok"
    except Exception as exc:
        row["status"] = _reason(exc)
    _free(device)
    _agree(row["status"] != "ok", device)
    return row


def _summarize(name: str, prof, args, cuda: bool) -> dict:
    n = args.profile_steps
    events = prof.key_averages()
    phases = {e.key: e for e in events if e.key in ("forward", "backward", "optimizer.step")}
    phases |= {e.key: e for e in events if e.key == "zero_grad"}
    ops = [e for e in events if e.key not in phases and not e.key.startswith("ProfilerStep")]
    row = {f"{k}_cpu_ms": phases[k].cpu_time_total / 1e3 / n for k in phases}
    row["self_cpu_ms"] = sum(e.self_cpu_time_total for e in ops) / 1e3 / n
    row["top_cpu"] = _top(ops, "self_cpu_time_total", n)
    if cuda:
        row["self_cuda_ms"] = sum(getattr(e, "self_device_time_total", 0) for e in ops) / 1e3 / n
        row["top_cuda"] = _top(ops, "self_device_time_total", n)
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"profile_{name}.txt"), "w") as f:
        f.write(f"{name}: {n} steps, rank 0 of {dist.get_world_size()}; times are totals\n\n")
        for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
            f.write(f"sorted by {key}\n{events.table(sort_by=key, row_limit=30)}\n\n")
    return row


# ----------------------------------------------------------------- driver


def default_out(world: int, device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    words = re.split(r"[^a-z0-9]+", torch.cuda.get_device_name(device).lower())
    short = next((w for w in words if re.fullmatch(r"[a-z]+\d+[a-z]*", w)), "gpu")  # h200
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "docs", "data", f"ddp_{world}x{short}.csv")


def _in_time(start: float, per_item: float, args, device: torch.device) -> bool:
    """Whether another item of ``per_item`` seconds fits the budget (the same on every rank)."""
    ok = args.time_budget is None or time.monotonic() - start + per_item <= args.time_budget
    return not _agree(not ok, device)


def _ratio(values: dict, a: str, b: str | None) -> str:
    """``values[a] / values[b]`` to 3 decimals, or "" when either is missing."""
    if b is None or not values.get(a) or not values.get(b):
        return ""
    return f"{values[a] / values[b]:.3f}"


def _rows(pooled: dict, args, world: int) -> list[dict]:
    ok = {n for n, r in pooled.items() if r["status"] == "ok"}
    mean = {n: statistics.fmean(pooled[n]["times"]) for n in ok}
    peak = {n: pooled[n]["peak_gib"] for n in ok}
    rows = []
    for name in args.names:
        res, t, peer = pooled[name], percentiles(pooled[name]["times"]), PEER.get(name)
        good = name in ok
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
        })  # fmt: skip
    return rows


def worker(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    start = time.monotonic()
    if args.profile:
        rows, per = [], 0.0
        for name in args.names:
            if not _in_time(start, per, args, device):
                break
            t0 = time.monotonic()
            rows.append(profile_variant(name, args, device))
            per = max(per, time.monotonic() - t0)
        if rank == 0:
            columns = ["variant", "step_ms", "forward_cpu_ms", "backward_cpu_ms"]
            columns += ["optimizer.step_cpu_ms", "zero_grad_cpu_ms", "self_cpu_ms"]
            columns += ["self_cuda_ms"] if device.type == "cuda" else []
            columns += ["status"]
            title = f"torch.profiler, {args.size} LM, {args.profile_steps} steps, rank 0 of {world}"
            print_report(title, rows, columns)
            for row in rows:
                print(f"- {row['variant']} top CPU ms/step: {row.get('top_cpu', '')}")
                if "top_cuda" in row:
                    print(f"  top CUDA ms/step: {row['top_cuda']}")
        return
    pooled: dict[str, dict] = {}
    round_s = 0.0
    for r in range(args.rounds):
        if r and not _in_time(start, round_s, args, device):
            break
        t0 = time.monotonic()
        shift = r % len(args.names)
        for name in args.names[shift:] + args.names[:shift]:
            if rank == 0:
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            res = run_variant(name, args, device)
            acc = pooled.setdefault(name, {**res, "times": []})
            if res["status"] != "ok":
                acc["status"] = res["status"]
            acc["times"] += res["times"]
            if res["peak_gib"] is not None:
                acc["peak_gib"] = max(acc["peak_gib"] or 0.0, res["peak_gib"])
            acc["leftover_gib"] = max(acc["leftover_gib"], res["leftover_gib"])
        round_s = time.monotonic() - t0
    if rank != 0:
        return
    rows = _rows(pooled, args, world)
    write_results(args.out or default_out(world, device), rows)
    columns = ["variant", "step_ms", "p20_ms", "p80_ms", "peak_gib", "vs_peer", "peak_vs_peer"]
    columns += ["vs_plain", "loss", "status"]
    amp = "bf16 autocast" if args.autocast == "bf16" else "fp32"
    title = (
        f"Step time, {args.size} LM, batch {args.batch}x{args.context} per rank, {world} ranks "
        f"({dist.get_backend()}), {amp}, AdamW, zero_grad() to None, "
        f"{rows[0]['samples']} timed steps per variant"
    )
    print_report(title, rows, columns)


def _run(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        worker(args)
        dist.barrier()  # rank 0 wrote the results: leave together
    finally:
        _Mesh.mesh = None  # its process groups go before the default one
        gc.collect()
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    set_spawn_env(rank, world, port)
    _run(args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if under_torchrun():
        _run(args)
    else:
        mp.spawn(_spawned, args=(args.nproc, free_port(), args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
