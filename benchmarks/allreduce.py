"""All-reduce: gloo on CPU tensors and NCCL on GPU tensors, per message size and world size.

Per size, the median over iterations of the slowest rank's time, and nccl-tests' algbw/busbw
(docs/benchmarking.md, section 4). Under torchrun the world is the launched one (nccl and a gloo
group); otherwise the script spawns each of --world-sizes in turn.

    torchrun --nproc_per_node=2 benchmarks/allreduce.py --out ar2.csv    # NCCL+GPU and gloo+CPU
    torchrun --nproc_per_node=4 benchmarks/allreduce.py --out ar4.csv --plot ar.png
    python benchmarks/allreduce.py --world-sizes 2,4,6 --backends gloo   # spawned, CPU only
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import (
    csv_list,
    line_plot,
    parser,
    percentiles,
    progress,
    report,
    run_ranks,
    samples_ms,
    under_torchrun,
)

BACKENDS = ("nccl", "gloo")


def parse_args(argv=None):
    p = parser(__doc__, smoke="tiny sizes, gloo on CPU, seconds", plot=True)
    p.add_argument("--sizes-mb", default="1,10,100,1000", help="message sizes in MB (1e6 bytes)")
    p.add_argument("--backends", help="subset of nccl,gloo (default: both with CUDA, else gloo)")
    p.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size")
    p.add_argument("--iters", type=int, default=20, help="timed all-reduces per size")
    p.add_argument("--gloo-max-iters", type=int, default=5, help="gloo iterations from 100 MB on")
    p.add_argument("--world-sizes", default="2", help="without torchrun: worlds to spawn")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes_mb, args.backends, args.warmup, args.iters = "0.001,0.01", "gloo", 1, 3
    args.sizes = csv_list(p, args.sizes_mb, "--sizes-mb", float)
    args.world_size_list = csv_list(p, args.world_sizes, "--world-sizes", int)
    default = "nccl,gloo" if torch.cuda.is_available() else "gloo"
    args.backend_list = csv_list(p, args.backends or default, "--backends", choices=BACKENDS)
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    return args


def worker(args) -> list[dict] | None:
    """Every (backend, size) on this rank; rank 0 returns the rows, the others None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    # new_group is collective: every rank creates every group in the same order.
    groups = {
        b: None if b == dist.get_backend() else dist.new_group(backend=b) for b in args.backend_list
    }
    configs = [(b, s) for b in args.backend_list for s in args.sizes]
    rows = []
    for backend, size_mb in progress(configs, f"all-reduce x{world}") if rank == 0 else configs:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        numel = max(1, round(size_mb * 1e6 / 4))
        x = torch.ones(numel, dtype=torch.float32, device=device)
        big_gloo = backend == "gloo" and size_mb >= 100
        iters = min(args.iters, args.gloo_max_iters) if big_gloo else args.iters
        group = groups[backend]

        def reset(x=x, group=group):  # every rank holds ones: the sum is the world size
            x.fill_(1.0)
            dist.barrier(group=group)

        run = lambda x=x, group=group: dist.all_reduce(x, group=group)
        samples = samples_ms(run, args.warmup, iters, reset)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"samples": samples, "ok": bool((x == world).all())})
        rows.append(_row(backend, size_mb, numel * 4, world, gathered))
    return rows


def _row(backend: str, size_mb: float, nbytes: int, world: int, gathered: list) -> dict:
    slowest = [max(g["samples"][i] for g in gathered) for i in range(len(gathered[0]["samples"]))]
    stats = percentiles(slowest)
    rank_medians = [statistics.median(g["samples"]) for g in gathered]
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
        "iters": len(slowest),
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (world - 1) / world,
        "correct": all(g["ok"] for g in gathered),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    backend = "nccl" if "nccl" in args.backend_list else "gloo"
    if under_torchrun():  # one world, the launched one
        rows = run_ranks(worker, args, 0, backend, 300)
        if rows is None:
            return
    else:
        if backend == "nccl" and torch.cuda.device_count() < max(args.world_size_list):
            raise SystemExit(
                f"allreduce.py: --backends nccl with --world-sizes {args.world_sizes} needs that "
                f"many GPUs, found {torch.cuda.device_count()}; use --backends gloo"
            )
        rows = [r for w in args.world_size_list for r in run_ranks(worker, args, w, backend, 300)]
    if args.plot:
        series: dict[str, list] = {}
        for r in rows:
            label = f"{r['backend']} x{r['world_size']}"
            series.setdefault(label, []).append((r["bytes"], r["busbw_GBps"]))
        ylabel = "bus bandwidth (GB/s)"
        line_plot(args.plot, series, "message size (bytes)", ylabel, "all-reduce", log="xy")
    cols = ["backend", "world_size", "size_MB", "time_ms", "algbw_GBps", "busbw_GBps", "correct"]
    title = "All-reduce (sum, float32): median over iterations of the slowest rank"
    report(title, rows, cols, args.out)


if __name__ == "__main__":
    main()
