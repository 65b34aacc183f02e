"""Seconds of each first fwd+bwd at a new sequence length in a warm process (issue 26's "new
lengths compile nothing", checked against the Hopper path's length rules of issue 27).

Each family (dtype, head dim, causal, heads/key-value heads) runs in its own fresh process with an
empty Triton cache: a first call at ``--first`` tokens, then one call at each of ``--lengths`` in
that order, each timed (synchronized) and printed as it ends; a call that takes seconds compiled a
kernel. The families run ``--parallel`` at a time (compile is CPU work: seconds stay seconds).
``--settle``: after the first call, wait for the background compiles it queued
(``_precompile.wait()``, a training loop's first steps) and print how long they took, as the
length ``-1`` row (0 when precompiling is off or absent).

    PYTHONPATH=. python3 benchmarks/gpu_checks/new_lengths.py [--families ...] [--out CSV]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

FAMILIES = ["bfloat16,64,1,8,8", "bfloat16,64,0,8,8", "bfloat16,128,1,8,8", "bfloat16,128,0,8,8",
            "bfloat16,64,1,8,2", "float16,128,1,8,2"]  # fmt: skip
LENGTHS = "700,1024,1500,2049,3000,4096,8192,12000,16384,900"


def child(family: str, first: int, lengths: str, settle: bool) -> None:
    import torch

    from torch_flashsys import flash_attention

    dtype_name, d, causal, heads, kv = family.split(",")
    dtype, causal = getattr(torch, dtype_name), causal == "1"
    d, heads, kv = int(d), int(heads), int(kv)
    torch.ones(1, device="cuda").sum().item()

    def call(n: int) -> float:
        q = torch.randn(1, heads, n, d, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, kv, n, d, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(2))  # fmt: skip
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        flash_attention(q, k, v, is_causal=causal, enable_gqa=kv != heads).sum().backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    print(json.dumps([family, first, call(first)]), flush=True)
    if settle:
        t0 = time.perf_counter()
        try:
            from torch_flashsys.attention import _precompile

            _precompile.wait()
        except ImportError:  # a version without background compiles
            pass
        print(json.dumps([family, -1, time.perf_counter() - t0]), flush=True)
    for n in map(int, lengths.split(",")):
        print(json.dumps([family, n, call(n)]), flush=True)


def run_family(family: str, first: int, lengths: str, settle: bool) -> list[list]:
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        cmd = [sys.executable, __file__, "--child", family, "--first", str(first), "--lengths",
               lengths, *(["--settle"] if settle else [])]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode != 0:
        rows.append([family, -1, float("nan")])
        print(done.stderr[-2000:], file=sys.stderr)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--families", default=";".join(FAMILIES))
    p.add_argument("--first", type=int, default=2048)
    p.add_argument("--lengths", default=LENGTHS)
    p.add_argument("--parallel", type=int, default=3)
    p.add_argument("--settle", action="store_true", help="wait for background compiles first")
    p.add_argument("--out")
    args = p.parse_args()
    if args.child:
        return child(args.child, args.first, args.lengths, args.settle)
    families = args.families.split(";")
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda f: run_family(f, args.first, args.lengths, args.settle),
                                families))  # fmt: skip
    rows = [r for rs in results for r in rs]
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["family", "length", "seconds"])
            w.writerows(rows)
    settle = ["background"] if args.settle else []
    print("| family (dtype, d, causal, heads, kv) | first | " + " | ".join(
        settle + args.lengths.split(",")) + " |")  # fmt: skip
    for fam, rs in zip(families, results, strict=True):
        print(f"| {fam} | " + " | ".join(f"{s:.3f}" for _, _, s in rs) + " |")


if __name__ == "__main__":
    main()
