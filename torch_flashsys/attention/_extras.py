"""What flash_attention passes to a backend besides q, k, v and the scale: the score modifications.

``flash_attention`` validates its arguments (``_checks``) and normalizes them here into one
:class:`Extras` whose tensors are views over the 4-D problem ``(batch, heads, seq_q, seq_k)`` (no
copies: broadcast dimensions get stride 0). ``is_causal`` folds into the window as ``right = 0``, so
the backends know one rule: query ``i`` may attend key ``j`` when ``j < seq_k``, ``j >= i - left``
(if ``left >= 0``) and ``j <= i + right`` (if ``right >= 0``), and the boolean mask allows it.

Scores are then ``s = scale * q.k``, ``s = softcap * tanh(s / softcap)`` (softcap > 0),
``s -= slope * |i - j|`` (ALiBi), ``s += mask`` (float mask), and disallowed positions are ``-inf``;
``P = softmax(s)`` (rows with no allowed key give zeros), dropped out with probability
``dropout_p`` (``_dropout``), and ``out = P @ v``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from torch_flashsys.attention._dropout import new_seed


@dataclass(frozen=True)
class Extras:
    mask: torch.Tensor | None = None  # (B, H, L, S) view; bool (True = attend) or floating (added)
    left: int = -1  # keys j >= i - left; -1: unbounded
    right: int = -1  # keys j <= i + right; -1: unbounded (is_causal: 0)
    softcap: float = 0.0  # > 0: s -> softcap * tanh(s / softcap)
    alibi: torch.Tensor | None = None  # (B, H) float32 (float64 inputs: float64): s -= slope*|i-j|
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None  # int64 (1,) on the device, when dropout_p > 0
    # Packed variable-length batch: int32 cumulative lengths (n + 1,) and the longest lengths.
    # q/k/v are then (1, heads, total, head_dim) views of the packed (total, heads, head_dim).
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    # A KV cache: per-sequence numbers of valid keys (B,) int32; key/value hold seq_k >= these.
    # Queries are then the last seq_q positions of each sequence (bottom-right aligned).
    seqused_k: torch.Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None

    @property
    def may_empty_rows(self) -> bool:
        """Whether some query row may have no key to attend (then out = 0, lse = -inf)."""
        # (a packed batch or a KV cache may hold a sequence with no keys)
        return (
            self.mask is not None
            or self.left >= 0
            or self.cu_q is not None
            or self.seqused_k is not None
        )

    @property
    def float_mask(self) -> bool:
        return self.mask is not None and self.mask.dtype != torch.bool


PLAIN = Extras()
CAUSAL = Extras(right=0)
_TENSOR_FIELDS = tuple(f.name for f in fields(Extras) if "Tensor" in str(f.type))


def canonical(ex: Extras) -> Extras:
    """``PLAIN`` or ``CAUSAL`` itself where ``ex`` is an equal copy (the custom ops rebuild
    ``Extras`` from their arguments, and the kernels' rules test identity), else ``ex``."""
    if any(getattr(ex, name) is not None for name in _TENSOR_FIELDS):
        return ex  # (and dataclass equality would compare tensors)
    return next((c for c in (PLAIN, CAUSAL) if ex == c), ex)


def make_extras(
    q4_shape: tuple[int, ...],
    seq_k: int,
    device: torch.device,
    dtype: torch.dtype,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    window_size: tuple[int, int] | None,
    softcap: float | None,
    alibi_slopes: torch.Tensor | None,
) -> Extras:
    """Normalize validated arguments for the 4-D problem of shape ``q4_shape`` (B, H, L, E) whose
    inputs have ``dtype``. A float64 problem (the PyTorch backend) keeps a float64 mask and
    ALiBi slopes in float64; otherwise they become at most 32-bit, what the kernels read."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    batch, heads, seq_q, _ = q4_shape
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    if (
        attn_mask is None
        and not dropout_p
        and not softcap
        and alibi_slopes is None
        and left < 0
        and right < 0
    ):
        return PLAIN
    causal_only = left < 0 and right == 0 and alibi_slopes is None
    if causal_only and attn_mask is None and not dropout_p and not softcap:
        return CAUSAL
    mask = None
    if attn_mask is not None:
        mask = attn_mask
        if mask.dtype not in (torch.bool, torch.float16, torch.bfloat16, torch.float32, wide):
            mask = mask.to(wide)  # e.g. float64 for a float32 problem: the kernels read 32 bits
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        mask = mask.expand(batch, heads, seq_q, seq_k)
    alibi = None
    if alibi_slopes is not None:
        alibi = alibi_slopes.to(wide)
        if alibi.dim() == 1:
            alibi = alibi.unsqueeze(0)
        alibi = alibi.expand(batch, heads)
    p = float(dropout_p)
    return Extras(
        mask=mask,
        left=left,
        right=right,
        softcap=float(softcap or 0.0),
        alibi=alibi,
        dropout_p=p,
        seed=new_seed(device) if p > 0 else None,
    )
