"""Context parallelism: attention over a sequence split across the ranks of a process group.

Long-context training runs out of *activation* memory; splitting the sequence over P GPUs cuts
every activation by P. Only attention mixes positions, so it is the only layer that communicates:

- :func:`context_parallel_attention` (``mode="ring"`` or ``"ulysses"``) takes the local sequence
  shards of q, k, v and returns the local output shard, with an exact backward;
- :func:`shard_sequence` / :func:`gather_sequence` split a batch along the sequence (zigzag
  layout by default, which balances causal attention) and put it back together;
- :func:`shard_position_ids`: the global positions of the local tokens, for rotary embeddings;
- :func:`context_parallel_sdpa`: a context manager that routes
  ``torch.nn.functional.scaled_dot_product_attention`` calls to :func:`context_parallel_attention`,
  so a model written against SDPA (HF-style models, the reference LM with ``attention="sdpa"``)
  runs context-parallel unchanged.

See ``docs/context_parallel.md`` for when to use ring or Ulysses and the full wiring recipe.

Example (every rank of ``group``)::

    tokens = shard_sequence(full_tokens, group)              # (batch, seq / P)
    positions = shard_position_ids(full_tokens.shape[1], group)
    with context_parallel_sdpa(group, mode="ring"):
        logits = model(tokens, position_ids=positions)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_flashsys.attention import flash_attention
from torch_flashsys.attention._checks import check_inputs, softmax_scale
from torch_flashsys.attention._dispatch import autocast_inputs
from torch_flashsys.attention._dtensor import is_dtensor
from torch_flashsys.attention.module import CONTEXT_PARALLEL_MARK, context_parallel_routed
from torch_flashsys.distributed._cp_layout import LAYOUTS, chunk_ids, chunks_per_rank, shard_order
from torch_flashsys.distributed._cp_ring import Ring, RingAttention
from torch_flashsys.distributed._cp_ulysses import ulysses_attention
from torch_flashsys.distributed._release import mark_used
from torch_flashsys.distributed._verify import check_process_group, verify_same_across_ranks

__all__ = [
    "context_parallel_attention",
    "context_parallel_sdpa",
    "gather_sequence",
    "shard_position_ids",
    "shard_sequence",
]

MODES = ("ring", "ulysses")
_NAME = "context_parallel_attention"


def _group_info(group: dist.ProcessGroup | None, caller: str) -> tuple[int, int]:
    mark_used()  # the exit hook waits for quiet backend threads (see _release)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{caller}: torch.distributed is not initialized (init_process_group)")
    check_process_group(caller, group, name="group")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_choice(caller: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{caller}: {name} must be one of {choices}, got {value!r}")


# --------------------------------------------------------------------------------- layout helpers


def _chunk_len(caller: str, seq: int, world: int, layout: str) -> int:
    n = world * chunks_per_rank(layout)
    if seq % n != 0:
        raise ValueError(
            f"{caller}: the sequence length must be a multiple of {n} (world size {world} x "
            f"{chunks_per_rank(layout)} chunk(s) per rank for layout={layout!r}), got {seq}"
        )
    return seq // n


def shard_sequence(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    dim: int = 1,
    layout: str = "zigzag",
) -> torch.Tensor:
    """This rank's shard of ``tensor`` along the sequence dimension ``dim`` (no communication).

    ``"zigzag"`` (default): the sequence is cut into ``2 * P`` equal chunks and rank ``r`` keeps
    chunks ``r`` and ``2P - 1 - r``, concatenated; causal attention then costs every rank the same.
    ``"contiguous"``: ``P`` chunks, rank ``r`` keeps chunk ``r``. Shard inputs, labels (shifted on
    the *full* sequence first) and position ids the same way.

    tensor: any shape; ``tensor.shape[dim]`` must be a multiple of ``2 P`` (zigzag) or ``P``.
    Returns a copy (zigzag) or a view (contiguous, or ``P == 1``: ``tensor`` itself).

    Example:
        >>> tokens = torch.arange(8).view(1, 8)        # on rank 1 of 2
        >>> shard_sequence(tokens)                      # chunks 1 and 2 of 4
        tensor([[2, 3, 4, 5]])
    """
    return _shard(tensor, group, dim, layout, "shard_sequence")


def _check_dim(caller: str, tensor: object, dim: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{caller}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(
            f"{caller}: dim must be an int in [-{tensor.dim()}, {tensor.dim() - 1}] (the sequence "
            f"dimension of a {tensor.dim()}-D tensor of shape {tuple(tensor.shape)}), got {dim!r}"
        )


def _shard(tensor: torch.Tensor, group, dim: int, layout: str, caller: str) -> torch.Tensor:
    """:func:`shard_sequence`, its errors named for ``caller``."""
    _check_choice(caller, "layout", layout, LAYOUTS)
    rank, world = _group_info(group, caller)
    _check_dim(caller, tensor, dim)
    if world == 1:
        return tensor
    c = _chunk_len(caller, tensor.shape[dim], world, layout)
    pieces = [tensor.narrow(dim, i * c, c) for i in chunk_ids(rank, world, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def gather_sequence(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    dim: int = 1,
    layout: str = "zigzag",
) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of :func:`shard_sequence`).

    A collective (one all-gather on ``group``): every rank must call it with equal shapes,
    ``dim`` and ``layout`` (checked first: a mismatch raises the same error on every rank). Not
    differentiable (use it for outputs, logits to inspect, or gradients in tests).

    Example:
        >>> full = gather_sequence(shard_sequence(tokens))  # == tokens on every rank
    """
    caller = "gather_sequence"
    _check_choice(caller, "layout", layout, LAYOUTS)
    _, world = _group_info(group, caller)
    if world == 1:
        return tensor
    _check_dim(caller, tensor, dim)
    # equal shapes with another dim or layout on some rank would give each rank another tensor
    items = [("shard", _describe(tensor)), ("dim", repr(dim % tensor.dim())), ("layout", layout)]
    verify_same_across_ranks(caller, items, group, what="the call")
    per_rank = chunks_per_rank(layout)
    if tensor.shape[dim] % per_rank:
        raise ValueError(
            f"{caller}: a shard of layout={layout!r} holds {per_rank} equal chunks, so its "
            f"length (dim {dim}) must be a multiple of {per_rank}, got {tensor.shape[dim]}"
        )
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    chunks = [c for p in parts for c in p.chunk(per_rank, dim)]
    order = shard_order(world, layout)  # chunks[i] is global chunk order[i]
    by_position = sorted(range(len(order)), key=order.__getitem__)
    return torch.cat([chunks[i] for i in by_position], dim)


