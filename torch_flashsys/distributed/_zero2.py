"""ZeRO-2 glue for ShardedOptimizer(..., shard_gradients=True): finding the parameters'
BucketedDDP, and gradient-norm clipping when each rank holds only its own gradients."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_flashsys.distributed._verify import collective_device


def find_wrapper(
    params: Sequence[torch.Tensor], index: Mapping[torch.Tensor, int], global_ranks: list[int]
) -> tuple[Any, str | None]:
    """The BucketedDDP that synchronizes every trainable one of ``params`` (the optimizer's, with
    ``index`` their positions), or ``(None, problem)``. ``problem`` reads after "needs": the rule
    broken, then (after ";") the details, which may differ across ranks."""
    from torch_flashsys.distributed.ddp import wrapper_of

    trainable = [(i, p) for i, p in enumerate(params) if p.requires_grad]
    wrappers = {id(w): w for _, p in trainable if (w := wrapper_of(p)) is not None}
    if len(wrappers) != 1:
        found = "none" if not wrappers else f"{len(wrappers)} different ones"
        return None, (
            "the parameters to be wrapped by one BucketedDDP, built before the optimizer "
            f"(BucketedDDP(model), then ShardedOptimizer(model.parameters(), ...)); found {found}"
        )
    ddp = next(iter(wrappers.values()))
    for i, p in trainable:
        if wrapper_of(p) is not ddp:
            return None, (
                "every trainable parameter to be synchronized by the BucketedDDP; parameter "
                f"{i} (shape {tuple(p.shape)}) is not"
            )
    for p, name in zip(ddp._params, ddp._names, strict=True):
        if p not in index:
            return None, (
                f"every parameter of the BucketedDDP in the optimizer; {name!r} is not (its "
                "gradient would have no owner)"
            )
    if ddp._comm_hook is not None:
        return None, (
            "a BucketedDDP without a communication hook (register_comm_hook); ZeRO-2 reduces "
            "each bucket to its owner rank instead of all-reducing it"
        )
    group = ddp.process_group if ddp.process_group is not None else dist.group.WORLD
    ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    if ranks != global_ranks:
        return None, (
            "the BucketedDDP and the optimizer to use the same process group; the BucketedDDP's "
            f"has global ranks {ranks}, the optimizer's {global_ranks}"
        )
    return ddp, None


@torch.no_grad()
def clip_grad_norm(
    owned: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` when the gradients are split across ``group``: the norm
    of the ``owned`` parameters' gradients on each rank (every parameter owned by exactly one
    rank), combined by one all-reduce; then every gradient of ``params`` present is scaled."""
    norm_type = float(norm_type)
    device = collective_device(group)
    grads = [p.grad for p in owned if p.grad is not None]
    norms = [torch.linalg.vector_norm(g, norm_type).double().to(device) for g in grads]
    if not norms:
        local = torch.zeros((), dtype=torch.float64, device=device)
    elif norm_type == math.inf:
        local = torch.stack(norms).max()
    else:
        local = torch.stack(norms).pow(norm_type).sum()
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    dist.all_reduce(local, op=op, group=group)
    total = local if norm_type == math.inf else local.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"ShardedOptimizer.clip_grad_norm_: the total norm of order {norm_type} of the "
            "gradients is non-finite, so it cannot be clipped (error_if_nonfinite=True)"
        )
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
    return total.float()
