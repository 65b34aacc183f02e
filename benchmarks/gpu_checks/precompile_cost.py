"""What the background compiles cost the caller: in a fresh process (empty Triton cache), a first
fwd+bwd, then the same call in a loop for ``--seconds``, each call's synchronized wall time;
medians per window of time since the first call ended, and the calls each window held, with
background compiles on (``TORCH_FLASHSYS_PRECOMPILE=1``, the default) and off, one process each,
one after the other in ``--order`` (on, off, off, on: the machine's warming up is shared).
A (4, 16, 2048, 64) causal bf16 call is host-bound on the H100 box: the compiles' share of the
GIL shows in its time.

    PYTHONPATH=. python3 benchmarks/gpu_checks/precompile_cost.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WINDOWS = (0, 2, 5, 10, 15, 20, 30)


def child(seconds: float) -> None:
    import torch

    from torch_flashsys import flash_attention

    q, k, v = (torch.randn(4, 16, 2048, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))  # fmt: skip

    def call() -> None:
        flash_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    call()
    first, start, times = time.perf_counter() - t0, time.perf_counter(), []
    while (now := time.perf_counter()) - start < seconds:
        call()
        times.append((now - start, time.perf_counter() - now))
    print(json.dumps({"first": first, "times": times}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--order", default="1,0,0,1", help="TORCH_FLASHSYS_PRECOMPILE per process")
    args = p.parse_args()
    if args.child:
        return child(args.seconds)
    rows = []
    for on in args.order.split(","):
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache, "TORCH_FLASHSYS_PRECOMPILE": on}
            done = subprocess.run([sys.executable, __file__, "--child", "--seconds",
                                   str(args.seconds)], env=env, capture_output=True, text=True,
                                  timeout=300)  # fmt: skip
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            continue
        rows.append((on, json.loads(done.stdout.strip().splitlines()[-1])))
    windows = [(a, b) for a, b in itertools.pairwise(WINDOWS) if a < args.seconds]
    print("| precompile | first call s | " + " | ".join(f"{a}-{b} s: median ms (calls)"
                                                     for a, b in windows) + " |")  # fmt: skip
    for on, r in rows:
        cells = []
        for a, b in windows:
            ms = [dt * 1e3 for t, dt in r["times"] if a <= t < b]
            cells.append(f"{statistics.median(ms):.3f} ({len(ms)})" if ms else "-")
        print(f"| {'on' if on == '1' else 'off'} | {r['first']:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
