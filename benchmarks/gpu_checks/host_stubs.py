"""Where an eager fwd+bwd call's host time goes on the Hopper path (issue 27): wall microseconds
per call of an unsynchronized loop on a problem whose GPU work is small ((1, 2, 1024, 64)
causal: the dynamic forward and the fused backward, as the grid's 1024-2048 rows), with parts of
the library's path replaced by stubs that return preallocated results, or with autograd's
multithreading off (the backward on the calling thread), beside cuDNN, a trivial op and a
trivial Python autograd Function; then our backward timed and cProfiled inside autograd (on its
thread) and called directly, and the forward's cProfile (profiler-inflated).

    PYTHONPATH=. python3 benchmarks/gpu_checks/host_stubs.py [--calls N] [--rounds R]
        [--only NAME,...]    (R rounds of the cases in alternating order, their medians)
"""

import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from unittest import mock

import torch

import torch_flashsys.attention._ops as ops
import torch_flashsys.attention._sm90 as sm
from benchmarks import _peers
from benchmarks._harness import host_us, markdown_table
from torch_flashsys import flash_attention
from torch_flashsys.attention._autograd import Kernels
from torch_flashsys.attention._extras import CAUSAL

SHAPE = (1, 2, 1024, 64)


class _Trivial(torch.autograd.Function):
    """A Python Function with our Function's shape of work: outputs allocated, nothing launched."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def main() -> None:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 500
    q, k, v, dout = _peers.inputs(SHAPE, torch.bfloat16, "cuda", seed=1)
    ours = lambda q, k, v: flash_attention(q, k, v, is_causal=True)
    fwd_out = ours(q, k, v)  # (compiles; the stubs' preallocated results)
    lse = q.new_empty(SHAPE[:-1], dtype=torch.float32)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    stub_bwd = lambda *a, **kw: grads  # (stands in for _sm90.backward or _ops._backward)
    stub_fwd = lambda q, k, v, scale, ex: (fwd_out.detach(), lse)
    cases = {
        "ours fwd+bwd (the kept backward)": (ours, None),
        "ours fwd+bwd, the general backward (nothing kept)": (
            ours, lambda: mock.patch.object(sm, "kept_backward", lambda *a: None)),
        "ours fwd+bwd, _sm90.backward a stub": (
            ours, lambda: mock.patch.object(sm, "backward", stub_bwd)),
        "ours fwd+bwd, the whole kernel backward a stub": (
            ours, lambda: mock.patch.object(ops, "_backward", stub_bwd)),
        "ours fwd+bwd, forward and backward stubs (dispatch + autograd only)": (
            ours, lambda: mock.patch.object(ops, "TRITON", Kernels(stub_fwd, stub_bwd))),
        # the backward on the calling thread, not autograd's device thread (the context
        # manager takes effect when made: made in the loop, by these lambdas)
        "ours fwd+bwd, autograd multithreading off": (
            ours, lambda: torch.autograd.set_multithreading_enabled(False)),
        "sdpa cudnn fwd+bwd": (_peers.sdpa_call("CUDNN_ATTENTION", is_causal=True), None),
        "sdpa cudnn fwd+bwd, autograd multithreading off": (
            _peers.sdpa_call("CUDNN_ATTENTION", is_causal=True),
            lambda: torch.autograd.set_multithreading_enabled(False)),
        "trivial Python Function fwd+bwd": (lambda q, k, v: _Trivial.apply(q, k, v), None),
        "floor: q * 1.0 fwd+bwd": (lambda q, k, v: q * 1.0, None),
    }  # fmt: skip
    if "--only" in sys.argv:  # cases whose names contain one of these (comma-separated)
        only = sys.argv[sys.argv.index("--only") + 1].split(",")
        cases = {n: c for n, c in cases.items() if any(part in n for part in only)}
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 1
    times: dict[str, list[dict]] = {name: [] for name in cases}
    for r in range(rounds):  # the cases in turn, in alternating order: their medians
        for name, (fn, patch) in list(cases.items())[:: 1 if r % 2 == 0 else -1]:
            step = _peers.fwd_bwd(fn, (q, k, v), dout)
            with patch() if patch is not None else contextlib.nullcontext():
                res = host_us(step, calls, warmup=20)
                with torch.no_grad():
                    fwd = host_us(lambda fn=fn: fn(q, k, v), calls, warmup=20)
            times[name].append({"fwd+bwd wall us": res["wall_us"], "fwd+bwd cpu us": res["cpu_us"],
                                "fwd no_grad wall us": fwd["wall_us"]})  # fmt: skip
    rows = []
    for name, runs in times.items():
        walls = [t["fwd+bwd wall us"] for t in runs]
        rows.append({"case": name, **{key: statistics.median(t[key] for t in runs)
                                      for key in runs[0]},
                     "wall us min-max": f"{min(walls):.0f}-{max(walls):.0f}"})  # fmt: skip
    print(markdown_table(rows, list(rows[0])))
    # cProfile sees the calling thread only, and autograd runs a CUDA backward on its own
    # thread: the forward (grad on) and our backward (called directly) are profiled apart.
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = ops._forward(qd, kd, vd, SHAPE[-1] ** -0.5, CAUSAL)
    scale = SHAPE[-1] ** -0.5
    parts = {
        "forward, grad on (main thread)": lambda: ours(q, k, v),
        "our backward (_kernel_backward, called directly)": lambda: ops._kernel_backward(
            dout, qd, kd, vd, out, lse, None, scale, CAUSAL),
    }  # fmt: skip
    # Our backward as autograd runs it (its engine thread) against the same call made directly:
    # wall time inside it per call, then its cProfile on that thread.
    direct = host_us(parts["our backward (_kernel_backward, called directly)"], calls, 20)
    inside: list[float] = []
    prof = cProfile.Profile()
    profiling = [False]

    def timed_backward(*args):
        start = time.perf_counter()
        if profiling[0]:
            prof.enable()
        try:
            return ops._kernel_backward(*args)
        finally:
            if profiling[0]:
                prof.disable()
            inside.append(time.perf_counter() - start)

    step = _peers.fwd_bwd(ours, (q, k, v), dout)
    with mock.patch.object(ops, "TRITON", Kernels(ops._forward, timed_backward)):
        whole = host_us(step, calls, 20)
        n = len(inside)
        print(f"our backward, direct call: {direct['wall_us']:.0f} us a call; inside autograd: "
              f"{sum(inside[-calls:]) / calls * 1e6:.0f} us a call inside it, the fwd+bwd "
              f"{whole['wall_us']:.0f} us ({n} calls)")  # fmt: skip
        profiling[0] = True
        for _ in range(min(200, calls)):
            step()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    print(f"== cProfile, {min(200, calls)} calls: our backward on autograd's thread")
    print(text.getvalue())
    for name, fn in parts.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(min(200, calls)):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        print(f"== cProfile, {min(200, calls)} calls: {name}")
        print(text.getvalue())


if __name__ == "__main__":
    main()
