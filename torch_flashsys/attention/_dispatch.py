"""The one place a flash_attention call is routed to a backend.

Every input form becomes one validated 3-D/4-D problem ``(q, k, v, Extras, scale)`` and runs on
the backend ``_checks.check_inputs`` chose (``_backend.choose_backend``): DTensors run on their
local heads (``_dtensor``), nested tensors and packed batches as (1, heads, total, dim) views
(``_varlen``), a KV cache on the split-KV decode kernel where it applies (``_cache``), 2-D and
5-D+ inputs as 4-D views; :func:`run` then takes the Triton path (``_ops``) or the PyTorch path
(``_autograd``). Inside ``torch.autocast`` the inputs are first cast, as autocast does for SDPA.
"""

from __future__ import annotations

import math

import torch

from torch_flashsys.attention._autograd import TORCH, apply, torch_attention
from torch_flashsys.attention._cache import cache_extras
from torch_flashsys.attention._checks import check_inputs, dropout_float, refuse, softmax_scale
from torch_flashsys.attention._dtensor import is_dtensor, local_inputs, wrap_outputs
from torch_flashsys.attention._extras import Extras, make_extras
from torch_flashsys.attention._padding import key_lengths, packed_layout, per_sequence, route
from torch_flashsys.attention._tensors import empty_like_layout, unit_last_stride
from torch_flashsys.attention._varlen import (
    nested_inputs,
    packed_extras,
    packed_problem,
    packed_views,
    to_nested,
    unpack,
)


def attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
              softcap, alibi_slopes, cu_q, cu_k, max_q, max_k, cache_seqlens, backend,
              return_lse):  # fmt: skip
    """:func:`~torch_flashsys.attention.flash_attention` (same arguments, in its order)."""
    if dropout_p.__class__ is not float:  # an int, a numpy scalar, a 0-d tensor: SDPA's types
        dropout_p = dropout_float(dropout_p)
    if query.__class__ is not torch.Tensor and is_dtensor(query):
        unsupported = {"attn_mask": attn_mask, "alibi_slopes": alibi_slopes, "cu_seqlens_q": cu_q,
                       "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
                       "cache_seqlens": cache_seqlens}  # fmt: skip
        q, k, v = local_inputs(query, key, value, unsupported)
        out, lse = attention(q, k, v, None, dropout_p, is_causal, scale, enable_gqa, window_size,
                             softcap, None, None, None, None, None, None, backend, True)  # fmt: skip
        out, lse = wrap_outputs(query, value, out, lse)
    elif isinstance(query, torch.Tensor) and query.is_nested:
        refuse({"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q,
                "max_seqlen_k": max_k, "cache_seqlens": cache_seqlens},
               "with nested (jagged) inputs: their offsets give the sequences")  # fmt: skip
        q, k, v, cu_q, cu_k, max_q, max_k = nested_inputs(query, key, value, attn_mask)
        q, k, v = autocast_inputs(q, k, v)  # as SDPA's nested path under autocast
        out, lse = _packed(q, k, v, None, dropout_p, is_causal, scale, enable_gqa, window_size,
                           softcap, alibi_slopes, backend, cu_q, cu_k, max_q, max_k)  # fmt: skip
        out, lse = to_nested(out, lse, cu_q)
    else:
        if _any_autocast():  # (checked here: the common call makes no extra Python call)
            query, key, value = autocast_inputs(query, key, value)
        if cu_q is not None or cu_k is not None:
            refuse({"cache_seqlens": cache_seqlens}, "with cu_seqlens (packed batches): "
                   "KV-cache decoding takes (batch, heads, capacity, head_dim) caches")  # fmt: skip
            out, lse = _packed(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, window_size, softcap, alibi_slopes, backend, cu_q,
                               cu_k, max_q, max_k)  # fmt: skip
            return (out, lse) if return_lse else out
        if max_q is not None or max_k is not None:
            refuse({"max_seqlen_q": max_q, "max_seqlen_k": max_k}, "without cu_seqlens_q and "
                   "cu_seqlens_k: they bound a packed batch's sequences")  # fmt: skip
        resolved = check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                enable_gqa, backend, window_size, softcap, alibi_slopes)  # fmt: skip
        sm_scale = softmax_scale(scale, query.shape[-1])
        mods = (dropout_p, is_causal, window_size, softcap, alibi_slopes)
        if cache_seqlens is not None:
            ex = cache_extras(query, key, value, attn_mask, mods, cache_seqlens)
            out, lse = _cached(query, key, value, ex, sm_scale, resolved)
        elif (lengths := right_padded(query, key, attn_mask, mods)) is not None:
            out, lse = _run_right_padded(query, key, value, attn_mask, is_causal, lengths,
                                         sm_scale, resolved)  # fmt: skip
        elif query.dim() in (3, 4):
            q4_shape = query.shape if query.dim() == 4 else (1, *query.shape)
            ex = make_extras(q4_shape, key.shape[-2], query.device, query.dtype, attn_mask, *mods)
            out, lse = run(query, key, value, ex, sm_scale, resolved)
        else:
            out, lse = _any_rank(query, key, value, attn_mask, mods, sm_scale, resolved)
    return (out, lse) if return_lse else out


