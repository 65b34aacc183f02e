"""flash_attention: the public function (signature and documentation; ``_dispatch`` runs it)."""

from __future__ import annotations

import torch

from torch_flashsys.attention._dispatch import attention


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
    semantics), memory linear in the sequence length, differentiable in query, key and value (also
    twice: under ``create_graph=True`` the backward runs differentiable PyTorch ops). Dtypes
    float16, bfloat16, float32 and (PyTorch backend) float64; under ``torch.autocast`` the inputs
    are cast first, as for SDPA. ``torch.compile``, ``torch.func`` (grad, vjp, vmap) and DTensors
    sharded on the head dimension work; details and limits: docs/attention.md (DTensors:
    docs/context_parallel.md).

    Args:
        query: ``(batch, heads, seq_q, head_dim)``; also ``(batch, seq_q, head_dim)``,
            ``(seq_q, head_dim)`` or more leading batch dimensions, as SDPA takes them.
        key: ``(..., kv_heads, seq_k, head_dim)``; ``seq_k`` may be 0 (output zeros).
        value: ``(..., kv_heads, seq_k, head_dim_v)``; ``head_dim_v`` may differ from head_dim.
        attn_mask: broadcastable to ``query.shape[:-1] + (seq_k,)``; bool (True = attend) or float
            (added to the scaled scores), as SDPA; combines with ``is_causal``; no gradient.
        dropout_p: dropout on the attention weights whenever > 0 (pass 0.0 in evaluation).
        is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned, as SDPA).
        scale: multiplies the scores; default ``1 / sqrt(head_dim)`` (float, int, 0-d tensor).
        enable_gqa: allow ``kv_heads < heads``: query head ``h`` uses kv head ``h // (heads //
            kv_heads)``.
        window_size: ``(left, right)``: query ``i`` attends keys ``i - left <= j <= i + right``
            (``-1``: unbounded), as flash-attn; skipped tiles make the cost grow with the window.
        softcap: ``> 0``: scores ``s`` become ``softcap * tanh(s / softcap)``; ``None``: off.
        alibi_slopes: ``(heads,)`` or ``(batch, heads)``: adds ``-slope * |i - j|`` to the scores.
        cu_seqlens_q, cu_seqlens_k: a packed batch, as flash-attn's varlen API: q/k/v ``(total,
            heads, head_dim)`` and int32 ``(n + 1,)`` cumulative lengths; no sequence attends
            across a boundary. Nested (jagged) tensors are packed batches too.
        max_seqlen_q, max_seqlen_k: the longest sequences (optional; on CUDA no host sync).
        cache_seqlens: KV-cache decoding (forward only), as ``flash_attn_with_kvcache``: key/value
            are caches ``(batch, kv_heads, capacity, head_dim)`` with ``cache_seqlens[b]`` valid
            positions; the queries are the last ``seq_q`` of them (bottom-right aligned).
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``; head dims 16..256 in
            multiples of 8), ``"torch"`` (tiled PyTorch, any device) or ``"auto"`` (Triton for
            CUDA tensors unless interpreting; torch for CPU tensors and float64).
        return_lse: also return the logsumexp of the scaled, modified scores (before dropout),
            float32 (float64 for float64 inputs), shape ``query.shape[:-1]``.

    Returns:
        ``out`` with ``query``'s shape (last dim ``head_dim_v``), dtype and memory layout;
        ``(out, lse)`` when ``return_lse``.

    Example:
        >>> q, k, v = (torch.randn(2, 4, 128, 64) for _ in range(3))
        >>> flash_attention(q, k, v, is_causal=True, backend="torch").shape
        torch.Size([2, 4, 128, 64])
    """
    return attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
        softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        cache_seqlens, backend, return_lse,
    )  # fmt: skip
