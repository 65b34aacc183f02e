"""Cold start (``flash.py --first-call``): per dtype, the first fwd+bwd in a fresh process with an
empty Triton cache, the background compiles it queues (the builds other lengths take: the wait for
them, a row of its own), the first call at 8 new random lengths and a warm call; SDPA's default
beside it, in its own fresh process. Rows ``impl, dtype, case, seconds``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUN_CHILD = "import sys; from benchmarks._startup import _child; _child(*sys.argv[1:])"


def _child(impl: str, dtype_name: str, lengths: str, shape: str, device: str) -> None:
    """In the fresh process: print the JSON list of (case, seconds)."""
    import torch
    import torch.nn.functional as F

    import torch_flashsys.attention._precompile as _precompile

    (b, h, n, d), dtype = json.loads(shape), getattr(torch, dtype_name)
    if impl == "flash_attention":
        from torch_flashsys import flash_attention as attend
    else:
        attend = F.scaled_dot_product_attention
    torch.ones(1, device=device).sum().item()  # CUDA context and allocator up: not ours to count

    def seconds(n: int) -> float:
        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()  # (not samples_ms: its sync waits for background compiles)
        attend(q, k, v, is_causal=True).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    rows = [("first call", seconds(n))]
    if impl == "flash_attention":  # the builds other lengths take, compiled in the background
        start = time.perf_counter()
        _precompile.wait()
        rows.append(("background compiles after the first call", time.perf_counter() - start))
    rows += [(f"first call at length {m}", seconds(m)) for m in json.loads(lengths)]
    rows.append(("warm call", seconds(n)))
    print(json.dumps(rows))


def first_call_rows(dtypes, device: str, smoke: bool = False, seed: int = 0) -> list[dict]:
    """One fresh process per (impl, dtype): its first, new-length and warm fwd+bwd times."""
    shape = [1, 2, 64, 16] if smoke else [2, 8, 2048, 64]
    rng = random.Random(seed)
    lengths = sorted(rng.randint(40, 200) if smoke else rng.randint(100, 16384) for _ in range(8))
    lengths = lengths[:2] if smoke else lengths
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    rows = []
    for dtype_name, impl in [(t, i) for t in dtypes for i in ("flash_attention", "sdpa")]:
        base = {"impl": impl, "dtype": dtype_name}
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": path}
            args = [impl, dtype_name, json.dumps(lengths), json.dumps(shape), device]
            done = subprocess.run([sys.executable, "-c", _RUN_CHILD, *args], env=env,
                                  capture_output=True, text=True, timeout=900)  # fmt: skip
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            rows.append({**base, "case": "first call", "seconds": float("nan"), "error": tail[0]})
            continue
        for case, seconds in json.loads(done.stdout.strip().splitlines()[-1]):
            rows.append({**base, "case": case, "seconds": seconds})
    return rows
