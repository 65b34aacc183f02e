r"""End-to-end benchmark of the reference LM: forward, forward+backward and a full AdamW train step.

Mean and standard deviation per phase, tokens/s and peak memory over the measured steps; a
configuration that runs out of memory is an OOM row; lists are swept. ``--preset e2e`` instead
alternates SDPA and flash_attention in one model every step and reports medians. Modes, columns,
NVTX ranges and the memory_viz snapshot: docs/benchmarking.md, sections 1 and 2.

    python benchmarks/model.py --size small,medium,large,xl,2.7B --context-length 512 \
        --dtype fp32,bf16 --mode fwd,fwd+bwd --out model.csv --plot model.png
    python benchmarks/model.py --preset memory --out memory.csv    # 2.7B peak memory table
    python benchmarks/model.py --preset e2e --out e2e.csv          # train step, SDPA vs ours
    python benchmarks/model.py --size 2.7B --context-length 128 --mode train --steps 1 \
        --memory-profile snapshot.pickle
    nsys profile -o lm python benchmarks/model.py --size large --attention naive
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import (
    Laps,
    csv_list,
    is_oom,
    line_plot,
    nvtx_range,
    parser,
    progress,
    report,
)
from torch_flashsys._memory import record_memory, validate_snapshot_file
from torch_flashsys.models import ATTENTION_CHOICES, MODEL_SIZES, build_model

MODES = ("fwd", "fwd+bwd", "train")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
PHASES = ("fwd", "bwd", "opt", "step")
PRESETS = {
    # Script 2 of the benchmarking issue: peak memory of the 2.7B model per context length.
    "memory": dict(size="2.7B", context_length="128,256,512", dtype="fp32,bf16", mode="fwd,train",
                   warmup=1, steps=2),
    # Issue 27's training step: the LLaMA-1B-shaped LM (GQA 32/8), 8192 tokens a step, SDPA's
    # default against flash_attention in interleaved rounds (run_e2e), eager and compiled; rows
    # model,context,batch,compiled,sdpa_ms,ours_ms.
    "e2e": dict(size="1B", context_length="2048,4096,8192", attention="sdpa,flash", dtype="bf16",
                mode="train", tokens=8192, compiled="both", warmup=3, steps=10),
}  # fmt: skip
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, smoke="tiny model on CPU, a few seconds", plot=True)
    p.add_argument("--preset", choices=sorted(PRESETS), help="memory: script 2's table")
    p.add_argument("--size", default="small", help=f"model size(s) from {list(MODEL_SIZES)}")
    p.add_argument("--context-length", default="512", help="sequence length(s)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--tokens", type=int, help="tokens per step: batch = tokens // context")
    p.add_argument("--attention", default="sdpa", help=f"from {list(ATTENTION_CHOICES)}")
    p.add_argument("--dtype", help="fp32 (no autocast) and/or bf16 (autocast); fp32 if not given")
    p.add_argument("--mode", default=",".join(MODES), help=f"subset of {list(MODES)}")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (in warm-up)")
    p.add_argument("--compiled", choices=["eager", "compiled", "both"],
                   help="instead of --compile: eager, compiled or both, one after the other")  # fmt: skip
    p.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"],
                   help="torch.set_float32_matmul_precision; high allows TF32")  # fmt: skip
    p.add_argument("--memory-profile", metavar="PATH", help="memory_viz snapshot of measured steps")
    p.add_argument("--memory-max-entries", type=int, default=100_000, help="allocator events kept")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    args = p.parse_args(argv)
    for key, value in PRESETS.get(args.preset, {}).items():  # what the command line left unset
        if getattr(args, key) == p.get_default(key):
            setattr(args, key, value)
    args.vocab = 100 if args.smoke else 10_000
    modes = {"eager": [False], "compiled": [True], "both": [False, True]}
    args.compiles = modes[args.compiled] if args.compiled else [args.compile]
    if args.smoke:
        args.size, args.context_length, args.batch = "tiny", "16", 2
        args.warmup, args.steps, args.device = 1, 2, "cpu"
        args.dtype = args.dtype or "fp32,bf16"
        args.tokens, args.compiles = args.tokens and 32, [False]
    args.sizes = csv_list(p, args.size, "--size", choices=MODEL_SIZES)
    args.attentions = csv_list(p, args.attention, "--attention", choices=ATTENTION_CHOICES)
    args.dtypes = csv_list(p, args.dtype or "fp32", "--dtype", choices=DTYPES)
    args.modes = csv_list(p, args.mode, "--mode", choices=MODES)
    args.contexts = csv_list(p, args.context_length, "--context-length", int)
    if min(args.batch, args.steps) < 1 or args.warmup < 0:
        p.error("--batch and --steps must be >= 1 and --warmup >= 0")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def _stepper(model, mode: str, dtype, device: torch.device, tokens, targets):
    """One (model, dtype, mode) step: returns its phase times (ms) from :class:`Laps`."""
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if mode == "train" else None
    cuda = device.type == "cuda"

    def step() -> dict[str, float]:
        laps = Laps()
        with nvtx_range("forward", cuda), autocast, torch.set_grad_enabled(mode != "fwd"):
            logits = model(tokens)
            if mode != "fwd":
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        laps.lap("fwd")
        if mode != "fwd":
            with nvtx_range("backward", cuda):
                loss.backward()
            laps.lap("bwd")
            with nvtx_range("optimizer", cuda):
                if opt is not None:
                    opt.step()
                (opt or model).zero_grad()
            laps.lap("opt" if opt is not None else "zero_grad")  # zero_grad: no column
        return {**laps.ms, "step": sum(laps.ms.values())}

    return step


def _batch(vocab: int, batch: int, ctx: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random (tokens, targets) of shape (batch, ctx): the same data every run."""
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, ctx), device=device, generator=gen)
    targets = torch.randint(0, vocab, (batch, ctx), device=device, generator=gen)
    return tokens, targets


