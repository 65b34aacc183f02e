"""Fused attention: :func:`flash_attention` (FlashAttention-2) and the :class:`FlashAttention` module."""

from __future__ import annotations

import math

import torch

from torch_flashsys.attention._checks import check_inputs
from torch_flashsys.attention._dropin import (
    disable_sdpa_override,
    enable_sdpa_override,
    replace_attention,
    sdpa_override,
)
from torch_flashsys.attention.module import FlashAttention

__all__ = [
    "FlashAttention",
    "disable_sdpa_override",
    "enable_sdpa_override",
    "flash_attention",
    "replace_attention",
    "sdpa_override",
]


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2: ``softmax(query @ key.T * scale) @ value`` without materialising the scores.

    A drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` (same argument names and
    semantics) with memory linear in the sequence length, differentiable in query, key and value.

    Args:
        query: ``(batch, heads, seq_q, head_dim)`` or ``(batch, seq_q, head_dim)``.
        key: ``(batch, kv_heads, seq_k, head_dim)`` or ``(batch, seq_k, head_dim)``.
        value: same shape as ``key``.
        attn_mask: not supported; must be ``None`` (raises ``NotImplementedError``).
        dropout_p: must be ``0.0`` (dropout raises ``NotImplementedError``).
        is_causal: query ``i`` attends to keys ``j <= i`` (top-left aligned, as in
            ``scaled_dot_product_attention``, also when ``seq_q != seq_k``).
        scale: multiplies the scores; default ``1 / sqrt(head_dim)``.
        enable_gqa: allow ``kv_heads < heads`` (grouped-query / multi-query attention): query head
            ``h`` uses key/value head ``h // (heads // kv_heads)``.
        backend: ``"triton"`` (Triton kernels: CUDA tensors, or CPU tensors under
            ``TRITON_INTERPRET=1``), ``"torch"`` (pure-PyTorch tiled FlashAttention-2, any device), or
            ``"auto"`` (Triton where it can run, else torch).
        return_lse: also return the logsumexp of the scaled scores, float32, shape
            ``query.shape[:-1]``.

    Returns:
        ``out`` with the shape, dtype and memory layout of ``query``; ``(out, lse)`` when
        ``return_lse``.

    Dtypes are float16, bfloat16 and float32 (float32 dots are full precision unless TF32 is
    allowed, e.g. ``torch.backends.cuda.matmul.allow_tf32 = True``, read at each call).
    Under ``torch.autocast``, query, key and value are first cast to the autocast dtype, as
    ``scaled_dot_product_attention`` does.
    The Triton backend takes head dims 16..256 that are multiples of 8.

    Example:
        >>> q, k, v = (torch.randn(2, 4, 128, 64) for _ in range(3))
        >>> out = flash_attention(q, k, v, is_causal=True, backend="torch")
        >>> out.shape
        torch.Size([2, 4, 128, 64])
    """
    query, key, value = _autocast(query, key, value)
    resolved = check_inputs(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend
    )
    sm_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if resolved == "triton":
        from torch_flashsys.attention._ops import triton_attention

        out, lse = triton_attention(query, key, value, is_causal, sm_scale)
    else:
        from torch_flashsys.attention._torch_impl import TiledAttention

        out, lse = TiledAttention.apply(query, key, value, is_causal, sm_scale)
    return (out, lse) if return_lse else out


_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inside ``torch.autocast``: cast to the autocast dtype, as autocast does for SDPA."""
    if not _any_autocast():  # the common case, checked in one cheap call
        return tensors
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors  # check_inputs names the offending argument
    device_type = tensors[0].device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.dtype in _AUTOCAST_ELIGIBLE else t for t in tensors)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
