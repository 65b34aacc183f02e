"""Sweep the attention kernels' tiles (BLOCK_M, BLOCK_N, warps, stages) on a GPU: per kernel, head
dim, causality and length; each candidate is compiled first in worker processes, then timed alone
(do_bench median). ``--table`` writes the package's tile table (torch_flashsys/attention/tiles/),
``--from-csv`` makes it from an earlier sweep's rows; ``--kernels decode`` sweeps the split-KV
decode launch settings instead. Details: docs/benchmarking.md, docs/attention.md.

    python benchmarks/tune_attention.py --out tune.csv --table sm90.json
    python benchmarks/tune_attention.py --from-csv docs/data/attention_tune_h100.csv --table t.json
    python benchmarks/tune_attention.py --kernels decode --out decode.csv
    python benchmarks/tune_attention.py --smoke     # CPU: the Triton interpreter, one tiny shape
"""

from __future__ import annotations

import csv
import functools
import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _harness as H
from benchmarks._peers import decode_rows, device_dtype

# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per kernel and head-dim class.
SMOKE_CANDIDATES = {
    k: {16: [(16, 16, 4, 1), (32, 16, 4, 1)]} for k in ("fwd", "dq", "dkdv", "dkdv_split")
}
CANDIDATES = {
    "fwd": {
        64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3),
             (64, 64, 4, 3), (128, 32, 4, 4), (256, 64, 8, 3), (256, 128, 8, 2)],
        128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
              (128, 32, 4, 3), (128, 64, 8, 4), (256, 64, 8, 2), (64, 128, 4, 2)],
        # Head dims 129-256 (never swept: the library's lists' first tiles run there, and their
        # sm90 builds spill, `python -m tests.attention.sm90_offline spills 256`); the others
        # here do not (Triton 3.6, offline).
        256: [(64, 64, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 8, 3),
              (128, 32, 8, 3), (64, 32, 4, 2)],
    },
    "dq": {
        64: [(128, 32, 4, 4), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4),
             (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 8, 3)],
        128: [(128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
              (128, 32, 8, 3), (128, 64, 4, 2), (64, 64, 4, 2)],
        256: [(64, 32, 4, 2), (64, 32, 8, 2), (128, 32, 8, 2), (64, 32, 8, 3), (128, 16, 8, 2),
              (64, 64, 8, 2), (64, 16, 4, 2)],
    },
    "dkdv": {
        64: [(32, 128, 4, 3), (32, 128, 4, 5), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3),
             (32, 64, 4, 4), (64, 128, 4, 3), (16, 128, 4, 5), (128, 128, 8, 2)],
        128: [(32, 128, 4, 2), (32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3),
              (32, 64, 4, 3), (32, 128, 8, 3), (64, 128, 4, 2), (16, 128, 4, 3)],
        # Head dims past 128 run the kernel SPLIT (``_triton_bwd.DKDV_SPLIT_MIN_DIM``): these
        # tiles' split builds do not spill (sm90, Triton 3.6, offline). The unsplit kernel's
        # sweeps: docs/data/attention_tune_256_dkdv_h100.csv.
        256: [(32, 128, 8, 3), (32, 128, 8, 2), (16, 128, 8, 2), (16, 128, 8, 3), (64, 32, 8, 3),
              (32, 64, 8, 2)],
    },
    # The dK/dV kernel SPLIT (one accumulator a program: dK's or dV's) at any head dim, for an
    # A/B against dkdv (which splits past 128).
    # sm90 builds without spills (Triton 3.6, offline) but 64x64x4x3 (6 STL causal)
    "dkdv_split": {
        64: [(64, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3)],
        128: [(64, 128, 8, 2), (32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 128, 8, 2)],
        256: [(32, 128, 8, 2), (16, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3), (64, 32, 8, 3),
              (32, 64, 8, 2)],
    },
}  # fmt: skip


