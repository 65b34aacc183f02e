"""Fused attention: :func:`flash_attention` (FlashAttention-2) and the :class:`FlashAttention` module."""

from __future__ import annotations

import math

import torch

from torch_flashsys.attention._checks import check_inputs, softmax_scale
from torch_flashsys.attention._dropin import (
    disable_sdpa_override,
    enable_sdpa_override,
    replace_attention,
    sdpa_override,
)
from torch_flashsys.attention._extras import make_extras
from torch_flashsys.attention._kvcache import KVCache
from torch_flashsys.attention.module import FlashAttention

__all__ = [
    "FlashAttention",
    "KVCache",
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
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    cache_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2: ``softmax(query @ key.T * scale) @ value`` without materialising the scores.

    A drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` (same argument names and
    semantics) with memory linear in the sequence length, differentiable in query, key and value,
    twice too: a backward under ``create_graph=True`` (a gradient penalty) runs through
    differentiable PyTorch ops (slower, memory quadratic in the length) so a second backward is
    exact.

    Args:
        query: ``(batch, heads, seq_q, head_dim)``; also ``(batch, seq_q, head_dim)``,
            ``(seq_q, head_dim)`` and several leading batch dimensions ``(..., heads, seq_q,
            head_dim)``, as SDPA takes them (no broadcasting between q and k/v).
        key: ``(..., kv_heads, seq_k, head_dim)``; ``seq_k`` may be 0 (output zeros).
        value: ``(..., kv_heads, seq_k, head_dim_v)``; ``head_dim_v`` may differ from the
            query/key head dim (e.g. 128 with 192 for MLA models).
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
        scale: multiplies the scores; default ``1 / sqrt(head_dim)``. Like SDPA, also an int, a
            numpy scalar or a 0-d tensor (read on the host; no gradient).
        enable_gqa: allow ``kv_heads < heads`` (grouped-query / multi-query attention): query head
            ``h`` uses key/value head ``h // (heads // kv_heads)``.
        window_size: ``(left, right)``: query ``i`` attends keys ``i - left <= j <= i + right``
            (``-1``: unbounded on that side; top-left aligned like ``is_causal``; with
            ``is_causal`` the right side is 0). Key tiles outside the window are skipped, so the
            cost grows with the window, not the sequence (as flash-attn's ``window_size``).
        softcap: ``> 0``: scores ``s`` become ``softcap * tanh(s / softcap)`` (Gemma 2), applied to
            the scaled scores before ALiBi and the mask. ``None``: off (flash-attn's ``0.0``).
        alibi_slopes: ``(heads,)`` or ``(batch, heads)`` (batch: the product of the leading
            dimensions): adds ``-slope * |i - j|`` to the scaled scores (ALiBi, as flash-attn's
            ``alibi_slopes`` when ``seq_q == seq_k``).
        cu_seqlens_q, cu_seqlens_k: a packed batch, as flash-attn's ``flash_attn_varlen_func``:
            query ``(total_q, heads, head_dim)``, key/value ``(total_k, kv_heads, head_dim)`` hold
            the sequences back to back; these int32 (or int64) ``(n + 1,)`` tensors are their
            cumulative lengths (starting at 0). No sequence attends across a boundary; causal
            and windows are top-left aligned within each sequence. Output ``(total_q, heads,
            head_dim_v)``. Nested tensors (``layout=torch.jagged``, (batch, heads, j, dim) as SDPA
            takes them) are packed batches too and give a nested output.
        max_seqlen_q, max_seqlen_k: the longest sequences. Optional; passing them on CUDA avoids
            reading the lengths on the host (the checks of ``cu_seqlens`` then run on the GPU).
        cache_seqlens: decoding with a KV cache, as flash-attn's ``flash_attn_with_kvcache``:
            key/value are pre-allocated caches ``(batch, kv_heads, capacity, head_dim)`` of which
            the first ``cache_seqlens[b]`` positions (int32 ``(batch,)``, each in ``[seq_q,
            capacity]``; checked on the GPU for CUDA tensors) are valid; the
            ``seq_q`` queries are the last ``seq_q`` of those positions (bottom-right aligned:
            with ``is_causal``, query ``i`` attends keys ``j <= cache_seqlens[b] - seq_q + i``).
            Up to 128 query rows per key/value head (e.g. 1-16 new tokens) run a split-KV
            kernel that spreads the cache over the whole GPU. Forward only.
        backend: ``"triton"`` (Triton kernels: CUDA tensors, or CPU tensors under
            ``TRITON_INTERPRET=1`` through the slow interpreter, which raises for bfloat16),
            ``"torch"`` (pure-PyTorch tiled FlashAttention-2, any device), or ``"auto"`` (Triton
            for CUDA tensors unless ``TRITON_INTERPRET=1``; torch for CPU tensors and float64).
        return_lse: also return the logsumexp of the scaled, modified scores (before dropout),
            float32 (float64 for float64 inputs), shape ``query.shape[:-1]``; ``-inf`` for rows
            with no allowed key.

    Returns:
        ``out`` with the shape (last dimension ``head_dim_v``), dtype and memory layout of
        ``query``; ``(out, lse)`` when ``return_lse``.

    DTensor inputs (tensor parallelism, e.g. after ``parallelize_module`` with column-parallel
    q/k/v projections) sharded on the head dimension (``Shard(heads_dim)``, or replicated) run on
    each rank's local heads with no communication and return DTensors with the same placements;
    other layouts raise ``ValueError`` (redistribute first), and masks, ALiBi, packed batches and
    KV caches raise ``NotImplementedError`` with DTensors. With dropout the random numbers
    depend on the local head index, so they differ from a plain call's (same distribution).

    Dtypes are float16, bfloat16 and float32 (float32 dots are full precision unless TF32 is
    allowed, e.g. ``torch.backends.cuda.matmul.allow_tf32 = True``, read at each call), and
    float64 through the PyTorch backend (``"auto"`` picks it; for ``torch.autograd.gradcheck``).
    Under ``torch.autocast``, query, key and value are first cast to the autocast dtype, as
    ``scaled_dot_product_attention`` does. ``torch.compile(fullgraph=True)``, ``torch.func.grad``,
    ``vjp`` and ``vmap`` work on both backends (limits: docs/attention.md).
    The Triton backend takes head dims 16..256 that are multiples of 8; head dim 0 gives SDPA's
    result (uniform weights over the allowed keys, or an empty output) on any backend.

    Example:
        >>> q, k, v = (torch.randn(2, 4, 128, 64) for _ in range(3))
        >>> out = flash_attention(q, k, v, is_causal=True, backend="torch")
        >>> out.shape
        torch.Size([2, 4, 128, 64])
        >>> pad = torch.ones(2, 1, 1, 128, dtype=torch.bool); pad[1, ..., 100:] = False
        >>> out = flash_attention(q, k, v, attn_mask=pad, window_size=(32, 0), backend="torch")
    """
    if query.__class__ is not torch.Tensor and _is_dtensor(query):
        return _dtensor_call(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
            softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            cache_seqlens, backend, return_lse,
        )  # fmt: skip
    if isinstance(query, torch.Tensor) and query.is_nested:
        from torch_flashsys.attention._varlen import nested_attention

        kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal,
                  "scale": scale, "enable_gqa": enable_gqa, "window_size": window_size,
                  "softcap": softcap, "alibi_slopes": alibi_slopes, "backend": backend}  # fmt: skip
        out, lse = nested_attention(query, key, value, kwargs, _run)
        return (out, lse) if return_lse else out
    query, key, value = _autocast(query, key, value)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        from torch_flashsys.attention._varlen import packed_attention

        out, lse = packed_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
            softcap, alibi_slopes, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, _run,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    resolved = check_inputs(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
        window_size, softcap, alibi_slopes,
    )  # fmt: skip
    sm_scale = softmax_scale(scale, query.shape[-1])
    mods = (dropout_p, is_causal, window_size, softcap, alibi_slopes)
    if cache_seqlens is not None:
        from torch_flashsys.attention._cache import cached_attention

        out, lse = cached_attention(
            query, key, value, attn_mask, mods, sm_scale, resolved, cache_seqlens
        )
        return (out, lse) if return_lse else out
    if query.dim() in (3, 4):
        out, lse = _attend(query, key, value, attn_mask, mods, sm_scale, resolved)
        return (out, lse) if return_lse else out
    # 2-D, or several leading batch dimensions: the same problem on 4-D views
    q4, k4, v4 = (_as_4d(t) for t in (query, key, value))
    mask4 = attn_mask
    if attn_mask is not None and query.dim() > 4:
        mask4 = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        mask4 = mask4.reshape(-1, *mask4.shape[-3:])
    out, lse = _attend(q4, k4, v4, mask4, mods, sm_scale, resolved)
    out = out.reshape(*query.shape[:-1], value.shape[-1])
    lse = lse.reshape(query.shape[:-1])
    return (out, lse) if return_lse else out


def _dtensor_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                  window_size, softcap, alibi_slopes, cu_q, cu_k, max_q, max_k, cache_seqlens,
                  backend, return_lse):  # fmt: skip
    """DTensor inputs sharded on the head dimension: flash_attention on the local heads."""
    from torch_flashsys.attention._dtensor import dtensor_attention

    kwargs = {"dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
              "enable_gqa": enable_gqa, "window_size": window_size, "softcap": softcap,
              "backend": backend, "return_lse": True}  # fmt: skip
    extra = {"attn_mask": attn_mask, "alibi_slopes": alibi_slopes, "cu_seqlens_q": cu_q,
             "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
             "cache_seqlens": cache_seqlens}  # fmt: skip
    out, lse = dtensor_attention(query, key, value, flash_attention, kwargs, extra)
    return (out, lse) if return_lse else out


def _is_dtensor(t: object) -> bool:
    from torch_flashsys.attention._dtensor import is_dtensor

    return is_dtensor(t)


def _attend(query, key, value, attn_mask, mods, sm_scale: float, backend: str):
    """The validated 3-D/4-D problem on ``backend``: ``(out, lse)``."""
    q4_shape = query.shape if query.dim() == 4 else (1, *query.shape)
    ex = make_extras(q4_shape, key.shape[-2], query.device, query.dtype, attn_mask, *mods)
    return _run(query, key, value, ex, sm_scale, backend)


def _run(query, key, value, ex, sm_scale: float, backend: str):
    if backend == "triton":
        from torch_flashsys.attention._ops import triton_attention

        return triton_attention(query, key, value, sm_scale, ex)
    from torch_flashsys.attention._torch_impl import TiledAttention

    if torch.compiler.is_compiling():  # Dynamo refuses one tensor passed to a Function twice
        key = key.view_as(key) if key is query else key
        value = value.view_as(value) if value is query or value is key else value
    return TiledAttention.apply(query, key, value, sm_scale, ex)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(seq, dim) -> (1, 1, seq, dim); (..., heads, seq, dim) -> (batch, heads, seq, dim)."""
    if t.dim() == 2:
        return t.view(1, 1, *t.shape)
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


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
