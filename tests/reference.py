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
