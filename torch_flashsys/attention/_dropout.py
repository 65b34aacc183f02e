"""Attention dropout's random numbers: counter-based Philox4x32-10, the same in both backends.

Element (b, h, i, j) of the attention probabilities (query ``i``, key ``j``, ``bh = b * heads +
h``) takes byte ``j % 4`` of word ``(j % 16) // 4`` of ``Philox4x32-10(key=seed, counter=(j // 16,
i, bh, 0))``: one Philox call serves 16 neighbouring keys (the random numbers were most of the cost
of dropout when every element had its own call). The element is kept when its byte is at least
``threshold = round(256 * p)`` (at least 1 when ``p > 0``), so the dropout probability is ``p``
rounded to a multiple of 1/256 (as in flash-attn and SDPA's FlashAttention backend, which also
compare 8-bit random numbers); kept values are scaled by ``1 / (1 - threshold / 256)``, which keeps
the expectation exact. The Triton kernels call ``tl.philox`` with exactly these counters; this
module computes the same bytes in PyTorch integer arithmetic for the torch backend and for tests
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
    """8-bit threshold: an element whose random byte is ``>= threshold`` is kept (256: none)."""
    if p <= 0:
        return 0
    return min(max(round(p * 256), 1), 256)


def effective_p(p: float) -> float:
    """The dropout probability a call with ``dropout_p = p`` applies: ``p`` rounded to 1/256."""
    return keep_threshold(p) / 256


def keep_scale(p: float) -> float:
    """The factor kept probabilities are multiplied by: ``1 / (1 - effective_p(p))`` (0 if none
    is kept)."""
    t = keep_threshold(p)
    return 256 / (256 - t) if t < 256 else 0.0


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


def philox_words(
    seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four output words of Philox4x32-10 for counters ``(c0, c1, c2, 0)`` (int64 tensors
    holding 32-bit values, broadcastable) and a 64-bit ``seed``; as ``tl.philox`` computes them."""
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape)
    c0, c1, c2 = (c.expand(shape).to(torch.int64) & _M32 for c in (c0, c1, c2))
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(ROUNDS):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def keep_tile(
    seed: int, bh: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, threshold: int
) -> torch.Tensor:
    """Keep mask for query indices ``rows`` and key indices ``cols`` of heads ``bh`` (broadcast)."""
    cols = cols.to(torch.int64)
    words = torch.stack(philox_words(seed, cols // 16, rows, bh))  # (4, *shape)
    pos = (cols % 16).expand(words.shape[1:])
    word = torch.gather(words, 0, (pos // 4).unsqueeze(0)).squeeze(0)
    return ((word >> (8 * (pos % 4))) & 0xFF) >= threshold


def dropout_keep_mask(
    seed: torch.Tensor | int, batch: int, heads: int, seq_q: int, seq_k: int, p: float
) -> torch.Tensor:
    """The (batch, heads, seq_q, seq_k) bool keep mask a call with this seed used (CPU tensor)."""
    seed = int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed)
    bh = torch.arange(batch * heads).view(batch, heads, 1, 1)
    rows = torch.arange(seq_q).view(1, 1, seq_q, 1)
    cols = torch.arange(seq_k).view(1, 1, 1, seq_k)
    return keep_tile(seed, bh, rows, cols, keep_threshold(p))