def _measure(model, ctx: int, args, dtype_name: str, mode: str, device, snapshot_path) -> dict:
    tokens, targets = _batch(args.vocab, args.batch, ctx, device)
    step = _stepper(model, mode, DTYPES[dtype_name], device, tokens, targets)
    cuda = device.type == "cuda"
    with nvtx_range("warmup", cuda):
        for _ in range(args.warmup):
            step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    samples: list[dict[str, float]] = []
    record = contextlib.nullcontext()
    if snapshot_path:
        record = record_memory(snapshot_path, device, max_entries=args.memory_max_entries)
    with record, nvtx_range("measured", cuda):
        for i in range(args.steps):
            with nvtx_range(f"step {i}", cuda):
                samples.append(step())
    row: dict = {}
    for phase in PHASES:
        if xs := [s[phase] for s in samples if phase in s]:
            std = statistics.stdev(xs) if len(xs) > 1 else 0.0
            row |= {f"{phase} ms": statistics.fmean(xs), f"{phase} std": std}
    row["tokens/s"] = args.batch * ctx / (row["step ms"] * 1e-3)
    if cuda:
        row["peak MiB"] = torch.cuda.max_memory_allocated(device) / MIB
    if snapshot_path:
        summary = validate_snapshot_file(snapshot_path, strict=cuda)
        size = os.path.getsize(snapshot_path)
        peak = summary["trace_peak_bytes"] / MIB
        print(f"memory snapshot {snapshot_path}: {size / MIB:.1f} MiB, {summary['n_events']} events, "
              f"trace peak {peak:.0f} MiB; loads in memory_viz format", file=sys.stderr)  # fmt: skip
        row["snapshot"] = os.path.basename(snapshot_path)
    return row


def _snapshot_path(args, several: bool, size, ctx, attn, dtype, mode) -> str | None:
    if not args.memory_profile or not several:
        return args.memory_profile
    stem, ext = os.path.splitext(args.memory_profile)
    return f"{stem}-{size}-ctx{ctx}-{attn}-{dtype}-{mode.replace('+', '')}{ext or '.pickle'}"


def _build(args, size: str, ctx: int, attn: str, device: torch.device, compile_: bool):
    """(model, the module to run: compiled if asked); None, None when it does not fit."""
    if compile_:
        torch.compiler.reset()
    gc.collect()
    torch.manual_seed(0)
    try:
        model = build_model(size, context_length=ctx, attention=attn, vocab_size=args.vocab,
                            device=device)  # fmt: skip
    except Exception as exc:  # OOM while building: every row of this model is OOM
        if not is_oom(exc):
            raise
        return None, None
    return model, (torch.compile(model) if compile_ else model)