class Problem:
    """Inputs of one attention problem and the argument lists of each kernel."""

    def __init__(self, batch, heads, seq, dim, causal, dtype, device="cuda", candidates=CANDIDATES):
        gen = torch.Generator(device=device).manual_seed(seq + dim)
        shape = (batch, heads, seq, dim)
        self.q, self.k, self.v, self.do = (
            torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4)
        )
        self.shape, self.causal, self.scale = shape, causal, dim**-0.5
        self.out, self.dq, self.dk, self.dv = (torch.empty_like(self.q) for _ in range(4))
        self.lse = torch.empty(shape[:-1], device=device, dtype=torch.float32)
        self.delta = torch.empty_like(self.lse)
        # Real out, lse and delta (the backward kernels' inputs) from the first candidates.
        for kernel in ("fwd", "dq", "dkdv"):
            self.launch(kernel, candidates[kernel][dim][0])
        self.expected = {k: [t.clone() for t in self.outputs(k)] for k in ("fwd", "dq", "dkdv")}
        self.expected["dkdv_split"] = self.expected["dkdv"]  # the split kernel's are the same

    def outputs(self, kernel: str):
        dkdv = (self.dk, self.dv)
        return {"fwd": (self.out,), "dq": (self.dq,), "dkdv": dkdv, "dkdv_split": dkdv}[kernel]

    def max_diff(self, kernel: str) -> float:
        """Largest difference from the first candidate's results (a wrong config shows here)."""
        got, want = self.outputs(kernel), self.expected[kernel]
        return max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(got, want, strict=True)
        )

    def _extras(self):
        from torch_flashsys.attention._extras import CAUSAL, PLAIN
        from torch_flashsys.attention._triton_common import kernel_extras

        return kernel_extras(CAUSAL if self.causal else PLAIN, self.q)

    def args(self, kernel: str):
        """The kernel's runtime arguments, as _triton_fwd / _triton_bwd pass them."""
        from torch_flashsys.attention._triton_common import LOG2E, tune_len

        _, h, n, _ = self.shape
        tensors, runtime, _ = self._extras()
        s = lambda t: t.stride()[:3]
        lse_strides = (h * n, n)
        tail = (n, n, tune_len(n, n), self.scale * LOG2E, self.scale, *runtime[6:])
        if kernel == "fwd":
            return (self.q, self.k, self.v, self.out, self.lse, *tensors, *s(self.q), *s(self.k),
                    *s(self.v), *s(self.out), *lse_strides, *runtime[:6], h, 1, *tail)  # fmt: skip
        if kernel == "dq":
            return (self.q, self.k, self.v, self.out, self.do, self.lse, self.lse, self.delta,
                    self.dq, self.dk, self.dv, *tensors, *s(self.q), *s(self.k), *s(self.v),
                    *s(self.out), *s(self.do), *s(self.dq), *s(self.dk), *s(self.dv),
                    *lse_strides, *runtime[:6], h, 1, *tail)  # fmt: skip
        return (self.q, self.k, self.v, self.do, self.lse, self.delta, self.dk, self.dv, *tensors,
                *s(self.q), *s(self.k), *s(self.v), *s(self.do), *s(self.dk), *s(self.dv),
                *lse_strides, *runtime[:6], h, h, 1, *tail)  # fmt: skip

    def constexprs(self, kernel: str):
        from torch_flashsys.attention._triton_common import kernel_constexprs

        d = self.shape[-1]
        c = kernel_constexprs(d, d, "tf32", self._extras()[2]._asdict())
        # fwd: no score modification, positive scale (FOLD_SCALE); dq: no gradient into the lse,
        # dQ only (KV_GRADS off: the dK/dV kernel's problems)
        extra = {"fwd": {"FOLD_SCALE": True}, "dq": {"HAS_DLSE": False, "KV_GRADS": False},
                 "dkdv": {"SPLIT": self.split(kernel)}, "dkdv_split": {"SPLIT": True}}  # fmt: skip
        return {**c, **extra[kernel]}

    def split(self, kernel: str) -> bool:
        """dK/dV in two programs per key tile: ``dkdv_split``, or ``dkdv`` where the library's
        rule (``_triton_bwd.dkdv_split``) splits."""
        from torch_flashsys.attention._triton_bwd import dkdv_split

        d = self.shape[-1]
        return kernel == "dkdv_split" or (kernel == "dkdv" and dkdv_split(d, d))

    def launch(self, kernel: str, cfg):
        import triton

        from torch_flashsys.attention import _triton_bwd, _triton_fwd

        fn = {"fwd": _triton_fwd._attn_fwd, "dq": _triton_bwd._attn_bwd_dq}.get(kernel)
        fn = fn or _triton_bwd._attn_bwd_dkdv
        b, h, n, _ = self.shape
        if fn is _triton_bwd._attn_bwd_dkdv:  # key tiles, two programs each when split
            tiles = triton.cdiv(n, cfg[1]) * (2 if self.split(kernel) else 1)
        else:
            tiles = triton.cdiv(n, cfg[0])
        grid = (tiles * b * h,)
        constexprs = self.constexprs(kernel)
        # Triton's interpreter (--smoke) ignores keywords the kernel lacks; a GPU launch raises.
        unknown = sorted(set(constexprs) - set(fn.arg_names))
        if unknown:
            raise TypeError(f"{fn.__name__} has no arguments {unknown}")
        fn[grid](*self.args(kernel), **constexprs, BLOCK_M=cfg[0], BLOCK_N=cfg[1],
                 num_warps=cfg[2], num_stages=cfg[3])  # fmt: skip


