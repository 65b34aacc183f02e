"""All-reduce benchmark: gloo on CPU tensors and NCCL on GPU tensors, per message size and world size.

Each rank all-reduces (sum) a float32 tensor of each size: ``--warmup`` untimed calls, then
``--iters`` timed ones, each started after a barrier and ended by ``torch.cuda.synchronize()``
(NCCL). Every rank's timings are gathered with ``all_gather_object``; a collective takes as long
as its slowest rank, so the reported time per size is the median over iterations of the maximum
over ranks. Bandwidths (GB/s = 1e9 bytes/s), as nccl-tests define them::

    algbw = bytes / time                   (bytes = the tensor's size on one rank)
    busbw = algbw * 2 (n - 1) / n          (n ranks; what each link carries in a ring)

Sizes are decimal: 1 MB = 1e6 bytes = 250,000 float32 elements.

    torchrun --nproc_per_node=2 benchmarks/allreduce.py --out ar2.csv    # NCCL+GPU and gloo+CPU
    torchrun --nproc_per_node=4 benchmarks/allreduce.py --out ar4.csv
    python benchmarks/allreduce.py --world-sizes 2,4,6 --backends gloo   # spawned, CPU only
    python benchmarks/allreduce.py --smoke                               # tiny, CPU, seconds

Under torchrun the world size is the launched one and the default backends are nccl (when
every rank has a GPU) and gloo (a second process group on CPU tensors). Without torchrun the
script spawns ``--world-sizes`` processes itself, one world after another.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import (
    free_port,
    line_plot,
    percentiles,
    print_report,
    progress,
    set_spawn_env,
    under_torchrun,
    write_results,
)

BACKENDS = ("nccl", "gloo")


def _ints(p: argparse.ArgumentParser, value: str, option: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        items = []
    if not items or min(items) < 1:
        p.error(f"{option} takes comma-separated positive integers, got {value!r}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sizes-mb",
        default="1,10,100,1000",
        help="message sizes in MB (1e6 bytes) of float32, comma-separated (1,10,100,1000)",
    )
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated subset of nccl,gloo (default: both when CUDA is available, else gloo)",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size (5)")
    p.add_argument("--iters", type=int, default=20, help="timed all-reduces per size (20)")
    p.add_argument(
        "--gloo-max-iters",
        type=int,
        default=5,
        help="cap on timed gloo all-reduces for sizes >= 100 MB (CPU rings are slow) (5)",
    )
    p.add_argument(
        "--world-sizes",
        default="2",
        help="without torchrun: process counts to spawn, one after another, comma-separated (2)",
    )
    p.add_argument(
        "--timeout-s", type=int, default=300, help="process-group timeout in seconds (300)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, gloo on CPU, seconds")
    p.add_argument("--out", help="write rows to a .json or .csv file")
    p.add_argument("--plot", help="save a PNG of bus bandwidth against message size")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes_mb, args.backends, args.warmup, args.iters = "0.001,0.01", "gloo", 1, 3
        args.world_sizes = "2"
    try:
        args.sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        args.sizes = []
    if not args.sizes or min(args.sizes) <= 0:
        p.error(f"--sizes-mb takes comma-separated positive numbers, got {args.sizes_mb!r}")
    args.world_size_list = _ints(p, args.world_sizes, "--world-sizes")
    if args.backends is None:
        args.backends = "nccl,gloo" if torch.cuda.is_available() else "gloo"
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = sorted(set(args.backend_list) - set(BACKENDS))
    if bad or not args.backend_list:
        p.error(f"--backends takes a comma-separated subset of {BACKENDS}, got {args.backends!r}")
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    return args


def _time_allreduce(x: torch.Tensor, group, iters: int, warmup: int) -> list[float]:
    cuda = x.is_cuda
    for _ in range(warmup):
        dist.all_reduce(x, group=group)
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        x.fill_(1.0)  # every rank holds ones: the sum is the world size after each call
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return samples


def worker(args: argparse.Namespace) -> list[dict] | None:
    """Run every (backend, size) on this rank; rank 0 returns the rows, the others None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    groups = {}
    for backend in args.backend_list:
        # new_group is collective: every rank creates every group in the same order.
        if backend == dist.get_backend():
            groups[backend] = None
        else:
            groups[backend] = dist.new_group(backend=backend)
    configs = [(b, s) for b in args.backend_list for s in args.sizes]
    it = progress(configs, desc=f"all-reduce x{world}") if rank == 0 else configs
    for backend, size_mb in it:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        numel = max(1, round(size_mb * 1e6 / 4))
        x = torch.ones(numel, dtype=torch.float32, device=device)
        iters = args.iters
        if backend == "gloo" and size_mb >= 100:
            iters = min(iters, args.gloo_max_iters)
        samples = _time_allreduce(x, groups[backend], iters, args.warmup)
        ok = bool((x == world).all())
        del x
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "samples": samples, "ok": ok})
        if rank == 0:
            rows.append(_row(backend, size_mb, numel * 4, world, gathered))
    return rows if rank == 0 else None


