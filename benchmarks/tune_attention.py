r"""Sweep the attention kernels' tile configs on a GPU: which (BLOCK_M, BLOCK_N, warps, stages) wins
per kernel, head dim, causality and length. The package's tile table (``--table``, below) and the
fallback config lists in ``torch_flashsys/attention/_triton_fwd.py`` / ``_triton_bwd.py`` come
from its output.

Compiles every candidate first in parallel worker processes (they fill Triton's on-disk cache, so
the timing pass only loads binaries), then times each kernel alone with ``do_bench`` (median) and
writes one row per (kernel, config, shape). Example::

    python benchmarks/tune_attention.py --out tune.csv            # the default grid, bf16
    python benchmarks/tune_attention.py --kernels fwd --dims 128 --seqs 16384 --batch-heads 1x16
    python benchmarks/tune_attention.py --smoke     # CPU: the Triton interpreter, one tiny shape

``--kernels decode`` sweeps the split-KV decode kernel's launch settings instead (BLOCK_N, warps,
stages, programs per SM of ``_triton_decode.CONFIG``) at the varlen preset's decode cases, timing
``flash_attention(q, k_cache, v_cache, cache_seqlens=...)`` beside SDPA cuDNN and the copy bound::

    python benchmarks/tune_attention.py --kernels decode --out decode.csv

``--table sm90.json`` writes the fastest config per (kernel, head-dim class, causal, length) as the
tile table the package reads (``torch_flashsys/attention/tiles/<arch>.json``), with the sweep's
device, versions, date and command; ``--from-csv tune.csv`` makes it from an earlier sweep's rows
without a GPU::

    python benchmarks/tune_attention.py --from-csv docs/data/attention_tune_h100.csv \
        --table torch_flashsys/attention/tiles/sm90.json
"""

from __future__ import annotations

import csv
import functools
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import bench, env_stamp, markdown_table, parser, write_results
from benchmarks._peers import sdpa_call

# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per kernel and head-dim class.
SMOKE_CANDIDATES = {k: {16: [(16, 16, 4, 1), (32, 16, 4, 1)]} for k in ("fwd", "dq", "dkdv")}
CANDIDATES = {
    "fwd": {
        64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3),
             (64, 64, 4, 3), (128, 32, 4, 4), (256, 64, 8, 3), (256, 128, 8, 2)],
        128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
              (128, 32, 4, 3), (128, 64, 8, 4), (256, 64, 8, 2), (64, 128, 4, 2)],
    },
    "dq": {
        64: [(128, 32, 4, 4), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4),
             (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 8, 3)],
        128: [(128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
              (128, 32, 8, 3), (128, 64, 4, 2), (64, 64, 4, 2)],
    },
    "dkdv": {
        64: [(32, 128, 4, 3), (32, 128, 4, 5), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3),
             (32, 64, 4, 4), (64, 128, 4, 3), (16, 128, 4, 5), (128, 128, 8, 2)],
        128: [(32, 128, 4, 2), (32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3),
              (32, 64, 4, 3), (32, 128, 8, 3), (64, 128, 4, 2), (16, 128, 4, 3)],
    },
}  # fmt: skip


def _kernels():
    from torch_flashsys.attention import _triton_bwd, _triton_fwd

    return {
        "fwd": _triton_fwd._attn_fwd,
        "dq": _triton_bwd._attn_bwd_dq,
        "dkdv": _triton_bwd._attn_bwd_dkdv,
    }


