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
from torch_flashsys.attention._extras import make_extras
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
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
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
        attn_mask: broadcastable to ``query.shape[:-1] + (seq_k,)``, e.g. a key-padding mask
            ``(batch, 1, 1, seq_k)``; bool (True = take part in attention) or float (added to the
            scaled scores), as in SDPA. Never materialised at full size. Rows with no allowed key
            give zeros (SDPA's result). Composes with ``is_causal`` (both apply, as SDPA's CPU
            kernel does; its math path raises).
            It gets no gradient: a mask that requires one raises ``NotImplementedError``.
        dropout_p: dropout probability on the attention weights, applied whenever > 0 (as in SDPA;
            pass 0.0 in evaluation). Random numbers from PyTorch's generator on the inputs' device
            (``torch.manual_seed`` reproduces a run), regenerated in the backward, never stored.
        is_causal: query ``i`` attends to keys ``j <= i`` (top-left aligned, as in
            ``scaled_dot_product_attention``, also when ``seq_q != seq_k``).
        scale: multiplies the scores; default ``1 / sqrt(head_dim)``.
        enable_gqa: allow ``kv_heads < heads`` (grouped-query / multi-query attention): query head
            ``h`` uses key/value head ``h // (heads // kv_heads)``.
        window_size: ``(left, right)``: query ``i`` attends keys ``i - left <= j <= i + right``
            (``-1``: unbounded on that side; top-left aligned like ``is_causal``; with
            ``is_causal`` the right side is 0). Key tiles outside the window are skipped, so the
            cost grows with the window, not the sequence (as flash-attn's ``window_size``).
        softcap: ``> 0``: scores ``s`` become ``softcap * tanh(s / softcap)`` (Gemma 2), applied to
            the scaled scores before ALiBi and the mask. ``None`` or ``0``: off.
        alibi_slopes: ``(heads,)`` or ``(batch, heads)``: adds ``-slope * |i - j|`` to the scaled
            scores (ALiBi, as flash-attn's ``alibi_slopes`` when ``seq_q == seq_k``).
        backend: ``"triton"`` (Triton kernels: CUDA tensors, or CPU tensors under
            ``TRITON_INTERPRET=1``), ``"torch"`` (pure-PyTorch tiled FlashAttention-2, any device), or
            ``"auto"`` (Triton where it can run, else torch).
        return_lse: also return the logsumexp of the scaled, modified scores (before dropout),
            float32, shape ``query.shape[:-1]``; ``-inf`` for rows with no allowed key.

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
        >>> pad = torch.ones(2, 1, 1, 128, dtype=torch.bool); pad[1, ..., 100:] = False
        >>> out = flash_attention(q, k, v, attn_mask=pad, window_size=(32, 0), backend="torch")
    """
    query, key, value = _autocast(query, key, value)
    resolved = check_inputs(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
        window_size, softcap, alibi_slopes,
    )  # fmt: skip
    sm_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    q4_shape = query.shape if query.dim() == 4 else (1, *query.shape)
    ex = make_extras(
        q4_shape, key.shape[-2], query.device, attn_mask, dropout_p, is_causal, window_size,
        softcap, alibi_slopes,
    )  # fmt: skip
    if resolved == "triton":
        from torch_flashsys.attention._ops import triton_attention

        out, lse = triton_attention(query, key, value, sm_scale, ex)
    else:
        from torch_flashsys.attention._torch_impl import TiledAttention

        out, lse = TiledAttention.apply(query, key, value, sm_scale, ex)
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
