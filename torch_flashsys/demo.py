"""``python -m torch_flashsys.demo``: train a tiny language model with all four APIs at once.

The reference LM (:mod:`torch_flashsys.models`, size "tiny", attention through
:func:`~torch_flashsys.flash_attention`) learns to reverse random sequences of symbols on N
data-parallel processes: :class:`~torch_flashsys.BucketedDDP` averages the gradients and
:class:`~torch_flashsys.ShardedOptimizer` shards AdamW's state across the ranks. It prints a
progress bar, a loss table and a final check that every replica holds identical parameters.

Examples::

    python -m torch_flashsys.demo                        # 2 processes (gloo on CPU, NCCL on GPUs)
    python -m torch_flashsys.demo --nproc 4 --plot loss.png
    torchrun --nproc_per_node=2 -m torch_flashsys.demo  # launched by torchrun instead
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_flashsys._ports import free_port

_IGNORE = -100  # cross_entropy's ignore_index: no loss on the prompt half


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m torch_flashsys.demo",
        description="Train the tiny reference LM to copy or reverse sequences with "
        "flash_attention + BucketedDDP + ShardedOptimizer on N processes.",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn (default 2; "
                   "ignored under torchrun, which sets the world size)")  # fmt: skip
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per rank and step")
    p.add_argument("--task", choices=("reverse", "copy"), default="reverse",
                   help="target = the prompt reversed (default) or copied")  # fmt: skip
    p.add_argument("--length", type=int, default=8, help="symbols per prompt (default 8)")
    p.add_argument("--symbols", type=int, default=16, help="alphabet size (default 16)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--bucket-mb", type=float, default=1.0,
                   help="BucketedDDP bucket size in MB (default 1: several buckets)")  # fmt: skip
    p.add_argument("--dist-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when every rank has its own GPU, else gloo")  # fmt: skip
    p.add_argument("--attention-backend", choices=("auto", "triton", "torch"), default="auto",
                   help="flash_attention backend (auto: Triton on GPUs, else PyTorch)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--plot", metavar="PATH", help="save the loss curve there (needs matplotlib)")
    p.add_argument("--out", metavar="PATH", help="also write the results as JSON there")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("nproc", "steps", "batch_size", "length"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.symbols < 2:
        p.error(f"--symbols must be >= 2, got {args.symbols}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        p.error(f"--lr must be a positive number, got {args.lr}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib")
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        problem = path and _unwritable(path)
        if problem:  # now, not after the training whose results it would hold
            p.error(f"{flag} {path}: {problem}")
    return args


def _unwritable(path: str) -> str | None:
    """Why a file cannot be written at ``path`` (its folder is missing, ...), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a folder; give a file name"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist (create it first)"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is not writable"
    return None


# ---------------------------------------------------------------------------------------------
# The synthetic task