class Problem:
    """Inputs of one attention problem and the argument lists of each kernel."""

    def __init__(self, batch, heads, seq, dim, causal, dtype, device="cuda", candidates=None):
        candidates = candidates or CANDIDATES
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
        self.launch("fwd", candidates["fwd"][dim][0])
        self.launch("dq", candidates["dq"][dim][0])
        self.launch("dkdv", candidates["dkdv"][dim][0])
        self.expected = {k: [t.clone() for t in self.outputs(k)] for k in ("fwd", "dq", "dkdv")}

    def outputs(self, kernel: str):
        return {"fwd": (self.out,), "dq": (self.dq,), "dkdv": (self.dk, self.dv)}[kernel]

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
                    self.dq, *tensors, *s(self.q), *s(self.k), *s(self.v), *s(self.out),
                    *s(self.do), *s(self.dq), *lse_strides, *runtime[:6], h, 1, *tail)  # fmt: skip
        return (self.q, self.k, self.v, self.do, self.lse, self.delta, self.dk, self.dv, *tensors,
                *s(self.q), *s(self.k), *s(self.v), *s(self.do), *s(self.dk), *s(self.dv),
                *lse_strides, *runtime[:6], h, h, 1, *tail)  # fmt: skip

    def constexprs(self, kernel: str):
        import triton

        d = self.shape[-1]
        _, _, flags = self._extras()
        c = {"HEAD_DIM": d, "BLOCK_D": triton.next_power_of_2(d), "HEAD_DIM_V": d,
             "BLOCK_DV": triton.next_power_of_2(d), **flags._asdict(), "PRECISION": "tf32"}  # fmt: skip
        if kernel == "dq":
            c["HAS_DLSE"] = False
        if kernel == "fwd":
            c["FOLD_SCALE"] = True  # no score modification, positive scale
        return c

    def grid(self, kernel: str, cfg):
        import triton

        b, h, n, _ = self.shape
        block = cfg[1] if kernel == "dkdv" else cfg[0]
        return (triton.cdiv(n, block) * b * h,)

    def launch(self, kernel: str, cfg):
        fn = _kernels()[kernel]
        bm, bn, w, st = cfg
        fn[self.grid(kernel, cfg)](
            *self.args(kernel), **self.constexprs(kernel),
            BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st,
        )  # fmt: skip