def right_padded(query, key, attn_mask, mods: tuple) -> list[int] | None:
    """Each sequence's key count where ``attn_mask`` (with ``is_causal``) is a right-padded
    causal mask and nothing else modifies the scores (``_padding``); else None."""
    if attn_mask is None or query.dim() != 4 or not isinstance(attn_mask, torch.Tensor):
        return None
    dropout_p, is_causal, window_size, softcap, alibi_slopes = mods
    if dropout_p or window_size is not None or softcap or alibi_slopes is not None:
        return None
    if _functorch_active():  # vmap/grad transforms: the mask path
        return None
    return key_lengths(attn_mask, query.shape[0], query.shape[2], key.shape[2], is_causal)


def _run_right_padded(query, key, value, attn_mask, is_causal: bool, lengths: list[int],
                      sm_scale: float, backend: str):  # fmt: skip
    """A right-padded causal mask's problem: causal and mask-free where no sequence is padded,
    else each sequence's causal problem on its keys, one call each (``_padding.per_sequence``)
    or as one packed problem (``_padding.route`` chooses)."""
    shape, seq_k, device, dtype = query.shape, key.shape[-2], query.device, query.dtype
    if all(n == seq_k for n in lengths):
        causal = make_extras(shape, seq_k, device, dtype, None, 0.0, True, None, None, None)
        return run(query, key, value, causal, sm_scale, backend)
    if route(query) == "packed":
        return _run_packed(query, key, value, sm_scale, lengths, backend)
    masked = make_extras(shape, seq_k, device, dtype, attn_mask, 0.0, is_causal, None, None, None)
    if backend == "triton":
        from torch_flashsys.attention._ops import TRITON as base
    else:
        base = TORCH
    return apply(query, key, value, sm_scale, masked, per_sequence(base, lengths))


def _run_packed(query, key, value, sm_scale: float, lengths: list[int], backend: str):
    """The right-padded batch as one packed causal problem: every sequence's ``seq`` query rows
    (padded ones included: they see the sequence's n_b keys, top-left causal), its first n_b keys
    gathered; the results viewed back as (batch, heads, seq, ...) in the (batch, seq, heads)
    order the packing reads (free for a projection's layout). The cumulative lengths are built
    here (``_padding.packed_layout``), so ``_varlen``'s checks of a user's are skipped."""
    batch, heads, seq, dim = query.shape
    cu_q, cu_k, rows = packed_layout(lengths, seq, query.device)
    q3 = query.transpose(1, 2).reshape(batch * seq, heads, dim)
    k3, v3 = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], -1).index_select(0, rows)
              for t in (key, value))  # fmt: skip
    ex = packed_extras(q3, cu_q, cu_k, seq, max(lengths), 0.0, True, None, None, None)
    out, lse = unpack(*run(*packed_views(q3, k3, v3), ex, sm_scale, backend))  # (total, heads, ..)
    out = out.view(batch, seq, heads, -1).transpose(1, 2)
    return out, lse.view(batch, seq, heads).transpose(1, 2)


def run(query, key, value, ex: Extras, sm_scale: float, backend: str):
    """The validated 3-D/4-D problem on ``backend``: ``(out, lse)``, differentiable."""
    if backend == "triton":
        from torch_flashsys.attention._ops import triton_attention  # imports triton: only if used

        return triton_attention(query, key, value, sm_scale, ex)
    return torch_attention(query, key, value, sm_scale, ex)


def _packed(*args):
    """A packed batch (``_varlen.packed_problem``'s arguments) -> packed ``(out, lse)``."""
    q4, k4, v4, ex, sm_scale, backend = packed_problem(*args)
    return unpack(*run(q4, k4, v4, ex, sm_scale, backend))


def _cached(query, key, value, ex: Extras, sm_scale: float, backend: str):
    """The decode step: the split-KV kernel where it applies, else :func:`run` (the prefill
    kernel's cache mode or the PyTorch backend)."""
    if backend == "triton":
        from torch_flashsys.attention._triton_decode import decode_forward, decode_supported

        if decode_supported(query, key, ex):
            q, k, v = (unit_last_stride(t) for t in (query, key, value))  # as _ops._as_4d
            out, lse = decode_forward(q, k, v, sm_scale, ex)
            if q is not query:  # the output still takes the query's layout
                out = empty_like_layout(query, value.shape[-1]).copy_(out)
            return out, lse
    return run(query, key, value, ex, sm_scale, backend)


def _any_rank(query, key, value, attn_mask, mods: tuple, sm_scale: float, backend: str):
    """2-D, or several leading batch dimensions: the same problem on 4-D views."""
    q4, k4, v4 = (_as_4d(t) for t in (query, key, value))
    mask4 = attn_mask
    if attn_mask is not None and query.dim() > 4:
        mask4 = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        mask4 = mask4.reshape(-1, *mask4.shape[-3:])
    ex = make_extras(q4.shape, k4.shape[-2], query.device, query.dtype, mask4, *mods)
    out, lse = run(q4, k4, v4, ex, sm_scale, backend)
    return out.reshape(*query.shape[:-1], value.shape[-1]), lse.reshape(query.shape[:-1])


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(seq, dim) -> (1, 1, seq, dim); (..., heads, seq, dim) -> (batch, heads, seq, dim)."""
    if t.dim() == 2:
        return t.view(1, 1, *t.shape)
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
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


_functorch_active = torch._C._are_functorch_transforms_active
