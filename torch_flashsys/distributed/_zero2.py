"""The DDP x ZeRO glue (as torch's ``ddp_zero_hook.py``): the only module that sees both sides.

BucketedDDP's side is its gradient reducer (``_reducer``), found from a parameter with
``reducer_of``; ShardedOptimizer (``sharded_optimizer``, which imports this module) gets from here
the reducer of its parameters for ``shard_gradients=True`` (ZeRO-2: each bucket reduced to its
owner), what that reducer's ``Join`` state says, and gradient-norm clipping when each rank holds
only its own gradients. Import order: ``_reducer`` -> ``ddp`` -> ``_zero2`` -> ``sharded_optimizer``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from torch_flashsys.distributed._reducer import GradientReducer, reducer_of
from torch_flashsys.distributed._verify import collective_device


def find_reducer(
    params: Sequence[torch.Tensor], index: Mapping[torch.Tensor, int], global_ranks: list[int]
) -> tuple[GradientReducer | None, str | None]:
    """The reducer of the BucketedDDP that synchronizes every trainable one of ``params`` (the
    optimizer's, with ``index`` their positions), or ``(None, problem)``. ``problem`` reads after
    "needs": the rule broken, then (after ";") the details, which may differ across ranks."""
    trainable = [(i, p) for i, p in enumerate(params) if p.requires_grad]
    wrappers = {id(w): w for _, p in trainable if (w := reducer_of(p)) is not None}
    if len(wrappers) != 1:
        found = "none" if not wrappers else f"{len(wrappers)} different ones"
        return None, (
            "the parameters to be wrapped by one BucketedDDP, built before the optimizer "
            f"(BucketedDDP(model), then ShardedOptimizer(model.parameters(), ...)); found {found}"
        )
    reducer = next(iter(wrappers.values()))
    for i, p in trainable:
        if reducer_of(p) is not reducer:
            return None, (
                "every trainable parameter to be synchronized by the BucketedDDP; parameter "
                f"{i} (shape {tuple(p.shape)}) is not"
            )
    for p, name in zip(reducer.params, reducer.names, strict=True):
        if p not in index:
            return None, (
                f"every parameter of the BucketedDDP in the optimizer; {name!r} is not (its "
                "gradient would have no owner)"
            )
    if reducer.comm_hook is not None:
        return None, (
            "a BucketedDDP without a communication hook (register_comm_hook); ZeRO-2 reduces "
            "each bucket to its owner rank instead of all-reducing it"
        )
    group = reducer.group
    ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    if ranks != global_ranks:
        return None, (
            "the BucketedDDP and the optimizer to use the same process group; the BucketedDDP's "
            f"has global ranks {ranks}, the optimizer's {global_ranks}"
        )
    return reducer, None


def reduce_to_owners(
    reducer: GradientReducer, owners: Sequence[int], index: Mapping[torch.Tensor, int]
) -> None:
    """ZeRO-2: make ``reducer`` reduce each gradient only to the rank owning its parameter
    (``owners[index[p]]``, the optimizer's partition)."""
    reducer.shard_gradients([owners[index[p]] for p in reducer.params])


def reducer_for(params: Sequence[torch.Tensor]) -> GradientReducer | None:
    """The reducer (of a live BucketedDDP) of the first of ``params`` that has one."""
    return next((r for p in params if (r := reducer_of(p)) is not None), None)


def check_model_joins(params: Sequence[torch.Tensor]) -> None:
    """Inside ``Join``, on a rank still training: the BucketedDDP of ``params`` (if any) must be
    in the Join too (else the ranks that ran out of inputs would not shadow its reductions)."""
    reducer = reducer_for(params)
    if reducer is not None and not reducer.join_config.enable:
        raise ValueError(
            "ShardedOptimizer: inside Join, the BucketedDDP of its parameters must join "
            "too, first: Join([model, optimizer]) (else the ranks that ran out of inputs "
            "would not shadow its gradient reductions)"
        )


def shadow_skips_step(params: Sequence[torch.Tensor]) -> bool:
    """On a joined rank: whether the step of the ranks still training is not to be mirrored,
    because the BucketedDDP's shadowed forward did not synchronize (a ``no_sync()``
    micro-batch, with no step after it)."""
    reducer = reducer_for(params)
    return reducer is not None and reducer.join_config.enable and not reducer.join_synced


# The gradient dtypes clip_grad_norm tells apart (others count as float32).
_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _partial_norm(
    norms: list[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """This rank's part (0-dim, float64, on ``device``) of torch's total norm, the norm of the
    per-gradient norms as one vector (``vector_norm(stack(norms), norm_type)``): the largest norm
    (inf) or the negated smallest (-inf), both combined across ranks by maximum; the count of
    nonzero norms (order 0) or the sum of the norms' powers, combined by sum."""
    if not norms:
        return torch.tensor(-math.inf if norm_type == -math.inf else 0.0, device=device)
    stacked = torch.stack(norms)
    if norm_type == math.inf:
        return stacked.max()
    if norm_type == -math.inf:
        return stacked.min().neg()
    if norm_type == 0:
        return stacked.ne(0).sum().double()
    return stacked.pow(norm_type).sum()


def _total_norm(combined: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The total norm from the ranks' combined parts (:func:`_partial_norm`)."""
    if norm_type == -math.inf:
        return combined.neg()
    if norm_type in (0, math.inf):
        return combined
    return combined.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(
    owned: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    group: dist.ProcessGroup,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` when the gradients are split across ``group``: the norm
    of the ``owned`` parameters' gradients on each rank (every parameter owned by exactly one
    rank), combined by one all-reduce; then every gradient of ``params`` present is scaled.
    ``foreach`` as torch's: the ``torch._foreach_*`` kernels per (device, dtype) group (``None``:
    for CUDA gradients), else one norm and one scaling per gradient."""
    norm_type = float(norm_type)
    device = collective_device(group)
    grads = [p.grad for p in owned if p.grad is not None]
    norms = [n.double().to(device) for n in _grad_norms(grads, norm_type, foreach)]
    # [the local part, then which gradient dtypes this rank has], one all-reduce: the norm comes
    # back in their promoted dtype, as torch.nn.utils.clip_grad_norm_'s does
    present = {g.dtype for g in grads}
    flags = [float(dtype in present) for dtype in _NORM_DTYPES]
    local = torch.tensor([0.0, *flags], dtype=torch.float64, device=device)
    local[0] = _partial_norm(norms, norm_type, device)
    by_max = norm_type in (math.inf, -math.inf)
    dist.all_reduce(local, op=dist.ReduceOp.MAX if by_max else dist.ReduceOp.SUM, group=group)
    seen = local[1:].tolist()  # (one synchronization, the flags)
    dtypes = [dtype for dtype, flag in zip(_NORM_DTYPES, seen, strict=True) if flag > 0]
    out_dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32
    # no gradient on any rank: 0, as torch's norm of no tensors
    total = _total_norm(local[0], norm_type) if dtypes else local.new_zeros(())
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"ShardedOptimizer.clip_grad_norm_: the total norm of order {norm_type} of the "
            "gradients is non-finite, so it cannot be clipped (error_if_nonfinite=True)"
        )
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for same, batched in _batches([p.grad for p in params if p.grad is not None], foreach):
        scale = coef.to(device=same[0].device, dtype=same[0].dtype)
        if batched:
            torch._foreach_mul_(same, scale)
        else:
            same[0].mul_(scale)
    return total.to(out_dtype)


def _batches(grads: list[torch.Tensor], foreach: bool | None) -> list[tuple[list, bool]]:
    """``grads`` as ``(tensors, batched)``: one batch per (device, dtype) of dense gradients
    where ``foreach`` (``None``: CUDA ones) takes the ``torch._foreach_*`` kernels, else one
    gradient each (sparse ones always)."""
    batches: dict[tuple, list[torch.Tensor]] = {}
    single = []
    for g in grads:
        if g.layout == torch.strided and (foreach or (foreach is None and g.is_cuda)):
            batches.setdefault((g.device, g.dtype), []).append(g)
        else:
            single.append(([g], False))
    return [(same, True) for same in batches.values()] + single


def _grad_norms(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list:
    """Each gradient's norm of order ``norm_type`` (in some order: the total does not depend on
    it), batched as :func:`_batches` says."""
    norms = []
    for same, batched in _batches(grads, foreach):
        if batched:
            norms += torch._foreach_norm(same, norm_type)
        else:
            norms.append(torch.linalg.vector_norm(same[0], norm_type))
    return norms
