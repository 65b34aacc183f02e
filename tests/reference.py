"""Float64 references shared by the tests and the benchmarks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _expand_kv(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    return t.repeat_interleave(n_heads // t.shape[-3], dim=-3)


def scores(q, k, is_causal: bool, scale: float | None) -> torch.Tensor:
    """Scaled, causally masked scores (SDPA's top-left alignment) in q's dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ _expand_kv(k, q.shape[-3]).transpose(-1, -2)) * scale
    if is_causal:
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def attention_reference(q, k, v, is_causal=False, scale=None):
    """(out, lse) in float64: out from SDPA's math path, lse = logsumexp of the scaled scores."""
    q64, k64, v64 = (t.double() for t in (q, k, v))
    gqa = q.shape[-3] != k.shape[-3]
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(
            q64, k64, v64, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    return out, scores(q64, k64, is_causal, scale).logsumexp(-1)


def naive_attention(q, k, v, is_causal=False, scale=None):
    """Attention computed plainly in the inputs' dtype: the error baseline PyTorch itself makes."""
    p = torch.softmax(scores(q, k, is_causal, scale), dim=-1)
    return p @ _expand_kv(v, q.shape[-3])


def modded_attention(
    q,
    k,
    v,
    *,
    attn_mask=None,
    is_causal=False,
    scale=None,
    window=None,
    softcap=None,
    alibi=None,
    keep=None,
    dropout_p=0.0,
):
    """Attention with every score modification spelled out, in the inputs' dtype: ``(out, lse)``.

    ``s = scale * q k^T``; ``s = softcap * tanh(s / softcap)``; ``s -= slope * |i - j|`` (ALiBi,
    slopes (H,) or (B, H)); a float mask is added; causal / window (left, right; -1 unbounded) /
    bool mask (True = attend) disallow; ``lse = logsumexp(s)`` (-inf for a row with no allowed
    key, whose output is 0); ``P = softmax(s)``, times ``keep / (1 - dropout_p)`` when a dropout
    keep mask is given; ``out = P v``. Float64 inputs give the float64 reference.
    """
    heads, seq_q, seq_k = q.shape[-3], q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ _expand_kv(k, heads).transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(seq_q, device=q.device)[:, None]
    j = torch.arange(seq_k, device=q.device)[None, :]
    if alibi is not None:
        slopes = alibi.to(s.dtype)
        slopes = slopes.view(*slopes.shape, 1, 1)
        s = s - slopes * (i - j).abs().to(s.dtype)
    allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = allowed & (j <= i)
    if window is not None:
        left, right = window
        if left >= 0:
            allowed = allowed & (j >= i - left)
        if right >= 0:
            allowed = allowed & (j <= i + right)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            s = s + attn_mask.to(s.dtype)
    s = s.masked_fill(~allowed, float("-inf"))
    # Kept finite where s or lse is -inf, also in the gradient (no 0 * NaN).
    empty = (s == float("-inf")).all(-1)
    lse = torch.logsumexp(s.masked_fill(empty[..., None], 0.0), dim=-1)
    lse = lse.masked_fill(empty, float("-inf"))
    lse_safe = lse.masked_fill(empty, 0.0)
    p = torch.exp(s - lse_safe[..., None])  # exp(-inf - finite) = 0, also in the gradient
    if keep is not None:
        p = p * keep.to(p.device) * (1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0)
    out = p.to(v.dtype) @ _expand_kv(v, heads)
    return out, lse