def shard_position_ids(
    seq_len: int,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "zigzag",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The global positions ``(seq_len / P,)`` int64 of this rank's tokens under ``layout``.

    Rotary embeddings must rotate each token by its *global* position; ``arange(seq_len / P)``
    on every rank (what a model computes from the shard's length) is the classic silent bug.
    Broadcast to ``(batch, seq_len / P)`` where a model wants a batch of them.

    Example:
        >>> shard_position_ids(8)          # rank 0 of 2, zigzag: chunks 0 and 3
        tensor([0, 1, 6, 7])
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"shard_position_ids: seq_len must be a positive int, got {seq_len!r}")
    return _shard(torch.arange(seq_len, device=device), group, 0, layout, "shard_position_ids")


# ------------------------------------------------------------------------------------- attention


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return f"not a tensor ({type(t).__name__})"
    return f"shape={tuple(t.shape)} dtype={t.dtype} device={t.device.type}"


def _check_shards(q, k, v, world: int, mode: str, is_causal: bool, layout: str, gqa: bool) -> None:
    """Rules of the sharded problem (after the cross-rank check, so every rank agrees)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if is_dtensor(t):
            raise TypeError(
                f"{_NAME}: {name} is a DTensor; pass this rank's sequence shards as plain "
                f"tensors (heads sharded for tensor parallelism: t.to_local(), then the "
                f"context-parallel group)"
            )
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{_NAME}: {name} must be a 4-D tensor (batch, heads, seq_local, head_dim), got "
                f"{_describe(t)}"
            )
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(
            f"{_NAME}: query, key and value shards must have the same local sequence length "
            f"(self-attention over one sharded sequence), got {q.shape[2]}, {k.shape[2]} and "
            f"{v.shape[2]}"
        )
    if q.shape[2] == 0:
        raise ValueError(f"{_NAME}: the local sequence length must be positive, got 0")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads and not gqa:
        raise ValueError(
            f"{_NAME}: query has {heads} heads and key/value {kv_heads}; pass enable_gqa=True "
            f"for grouped-query attention"
        )
    if mode == "ulysses" and (heads % world or kv_heads % world):
        raise ValueError(
            f"{_NAME}: mode='ulysses' needs heads ({heads}) and kv_heads ({kv_heads}) divisible "
            f"by the group size {world}; use mode='ring'"
        )
    if is_causal and layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(
            f"{_NAME}: layout='zigzag' shards hold two equal chunks, so the local sequence "
            f"length must be even, got {q.shape[2]}"
        )


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    mode: str = "ring",
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    layout: str = "zigzag",
    backend: str = "auto",
    verify: bool = True,
) -> torch.Tensor:
    """Attention over a sequence sharded across ``group``: the local shard of
    ``flash_attention(full_q, full_k, full_v, is_causal=..., ...)``.

    Args:
        query: ``(batch, heads, seq_local, head_dim)``, this rank's shard (as
            :func:`shard_sequence` cuts it, ``dim=2``), the layout of :func:`flash_attention`.
        key, value: ``(batch, kv_heads, seq_local, head_dim[_v])``, the shards of the same tokens.
        group: the context-parallel process group (default: the whole world).
        mode: ``"ring"``: key/value shards travel around the ring (P - 1 steps, the next shard in
            flight while the current one is attended), any head count. ``"ulysses"``: two
            all-to-alls trade the sequence shard for a head shard; heads and kv_heads must be
            multiples of P.
        is_causal: causal over the *global* positions (top-left aligned, as SDPA).
        scale: score scale, default ``1 / sqrt(head_dim)``.
        enable_gqa: allow ``kv_heads < heads`` (``heads % kv_heads == 0``), as SDPA.
        layout: how the sequence was sharded: ``"zigzag"`` (default of :func:`shard_sequence`) or
            ``"contiguous"``. Only causal attention depends on it.
        backend: the attention kernels, as :func:`flash_attention`'s (``"auto"``: Triton on CUDA).
        verify: check first, with one small all-gather, that every rank passed the same shapes,
            dtypes and options, so that a mismatch raises the same error on every rank instead of
            hanging the ring. ``False`` skips it (a little faster; only once a run is known good).

    Returns:
        ``(batch, heads, seq_local, head_dim_v)``, the local output shard, differentiable in
        query, key and value (the backward is exact: ring passes the key/value gradients around
        the ring back to their owners; Ulysses runs the reverse all-to-alls).

    With a group of one rank this is exactly ``flash_attention`` (no copy, no communication).

    Example (2 ranks)::

        q, k, v = (shard_sequence(t, group, dim=2) for t in (full_q, full_k, full_v))
        out = context_parallel_attention(q, k, v, group, is_causal=True)
        full_out = gather_sequence(out, group, dim=2)
    """
    _check_choice(_NAME, "mode", mode, MODES)
    _check_choice(_NAME, "layout", layout, LAYOUTS)
    _, world = _group_info(group, _NAME)
    if world == 1:
        return flash_attention(query, key, value, is_causal=is_causal, scale=scale,
                               enable_gqa=enable_gqa, backend=backend)  # fmt: skip
    # Under autocast, what flash_attention computes on (inputs of mixed dtypes are valid there,
    # as for SDPA): the checks and the fingerprint see the cast tensors.
    query, key, value = autocast_inputs(query, key, value)
    if verify:
        options = {"mode": mode, "is_causal": is_causal, "scale": scale,
                   "enable_gqa": enable_gqa, "layout": layout, "backend": backend}  # fmt: skip
        _verify_call(query, key, value, options, group)
    _check_shards(query, key, value, world, mode, is_causal, layout, enable_gqa)
    resolved = _resolve(query, key, value, is_causal, scale, enable_gqa, backend)
    sm_scale = softmax_scale(scale, query.shape[-1])  # (head dim 0: flash_attention's rule)
    if mode == "ulysses":

        def attend(q, k, v, causal):
            return flash_attention(
                q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=enable_gqa, backend=resolved
            )

        return ulysses_attention(query, key, value, group, layout, is_causal, attend)
    return RingAttention.apply(
        query, key, value, Ring(group), sm_scale, is_causal, layout, resolved
    )


def _verify_call(query, key, value, options: dict[str, Any], group) -> None:
    """The same shapes, dtypes, options and gradient needs on every rank (one all-gather), else
    the same error on every rank."""
    tensors = {"query": query, "key": key, "value": value}
    items = [(name, _describe(t)) for name, t in tensors.items()]
    # a backward on some ranks only would leave the others' ring / all-to-all waiting
    items += [(f"{name} gets a gradient", repr(torch.is_grad_enabled() and t.requires_grad))
              for name, t in tensors.items() if isinstance(t, torch.Tensor)]  # fmt: skip
    items += [(name, repr(o)) for name, o in options.items()]
    verify_same_across_ranks(_NAME, items, group, what="the attention call")


def _resolve(q, k, v, is_causal, scale, enable_gqa, backend) -> str:
    """flash_attention's own checks of the local problem; the concrete backend."""
    try:
        return check_inputs(q, k, v, None, 0.0, is_causal, scale, enable_gqa, backend)
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise type(exc)(f"{_NAME}: {exc}") from exc