def run(args: argparse.Namespace) -> list[dict]:
    """One row per (size, context, attention, dtype, mode); the model is built once per triple."""
    device = torch.device(args.device)
    torch.set_float32_matmul_precision(args.matmul_precision)
    models = list(itertools.product(args.compiles, args.sizes, args.contexts, args.attentions))
    runs = list(itertools.product(args.dtypes, args.modes))
    several, rows = len(models) * len(runs) > 1, []
    for compile_, size, ctx, attn in progress(models, desc="models"):
        model, run_model = _build(args, size, ctx, attn, device, compile_)
        args.batch = max(1, args.tokens // ctx) if args.tokens else args.batch
        for dtype_name, mode in runs:
            row = {"size": size, "context": ctx, "attention": attn, "batch": args.batch,
                   "dtype": dtype_name, "mode": mode, "compile": compile_}  # fmt: skip
            rows.append(row)
            if model is None:
                row["step ms"] = "OOM"
                continue
            row["params_M"] = model.num_parameters() / 1e6
            snap = _snapshot_path(args, several, size, ctx, attn, dtype_name, mode)
            try:
                row.update(_measure(run_model, ctx, args, dtype_name, mode, device, snap))
            except Exception as exc:
                if not is_oom(exc):
                    raise
                row["step ms"] = "OOM"
                print(f"OOM: {size} ctx {ctx} {attn} {dtype_name} {mode}", file=sys.stderr)
            model.zero_grad()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del model, run_model
    return rows


def _plot(rows: list[dict], args: argparse.Namespace) -> None:
    """Memory preset: peak MiB per context length; otherwise mean step time per model size."""
    memory = args.preset == "memory"
    series: dict[str, list] = {}
    for r in rows:
        value = r.get("peak MiB" if memory else "step ms")
        other = r["size"] if memory else f"ctx {r['context']}"  # the variable not on the x axis
        label = f"{r['mode']} {r['dtype']} {r['attention']} {other}"
        if isinstance(value, float):
            series.setdefault(label, []).append((r["context"] if memory else r["size"], value))
    if memory:
        title = f"Reference LM peak memory, batch {args.batch}"
        line_plot(args.plot, series, "context length", "peak memory (MiB)", title)
    else:
        title = f"Reference LM, context {args.context_length}, batch {args.batch}"
        line_plot(args.plot, series, "model size", "time per step (ms, mean)", title, log="y")


def run_e2e(args: argparse.Namespace) -> list[dict]:
    """Issue 27's training step: one model per (compiled, size, context), its attention switched
    (``set_attention``) between SDPA and flash_attention every step, in rounds whose order
    alternates, one AdamW for both; median ms per step of each, one row per case."""
    device = torch.device(args.device)
    torch.set_float32_matmul_precision(args.matmul_precision)
    rows = []
    for compile_, size, ctx in itertools.product(args.compiles, args.sizes, args.contexts):
        model, run_model = _build(args, size, ctx, "sdpa", device, compile_)
        batch = max(1, args.tokens // ctx) if args.tokens else args.batch
        row = {"model": size, "context": ctx, "batch": batch, "compiled": compile_}
        rows.append(row)
        if model is None:
            row["sdpa_ms"] = row["ours_ms"] = "OOM"
            continue
        try:
            row.update(_interleaved(model, run_model, ctx, batch, args, device))
        except Exception as exc:
            if not is_oom(exc):
                raise
            row["sdpa_ms"] = row["ours_ms"] = "OOM"
        del model, run_model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _interleaved(model, run_model, ctx: int, batch: int, args, device) -> dict:
    tokens, targets = _batch(args.vocab, batch, ctx, device)
    step = _stepper(run_model, "train", DTYPES[args.dtypes[0]], device, tokens, targets)
    choices = {"sdpa_ms": "sdpa", "ours_ms": "flash"}
    for attention in choices.values():  # warm-up (and compile) each
        model.set_attention(attention)
        for _ in range(args.warmup):
            step()
    samples: dict[str, list[float]] = {name: [] for name in choices}
    for i in range(args.steps):
        for name in list(choices)[:: 1 if i % 2 == 0 else -1]:
            model.set_attention(choices[name])
            samples[name].append(step()["step"])
    ms = {name: statistics.median(xs) for name, xs in samples.items()}
    return {**ms, "ours / sdpa": ms["ours_ms"] / ms["sdpa_ms"], "rounds": args.steps}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.preset == "e2e":
        rows = run_e2e(args)
        cols = ["model", "context", "batch", "compiled", "sdpa_ms", "ours_ms", "ours / sdpa"]
        title = "Training step (bf16 autocast, AdamW): SDPA's default against flash_attention"
        title += f", median of {args.steps} interleaved rounds"
        return report(title, rows, cols, args.out)
    rows = run(args)
    if args.plot:
        _plot(rows, args)
    cols = ["size", "context", "attention", "dtype", "mode"]
    cols += [f"{p} {c}" for p in PHASES if any(f"{p} ms" in r for r in rows) for c in ("ms", "std")]
    cols += ["tokens/s"] + ["peak MiB"] * any("peak MiB" in r for r in rows)
    title = "Reference LM peak memory" if args.preset == "memory" else "Reference LM end-to-end"
    title += f" (batch {args.batch}, warm-up {args.warmup}, {args.steps} measured steps"
    title += ", torch.compile)" if args.compile else ")"
    report(title, rows, cols, args.out)


if __name__ == "__main__":
    main()
