"""Cold start (``flash.py --first-call``): what a user waits for on the first attention calls.

Per dtype, a fresh process with an empty Triton cache (``TRITON_CACHE_DIR`` a new folder) times
its first ``flash_attention(q, k, v, is_causal=True).sum().backward()`` after CUDA is up, then the
first call at each of 8 new random lengths, then a warm call; SDPA's default (cuDNN on an H100)
does the same in its own fresh process. Rows: ``impl, dtype, case, seconds``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import torch.nn.functional as F
    impl, dtype_name, lengths, shape, device = sys.argv[1:6]
    lengths, shape = json.loads(lengths), json.loads(shape)
    dtype = getattr(torch, dtype_name)
    if impl == "flash_attention":
        from torch_flashsys import flash_attention as attend
    else:
        attend = F.scaled_dot_product_attention
    torch.ones(1, device=device).sum().item()  # CUDA context and allocator up: not ours to count

    def call(n):
        b, h, _, d = shape
        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        attend(q, k, v, is_causal=True).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    rows = [("first call", call(shape[2]))]
    rows += [(f"first call at length {n}", call(n)) for n in lengths]
    rows.append(("warm call", call(shape[2])))
    print(json.dumps(rows))
    """
)


def first_call_rows(dtypes, device: str, smoke: bool = False, seed: int = 0) -> list[dict]:
    """One fresh process per (impl, dtype): its first, new-length and warm fwd+bwd times."""
    shape = [1, 2, 64, 16] if smoke else [2, 8, 2048, 64]
    rng = random.Random(seed)
    lengths = sorted(rng.randint(40, 200) if smoke else rng.randint(100, 16384) for _ in range(8))
    if smoke:
        lengths = lengths[:2]
    rows = []
    for dtype_name in dtypes:
        for impl in ("flash_attention", "sdpa"):
            with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
                env = {**os.environ, "TRITON_CACHE_DIR": cache}
                args = [impl, dtype_name, json.dumps(lengths), json.dumps(shape), device]
                done = subprocess.run(
                    [sys.executable, "-c", _CHILD, *args],
                    env=env, capture_output=True, text=True, timeout=900,
                )  # fmt: skip
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
                rows.append({"impl": impl, "dtype": dtype_name, "case": "first call",
                             "seconds": float("nan"), "error": tail[0][:200]})  # fmt: skip
                continue
            for case, seconds in json.loads(done.stdout.strip().splitlines()[-1]):
                rows.append({"impl": impl, "dtype": dtype_name, "case": case, "seconds": seconds})
    return rows