def make_batch(
    batch: int, length: int, symbols: int, task: str, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences ``x_1..x_n SEP y_1..y_n`` (y = x reversed or copied), as (inputs, targets).

    inputs: (batch, 2n) int64; targets: (batch, 2n), the next token, or ``-100`` (ignored) for
    the first n positions, whose next token is part of the random prompt or ``SEP`` (token id
    ``symbols``): only the n answer tokens are scored.
    """
    x = torch.randint(0, symbols, (batch, length), generator=generator)
    y = x.flip(1) if task == "reverse" else x
    seq = torch.cat((x, torch.full((batch, 1), symbols), y), dim=1)
    targets = seq[:, 1:].clone()
    targets[:, :length] = _IGNORE  # the prompt and the (always predictable) SEP
    return seq[:, :-1], targets


# ---------------------------------------------------------------------------------------------
# One rank's training run


def _setup_device(backend: str) -> torch.device:
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _progress(total: int, enabled: bool) -> Any:
    if enabled and importlib.util.find_spec("tqdm") is not None:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="training", unit="step", dynamic_ncols=True)
    return None


def _train(args: argparse.Namespace, backend: str) -> int:
    from torch_flashsys import BucketedDDP, ShardedOptimizer
    from torch_flashsys.attention._backend import resolve_backend
    from torch_flashsys.models import build_model

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _setup_device(backend)
    torch.manual_seed(args.seed)  # identical initial weights everywhere (BucketedDDP checks)
    model = build_model(
        "tiny",
        context_length=2 * args.length,
        attention="flash",
        vocab_size=args.symbols + 1,
        device=device,
    )
    model.set_attention("flash", flash_backend=args.attention_backend)
    ddp = BucketedDDP(model, bucket_size_mb=args.bucket_mb)
    optimizer = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, lr=args.lr)
    data = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # a different shard per rank

    if rank == 0:
        attn_backend = resolve_backend(args.attention_backend, device)
        print(
            f"torch_flashsys demo: {args.task} {args.length} symbols (alphabet {args.symbols}) | "
            f"tiny LM, {model.num_parameters():,} parameters, flash_attention ({attn_backend} "
            f"backend) | {world} ranks x {args.batch_size} sequences, "
            f"{backend} on {device.type} | BucketedDDP + ShardedOptimizer(AdamW)",
            flush=True,
        )
    bar = _progress(args.steps, rank == 0 and not args.no_progress)
    every = max(1, args.steps // 10)
    losses = torch.zeros(args.steps, dtype=torch.float64)
    accs = torch.zeros(args.steps, dtype=torch.float64)
    start = time.perf_counter()
    for step in range(args.steps):
        inputs, targets = make_batch(args.batch_size, args.length, args.symbols, args.task, data)
        inputs, targets = inputs.to(device), targets.to(device)
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=_IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            scored = targets != _IGNORE
            correct = (logits.argmax(-1) == targets) & scored
            losses[step] = loss.item()
            accs[step] = (correct.sum() / scored.sum()).item()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[step]:.3f}", refresh=False)
        elif rank == 0 and not args.no_progress and ((step + 1) % every == 0 or step == 0):
            print(f"step {step + 1:>5}/{args.steps}  loss {losses[step]:.4f}", flush=True)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start

    # The curves, averaged over ranks: one collective for the whole run.
    curves = torch.stack((losses, accs)).to(device)
    dist.all_reduce(curves)
    losses, accs = (curves / world).cpu().unbind(0)
    same, max_diff, n_params = _replicas_identical(model)
    exact = _exact_match(model, args, device) if rank == 0 else 0.0
    if rank == 0:
        _report(args, losses, accs, elapsed, world, same, max_diff, n_params, exact)
        if args.plot:
            _plot(args.plot, losses, args)
        if args.out:
            _write_json(args, losses, accs, elapsed, world, backend, same, max_diff, exact)
    return 0 if same else 1


def _replicas_identical(model: torch.nn.Module) -> tuple[bool, float, int]:
    """All ranks' parameters bit-identical? Returns (identical, max |difference|, #params)."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    max_diff = (hi - lo).abs().max().item()
    return max_diff == 0.0, max_diff, flat.numel()


@torch.no_grad()
def _exact_match(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> float:
    """Fraction of 512 fresh sequences whose whole target the model predicts (= greedy decoding)."""
    gen = torch.Generator().manual_seed(10_000 + args.seed)
    inputs, targets = make_batch(512, args.length, args.symbols, args.task, gen)
    inputs, targets = inputs.to(device), targets.to(device)
    pred = model(inputs).argmax(-1)
    scored = targets != _IGNORE
    return ((pred == targets) | ~scored).all(dim=1).double().mean().item()


def _report(
    args: argparse.Namespace,
    losses: torch.Tensor,
    accs: torch.Tensor,
    elapsed: float,
    world: int,
    same: bool,
    max_diff: float,
    n_params: int,
    exact: float,
) -> None:
    steps = len(losses)
    window = max(1, steps // 20)
    marks = sorted({1, *(round(steps * f) for f in (0.1, 0.25, 0.5, 0.75)), steps} - {0})
    print(f"\n{'step':>6} | {'loss':>7} | {'token acc':>9}   (mean over ranks and {window} steps)")
    print(f"{'-' * 6}-+-{'-' * 7}-+-{'-' * 9}")
    for m in marks:
        lo = max(0, m - window)
        print(f"{m:>6} | {losses[lo:m].mean():7.4f} | {accs[lo:m].mean():9.1%}")
    chance = math.log(args.symbols)
    print(
        f"\n{steps} steps in {elapsed:.1f} s ({steps / elapsed:.1f} steps/s); loss "
        f"{losses[:window].mean():.3f} -> {losses[-window:].mean():.3f} (chance: {chance:.3f}); "
        f"exact-match on 512 fresh sequences: {exact:.1%}"
    )
    verdict = "identical" if same else f"DIFFERENT (max |difference| {max_diff:.3g})"
    print(f"replicas: {world} ranks x {n_params:,} parameters: {verdict}", flush=True)


def _write_json(
    args: argparse.Namespace,
    losses: torch.Tensor,
    accs: torch.Tensor,
    elapsed: float,
    world: int,
    backend: str,
    same: bool,
    max_diff: float,
    exact: float,
) -> None:
    import json

    results = {
        "args": vars(args),
        "world_size": world,
        "dist_backend": backend,
        "seconds": elapsed,
        "loss": losses.tolist(),
        "token_accuracy": accs.tolist(),
        "exact_match": exact,
        "replicas_identical": same,
        "replicas_max_abs_diff": max_diff,
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results written to {args.out}", flush=True)


def _plot(path: str, losses: torch.Tensor, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses.numpy(), lw=1.2)
    ax.axhline(math.log(args.symbols), color="gray", ls="--", lw=0.8, label="chance")
    ax.set(xlabel="step", ylabel="loss (mean over ranks)", yscale="log")
    ax.set_title(f"torch_flashsys demo: {args.task} {args.length} symbols")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve saved to {path}", flush=True)


# ---------------------------------------------------------------------------------------------
# Launching: spawned processes, or torchrun


def _resolve_backend(choice: str, world: int) -> str:
    if choice == "auto":
        return (
            "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
        )
    if choice == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(
            f"torch_flashsys.demo: --dist-backend nccl needs one GPU per rank, found "
            f"{torch.cuda.device_count()} GPU(s) for {world} ranks; use --dist-backend gloo"
        )
    return choice


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["LOCAL_RANK"] = str(rank)
    if backend == "gloo":  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        code = _train(args, backend)
    finally:
        dist.destroy_process_group()
    if code:
        sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit code (0: trained, and replicas identical)."""
    args = _parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        backend = _resolve_backend(args.dist_backend, int(os.environ["WORLD_SIZE"]))
        if backend == "gloo":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        dist.init_process_group(backend)
        try:
            return _train(args, backend)
        finally:
            dist.destroy_process_group()
    backend = _resolve_backend(args.dist_backend, args.nproc)
    try:
        torch.multiprocessing.start_processes(
            _worker,
            args=(args.nproc, free_port(), args, backend),
            nprocs=args.nproc,
            start_method="spawn",
        )
    except torch.multiprocessing.ProcessExitedException as exc:
        return exc.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