def _compile_job(job):
    """Worker: compile one (kernel, dim, causal, config) on a small problem of the same
    specialization (strides multiple of 16, 16 heads, group 1). Returns an error string or ''."""
    kernel, dim, causal, cfg, dtype_name = job
    try:
        prob = _problem_cache(dim, causal, dtype_name)
        prob.launch(kernel, cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # report, keep sweeping
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


_PROBLEMS: dict = {}


def _problem_cache(dim, causal, dtype_name):
    key = (dim, causal, dtype_name)
    if key not in _PROBLEMS:
        _PROBLEMS[key] = Problem(1, 16, 512, dim, causal, getattr(torch, dtype_name))
    return _PROBLEMS[key]


def flops(kernel, b, h, n, d, causal):
    matmuls = {"fwd": 2, "dq": 3, "dkdv": 4}[kernel]
    return 2 * matmuls * b * h * n * n * d * (0.5 if causal else 1.0)


def tile_table(rows: list[dict], tolerance: float = 1.03) -> dict[str, list[int]]:
    """The package's tile table from a sweep's rows: per ``kernel/dim/causal|full/seq``.

    Each (kernel, dim, causal) group gets one config, the one with the best geometric mean over
    the measured lengths, and a length keeps its own fastest config only where that one is more
    than ``tolerance`` faster: every new tile is a compile the first time a length reaches it.
    Warp-specialized variants and failed points are left out.
    """
    times: dict[tuple, dict[str, dict[str, float]]] = {}
    for r in rows:
        ms = float(r["ms"])
        if ms != ms or str(r.get("ws", "False")) == "True" or r.get("error"):
            continue
        causal = "causal" if str(r["causal"]) in ("True", "1") else "full"
        group = times.setdefault((r["kernel"], str(r["dim"]), causal), {})
        group.setdefault(str(r["config"]), {})[str(r["seq"])] = ms
    table = {}
    for (kernel, dim, causal), configs in times.items():
        seqs = sorted({s for c in configs.values() for s in c}, key=int)
        best = {s: min(configs, key=lambda c, s=s: configs[c].get(s, float("inf"))) for s in seqs}
        complete = [c for c in configs if len(configs[c]) == len(seqs)]
        compromise = min(complete, key=lambda c: sum(math.log(configs[c][s]) for s in seqs))
        for s in seqs:
            fastest = best[s]
            slower = configs[compromise][s] / configs[fastest][s]
            chosen = compromise if slower <= tolerance else fastest
            table[f"{kernel}/{dim}/{causal}/{s}"] = [int(x) for x in chosen.split("x")]
    return dict(sorted(table.items()))


def write_table(path: str, rows: list[dict], command: str) -> None:
    """Write the tile table of ``rows`` with the provenance of the sweep that measured them."""
    first = rows[0]
    meta = {k: first.get(k, "") for k in ("device", "torch", "triton", "date", "command")}
    table = {**meta, "made_by": command, "tiles": tile_table(rows)}
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote {len(table['tiles'])} tiles to {path}")


def main(argv=None):
    p = parser(__doc__, smoke="CPU, Triton interpreter, one tiny shape")
    p.add_argument("--kernels", default="fwd,dq,dkdv", help="subset of fwd,dq,dkdv, or decode")
    p.add_argument("--dims", default="64,128", help="head dims (64,128)")
    p.add_argument("--seqs", default="1024,4096,16384", help="sequence lengths")
    p.add_argument(
        "--batch-heads", default="4x16,4x16,1x16",
        help="batch x heads per sequence length, comma-separated (4x16,4x16,1x16)",
    )  # fmt: skip
    p.add_argument("--causal", default="1,0", help="causal values to sweep (1,0)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16")
    p.add_argument(
        "--workers", type=int, default=min(16, os.cpu_count() or 1),
        help="processes that compile the variants in parallel (default: up to 16 cores)",
    )  # fmt: skip
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per point")
    p.add_argument("--table", help="write the fastest configs as a tile table (.json)")
    p.add_argument("--from-csv", help="make --table from this sweep's rows, without running")
    args = p.parse_args(argv)
    command = "python benchmarks/tune_attention.py " + " ".join(argv or sys.argv[1:])
    if args.from_csv:
        if not args.table:
            p.error("--from-csv needs --table")
        with open(args.from_csv, newline="") as f:
            write_table(args.table, list(csv.DictReader(f)), command)
        return
    if args.kernels == "decode":
        return tune_decode(args)
    os.environ["TORCH_FLASHSYS_AUTOTUNE"] = "0"
    device, candidates = "cuda", CANDIDATES
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
        device, candidates, args.workers = "cpu", SMOKE_CANDIDATES, 0
        args.dims, args.seqs, args.batch_heads, args.dtype = "16", "40", "1x2", "float16"
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")
    kernels = args.kernels.split(",")
    dims = [int(x) for x in args.dims.split(",")]
    causals = [c == "1" for c in args.causal.split(",")]
    seqs = [int(x) for x in args.seqs.split(",")]
    bhs = [tuple(int(y) for y in x.split("x")) for x in args.batch_heads.split(",")]
    jobs = [
        (k, d, c, cfg, args.dtype)
        for k in kernels for d in dims for c in causals for cfg in candidates[k][d]
    ]  # fmt: skip
    t0 = time.time()
    if args.workers > 0:
        ctx = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
            errors = dict(zip(jobs, pool.map(_compile_job, jobs, chunksize=1), strict=True))
    else:  # compile on first use in the timing pass
        errors = dict.fromkeys(jobs, "")
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.0f} s "
          f"({sum(1 for e in errors.values() if e)} failed)", flush=True)  # fmt: skip

    rows = []
    for d, c, (seq, (b, h)) in itertools.product(dims, causals, zip(seqs, bhs, strict=True)):
        prob = Problem(b, h, seq, d, c, getattr(torch, args.dtype), device, candidates)
        for k in kernels:
            for cfg in candidates[k][d]:
                row = {"kernel": k, "dim": d, "causal": c, "batch": b, "heads": h,
                       "seq": seq, "config": "x".join(map(str, cfg))}  # fmt: skip
                err = errors[(k, d, c, cfg, args.dtype)]
                if err:
                    row["ms"], row["error"] = float("nan"), err
                else:
                    try:
                        fn = functools.partial(prob.launch, k, cfg)
                        ms = bench(fn, device, rep_ms=args.rep_ms)["median_ms"]
                        row["ms"] = ms
                        row["tflops"] = flops(k, b, h, seq, d, c) / ms / 1e9
                        row["max_diff"] = prob.max_diff(k)
                    except Exception as exc:
                        row["ms"], row["error"] = float("nan"), str(exc).splitlines()[0][:120]
                rows.append(row)
        prob = None
        if device == "cuda":
            torch.cuda.empty_cache()
    write_results(args.out, rows)
    if args.table:
        write_table(args.table, [{**env_stamp(), "command": command, **r} for r in rows], command)
    best = []
    for key, group in itertools.groupby(
        rows, key=lambda r: (r["kernel"], r["dim"], r["causal"], r["seq"])
    ):
        group = [r for r in group if r["ms"] == r["ms"]]
        if not group:
            continue
        top = sorted(group, key=lambda r: r["ms"])
        first = group[0]
        best.append({"kernel": key[0], "dim": key[1], "causal": key[2], "seq": key[3],
                     "best": top[0]["config"],
                     "best ms": top[0]["ms"], "TFLOP/s": top[0]["tflops"],
                     "2nd": f"{top[1]['config'] if len(top) > 1 else ''}",
                     "2nd ms": top[1]["ms"] if len(top) > 1 else "",
                     "first-listed ms": first["ms"],
                     "max diff": max(r["max_diff"] for r in group)})  # fmt: skip
    bad = {f"{k[0]} d{k[1]} {k[3]}": e for k, e in errors.items() if e}
    for name, e in list(bad.items())[:8]:
        print(f"failed: {name}: {e}")
    print(markdown_table(best, list(best[0]) if best else []))


