"""Issue 27's own measurement, as a migrating user runs it: a Hugging Face ``LlamaForCausalLM``
(TinyLlama-1.1B's shape: 22 layers, d 2048, 32 query / 8 key-value heads, fp32 parameters) trained
with bf16 autocast, fused AdamW and the default ``zero_grad()``, with SDPA's default and inside
``torch_flashsys.sdpa_override()``, steps interleaved in rounds of alternating order (medians).

Cases: ``CONTEXTxBATCH``, with ``p`` for right-padded sequences (lengths drawn from 50-100% of the
context, an ``attention_mask``, padding labels -100), e.g. ``2048x4,8192x1,2048x4p``. Each row
also counts, per step, the SDPA calls routed to flash_attention and those left to SDPA (the issue
required every one routed). Needs ``transformers`` (installed on the GPU box); not a dependency.

    PYTHONPATH=. python3 benchmarks/gpu_checks/hf_llama.py [--cases ...] [--rounds N] [--out CSV]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch
import torch.nn.functional as F

import torch_flashsys
from torch_flashsys.attention import _dropin, _padding, _precompile

COLUMNS = ["model", "context", "batch", "padded", "compiled", "sdpa_ms", "ours_ms", "ours / sdpa",
           "rounds", "routed_per_step", "left_to_sdpa_per_step"]  # fmt: skip


SHAPES = {  # LlamaConfig arguments; "tiny": a CPU smoke run of this script
    "1.1B": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=8),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip


def build(size: str, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[size], max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def batch_of(context: int, batch: int, padded: bool, vocab: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(context * 31 + batch)
    ids = torch.randint(0, vocab, (batch, context), generator=gen)
    mask = torch.ones(batch, context, dtype=torch.long)
    if padded:
        lengths = torch.randint(context // 2, context + 1, (batch,), generator=gen)
        lengths[0] = context  # one full row: the batch is as long as the context
        for row, n in enumerate(lengths.tolist()):
            mask[row, n:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = {"input_ids": ids, "labels": labels}
    if padded:
        out["attention_mask"] = mask
    return {k: v.to(device) for k, v in out.items()}


class Counts:
    """SDPA calls seen by the override: routed to flash_attention, or left to SDPA."""

    def __init__(self) -> None:
        self.routed = self.left = 0
        original_flash, original_sdpa = _dropin.flash_attention, F.scaled_dot_product_attention

        def flash(*args, **kwargs):
            self.routed += 1
            return original_flash(*args, **kwargs)

        def sdpa(*args, **kwargs):
            self.left += 1
            return original_sdpa(*args, **kwargs)

        _dropin.flash_attention = flash
        self.sdpa = sdpa  # installed under the router only while ours runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="2048x4,8192x1,2048x4p")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--size", default="1.1B", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--min-seq", type=int, default=None,
                        help="_padding.MIN_SEQ_CUDA: where padded masks run without the mask "
                        "(a huge value: the mask path alone)")  # fmt: skip
    parser.add_argument("--per-sequence-min-seq", type=int, default=None,
                        help="_padding.PER_SEQUENCE_MIN_SEQ_CUDA: from where one call per "
                        "sequence, below it one packed call")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="then one step of each under torch.profiler: the top kernels")  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.min_seq is not None:
        _padding.MIN_SEQ_CUDA = args.min_seq
    if args.per_sequence_min_seq is not None:
        _padding.PER_SEQUENCE_MIN_SEQ_CUDA = args.per_sequence_min_seq
    model, opt = build(args.size, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    counts = Counts()
    plain_sdpa = F.scaled_dot_product_attention
    rows = []
    for case in args.cases.split(","):
        padded = case.endswith("p")
        context, batch = map(int, case.rstrip("p").split("x"))
        data = batch_of(context, batch, padded, SHAPES[args.size]["vocab_size"], device)

        def step(ours: bool, data: dict = data) -> float:
            sync()
            start = time.perf_counter()
            if ours:
                F.scaled_dot_product_attention = counts.sdpa  # the router's original: counted
                try:
                    with torch_flashsys.sdpa_override():
                        with torch.autocast(device.type, dtype=torch.bfloat16):
                            loss = model(**data).loss
                        loss.backward()
                finally:
                    F.scaled_dot_product_attention = plain_sdpa
            else:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(**data).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            sync()
            return (time.perf_counter() - start) * 1e3

        first = {name: step(name == "ours") for name in ("sdpa", "ours")}
        for _ in range(args.warmup):
            for ours in (False, True):
                step(ours)
        _precompile.wait()  # the steady state: background compiles done
        counts.routed = counts.left = 0
        samples: dict[str, list[float]] = {"sdpa": [], "ours": []}
        for i in range(args.rounds):
            for name in ("sdpa", "ours")[:: 1 if i % 2 == 0 else -1]:
                samples[name].append(step(name == "ours"))
        ms = {name: statistics.median(xs) for name, xs in samples.items()}
        row = {"model": f"Llama-{args.size} (HF)", "context": context, "batch": batch, "padded": padded,
               "compiled": False, "sdpa_ms": round(ms["sdpa"], 2), "ours_ms": round(ms["ours"], 2),
               "ours / sdpa": round(ms["ours"] / ms["sdpa"], 4), "rounds": args.rounds,
               "routed_per_step": counts.routed / args.rounds,
               "left_to_sdpa_per_step": counts.left / args.rounds}  # fmt: skip
        rows.append(row)
        print(f"{case}: first step sdpa {first['sdpa']:.0f} ms, ours {first['ours']:.0f} ms; "
              f"{row}", flush=True)  # fmt: skip
        if args.profile:
            for name in ("sdpa", "ours"):
                with torch.profiler.profile() as prof:
                    step(name == "ours")
                table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=12)
                print(f"--- {case} {name}: kernels by device time (one step)\n{table}", flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    meta = (f"{name}, torch {torch.__version__}, "
            f"transformers {__import__('transformers').__version__}")  # fmt: skip
    print(f"\n{meta}\n| case | SDPA ms | ours ms | ours / SDPA | routed / left per step |")
    print("|---|---|---|---|---|")
    for r in rows:
        case = f"{r['context']} x {r['batch']}{' padded' if r['padded'] else ''}"
        print(f"| {case} | {r['sdpa_ms']} | {r['ours_ms']} | {r['ours / sdpa']} | "
              f"{r['routed_per_step']:g} / {r['left_to_sdpa_per_step']:g} |")  # fmt: skip
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
