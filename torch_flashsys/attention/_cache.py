"""KV-cache decoding, flash_attention(q, k_cache, v_cache, cache_seqlens=...): the checks of
``cache_seqlens`` and the problem's Extras (forward only; ``_dispatch`` picks the kernel)."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.weak import WeakIdKeyDictionary

from torch_flashsys.attention._checks import NAME, fail
from torch_flashsys.attention._extras import Extras, make_extras

# CUDA cache_seqlens tensors already checked on the device: tensor -> (version, seq_q, capacity).
# Weak keys: a new tensor (even at a reused address) is checked again, and so is an in-place
# update (it bumps the version).
_CHECKED = WeakIdKeyDictionary()


def check_cache_seqlens(cache_seqlens: object, query, key, value) -> None:
    """(batch,) int32/int64 on the inputs' device, values in [seq_q, capacity] (the queries are
    the last seq_q positions of each sequence): checked on the host for CPU tensors and on the
    device (``torch._assert_async``, no synchronization) for CUDA ones."""
    if query.dim() != 4:
        fail(ValueError, "cache_seqlens needs 4-D (batch, heads, seq, head_dim) inputs, got "
                          f"{query.dim()}-D query")  # fmt: skip
    batch, capacity = query.shape[0], key.shape[2]
    if (
        not isinstance(cache_seqlens, torch.Tensor)
        or cache_seqlens.dtype not in (torch.int32, torch.int64)
        or tuple(cache_seqlens.shape) != (batch,)
    ):
        what = (f"{cache_seqlens.dtype} of shape {tuple(cache_seqlens.shape)}"
                if isinstance(cache_seqlens, torch.Tensor) else type(cache_seqlens).__name__)  # fmt: skip
        fail(TypeError, f"cache_seqlens must be an int32 (or int64) tensor of shape (batch,) = "
                         f"({batch},), got {what}")  # fmt: skip
    if cache_seqlens.device != query.device:
        fail(ValueError, f"cache_seqlens must be on {query.device}, got {cache_seqlens.device}")
    if torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    ):
        fail(ValueError, "cache_seqlens (KV-cache decoding) is forward only; call it under "
                          "torch.no_grad() / torch.inference_mode()")  # fmt: skip
    seq_q = query.shape[2]
    bounds = f"[seq_q, capacity] = [{seq_q}, {capacity}]"
    if cache_seqlens.is_cuda:
        # Every layer of a decode step passes the same tensor: check each version of it once.
        stamp = (cache_seqlens._version, seq_q, capacity)
        if torch.compiler.is_compiling() or _CHECKED.get(cache_seqlens) != stamp:
            ok = (cache_seqlens.min() >= seq_q) & (cache_seqlens.max() <= capacity)
            torch._assert_async(ok, f"{NAME}: cache_seqlens must lie in {bounds}")
            if not torch.compiler.is_compiling():
                _CHECKED[cache_seqlens] = stamp
    elif batch and (int(cache_seqlens.min()) < seq_q or int(cache_seqlens.max()) > capacity):
        fail(ValueError, f"cache_seqlens must lie in {bounds} (the queries are the last seq_q "
                          "positions of each sequence's valid keys; capacity is key's dim -2), "
                          f"got {cache_seqlens.tolist()}")  # fmt: skip


def cache_extras(query, key, value, attn_mask, mods: tuple, cache_seqlens) -> Extras:
    """Check ``cache_seqlens``; the Extras of the decode problem (``mods``: dropout_p, is_causal,
    window_size, softcap, alibi_slopes)."""
    check_cache_seqlens(cache_seqlens, query, key, value)
    ex = make_extras(query.shape, key.shape[-2], query.device, query.dtype, attn_mask, *mods)
    # the kernels index it as contiguous memory (no copy when it is)
    return dataclasses.replace(ex, seqused_k=cache_seqlens.contiguous())
