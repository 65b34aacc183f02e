"""Compile the Hopper (Gluon) forward for sm90 without a GPU: a stand-in driver that reports a
cuda:90 target, then ``warmup`` (compile, no launch). Run as a script in a fresh process (the
test suite runs the Triton interpreter, and the stand-in driver must not leak into other tests).

    python -m tests.attention.sm90_offline      # prints one line per variant, exit 0 if all compile
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import GPUDriver


class _Sm90Target(GPUDriver):
    """Just enough driver for Triton to compile for an H100 (compute capability 9.0)."""

    def __init__(self):
        self.get_device_capability = lambda *a: (9, 0)
        self.get_current_stream = lambda *a: 0
        self.get_current_device = lambda: 0
        self.set_current_device = lambda d: None

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise NotImplementedError


def compile_variants(variants) -> list[str]:
    """Compile ``(head_dim, causal, dtype)`` variants; one report line each (shared memory,
    registers at launch). Raises on the first that fails."""
    triton.runtime.driver.set_active(_Sm90Target())
    from torch_flashsys.attention import _sm90
    from torch_flashsys.attention._sm90._fwd import attn_fwd_sm90

    lines = []
    for d, causal, dtype in variants:
        q = torch.zeros(1, 4, 256, d, dtype=dtype)
        k = torch.zeros(1, 2, 256, d, dtype=dtype)
        lse = torch.zeros(1, 4, 256)
        descs = (_sm90._descriptor(q, _sm90.BLOCK_M), _sm90._descriptor(k, _sm90.BLOCK_N),
                 _sm90._descriptor(k, _sm90.BLOCK_N), _sm90._descriptor(q, _sm90.BLOCK_M))  # fmt: skip
        kernel = attn_fwd_sm90.warmup(
            *descs, lse, lse.stride(0), lse.stride(1), 4, 4, 2, 256, 256, 0.18, 3,
            CAUSAL=causal, STAGES=_sm90.STAGES[d], num_warps=_sm90.NUM_WARPS,
            maxnreg=_sm90.MAX_REGS, grid=(1,),
        )  # fmt: skip
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx, "not the warp-specialized kernel"
        lines.append(f"d={d} causal={causal} {dtype}: shared memory {kernel.metadata.shared} bytes")
    return lines


if __name__ == "__main__":
    for line in compile_variants([(64, True, torch.float16), (128, False, torch.bfloat16)]):
        print(line)
    sys.exit(0)