DECODE_GRID = {"BLOCK_N": [64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4],
               "programs_per_sm": [1, 2, 4]}  # fmt: skip


def tune_decode(args) -> None:
    """Every launch setting of DECODE_GRID at batch 8 / cache 32768 and 64 / 1024 (32 query heads,
    8 KV heads, d 128, bf16); SDPA cuDNN and half a cache copy (K and V read once) beside them."""
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    cases, grid, dims = [(8, 32768), (64, 1024)], DECODE_GRID, (32, 8, 128, torch.bfloat16)
    if args.smoke:
        cases, dims = [(2, 256)], (4, 2, 16, torch.float32)
        grid = {**{k: v[:1] for k, v in DECODE_GRID.items()}, "programs_per_sm": [1, 2]}
    elif device != "cuda":
        sys.exit("tune_attention.py --kernels decode needs a CUDA device (or --smoke)")
    with torch.no_grad():
        rows = [r for batch, cache in cases for r in _decode_rows(batch, cache, dims, grid, device)]
    write_results(args.out, rows)
    rows.sort(key=lambda r: (r["case"], r["ms"]))
    print(f"config: {'x'.join(grid)}; {dims[0]}/{dims[1]} heads, d {dims[2]}\n")
    print(markdown_table(rows, ["case", "config", "ms"]))


def _decode_rows(batch, cache, dims, grid, device) -> list[dict]:
    from torch_flashsys import flash_attention
    from torch_flashsys.attention import _triton_decode

    heads, kv_heads, dim, dtype = dims
    q = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype)
    kc, vc = (
        torch.randn(batch, kv_heads, cache, dim, device=device, dtype=dtype) for _ in range(2)
    )
    lens, dst = torch.full((batch,), cache, device=device, dtype=torch.int32), torch.empty_like(kc)
    sdpa = sdpa_call("CUDNN_ATTENTION" if device == "cuda" else "MATH", enable_gqa=True)
    case, default = f"b{batch} c{cache}", dict(_triton_decode.CONFIG)
    rows = [
        {"case": case, "config": "SDPA", "ms": bench(lambda: sdpa(q, kc, vc), device)["median_ms"]}
    ]
    copy = bench(lambda: (dst.copy_(kc), dst.copy_(vc)), device)["median_ms"] / 2
    rows.append({"case": case, "config": "copy bandwidth (K and V read once)", "ms": copy})
    ours = lambda: flash_attention(q, kc, vc, cache_seqlens=lens, enable_gqa=True)
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid, values, strict=True))
        _triton_decode.CONFIG.update(config)
        try:
            ms = bench(ours, device)["median_ms"]
        except Exception:  # a config that does not compile or fit: no time
            ms = float("inf")
        name = "x".join(map(str, values)) + (" (current)" if config == default else "")
        rows.append({"case": case, "config": name, **config, "ms": ms})
    _triton_decode.CONFIG.update(default)
    return rows


if __name__ == "__main__":
    main()
