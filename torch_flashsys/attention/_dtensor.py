"""flash_attention on DTensors sharded over the head dimension (tensor parallelism).

Under ``parallelize_module`` (column-parallel q/k/v projections) the attention inputs are DTensors
``Shard(heads_dim)`` on their mesh: every rank holds whole sequences of some heads, which is all
attention needs. :func:`local_inputs` checks the layout and hands ``_dispatch`` the local heads;
:func:`wrap_outputs` wraps the result with the same placements: no redistribution and no
communication. Layouts it cannot
serve this way (a sharded sequence, batch or head dim ``head_dim``, ``Partial``, heads that do
not divide evenly, DTensors mixed with plain tensors) raise a ``ValueError`` that names them.

:func:`register_op_sharding` gives the custom ops ``torch_flashsys::attn_fwd`` / ``attn_bwd``
the same rule for DTensor dispatch (``register_sharding``): all replicated, or everything with a
head dimension sharded on it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from torch_flashsys.attention._backend import triton_installed
from torch_flashsys.attention._checks import NAME as _NAME


def is_dtensor(t: object) -> bool:
    if t.__class__ is torch.Tensor or not isinstance(t, torch.Tensor):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(t, DTensor)


def _placements_ok(t, heads_dim: int) -> str | None:
    """None if ``t``'s placements are Replicate or Shard(heads_dim); else what is wrong."""
    from torch.distributed.tensor import Replicate, Shard

    for p in t.placements:
        if isinstance(p, Shard) and p.dim in (heads_dim, heads_dim - t.dim()):
            continue
        if not isinstance(p, Replicate):
            return repr(p)
    return None


def _check(query, key, value, extra: dict[str, Any]) -> int:
    """Validate the DTensor layout; return the head dimension's index."""
    tensors = {"query": query, "key": key, "value": value}
    plain = [n for n, t in tensors.items() if not is_dtensor(t)]
    if plain:
        raise ValueError(
            f"{_NAME}: query is a DTensor, so key and value must be DTensors on the same mesh; "
            f"{' and '.join(plain)} {'is' if len(plain) == 1 else 'are'} not"
        )
    if query.dim() < 3:
        raise ValueError(
            f"{_NAME}: DTensor inputs need a head dimension ((batch, heads, seq, head_dim) or "
            f"(heads, seq, head_dim)), got query of shape {tuple(query.shape)}"
        )
    heads_dim = query.dim() - 3
    for name, t in tensors.items():
        if t.device_mesh != query.device_mesh:
            raise ValueError(f"{_NAME}: {name} is on another device mesh than query")
        if t.placements != query.placements:
            raise ValueError(
                f"{_NAME}: query, key and value must have the same placements, got "
                f"{query.placements} for query and {t.placements} for {name}"
            )
        wrong = _placements_ok(t, heads_dim)
        if wrong is not None:
            raise ValueError(
                f"{_NAME}: DTensor inputs must be sharded on the head dimension (Shard({heads_dim}))"
                f" or replicated (runs on the local heads with no redistribution); got {wrong} "
                f"in {t.placements} for {name}. Redistribute them first, e.g. "
                f"t.redistribute(placements=[Shard({heads_dim})])"
            )
    shards = _head_shards(query)
    for name, t in tensors.items():
        if t.shape[heads_dim] % shards:
            raise ValueError(
                f"{_NAME}: the {t.shape[heads_dim]} heads of {name} do not divide evenly over the "
                f"{shards} shards of the head dimension; use a head count divisible by {shards}"
            )
    used = sorted(n for n, v in extra.items() if v is not None)
    if used:
        raise NotImplementedError(
            f"{_NAME}: with DTensor inputs, {', '.join(used)} is not supported (only "
            f"is_causal, scale, enable_gqa, dropout_p, window_size, softcap, backend, return_lse)"
        )
    return heads_dim


def _head_shards(t) -> int:
    from torch.distributed.tensor import Shard

    n = 1
    for size, p in zip(t.device_mesh.shape, t.placements, strict=True):
        if isinstance(p, Shard):
            n *= size
    return n


def local_inputs(query, key, value, unsupported: dict[str, Any]) -> tuple:
    """Check the DTensor layout; the local tensors of query, key and value. ``unsupported``: the
    arguments DTensor inputs do not take (must all be None)."""
    _check(query, key, value, unsupported)
    register_op_sharding()
    return query.to_local(), key.to_local(), value.to_local()


def wrap_outputs(query, value, out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """The local ``(out, lse)`` as DTensors with query's mesh and placements."""
    from torch.distributed.tensor import DTensor

    mesh, placements = query.device_mesh, query.placements
    out_shape = (*query.shape[:-1], value.shape[-1])
    out = DTensor.from_local(out, mesh, placements, run_check=False, shape=torch.Size(out_shape),
                             stride=_contiguous_stride(out_shape))  # fmt: skip
    lse_shape = tuple(query.shape[:-1])
    lse = DTensor.from_local(lse, mesh, placements, run_check=False, shape=torch.Size(lse_shape),
                             stride=_contiguous_stride(lse_shape))  # fmt: skip
    return out, lse


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@functools.cache
def register_op_sharding() -> bool:
    """Register the head-sharding rule of the custom ops with DTensor (once; False without Triton,
    whose absence leaves the custom ops undefined)."""
    if not triton_installed():
        return False
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    import torch_flashsys.attention._ops  # noqa: F401  (defines the ops; imports triton)

    ops = torch.ops.torch_flashsys

    def rules(tensors: list, sharded_dims: list[int | None]):
        """All replicated, or each present tensor sharded on its head dim (None where absent)."""
        rep = [None if t is None else Replicate() for t in tensors]
        shard = [None if t is None else (Replicate() if d is None else Shard(d))
                 for t, d in zip(tensors, sharded_dims, strict=True)]  # fmt: skip
        return rep, shard

    def _replicate_tensors(args) -> list:
        """The trailing arguments: scalars (None) and the packed batch's cu_seqlens (Replicate)."""
        return [None if a is None or isinstance(a, (int, float)) else Replicate() for a in args]

    def heads(t) -> int:
        return t.ndim - 3  # q/k/v/out (..., heads, seq, dim); lse (..., heads, seq) -> ndim - 2

    @register_sharding(ops.attn_fwd.default)
    def _fwd(q, k, v, mask, alibi, seed, *scalars):
        h = heads(q)
        rep, shard = rules([q, k, v, mask, alibi, seed], [h, h, h, 1, 1, None])
        rep_out = [Replicate(), Replicate()]
        rest = _replicate_tensors(scalars)
        return [(rep_out, rep + rest), ([Shard(h), Shard(h)], shard + rest)]

    @register_sharding(ops.attn_bwd.default)
    def _bwd(dout, q, k, v, out, lse, dlse, mask, alibi, seed, *scalars):
        h = heads(q)
        rep, shard = rules([dout, q, k, v, out, lse, dlse, mask, alibi, seed],
                           [h, h, h, h, h, h, h, 1, 1, None])  # fmt: skip
        rest = _replicate_tensors(scalars)
        return [([Replicate()] * 3, rep + rest), ([Shard(h)] * 3, shard + rest)]

    return True
