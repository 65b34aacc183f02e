"""DDP benchmark: BucketedDDP at several bucket sizes beside torch DDP and two baselines, same run.

Every variant trains the reference LM (``torch_flashsys.models.build_model``) from the same
initial weights on the same data (each rank its own batch), with AdamW:

- ``compute``:        no communication at all (each rank trains alone): the floor
- ``naive``:          one synchronous all-reduce per parameter after backward
- ``flat``:           one all-reduce of all gradients (flattened) after backward
- ``overlap``:        ``BucketedDDP(bucket_size_mb=0)``: one asynchronous all-reduce per parameter
- ``bucketed-N``:     ``BucketedDDP(bucket_size_mb=N)`` for N in ``--buckets`` (1, 10, 25, 100, 1000)
- ``torch-ddp``:      ``torch.nn.parallel.DistributedDataParallel`` (its defaults: 25 MB buckets)
- ``torch-ddp-view``: the same with ``gradient_as_bucket_view=True`` (grads as bucket views, as ours)

Reported per variant (max over ranks, per step): step time (forward, backward, gradient
synchronization, optimizer step; median with 20th/80th percentiles), ``wait``: time from the end
of the backward computation until the averaged gradients are ready (measured where the wait is
visible: baselines and BucketedDDP; CUDA events on GPU), ``exposed``: median step time minus the
``compute`` variant's (communication not hidden behind computation, for every variant), peak
memory (CUDA only: ``max_memory_allocated``), ``vs torch``: median step time over torch DDP's, and
the final loss (equal across the synchronizing variants up to rounding).

    torchrun --nproc_per_node=2 benchmarks/ddp.py                         # xl, 2 GPUs, NCCL
    torchrun --nproc_per_node=2 benchmarks/ddp.py --size large --out ddp.json
    python benchmarks/ddp.py --size small --device cpu --nproc 2 --rounds 3   # CPU, gloo
    python benchmarks/ddp.py --smoke                      # tiny, CPU, gloo, 2 processes, seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._ddp_baselines import FlatDDP, NaiveDDP
from benchmarks._harness import (
    add_lm_args,
    free_port,
    percentiles,
    print_report,
    set_spawn_env,
    under_torchrun,
    write_results,
)
from torch_flashsys import BucketedDDP
from torch_flashsys.models import build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_lm_args(p)
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="parameter dtype (fp32)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round (10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    p.add_argument("--rounds", type=int, default=1, help="repeat all variants, rotating order (1)")
    p.add_argument(
        "--buckets", default="1,10,25,100,1000", help="BucketedDDP bucket sizes in MB (1,...)"
    )
    p.add_argument(
        "--variants", default=None, help="comma-separated subset of the variants (default: all)"
    )
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if any")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: cores/ranks)")
    p.add_argument("--nproc", type=int, default=2, help="processes when not under torchrun (2)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo), seconds")
    p.add_argument("--out", default=None, help="write the rows to a .json or .csv file")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.batch, args.context, args.vocab = "tiny", 2, 32, 512
        args.steps, args.warmup, args.device = 3, 1, "cpu"
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    buckets = [float(b) for b in args.buckets.split(",") if b]
    names = ["compute", "naive", "flat", "overlap", *(f"bucketed-{b:g}" for b in buckets)]
    names += ["torch-ddp", "torch-ddp-view"]
    if args.variants:
        unknown = set(args.variants.split(",")) - set(names)
        if unknown:
            p.error(f"--variants: unknown {sorted(unknown)}; choose from {names}")
        names = [n for n in names if n in args.variants.split(",")]
    args.names = names
    return args


def wrap(name: str, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    if name == "compute":
        return model
    if name == "naive":
        return NaiveDDP(model)
    if name == "flat":
        return FlatDDP(model)
    if name == "overlap":
        return BucketedDDP(model, 0)
    if name.startswith("bucketed-"):
        return BucketedDDP(model, float(name.split("-", 1)[1]))
    ids = [device.index] if device.type == "cuda" else None
    view = name == "torch-ddp-view"
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=ids, gradient_as_bucket_view=view
    )


class WaitTimer:
    """Sums the time of wrapped calls per step (CUDA events: from the queued backward to done)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.intervals: list = []

    def wrap(self, fn: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                self.intervals.append((start, end))
            else:
                t0 = time.perf_counter()
                fn()
                self.intervals.append(time.perf_counter() - t0)

        return timed

    def take_ms(self) -> float:
        """Total of the intervals since the last call (call after a device synchronize)."""
        cuda_ms = lambda: sum(s.elapsed_time(e) for s, e in self.intervals)
        total = cuda_ms() if self.cuda else 1e3 * sum(self.intervals)
        self.intervals = []
        return total


def run_variant(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    rank, cuda = dist.get_rank(), device.type == "cuda"
    gc.collect()  # the previous variant's model, optimizer and buffers
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = build_model(
        args.size,
        context_length=args.context,
        attention=args.attention,
        vocab_size=args.vocab,
        device=device,
        dtype=DTYPES[args.dtype],
    )
    model = wrap(name, model, device)
    timer = WaitTimer(device)
    sync = getattr(model, "finish_gradient_synchronization", None)
    if isinstance(model, BucketedDDP):  # the end-of-backward callback looks the method up here
        model.finish_gradient_synchronization = timer.wrap(model.finish_gradient_synchronization)
        sync = model.finish_gradient_synchronization
    elif sync is not None:
        sync = timer.wrap(sync)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        if sync is not None:
            sync()
        opt.step()
        return loss.detach()

    times, waits = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - t0) * 1e3
        wait = timer.take_ms()
        if i >= args.warmup:
            times.append(elapsed)
            waits.append(wait)
    # Per step, the slowest rank counts; memory: the largest rank.
    stats = torch.tensor([times, waits], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    peak = torch.tensor(
        [torch.cuda.max_memory_allocated(device) if cuda else 0], dtype=torch.float64, device=device
    )
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    buckets = len(model._buckets) if isinstance(model, BucketedDDP) else ""
    return {
        "times": stats[0].tolist(),
        "waits": stats[1].tolist() if sync is not None else None,
        "peak_mb": peak.item() / 2**20 if cuda else None,
        "loss": float(loss),
        "buckets": buckets,
    }


def worker(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    pooled: dict[str, dict] = {}
    for r in range(args.rounds):
        shift = r % len(args.names)
        for name in args.names[shift:] + args.names[:shift]:
            if rank == 0:
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            res = run_variant(name, args, device)
            acc = pooled.setdefault(name, {**res, "times": [], "waits": []})
            acc["times"] += res["times"]
            acc["waits"] = None if res["waits"] is None else acc["waits"] + res["waits"]
    if rank != 0:
        return
    floor = percentiles(pooled["compute"]["times"])["median_ms"] if "compute" in pooled else None
    ref = percentiles(pooled["torch-ddp"]["times"])["median_ms"] if "torch-ddp" in pooled else None
    rows = []
    for name in args.names:
        res, t = pooled[name], percentiles(pooled[name]["times"])
        row = {
            "variant": name,
            "buckets": res["buckets"],
            "step_ms": t["median_ms"],
            "p20_ms": t["p20_ms"],
            "p80_ms": t["p80_ms"],
            "wait_ms": percentiles(res["waits"])["median_ms"] if res["waits"] else "",
            "exposed_ms": t["median_ms"] - floor if floor is not None and name != "compute" else "",
            "peak_mb": res["peak_mb"] if res["peak_mb"] is not None else "",
            "vs_torch": t["median_ms"] / ref if ref else "",
            "loss": res["loss"],
            "size": args.size,
            "world": world,
            "backend": dist.get_backend(),
            "samples": len(res["times"]),
        }
        rows.append(row)
    write_results(args.out, rows)
    columns = ["variant", "buckets", "step_ms", "p20_ms", "p80_ms", "wait_ms", "exposed_ms"]
    columns += ["peak_mb", "vs_torch", "loss"]
    title = (
        f"DDP step time, {args.size} LM, batch {args.batch}x{args.context} per rank, "
        f"{world} ranks ({dist.get_backend()}), {args.dtype}, {rows[0]['samples']} timed steps "
        "per variant"
    )
    print_report(title, rows, columns)


def _run(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        worker(args)
    finally:
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
