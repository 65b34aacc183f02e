"""Packed variable-length batches: flash-attn's (total, heads, dim) + cumulative lengths, and
PyTorch's nested tensors with the jagged layout. Both become (1, heads, total, dim) views and a
packed :class:`~torch_flashsys.attention._extras.Extras` (:func:`packed_problem`); no sequence
attends across a boundary. ``_dispatch`` runs the problem and unpacks the result.
"""

from __future__ import annotations

import dataclasses

import torch

from torch_flashsys.attention._checks import NAME, check_inputs, fail, softmax_scale
from torch_flashsys.attention._extras import Extras, make_extras


def _check_cu(cu: object, name: str, total: int, device: torch.device) -> torch.Tensor:
    if (
        not isinstance(cu, torch.Tensor)
        or cu.dim() != 1
        or cu.dtype not in (torch.int32, torch.int64)
    ):
        what = (
            f"{cu.dtype} of shape {tuple(cu.shape)}"
            if isinstance(cu, torch.Tensor)
            else type(cu).__name__
        )
        fail(
            TypeError,
            f"{name} must be a 1-D int32 (or int64) tensor of cumulative lengths, got {what}",
        )
    if cu.numel() < 1:
        fail(ValueError, f"{name} must have at least one entry (0), got an empty tensor")
    if cu.device != device:
        fail(ValueError, f"{name} must be on {device} like the inputs, got {cu.device}")
    return cu.contiguous()  # the kernels index it as contiguous memory (no copy when it is)


def _check_values(cu: torch.Tensor, name: str, total: int, max_len: int | None) -> int:
    """Validate the cumulative lengths' values; return the longest length.

    Reads the values on the host (one synchronization) unless ``max_len`` is given for a CUDA
    tensor: then the checks run on the device (``torch._assert_async``), so a training loop that
    passes ``max_seqlen`` never waits for the GPU.
    """
    lengths = cu[1:] - cu[:-1]
    if max_len is not None and cu.is_cuda:
        ok = (cu[0] == 0) & (cu[-1] == total)
        if lengths.numel():
            ok = ok & (lengths.min() >= 0) & (lengths.max() <= max_len)
        torch._assert_async(
            ok, f"{NAME}: {name} must start at 0, end at the total length {total}, never decrease "
            f"and have no length above max_seqlen {max_len}",
        )  # fmt: skip
        return max_len
    first, last = int(cu[0]), int(cu[-1])
    longest = int(lengths.max()) if lengths.numel() else 0
    if first != 0 or last != total or (lengths.numel() and int(lengths.min()) < 0):
        fail(
            ValueError,
            f"{name} must start at 0, end at the total length {total} and never decrease, got "
            f"{cu.tolist() if cu.numel() <= 12 else f'{first} ... {last}'}",
        )
    if max_len is not None and longest > max_len:
        fail(
            ValueError, f"max_seqlen for {name} is {max_len} but a sequence has {longest} positions"
        )
    return longest if max_len is None else max_len


