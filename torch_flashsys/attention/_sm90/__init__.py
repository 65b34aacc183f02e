"""The Hopper (sm90) fast path: which calls take it, and its launch.

The rule (docs/attention.md, "Hopper fast path"): the forward of a call runs the warp-specialized
Gluon kernel (``_fwd``) when all of these hold, else the portable Triton kernel:

- a CUDA device of compute capability 9.0 (H100, H200) and a Triton whose Gluon API this package
  was written for (3.6; :mod:`._gluon`), and ``TORCH_FLASHSYS_SM90`` is not ``0``;
- float16 or bfloat16, head dim 64 or 128 for query, key and value alike;
- no score modification: causal or not, with GQA, and nothing else (no mask, dropout, window,
  soft-capping, ALiBi, packed batch or KV cache);
- a positive scale, and every stride but the last a multiple of 16 bytes, 16-byte aligned data
  (what TMA descriptors need).

The backward is the portable one (it reads the same ``out`` and ``lse``).
"""

from __future__ import annotations

import functools
import os

import torch

from torch_flashsys.attention._extras import CAUSAL, PLAIN, Extras
from torch_flashsys.attention._sm90._gluon import AVAILABLE, TensorDescriptor, gl
from torch_flashsys.attention._tensors import empty_like_layout

if AVAILABLE:
    from torch_flashsys.attention._sm90._fwd import attn_fwd_sm90

LOG2E = 1.4426950408889634  # log2(e): the kernel's softmax is base 2
BLOCK_M = 64  # query rows per consumer warpgroup (two per program)
BLOCK_N = 128  # key rows per tile
STAGES = {64: 3, 128: 2}  # key/value ring depth per head dim (shared memory: 115 / 164 KB)
NUM_WARPS = 4  # the default partition (consumer 0); the kernel adds 4 + 1 worker warps
MAX_REGS = 168  # registers per thread at launch: 168 x 384 threads fills the register file
_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


# Read once at import (a per-call environment lookup would cost host time on every call).
ENABLED = AVAILABLE and os.environ.get("TORCH_FLASHSYS_SM90", "1") != "0"


def enabled() -> bool:
    """Whether the Hopper path may run at all (Gluon available, not switched off)."""
    return ENABLED


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _tma_ok(t: torch.Tensor) -> bool:
    """16-byte aligned data and strides (but the last, which must be 1): a TMA descriptor."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    step = 16 // t.element_size()
    return all(s % step == 0 for s in t.stride()[:-1])


def forward_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  ex: Extras) -> bool:  # fmt: skip
    """Whether the forward of this 4-D problem runs on the Hopper kernel (the rule above)."""
    if not (ex is PLAIN or ex is CAUSAL) or scale <= 0 or q.dtype not in _GL_DTYPES:
        return False
    d = q.shape[-1]
    if d not in STAGES or k.shape[-1] != d or v.shape[-1] != d or not q.is_cuda:
        return False
    if not enabled() or not _is_sm90(q.get_device()):
        return False
    return _tma_ok(q) and _tma_ok(k) and _tma_ok(v)


@functools.cache
def _layout(rows: int, d: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], getattr(gl, _GL_DTYPES[dtype]))


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    d = t.shape[-1]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d],
                            _layout(rows, d, t.dtype))  # fmt: skip


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out, lse)`` of a 4-D problem :func:`forward_takes` accepted: out in q's layout, lse
    float32 (B, H, L), natural log."""
    batch, heads, seq_q, d = q.shape
    out = empty_like_layout(q, d)
    lse = q.new_empty((batch, heads, seq_q), dtype=torch.float32)
    n_tiles = triton_cdiv(seq_q, 2 * BLOCK_M)
    grid = (n_tiles * batch * heads,)
    with torch.cuda.device(q.device):
        attn_fwd_sm90[grid](
            _descriptor(q, BLOCK_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), out, lse,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            heads, heads // k.shape[1], seq_q, k.shape[2], scale * LOG2E,
            CAUSAL=causal, STAGES=STAGES[d], num_warps=NUM_WARPS, maxnreg=MAX_REGS,
        )  # fmt: skip
    return out, lse


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
