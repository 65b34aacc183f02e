"""SM clock and board power while the Hopper kernels run, beside their probes and cuDNN (issue 27).

    PYTHONPATH=. python3 benchmarks/gpu_checks/fwd_clocks.py [--shapes 1x16/16x16384x128c,...]
    PYTHONPATH=. python3 benchmarks/gpu_checks/fwd_clocks.py --backward [--shapes ...]

Per problem (bf16) and implementation: the kernel launched back to back for ``SECONDS`` while
``nvidia-smi`` samples the SM clock and the board's power every 50 ms; reported: ms per call and
the median clock and power of the samples. The implementations: the library's forward, its
measurement-only probes (``benchmarks/sm90_fwd.py``: loads only; no key/value traffic) and cuDNN's
forward. ``--backward``: the fused backward kernel alone and without its dQ work (the
measurement-only probe of ``sm90_bwd.py --variants``), and the whole fwd+bwd of flash_attention
and of cuDNN. Whether a variant runs at another clock than the default (the H100 lowers its clocks at
its power limit) tells whether its time differs by work or by clock.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from benchmarks._peers import sdpa_call
from benchmarks.sm90_bwd import _fused_kernel, _shapes
from benchmarks.sm90_bwd import _problem as _bwd_problem
from benchmarks.sm90_fwd import VARIANTS, _launcher, _problem
from torch_flashsys.attention import _sm90
from torch_flashsys.attention._extras import CAUSAL, PLAIN
from torch_flashsys.attention._ops import _forward

SECONDS = 4.0
IMPLS = ("default", "no K/V loads (probe)", "loads only (probe)")


def sampled(fn, seconds: float) -> dict:
    """``fn`` back to back for ``seconds`` (after a warm-up second) under nvidia-smi sampling."""
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
         "-lms", "50"], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    smi.terminate()
    out = smi.communicate()[0]
    samples = [tuple(map(float, line.split(","))) for line in out.splitlines() if "," in line]
    samples = samples[2:] or samples  # (the first samples can predate the loop)
    return {"ms": 1e3 * elapsed / calls, "mhz": statistics.median(s[0] for s in samples),
            "watts": statistics.median(s[1] for s in samples)}  # fmt: skip


def backward_fns(shape) -> tuple[str, dict]:
    """``(label, {name: fn})``: the fused backward kernel with and without its dQ work, and the
    fwd+bwd of flash_attention and of cuDNN."""
    q, k, v, dout, label, ours = _bwd_problem(shape)
    causal, d = shape[5], shape[4]
    o2, lse = _forward(q, k, v, d**-0.5, CAUSAL if causal else PLAIN)
    no_dq = {"PROBE": 3 if d in _sm90.SPLIT_HEAD_DIMS else 2}
    cudnn = sdpa_call("CUDNN_ATTENTION", is_causal=causal, enable_gqa=shape[1] != shape[2])
    fns = {
        "bwd kernel": _fused_kernel(q, k, v, dout, o2, lse, causal, {})[0],
        "bwd kernel, no dQ (probe)": _fused_kernel(q, k, v, dout, o2, lse, causal, no_dq)[0],
        "fwd+bwd flash_attention": lambda: torch.autograd.grad(ours(q, k, v), (q, k, v), dout),
        "fwd+bwd sdpa cudnn": lambda: torch.autograd.grad(cudnn(q, k, v), (q, k, v), dout),
    }
    for fn in fns.values():
        fn()
    return label, fns


def forward_fns(shape) -> tuple[str, dict]:
    """``(label, {name: fn})``: the forward kernel, its probes and cuDNN's forward."""
    q, k, v, causal, label = _problem(shape)
    fns = {}
    for name in IMPLS:
        launch = _launcher(q, k, v, causal, VARIANTS[name])[0]
        launch()
        fns[name] = launch
    cudnn = sdpa_call("CUDNN_ATTENTION", is_causal=causal, enable_gqa=shape[1] != shape[2])

    def cudnn_fwd():
        with torch.no_grad():
            return cudnn(q, k, v)

    fns["sdpa cudnn"] = cudnn_fwd
    return label, fns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shapes", type=_shapes, default=_shapes("1x16/16x16384x128c,1x16/16x16384x64c")
    )
    p.add_argument("--backward", action="store_true", help="the backward instead (see above)")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| problem | implementation | ms per call | SM MHz (median) | W (median) |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        label, fns = (backward_fns if args.backward else forward_fns)(shape)
        for name, fn in [*fns.items(), *reversed(fns.items())]:  # two passes, opposite orders
            r = sampled(fn, SECONDS / 2)
            print(f"| {label} | {name} | {r['ms']:.3f} | {r['mhz']:.0f} | {r['watts']:.0f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