def packed_problem(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size, softcap,
    alibi_slopes, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
):  # fmt: skip
    """Validate (total, heads, dim) inputs with cumulative lengths; return the 4-D problem
    ``(q4, k4, v4, ex, sm_scale, backend)`` over (1, heads, total, dim) views. The result of
    running it, ``(out4, lse4)``, unpacks with :func:`unpack`."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            fail(
                ValueError,
                f"with cu_seqlens, {name} must be packed (total, heads, head_dim), got {shape}",
            )
    if cu_seqlens_q is None or cu_seqlens_k is None:
        fail(ValueError, "a packed batch needs both cu_seqlens_q and cu_seqlens_k")
    if attn_mask is not None:
        fail(ValueError, "attn_mask is not supported with packed sequences (cu_seqlens); "
                          "sequence boundaries already separate them")  # fmt: skip
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            fail(ValueError, f"{name} must be None or an int >= 0, got {m!r}")
    q4, k4, v4 = packed_views(query, key, value)
    resolved = check_inputs(
        q4, k4, v4, None, dropout_p, is_causal, scale, enable_gqa, backend, window_size, softcap,
        None,
    )  # fmt: skip
    cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", query.shape[0], query.device)
    cu_k = _check_cu(cu_seqlens_k, "cu_seqlens_k", key.shape[0], query.device)
    if cu_q.numel() != cu_k.numel():
        fail(ValueError, f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                          f"sequences, got {cu_q.numel() - 1} and {cu_k.numel() - 1}")  # fmt: skip
    n_seqs, heads = cu_q.numel() - 1, query.shape[1]
    if alibi_slopes is not None and (
        not isinstance(alibi_slopes, torch.Tensor)
        or tuple(alibi_slopes.shape) not in ((heads,), (n_seqs, heads))
    ):
        shape = (
            tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else alibi_slopes
        )
        fail(ValueError, f"alibi_slopes must have shape (heads,) = ({heads},) or "
                          f"(sequences, heads) = ({n_seqs}, {heads}), got {shape}")  # fmt: skip
    max_q = _check_values(cu_q, "cu_seqlens_q", query.shape[0], max_seqlen_q)
    max_k = _check_values(cu_k, "cu_seqlens_k", key.shape[0], max_seqlen_k)
    ex = packed_extras(query, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, window_size, softcap,
                       alibi_slopes)  # fmt: skip
    if n_seqs == 0:  # (an empty total already chose the PyTorch backend in check_inputs)
        resolved = "torch"
    return q4, k4, v4, ex, softmax_scale(scale, query.shape[-1]), resolved


def packed_views(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Packed (total, heads, dim) tensors as the (1, heads, total, dim) views the kernels take."""
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in tensors)


def packed_extras(query: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
                  max_k: int, *mods) -> Extras:  # fmt: skip
    """The Extras of a packed problem with valid cumulative lengths: ``make_extras``'s for its
    (sequences, heads, max_q, dim) shape and ``mods`` (dropout_p, is_causal, window_size,
    softcap, alibi_slopes), with the lengths."""
    shape = (cu_q.numel() - 1, query.shape[1], max_q, query.shape[-1])
    ex = make_extras(shape, max_k, query.device, query.dtype, None, *mods)
    return dataclasses.replace(ex, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k)


def unpack(out4: torch.Tensor, lse4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, heads, total, dim_v) and (1, heads, total) -> (total, heads, dim_v), (total, heads)."""
    return out4[0].transpose(0, 1), lse4[0].transpose(0, 1)


def nested_inputs(query, key, value, attn_mask) -> tuple:
    """Nested (jagged) (batch, heads, j, dim) tensors, as SDPA takes them -> the packed batch
    ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``, q/k/v (total, heads,
    dim); :func:`to_nested` turns its result back."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not (isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged):
            fail(TypeError, f"nested {name} must be a nested tensor with layout=torch.jagged "
                            "like the others")  # fmt: skip
        if t.dim() != 4 or getattr(t, "_ragged_idx", 2) != 2:
            fail(ValueError, f"nested {name} must be (batch, heads, j, head_dim): a "
                             "(batch, j, heads, head_dim) jagged tensor transposed(1, 2)")  # fmt: skip
    if attn_mask is not None:
        fail(ValueError, "attn_mask is not supported with nested tensors")
    q, k, v = (t.values().transpose(0, 1) for t in (query, key, value))  # (total, heads, dim)
    return q, k, v, query.offsets(), key.offsets(), _max_seqlen(query), _max_seqlen(key)


def to_nested(out: torch.Tensor, lse: torch.Tensor, offsets: torch.Tensor) -> tuple:
    """Packed (total, heads, dim_v) / (total, heads) -> nested (batch, heads, j, dim_v) / (batch,
    heads, j), over the query's offsets."""
    out_nt = torch.nested.nested_tensor_from_jagged(out, offsets).transpose(1, 2)
    return out_nt, torch.nested.nested_tensor_from_jagged(lse, offsets).transpose(1, 2)


def _max_seqlen(t: torch.Tensor) -> int | None:
    """The longest sequence of a jagged tensor when it is cached (no device sync), else None."""
    value = getattr(t, "_maybe_max_seqlen", None)
    return int(value) if isinstance(value, int) else None