# ------------------------------------------------------------------------------ SDPA rerouting


@contextlib.contextmanager
def context_parallel_sdpa(
    group: dist.ProcessGroup | None = None,
    *,
    mode: str = "ring",
    layout: str = "zigzag",
    backend: str = "auto",
    verify: bool = True,
) -> Iterator[None]:
    """Context manager: ``torch.nn.functional.scaled_dot_product_attention`` calls inside it run
    :func:`context_parallel_attention` over ``group`` on the (sharded) q, k, v they receive.

    Every call inside is taken to be self-attention over this rank's sequence shard: 4-D
    ``(batch, heads, seq_local, head_dim)`` inputs; ``is_causal``, ``scale`` and ``enable_gqa``
    are passed on. A call it cannot serve (``attn_mask``, ``dropout_p > 0``) raises
    ``NotImplementedError`` (other shapes ``ValueError``): running it locally would silently
    attend to the local shard only.
    For the same reason ``nn.MultiheadAttention`` with ``need_weights=True`` (its default; that
    path does not call SDPA) raises inside, and torch's fused inference fast path of
    ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` is off (restored on exit).
    On exit the function found on entry is put back (as :func:`~torch_flashsys.sdpa_override`);
    both nest either way.

    Example::

        with context_parallel_sdpa(cp_group, mode="ulysses"):
            loss = model(shard_sequence(tokens, cp_group), position_ids=positions).sum()
            loss.backward()   # the backward needs no context
    """
    _check_choice("context_parallel_sdpa", "mode", mode, MODES)
    _check_choice("context_parallel_sdpa", "layout", layout, LAYOUTS)
    previous = F.scaled_dot_product_attention
    previous_mha = F.multi_head_attention_forward
    fast_path = torch.backends.mha.get_fastpath_enabled()
    F.scaled_dot_product_attention = _make_router(previous, group, mode, layout, backend, verify)
    # nn.MultiheadAttention (and the Transformer layers around it) reach SDPA only off their
    # fused inference fast path and with need_weights=False; else they attend to the local shard.
    F.multi_head_attention_forward = _refuse_weights(previous_mha)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
        F.multi_head_attention_forward = previous_mha
        torch.backends.mha.set_fastpath_enabled(fast_path)