@functools.cache  # one per worker process and specialization: its set-up launches run once
def _small_problem(dim, causal, dtype_name):
    return Problem(1, 16, 512, dim, causal, getattr(torch, dtype_name))


def _compile_job(job):
    """Worker: compile one (kernel, dim, causal, config) at a small shape; '' or the error."""
    kernel, dim, causal, cfg, dtype_name = job
    try:
        _small_problem(dim, causal, dtype_name).launch(kernel, cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # report, keep sweeping
        return H.why(exc, 120)


def flops(kernel, b, h, n, d, causal):
    matmuls = {"fwd": 2, "dq": 3, "dkdv": 4, "dkdv_split": 4}[kernel]  # split: S counted once
    return 2 * matmuls * b * h * n * n * d * (0.5 if causal else 1.0)


def write_table(path: str, rows: list[dict], command: str) -> None:
    """The tile table of ``rows``, with the provenance of the sweep that measured them."""
    from torch_flashsys.attention._kernel_config import build_table

    meta = {k: rows[0].get(k, "") for k in ("device", "torch", "triton", "date", "command")}
    table = {**meta, "made_by": command, "tiles": build_table(rows)}
    with open(path, "w") as f:
        f.write(json.dumps(table, indent=1) + "\n")
    print(f"wrote {len(table['tiles'])} tiles to {path}")


def main(argv=None):
    p = H.parser(__doc__, smoke="CPU, Triton interpreter, one tiny shape")
    p.add_argument(
        "--kernels",
        default="fwd,dq,dkdv",
        help="a subset of fwd,dq,dkdv,dkdv_split (the dK/dV kernel split in two programs per key tile), or decode",
    )
    p.add_argument("--dims", default="64,128", help="head dims")
    p.add_argument("--seqs", default="1024,4096,16384", help="sequence lengths")
    p.add_argument("--batch-heads", default="4x16,4x16,1x16", help="batch x heads per length")
    p.add_argument("--causal", default="1,0", help="causal values")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compilers")
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per point")
    p.add_argument("--table", help="write the fastest configs as a tile table (.json)")
    p.add_argument("--from-csv", help="make --table from this sweep's rows, without running")
    args = p.parse_args(argv)
    command = "python benchmarks/tune_attention.py " + " ".join(argv or sys.argv[1:])
    if args.from_csv or args.kernels == "decode":
        if args.from_csv and not args.table:
            p.error("--from-csv needs --table")
        if args.from_csv:
            with open(args.from_csv, newline="") as f:
                return write_table(args.table, list(csv.DictReader(f)), command)
        return tune_decode(args)
    os.environ["TORCH_FLASHSYS_AUTOTUNE"] = "0"
    device, candidates = "cuda", CANDIDATES
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
        device, candidates, args.workers = "cpu", SMOKE_CANDIDATES, 0
        args.dims, args.seqs, args.batch_heads, args.dtype = "16", "40", "1x2", "float16"
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")
    bh = [tuple(int(y) for y in x.split("x")) for x in args.batch_heads.split(",")]
    grid = (H.csv_list(p, args.kernels, "--kernels", choices=CANDIDATES),
            H.csv_list(p, args.dims, "--dims", int), [c == "1" for c in args.causal.split(",")],
            list(zip(H.csv_list(p, args.seqs, "--seqs", int), bh, strict=True)))  # fmt: skip
    rows = sweep(args, grid, candidates, device)
    H.write_results(args.out, rows)
    if args.table:
        write_table(args.table, [{**H.env_stamp(), "command": command, **r} for r in rows], command)
    for r in (r for r in rows if r.get("error")):
        print(f"failed: {r['kernel']} d{r['dim']} {r['seq']} {r['config']}: {r['error']}")
    point = lambda r: (r["kernel"], r["dim"], r["causal"], r["seq"])
    ok = (r for r in rows if r["ms"] == r["ms"])
    best = [min(g, key=lambda r: r["ms"]) for _, g in itertools.groupby(ok, key=point)]
    print(H.markdown_table(best, ["kernel", "dim", "causal", "seq", "config", "ms", "tflops"]))


def sweep(args, grid, candidates, device) -> list[dict]:
    """Compile every (kernel, dim, causal, config) (in parallel workers on a GPU), then time each
    config alone on each (length, (batch, heads)); a failed one gets ``ms`` NaN and its ``error``."""
    kernels, dims, causals, lengths = grid
    jobs = [
        (k, d, c, cfg, args.dtype)
        for k in kernels for d in dims for c in causals for cfg in candidates[k][d]
    ]  # fmt: skip
    errors = dict.fromkeys(jobs, "")  # workers 0: compile on first use in the timing pass
    if args.workers > 0:
        ctx = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
            errors = dict(zip(jobs, pool.map(_compile_job, jobs, chunksize=1), strict=True))
    rows = []
    for d, c, (seq, (b, h)) in itertools.product(dims, causals, lengths):
        prob = Problem(b, h, seq, d, c, getattr(torch, args.dtype), device, candidates)
        for k in kernels:
            for cfg in candidates[k][d]:
                row = {"kernel": k, "dim": d, "causal": c, "batch": b, "heads": h, "seq": seq,
                       "config": "x".join(map(str, cfg)), "ms": float("nan")}  # fmt: skip
                row["error"] = errors[(k, d, c, cfg, args.dtype)]
                try:
                    if not row["error"]:
                        fn = functools.partial(prob.launch, k, cfg)
                        row["ms"] = H.bench(fn, device, rep_ms=args.rep_ms)["median_ms"]
                        row["tflops"] = flops(k, b, h, seq, d, c) / row["ms"] / 1e9
                        row["max_diff"] = prob.max_diff(k)
                except Exception as exc:  # report, keep sweeping
                    row["error"] = H.why(exc)
                rows.append(row)
        del prob
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


DECODE_GRID = {"BLOCK_N": [64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4],
               "programs_per_sm": [1, 2, 4]}  # fmt: skip


def tune_decode(args) -> None:
    """Each DECODE_GRID setting at ``flash.py --preset varlen``'s decode cases; the peers once."""
    from torch_flashsys.attention import _triton_decode

    device, dtype = device_dtype(args.smoke)
    grid = {k: v[:1] for k, v in DECODE_GRID.items()} if args.smoke else DECODE_GRID
    default, rows, seen = dict(_triton_decode.CONFIG), [], set()
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid, values, strict=True))
        _triton_decode.CONFIG.update(config)
        name = "x".join(map(str, values)) + (" (current)" if config == default else "")
        for r in decode_rows(device, dtype, args.smoke):
            if r["impl"] == "ours":
                rows.append({**r, "config": name, **config})
            elif (r["impl"], r["case"]) not in seen:  # the peers: once
                seen.add((r["impl"], r["case"]))
                rows.append({**r, "config": ""})
    _triton_decode.CONFIG.update(default)
    H.write_results(args.out, rows)
    rows.sort(key=lambda r: (r["case"], r["ms"] or float("inf")))
    print(H.markdown_table(rows, ["case", "impl", "config", "ms"]))


if __name__ == "__main__":
    main()
