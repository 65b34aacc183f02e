"""Context parallelism: the longest trainable context of a LLaMA-1B-shaped LM, and attention time
per rank against single-GPU flash_attention (parts and columns: docs/benchmarking.md, section 6).

    python benchmarks/context_parallel.py --smoke            # CPU, gloo, 2 processes, seconds
    python benchmarks/context_parallel.py --nproc 1          # one GPU (~4 min on an H100)
    python benchmarks/context_parallel.py --nproc 2          # + 2-GPU context parallelism (NCCL)
"""

from __future__ import annotations

import functools
import gc
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from benchmarks._harness import (
    Laps,
    csv_list,
    is_oom,
    parser,
    percentiles,
    report,
    run_ranks,
    samples_ms,
)
from torch_flashsys import BucketedDDP, flash_attention
from torch_flashsys.distributed import (
    context_parallel_attention,
    context_parallel_sdpa,
    shard_position_ids,
    shard_sequence,
)
from torch_flashsys.models import ModelConfig, TransformerLM

GIB = 2**30
# A rank that runs out of memory mid-ring leaves the others waiting: the timeout ends the wait.
PG_TIMEOUT_S = 300.0
# LLaMA-1B-shaped (LLaMA 3.2 1B's width, depth and FFN; 32 heads of 64, no GQA; 32k vocabulary)
LLAMA_1B = {"d_model": 2048, "d_ff": 8192, "num_layers": 16, "num_heads": 32, "vocab_size": 32000}
SMOKE_LM = {"d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 128}
COLUMNS = ["part", "gpus", "mode", "context", "failed_at", "peak_gib", "step_s", "attn_ms",
           "single_gpu_ms", "speedup"]  # fmt: skip


def parse_args(argv=None):
    p = parser(__doc__, smoke="tiny LM on CPU (gloo), seconds")
    p.add_argument("--nproc", type=int, help="ranks for part 2 (default: GPUs, at most 2)")
    p.add_argument("--modes", default="ring,ulysses", help="context-parallel modes")
    p.add_argument("--start", type=int, default=8192, help="first context tried")
    p.add_argument("--max-context", type=int, default=262144, help="search ceiling")
    p.add_argument("--granularity", type=int, default=4096, help="search resolution")
    p.add_argument("--loss-chunk", type=int, default=4096, help="chunked-loss positions")
    p.add_argument("--attn-seqs", default="16384,65536", help="attention sequence lengths")
    p.add_argument("--reps", type=int, default=5, help="timed attention repetitions")
    p.add_argument("--time-budget", type=float, default=110.0, help="seconds per context search")
    p.add_argument("--simulate-oom-above", type=int, help="testing: longer contexts count as OOM")
    p.add_argument(
        "--parts",
        default="longest,attention",
        help="comma-separated: longest (context search), attention (time per rank)",
    )
    args = p.parse_args(argv)
    args.parts = csv_list(p, args.parts, "--parts", choices=["longest", "attention"])
    args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.lm = LLAMA_1B
    if args.smoke:
        args.lm, args.start, args.max_context, args.granularity = SMOKE_LM, 32, 256, 16
        args.simulate_oom_above = args.simulate_oom_above or 100  # exercises the bisection
        args.loss_chunk, args.attn_seqs, args.reps, args.nproc = 16, "64", 2, 2
    if args.nproc is None:
        args.nproc = min(2, torch.cuda.device_count()) if args.device == "cuda" else 2
    args.modes = args.modes.split(",")
    args.attn_seqs = [int(s) for s in args.attn_seqs.split(",")]
    if min(args.start, args.granularity, args.loss_chunk, args.reps, args.nproc) < 1:
        p.error("--start, --granularity, --loss-chunk, --reps and --nproc must be >= 1")
    return args


class _LossLM(torch.nn.Module):
    """The LM with its chunked loss as forward (BucketedDDP must see the forward)."""

    def __init__(self, args, device) -> None:
        super().__init__()
        attention = "sdpa" if dist.get_world_size() > 1 else "flash"
        cfg = ModelConfig(**args.lm, context_length=args.max_context, attention=attention,
                          activation_checkpointing=True)  # fmt: skip
        self.lm = TransformerLM(cfg, device=device)
        self.chunk = args.loss_chunk

    def forward(self, tokens, targets, positions):
        return self.lm.loss(tokens, targets, position_ids=positions, chunk_size=self.chunk)


def _trainer(args, device: torch.device, mode: str, warm_context: int):
    """A step function on a fresh model, after one step at ``warm_context`` (so AdamW's state and
    the gradient buckets exist: later probes see the steady state's memory)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = _LossLM(args, device)
    world = dist.get_world_size()
    module = BucketedDDP(model) if world > 1 else model
    opt = torch.optim.AdamW(module.parameters(), lr=1e-5)
    amp = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")

    def step(context: int) -> None:
        if args.simulate_oom_above is not None and context > args.simulate_oom_above:
            raise torch.cuda.OutOfMemoryError(f"simulated: {context} > --simulate-oom-above")
        seq = torch.randint(0, args.lm["vocab_size"], (1, context + 1), device=device)
        tokens, targets = (shard_sequence(t) for t in (seq[:, :-1], seq[:, 1:]))
        positions = shard_position_ids(context, device=device) if world > 1 else None
        with amp, context_parallel_sdpa(mode=mode):
            loss = module(tokens, targets, positions)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step(warm_context)
    return step, (model, opt)


def _try(step, context: int, device: torch.device) -> tuple[bool, float, float]:
    """(trained on every rank, peak GiB, seconds)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    laps, ok = Laps(), True
    try:
        step(context)
    except Exception as exc:
        if not is_oom(exc):
            raise
        ok = False
    laps.lap("step")
    seconds = laps.ms["step"] / 1e3
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    flag = torch.tensor([0.0 if ok else 1.0, peak], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag[0].item() == 0.0, flag[1].item(), seconds


def longest_context(args, device: torch.device, mode: str) -> dict:
    """Doubling from --start until a failure (or the ceiling), then bisection to --granularity."""
    world, deadline = dist.get_world_size(), time.monotonic() + args.time_budget
    unit = args.granularity * 2 * world  # zigzag: a multiple of 2 x world
    step, keep = _trainer(args, device, mode, unit)
    lo, hi, best = 0, None, (0.0, 0.0)
    context = max(unit, args.start // unit * unit)
    while time.monotonic() < deadline:
        ok, peak, seconds = _try(step, context, device)
        if ok:
            lo, best = context, (peak, seconds)
        else:  # a step that failed half-way leaves gradients (and BucketedDDP) mid-step
            hi = context
            del step, keep
            step, keep = _trainer(args, device, mode, unit)
        if hi is None:
            if context >= args.max_context:
                break
            context = min(2 * context, args.max_context // unit * unit)
        else:
            if hi - lo <= unit:
                break
            context = (lo + hi) // 2 // unit * unit or unit
    del step, keep
    return {"part": "longest context", "gpus": world, "mode": mode if world > 1 else "-",
            "context": lo, "failed_at": hi if hi is not None else f"> {args.max_context}",
            "peak_gib": best[0], "step_s": best[1]}  # fmt: skip


def _attention_ms(fn, args, device: torch.device) -> float:
    times = samples_ms(fn, 1, args.reps)  # the first call compiles / warms up
    stats = torch.tensor([percentiles(times)["median_ms"]], device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank's
    return stats.item()


def _qkv(seq: int, device: torch.device, local: bool):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(1, 32, seq, 64, device=device, dtype=dtype, generator=g) for _ in range(3)]
    ts = [shard_sequence(t, dim=2) for t in full] if local else full
    return [t.contiguous().requires_grad_() for t in ts]


def attention_rows(args, device: torch.device) -> list[dict]:
    """fwd+bwd per length: flash_attention on one rank (and the one-rank path), each mode on more."""
    world, rows = dist.get_world_size(), []
    modes = ["flash_attention", args.modes[0]] if world == 1 else args.modes
    for seq, mode in itertools.product(args.attn_seqs, modes):
        local = mode != "flash_attention"
        q, k, v = _qkv(seq, device, local)
        attend = (
            functools.partial(context_parallel_attention, mode=mode) if local else flash_attention
        )
        fwd_bwd = lambda f=attend, q=q, k=k, v=v: f(q, k, v, is_causal=True).sum().backward()
        ms = _attention_ms(fwd_bwd, args, device)
        base = args.single_ms.setdefault(seq, ms)  # the one-rank run times flash_attention first
        rows.append({"part": "attention", "gpus": world, "mode": mode, "context": seq,
                     "attn_ms": ms, "single_gpu_ms": base, "speedup": base / ms})  # fmt: skip
    return rows


def worker(args) -> list[dict]:
    """Part 1 and 2 on this rank's device; the rows (the same on every rank)."""
    world = dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    if "longest" in args.parts:
        rows += [longest_context(args, device, m) for m in (args.modes if world > 1 else ["ring"])]
    return rows + (attention_rows(args, device) if "attention" in args.parts else [])


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    args.single_ms = {}
    rows = run_ranks(worker, args, 1, backend, PG_TIMEOUT_S)  # one device: parts 1 and 2
    args.single_ms = {r["context"]: r["attn_ms"] for r in rows if r["mode"] == "flash_attention"}
    if args.nproc > 1:
        rows += run_ranks(worker, args, args.nproc, backend, PG_TIMEOUT_S)
    title = "Context parallelism: longest trainable context, attention time per rank"
    report(title, rows, COLUMNS, args.out)
    return rows


if __name__ == "__main__":
    main()