def _make_router(original: Callable[..., Any], group, mode, layout, backend, verify):
    @functools.wraps(original)
    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
        enable_gqa=False, **extra,
    ):  # fmt: skip
        if attn_mask is not None or dropout_p or extra:
            raise NotImplementedError(
                "context_parallel_sdpa: scaled_dot_product_attention under context parallelism "
                f"takes no attn_mask, dropout_p or other arguments; got attn_mask="
                f"{None if attn_mask is None else 'a tensor'}, dropout_p={dropout_p}, "
                f"extra={sorted(extra)} (use is_causal=True for causal masking)"
            )
        return context_parallel_attention(
            query, key, value, group, mode=mode, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa, layout=layout, backend=backend, verify=verify,
        )  # fmt: skip

    # Found by code that calls attention other than through SDPA (the reference LM's "flash"
    # attention, FlashAttention), which must reroute itself (functools.wraps copies it onto wrappers above).
    setattr(scaled_dot_product_attention, CONTEXT_PARALLEL_MARK, True)
    return scaled_dot_product_attention


def _refuse_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    """``F.multi_head_attention_forward`` that raises for ``need_weights=True``: that path computes
    the attention (and its weights) itself, without SDPA, so over this rank's shard only."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def multi_head_attention_forward(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        if call.arguments["need_weights"]:
            raise NotImplementedError(
                "context_parallel_sdpa: nn.MultiheadAttention with need_weights=True (its "
                "default) computes the attention weights itself, over this rank's sequence shard "
                "only; pass need_weights=False (it then calls scaled_dot_product_attention)"
            )
        return original(*args, **kwargs)

    return multi_head_attention_forward


def context_parallel_active() -> bool:
    """Whether ``torch.nn.functional.scaled_dot_product_attention`` is a
    :func:`context_parallel_sdpa` router now (directly or under another wrapper)."""
    return context_parallel_routed()
