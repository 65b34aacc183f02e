"""Rank body for the ShardedOptimizer error table (tests/distributed/test_sharded_optimizer.py).

Each case runs on every rank (some with rank-dependent arguments, to check that cross-rank
mismatches raise on every rank instead of hanging); the body records, per case, the exception
each rank raised (``"TypeName: message"``) or ``None``. Cases run one after another in one
process group, so a case that left the ranks out of step would hang the next one (and the
harness's timeout would report it).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from torch_flashsys import BucketedDDP, ShardedOptimizer

SGD = torch.optim.SGD


def _params(*shapes: tuple[int, ...]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(s)) for s in shapes]


def _trained(tmpdir: str) -> ShardedOptimizer:
    params = _params((3, 4), (5,), (2, 2))
    opt = ShardedOptimizer(params, torch.optim.Adam, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _state_dict_before_consolidate(rank, tmpdir):
    _trained(tmpdir).state_dict()


def _state_dict_on_other_rank(rank, tmpdir):
    opt = _trained(tmpdir)
    opt.consolidate_state_dict(to=0)
    opt.state_dict()  # fine on rank 0 only


def _state_dict_after_step(rank, tmpdir):
    opt = _trained(tmpdir)
    opt.consolidate_state_dict(to=rank * 0)
    opt.step()  # makes the consolidated copy stale
    opt.state_dict()


def _consolidate_out_of_range(rank, tmpdir):
    _trained(tmpdir).consolidate_state_dict(to=dist.get_world_size())


def _consolidate_to_differs(rank, tmpdir):
    _trained(tmpdir).consolidate_state_dict(to=rank)


def _load_wrong_groups(rank, tmpdir):
    params = _params((3,), (4,))
    opt = ShardedOptimizer(params, SGD, lr=0.1)
    plain = SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
    opt.load_state_dict(plain.state_dict())


def _load_not_a_state_dict(rank, tmpdir):
    ShardedOptimizer(_params((3,)), SGD, lr=0.1).load_state_dict({"weights": 1})


def _load_shard_as_plain(rank, tmpdir):
    opt = _trained(tmpdir)
    opt.load_state_dict(opt.sharded_state_dict())


def _load_other_ranks_shard(rank, tmpdir):
    opt = _trained(tmpdir)
    torch.save(opt.sharded_state_dict(), os.path.join(tmpdir, f"shard{rank}.pt"))
    dist.barrier()
    other = (rank + 1) % dist.get_world_size()
    opt.load_sharded_state_dict(torch.load(os.path.join(tmpdir, f"shard{other}.pt")))


def _load_shard_of_other_model(rank, tmpdir):
    shard = _trained(tmpdir).sharded_state_dict()
    other = ShardedOptimizer(_params((3, 4), (6,), (2, 2)), torch.optim.Adam, lr=0.1)
    other.load_sharded_state_dict(shard)


def _load_shard_of_other_world_size(rank, tmpdir):
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank calls
    params = _params((3, 4), (5,), (2, 2))
    alone = ShardedOptimizer(params, torch.optim.Adam, process_group=groups[rank], lr=0.1)
    shard = alone.sharded_state_dict()  # saved at world size 1
    ShardedOptimizer(params, torch.optim.Adam, lr=0.1).load_sharded_state_dict(shard)


def _shapes_differ(rank, tmpdir):
    ShardedOptimizer(_params((3, 4 + rank), (5,)), SGD, lr=0.1)


def _lr_differs(rank, tmpdir):
    ShardedOptimizer(_params((3,)), SGD, lr=0.1 * (rank + 1))


def _optimizer_differs(rank, tmpdir):
    ShardedOptimizer(_params((3,)), [torch.optim.Adam, torch.optim.AdamW][rank % 2], lr=0.1)


class _NeedsClosure(SGD):
    """An optimizer whose step() cannot run without a closure."""

    def step(self, closure):  # type: ignore[override]
        return super().step(closure)


def _lbfgs_on_one_rank(rank, tmpdir):
    ShardedOptimizer(_params((3,)), [torch.optim.LBFGS, SGD][rank % 2], lr=0.1)


def _optimizer_rejects_on_one_rank(rank, tmpdir):
    ShardedOptimizer(_params((3,)), SGD, lr=0.1 if rank == 0 else -1.0)


def _not_a_member(rank, tmpdir):
    group = dist.new_group([0])  # every rank must call new_group
    ShardedOptimizer(_params((3,)), SGD, process_group=group, lr=0.1) if rank != 0 else None


def _add_group_differs(rank, tmpdir):
    opt = ShardedOptimizer(_params((3,)), SGD, lr=0.1)
    opt.add_param_group({"params": _params((2 + rank,))})


def _add_group_existing(rank, tmpdir):
    params = _params((3,), (4,))
    ShardedOptimizer(params, SGD, lr=0.1).add_param_group({"params": params[1:]})


def _add_group_not_dict(rank, tmpdir):
    ShardedOptimizer(_params((3,)), SGD, lr=0.1).add_param_group(_params((3,)))


def _zero2_not_bool(rank, tmpdir):
    ShardedOptimizer(_params((3,)), SGD, shard_gradients="yes", lr=0.1)


def _zero2_without_ddp(rank, tmpdir):
    ShardedOptimizer(_params((3,)), SGD, shard_gradients=True, lr=0.1)


def _zero2_torch_ddp(rank, tmpdir):
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    ShardedOptimizer(model.parameters(), SGD, shard_gradients=True, lr=0.1)


def _zero2_param_missing(rank, tmpdir):
    model = BucketedDDP(nn.Linear(3, 2))
    ShardedOptimizer([model.module.weight], SGD, shard_gradients=True, lr=0.1)


def _zero2_other_group(rank, tmpdir):
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank calls
    model = BucketedDDP(nn.Linear(3, 2), process_group=groups[rank])
    ShardedOptimizer(model.parameters(), SGD, shard_gradients=True, lr=0.1)


def _zero2_differs(rank, tmpdir):
    model = BucketedDDP(nn.Linear(3, 2))
    ShardedOptimizer(model.parameters(), SGD, shard_gradients=rank == 0, lr=0.1)


CASES = {
    "params: not tensors": lambda r, d: ShardedOptimizer([1, 2], SGD, lr=0.1),
    "params: a single tensor": lambda r, d: ShardedOptimizer(_params((3,))[0], SGD, lr=0.1),
    "params: empty": lambda r, d: ShardedOptimizer([], SGD, lr=0.1),
    "params: listed twice": lambda r, d: ShardedOptimizer(_params((3,)) * 2, SGD, lr=0.1),
    "params: in two groups": lambda r, d: ShardedOptimizer(
        [{"params": p} for p in [_params((3,))] * 2], SGD, lr=0.1
    ),
    "optimizer_cls: an instance": lambda r, d: ShardedOptimizer(
        _params((3,)), SGD(_params((3,)), lr=0.1)
    ),
    "optimizer_cls: a function": lambda r, d: ShardedOptimizer(_params((3,)), lambda p: p),
    "optimizer_cls: bad value": lambda r, d: ShardedOptimizer(_params((3,)), SGD, lr=-1.0),
    "optimizer_cls: unknown option": lambda r, d: ShardedOptimizer(
        _params((3,)), SGD, lr=0.1, betas=(0.9, 0.99)
    ),
    "optimizer_cls: LBFGS": lambda r, d: ShardedOptimizer(
        _params((3,), (4,)), torch.optim.LBFGS, lr=0.1
    ),
    "optimizer_cls: step requires a closure": lambda r, d: ShardedOptimizer(
        _params((3,), (4,)), _NeedsClosure, lr=0.1
    ),
    "process_group: wrong type": lambda r, d: ShardedOptimizer(
        _params((3,)), SGD, process_group="world", lr=0.1
    ),
    "process_group: not a member": _not_a_member,
    "process_group: positional, wrong type": lambda r, d: ShardedOptimizer(
        _params((3,)), SGD, "world", lr=0.1
    ),
    # ZeroRedundancyOptimizer's names (params, optimizer_class, process_group=None,
    # parameters_as_bucket_view=False, overlap_with_ddp=False, **defaults)
    "optimizer_class: with optimizer_cls too": lambda r, d: ShardedOptimizer(
        _params((3,)), SGD, optimizer_class=SGD, lr=0.1
    ),
    "optimizer_class: neither name": lambda r, d: ShardedOptimizer(_params((3,)), lr=0.1),
    "optimizer_class: an instance": lambda r, d: ShardedOptimizer(
        _params((3,)), optimizer_class=SGD(_params((3,)), lr=0.1)
    ),
    "overlap_with_ddp: True": lambda r, d: ShardedOptimizer(
        _params((3,)), SGD, overlap_with_ddp=True, lr=0.1
    ),
    "parameters_as_bucket_view: not a bool": lambda r, d: ShardedOptimizer(
        _params((3,)), SGD, parameters_as_bucket_view="yes", lr=0.1
    ),
    "ranks: shapes differ": _shapes_differ,
    "ranks: optimizer_cls rejects on one rank": _optimizer_rejects_on_one_rank,
    "ranks: lr differs": _lr_differs,
    "ranks: optimizer_cls differs": _optimizer_differs,
    "ranks: LBFGS on one rank": _lbfgs_on_one_rank,
    "add_param_group: differs across ranks": _add_group_differs,
    "add_param_group: parameter already present": _add_group_existing,
    "add_param_group: not a dict": _add_group_not_dict,
    "state_dict: before consolidate": _state_dict_before_consolidate,
    "state_dict: on another rank": _state_dict_on_other_rank,
    "state_dict: after a step": _state_dict_after_step,
    "consolidate_state_dict: to out of range": _consolidate_out_of_range,
    "consolidate_state_dict: to differs across ranks": _consolidate_to_differs,
    "load_state_dict: groups differ": _load_wrong_groups,
    "load_state_dict: not a state dict": _load_not_a_state_dict,
    "load_state_dict: given a shard": _load_shard_as_plain,
    "load_sharded_state_dict: another rank's shard": _load_other_ranks_shard,
    "load_sharded_state_dict: another model's shard": _load_shard_of_other_model,
    "load_sharded_state_dict: another world size": _load_shard_of_other_world_size,
    "shard_gradients: not a bool": _zero2_not_bool,
    "shard_gradients: no BucketedDDP": _zero2_without_ddp,
    "shard_gradients: torch DDP": _zero2_torch_ddp,
    "shard_gradients: a BucketedDDP parameter not in the optimizer": _zero2_param_missing,
    "shard_gradients: another process group": _zero2_other_group,
    "shard_gradients: differs across ranks": _zero2_differs,
}


def run_error_cases(rank: int, world_size: int, tmpdir: str) -> dict[str, str | None]:
    """Run every case of CASES; return case -> 'Type: message' (or None if it did not raise)."""
    torch.manual_seed(0)
    results: dict[str, str | None] = {}
    for name, case in CASES.items():
        try:
            case(rank, tmpdir)
            results[name] = None
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"
    return results
