"""ShardedOptimizer benchmark: memory and step time beside plain AdamW and torch's ZeRO, same run.

Each variant trains the reference LM (``torch_flashsys.models.build_model``) with AdamW under
data parallelism (torch DDP by default, ``--ddp bucketed`` for BucketedDDP) on the same data:

- ``adamw``:     DDP + ``torch.optim.AdamW`` (every rank holds the whole state)
- ``zero``:      DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)`` (its defaults)
- ``zero-view``: the same with ``parameters_as_bucket_view=True``
- ``sharded``:   DDP + ``torch_flashsys.ShardedOptimizer(AdamW)``

Reported per variant (memory: ``torch.cuda.max_memory_allocated``, the max over ranks, minus
what was still allocated when the variant started, shown as ``leftover``): memory
after model/DDP/optimizer construction, peak during forward+backward and during the optimizer
step (over all steps, the first included, when the state is created), this rank's optimizer
state, and time per training step (median, 20th/80th percentiles). "saved" is the peak of
``adamw`` minus the variant's peak; the acceptance target for ``sharded`` is saved >= 0.4 x the
AdamW state size (8 bytes per fp32 parameter). The final loss should agree across variants.

    torchrun --nproc_per_node=2 benchmarks/sharded_optimizer.py                 # xl, 2 GPUs
    torchrun --nproc_per_node=2 benchmarks/sharded_optimizer.py --size large --out r.json
    python benchmarks/sharded_optimizer.py --smoke          # tiny, CPU, gloo, 2 processes, seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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

VARIANTS = ("adamw", "zero", "zero-view", "sharded")
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_lm_args(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (1e-4)")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}"
    )
    p.add_argument("--ddp", default="torch", choices=["torch", "bucketed"], help="DDP wrapper")
    p.add_argument("--nproc", type=int, default=2, help="processes when not under torchrun (2)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo), seconds")
    p.add_argument("--out", default=None, help="write the rows to a .json or .csv file")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = sorted(set(args.variants) - set(VARIANTS))
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {VARIANTS}")
    if args.smoke:
        args.size, args.batch, args.context, args.vocab = "tiny", 2, 32, 100
        args.steps, args.warmup, args.attention = 3, 1, "sdpa"
    return args


def _make_optimizer(variant: str, params, lr: float):
    if variant == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if variant in ("zero", "zero-view"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            params,
            optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=variant == "zero-view",
            lr=lr,
        )
    return ShardedOptimizer(params, torch.optim.AdamW, lr=lr)


def _local_state_bytes(opt) -> int:
    local = opt.optim if hasattr(opt, "optim") else opt
    return sum(
        v.numel() * v.element_size()
        for s in local.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


class _Memory:
    """Peak allocated bytes between ``reset()`` and ``peak()`` (CUDA); None on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def now(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None


def run_variant(variant: str, args, device: torch.device) -> dict:
    rank = dist.get_rank()
    mem = _Memory(device)
    gc.collect()
    if mem.cuda:
        torch.cuda.empty_cache()
    leftover = mem.now()
    mem.reset()
    torch.manual_seed(0)  # same initial model for every variant (DDP broadcasts rank 0's)
    model = build_model(
        args.size,
        context_length=args.context,
        attention=args.attention,
        vocab_size=args.vocab,
        device=device,
    )
    if args.ddp == "bucketed":
        ddp = BucketedDDP(model)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if mem.cuda else None
        )
    opt = _make_optimizer(variant, ddp.parameters(), args.lr)
    mem.sync()
    row = {
        "variant": f"{args.ddp} DDP + {variant}",
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "adamw_state_MiB": 2 * sum(p.numel() * p.element_size() for p in model.parameters()) / MIB,
        "init_MiB": mem.now(),
        "init_peak_MiB": mem.peak(),
    }
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, same per variant
    peak_fwd_bwd = peak_step = 0
    times, loss = [], torch.zeros(())
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.context), generator=gen)
        tokens = tokens.to(device)
        mem.sync()
        start = time.perf_counter()
        mem.reset()
        logits = ddp(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        del logits
        mem.sync()
        peak_fwd_bwd = max(peak_fwd_bwd, mem.peak() or 0)
        mem.reset()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mem.sync()
        peak_step = max(peak_step, mem.peak() or 0)
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    row["opt_state_MiB_rank0"] = _local_state_bytes(opt) / MIB
    if mem.cuda:  # the max over ranks, without what earlier variants left allocated
        peaks = [peak_fwd_bwd, peak_step, row["init_MiB"], row["init_peak_MiB"], leftover]
        peaks = torch.tensor(peaks, device=device).sub_(leftover)
        peaks[-1] = leftover
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        names = ("peak_fwd_bwd_MiB", "peak_step_MiB", "init_MiB", "init_peak_MiB", "leftover_MiB")
        row.update({k: float(v) / MIB for k, v in zip(names, peaks.tolist(), strict=True)})
        row["peak_MiB"] = max(row["peak_fwd_bwd_MiB"], row["peak_step_MiB"])
    else:
        for k in ("init_MiB", "init_peak_MiB", "peak_fwd_bwd_MiB", "peak_step_MiB", "peak_MiB"):
            row[k] = "n/a (CPU)"
    row.update(percentiles(times))
    row["final_loss"] = f"{float(loss.detach()):.6f}"
    del ddp, model, opt, loss
    return row


def worker(args: argparse.Namespace) -> None:
    use_cuda = torch.cuda.is_available() and not args.smoke
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: same for every variant
    else:
        device = torch.device("cpu")
    rows = [run_variant(v, args, device) for v in args.variants]
    if "adamw" in args.variants and use_cuda:
        base = next(r for r in rows if r["variant"].endswith("+ adamw"))
        for r in rows:
            r["saved_MiB"] = base["peak_MiB"] - r["peak_MiB"]
            r["saved_over_state"] = r["saved_MiB"] / r["adamw_state_MiB"]
    if rank == 0:
        for r in rows:
            r["world_size"] = dist.get_world_size()
            r["size"] = args.size
        write_results(args.out, rows)
        columns = [
            "variant", "params_M", "adamw_state_MiB", "opt_state_MiB_rank0", "init_MiB",
            "peak_fwd_bwd_MiB", "peak_step_MiB", "peak_MiB", "saved_MiB", "saved_over_state",
            "median_ms", "p20_ms", "p80_ms", "final_loss", "leftover_MiB",
        ]  # fmt: skip
        sharded = next((r for r in rows if r["variant"].endswith("+ sharded")), None)
        if sharded is not None and "saved_over_state" in sharded:
            ok = sharded["saved_over_state"] >= 0.4
            print(
                f"\nacceptance: ShardedOptimizer peak is {sharded['saved_MiB']:.0f} MiB below DDP + "
                f"AdamW = {sharded['saved_over_state']:.2f} x the AdamW state "
                f"({sharded['adamw_state_MiB']:.0f} MiB); target >= 0.40: "
                f"{'PASS' if ok else 'FAIL'}"
            )
        print_report(
            f"ShardedOptimizer vs AdamW and ZeroRedundancyOptimizer: {args.size}, "
            f"{dist.get_world_size()} ranks, batch {args.batch}x{args.context} per rank",
            rows,
            columns,
        )
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    set_spawn_env(rank, world, port)
    torch.set_num_threads(1)
    worker(args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if under_torchrun():
        worker(args)
        return
    mp.spawn(_spawned, args=(args.nproc, free_port(), args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