def _row(backend: str, size_mb: float, nbytes: int, world: int, gathered: list) -> dict:
    n_iters = len(gathered[0]["samples"])
    slowest_ms = [max(g["samples"][i] for g in gathered) * 1e3 for i in range(n_iters)]
    stats = percentiles(slowest_ms)
    rank_medians = [statistics.median(g["samples"]) * 1e3 for g in gathered]
    algbw = nbytes / (stats["median_ms"] * 1e-3) / 1e9
    return {
        "backend": f"{backend}+{'GPU' if backend == 'nccl' else 'CPU'}",
        "world_size": world,
        "size_MB": size_mb,
        "bytes": nbytes,
        "time_ms": stats["median_ms"],
        "time_p20_ms": stats["p20_ms"],
        "time_p80_ms": stats["p80_ms"],
        "rank_median_ms_min": min(rank_medians),
        "rank_median_ms_max": max(rank_medians),
        "iters": n_iters,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (world - 1) / world,
        "correct": all(g["ok"] for g in gathered),
    }


def _init_from_env(args: argparse.Namespace) -> None:
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    use_nccl = "nccl" in args.backend_list
    if use_nccl:
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise RuntimeError(
                f"allreduce.py: --backends nccl needs a GPU per rank, but LOCAL_RANK={local} and "
                f"torch.cuda.device_count()={torch.cuda.device_count()}"
            )
        torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl" if use_nccl else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s)
    )


def _run_world(args: argparse.Namespace) -> list[dict] | None:
    """Join the launched world, benchmark, leave; rank 0 returns the gathered rows."""
    _init_from_env(args)
    try:
        return worker(args)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    set_spawn_env(rank, world, port)
    torch.set_num_threads(1)
    rows = _run_world(args)
    if rows is not None:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def report(rows: list[dict], args: argparse.Namespace) -> None:
    write_results(args.out, rows)
    if args.plot:
        series: dict[str, list] = {}
        for r in rows:
            series.setdefault(f"{r['backend']} x{r['world_size']}", []).append(
                (r["bytes"], r["busbw_GBps"])
            )
        line_plot(args.plot, series, xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
                  title="all-reduce (sum, float32)", logx=True, logy=True)  # fmt: skip
    cols = ["backend", "world_size", "size_MB", "time_ms", "algbw_GBps", "busbw_GBps", "correct"]
    print_report(
        "All-reduce (sum, float32): median over iterations of the slowest rank", rows, cols
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if under_torchrun():  # one world, the launched one
        rows = _run_world(args)
        if rows is not None:
            report(rows, args)
        return
    if "nccl" in args.backend_list and torch.cuda.device_count() < max(args.world_size_list):
        raise SystemExit(
            f"allreduce.py: --backends nccl with --world-sizes {args.world_sizes} needs that many "
            f"GPUs, found {torch.cuda.device_count()}; use --backends gloo"
        )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_size_list:
            out_path = os.path.join(tmp, f"rows{world}.json")
            mp.spawn(_spawned, args=(world, free_port(), args, out_path), nprocs=world)
            with open(out_path) as f:
                rows += json.load(f)
    report(rows, args)


if __name__ == "__main__":
    main()
