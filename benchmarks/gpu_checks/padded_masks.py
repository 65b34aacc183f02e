"""Right-padded causal masks (a Hugging Face model's padded batches) on the GPU: SDPA's default with
the mask, flash_attention's mask path, and its per-sequence route (``_padding``: mask-free
causal calls on each sequence's keys), ``do_bench`` medians of fwd and fwd+bwd in one process.
Sets ``_padding.MIN_SEQ_CUDA`` (the route's threshold) from where the route wins.

    PYTHONPATH=. python3 benchmarks/gpu_checks/padded_masks.py [--shapes BxHQ/HKVxL,...] [--out CSV]
"""

from __future__ import annotations

import argparse
import csv

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from torch_flashsys import flash_attention
from torch_flashsys.attention import _padding, _precompile

SHAPES = "32x32/8x256,16x32/8x512,8x32/8x1024,4x32/8x2048,2x32/8x4096,1x32/8x8192,4x16/16x2048"


def padded_mask(lengths: list[int], seq: int, device) -> torch.Tensor:
    rows = torch.arange(seq, device=device)
    causal = rows[None, :] <= rows[:, None]
    keys = rows[None, None, :] < torch.tensor(lengths, device=device)[:, None, None]
    return (causal[None] & keys)[:, None]


def bench_shape(shape: str, dim: int, profile: bool = False) -> list[dict]:
    """The three implementations on one ``BxHQ/HKVxL`` problem (lengths 50-100% of L, one full)."""
    b, heads, seq = shape.split("x")
    b, seq = int(b), int(seq)
    hq, hk = map(int, heads.split("/"))
    gen = torch.Generator().manual_seed(seq + b)
    lengths = torch.randint(seq // 2, seq + 1, (b,), generator=gen)
    lengths[0] = seq
    lengths = lengths.tolist()
    q = torch.randn(b, seq, hq, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (
        torch.randn(b, seq, hk, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for _ in range(2)
    )  # fmt: skip  (a projection's layout)
    for t in (q, k, v):
        t.requires_grad_()
    mask = padded_mask(lengths, seq, "cuda")
    dout = torch.randn(b, hq, seq, dim, device="cuda", dtype=torch.bfloat16)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq > hk)

    def ours():
        return flash_attention(q, k, v, attn_mask=mask, enable_gqa=hq > hk)

    def fwd_bwd(fn):
        fn().backward(dout)

    big = 1 << 40  # (MIN_SEQ_CUDA, PER_SEQUENCE_MIN_SEQ_CUDA) of each of ours
    impls = {"sdpa (mask)": (sdpa, None), "ours, mask path": (ours, (big, big)),
             "ours, packed": (ours, (0, big)), "ours, per sequence": (ours, (0, 0))}  # fmt: skip
    ref = sdpa().float()
    rows, default = [], (_padding.MIN_SEQ_CUDA, _padding.PER_SEQUENCE_MIN_SEQ_CUDA)
    for impl, (fn, thresholds) in impls.items():
        if thresholds is not None:
            _padding.MIN_SEQ_CUDA, _padding.PER_SEQUENCE_MIN_SEQ_CUDA = thresholds
        err = (fn().float() - ref).abs().max().item()
        fwd_bwd(fn)
        _precompile.wait()
        fwd = do_bench(fn)
        both = do_bench(lambda fn=fn: fwd_bwd(fn))
        if profile:
            with torch.profiler.profile() as prof:
                for _ in range(3):
                    fwd_bwd(fn)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=14)
            print(f"--- {shape} {impl}: 3 x fwd+bwd\n{table}", flush=True)
        row = {
            "shape": shape,
            "dim": dim,
            "lengths": "/".join(map(str, lengths)),
            "impl": impl,
            "fwd_ms": round(fwd, 4),
            "fwd_bwd_ms": round(both, 4),
            "max_diff_vs_sdpa": err,
        }
        rows.append(row)
        print(row, flush=True)
    _padding.MIN_SEQ_CUDA, _padding.PER_SEQUENCE_MIN_SEQ_CUDA = default
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also a torch.profiler table of each impl's fwd+bwd (kernels)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [
        row
        for shape in args.shapes.split(",")
        for row in bench_shape(shape, args.dim, args.profile)
    ]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape, d | lengths | impl | fwd ms | fwd+bwd ms | / SDPA fwd+bwd |")
    print("|---|---|---|---|---|---|")
    base = {}
    for r in rows:
        if r["impl"].startswith("sdpa"):
            base[r["shape"]] = r["fwd_bwd_ms"]
        print(f"| {r['shape']}, {r['dim']} | {r['lengths']} | {r['impl']} | {r['fwd_ms']} | "
              f"{r['fwd_bwd_ms']} | {r['fwd_bwd_ms'] / base[r['shape']]:.3f} |")  # fmt: skip
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
