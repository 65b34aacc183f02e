"""Attention dropout's random numbers: counter-based Philox4x32-10, the same in both backends.

Element (b, h, i, j) of the attention probabilities (query ``i``, key ``j``, ``bh = b * heads +
h``) is kept when the first output of ``Philox4x32-10(key=seed, counter=(j, i, bh, 0))`` is at
least ``threshold = round(p * 2**32)``, so it is kept with probability ``1 - p``; kept values are
scaled by ``1 / (1 - p)``. The Triton kernels call ``tl.philox`` with exactly these counters; this
module computes the same stream in PyTorch integer arithmetic for the torch backend and for tests
(:func:`dropout_keep_mask` is the test-only way to read the mask a call used). Nothing is stored
between forward and backward: the backward regenerates the mask from the seed.

The seed is drawn per call from PyTorch's generator on the inputs' device (``torch.randint``), so
``torch.manual_seed`` reproduces a run and CUDA-graph replays draw fresh seeds.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Weyl increments of the key
ROUNDS = 10  # tl.philox's default


def new_seed(device: torch.device) -> torch.Tensor:
    """A fresh non-negative int64 seed, shape (1,), from the default generator of ``device``."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


def keep_threshold(p: float) -> int:
    """Unsigned 32-bit threshold: a random word ``r`` keeps its element when ``r >= threshold``."""
    return min(round(p * 2**32), _M32)


def as_int32(value: int) -> int:
    """The signed 32-bit integer with the same bits as the unsigned ``value`` (kernel argument)."""
    return value - 2**32 if value >= 2**31 else value


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` for a 32-bit constant and int64 tensors of 32-bit values
    (16-bit limbs: every partial product fits in int64)."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    b_lo, b_hi = b & 0xFFFF, b >> 16
    ll, hl, lh, hh = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    cross = (ll >> 16) + (hl & 0xFFFF) + (lh & 0xFFFF)
    hi = (hh + (hl >> 16) + (lh >> 16) + (cross >> 16)) & _M32
    lo = ((cross & 0xFFFF) << 16) | (ll & 0xFFFF)
    return hi, lo


def philox_first_word(
    seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor
) -> torch.Tensor:
    """First output word of Philox4x32-10 for counters ``(c0, c1, c2, 0)`` (int64 tensors holding
    32-bit values, broadcastable) and a 64-bit ``seed``; as ``tl.philox`` computes it."""
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape)
    c0, c1, c2 = (c.expand(shape).to(torch.int64) & _M32 for c in (c0, c1, c2))
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(ROUNDS):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0


def keep_tile(
    seed: int, bh: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, threshold: int
) -> torch.Tensor:
    """Keep mask for query indices ``rows`` and key indices ``cols`` of heads ``bh`` (broadcast)."""
    return philox_first_word(seed, cols, rows, bh) >= threshold


def dropout_keep_mask(
    seed: torch.Tensor | int, batch: int, heads: int, seq_q: int, seq_k: int, p: float
) -> torch.Tensor:
    """The (batch, heads, seq_q, seq_k) bool keep mask a call with this seed used (CPU tensor)."""
    seed = int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed)
    bh = torch.arange(batch * heads).view(batch, heads, 1, 1)
    rows = torch.arange(seq_q).view(1, 1, seq_q, 1)
    cols = torch.arange(seq_k).view(1, 1, 1, seq_k)
    return keep_tile(seed, bh, rows, cols, keep_threshold(p))
