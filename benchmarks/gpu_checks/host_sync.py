"""Where the host waits in flash_attention's fwd+bwd on the GPU (issue 27): host time per phase
without synchronizing, CUDA's sync-debug warnings, and cProfile of one backward call.

    PYTHONPATH=. python3 benchmarks/gpu_checks/host_sync.py
"""

import cProfile
import io
import pstats
import time
import warnings

import torch

from benchmarks._peers import sdpa_call
from torch_flashsys import flash_attention

cudnn = sdpa_call("CUDNN_ATTENTION")

for shape in [(1, 16, 16384, 64), (4, 16, 4096, 64)]:
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    dout = torch.randn_like(q)
    for name, fn in (("ours", flash_attention), ("cudnn", cudnn)):
        for _ in range(3):
            torch.autograd.grad(fn(q, k, v, is_causal=True), (q, k, v), dout)
        torch.cuda.synchronize()
        rows = []
        for _ in range(5):
            t0 = time.perf_counter()
            out = fn(q, k, v, is_causal=True)
            t1 = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), dout)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            rows.append((t1 - t0, t2 - t1, t3 - t0))
        fwd, bwd, tot = (1e3 * sorted(c)[2] for c in zip(*rows, strict=True))
        print(f"| {shape} | {name} | host fwd {fwd:.3f} ms | host bwd {bwd:.3f} ms | "
              f"wall {tot:.3f} ms |")  # fmt: skip
        if name == "ours":
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.autograd.grad(fn(q, k, v, is_causal=True), (q, k, v), dout)
            torch.cuda.set_sync_debug_mode(0)
            print(f"sync warnings: {len(caught)}")
            for w in caught[:5]:
                print("  ", str(w.message)[:300], w.filename, w.lineno)
            out = fn(q, k, v, is_causal=True)
            prof = cProfile.Profile()
            prof.enable()
            torch.autograd.grad(out, (q, k, v), dout)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            print("\n".join(s.getvalue().splitlines()[-22:]))
            torch.cuda.synchronize()
