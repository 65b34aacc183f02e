"""Uneven inputs: the ``torch.distributed.algorithms.Join`` protocol shared by BucketedDDP and
ShardedOptimizer. A leaf: what each hook does lives beside its owner (``BucketedDDP._join_shadow``
/ ``_join_final_sync`` in ``ddp.py``, ``ShardedOptimizer._join_shadow_step`` in
``sharded_optimizer.py``), as torch keeps ``_DDPJoinHook`` beside DDP; here are the hook class
they fill in, the collectives they share, and the ``join_device`` of both.

Inside ``with Join([model, optimizer]):`` (or ``model.join()``), each rank still training announces
every forward with one all-reduce of ``[syncs, broadcasts buffers, 1 at its own rank]``; a rank that
ran out of inputs (joined) contributes zeros to it and learns from the sum what the others will
do: whether their backward synchronizes (then it shadows every bucket's reduction with zeros,
and receives the average, so a joined owner can still step its shard of a ShardedOptimizer),
whether buffers are broadcast and from which rank (the highest rank still training, as torch
DDP), and how many ranks are still training (the divisor when
``divide_by_initial_world_size=False``). When every rank has joined, the model of the highest
last-joining rank is broadcast to all (torch DDP's ``_sync_final_model``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, JoinHook, _JoinConfig

from torch_flashsys.distributed._verify import collective_device


class JoinState(NamedTuple):
    """What the ranks still training do in this iteration (from :func:`exchange_join_state`)."""

    sync: bool  # their backward synchronizes gradients
    broadcast_buffers: bool  # they broadcast buffers before the forward
    active: int  # how many ranks have not joined
    source: int  # group rank buffers come from: the highest one still training


def exchange_join_state(
    group: dist.ProcessGroup,
    sync: bool,
    broadcast_buffers: bool,
    joined: bool,
    divide: bool,
    guard: Callable[[Callable[[], Any]], Any] = lambda fn: fn(),
) -> JoinState:
    """One all-reduce (run through ``guard``): ranks still training contribute their plans,
    joined ranks zeros; every rank also its ``divide_by_initial_world_size``, which must be the
    same everywhere (else every rank raises the same ``ValueError``)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    info = [0.0] * (3 + world)
    if not joined:
        info[0], info[1], info[3 + rank] = float(sync), float(broadcast_buffers), 1.0
    info[2] = float(divide)
    tensor = torch.tensor(info, device=collective_device(group))
    guard(lambda: dist.all_reduce(tensor, group=group))
    values = tensor.tolist()
    if values[2] not in (0.0, float(world)):
        raise ValueError(
            f"BucketedDDP.join: divide_by_initial_world_size differs across ranks ({values[2]:.0f}"
            f" of {world} ranks passed True); pass the same value on every rank"
        )
    active = [r for r in range(world) if values[3 + r] > 0]
    return JoinState(values[0] > 0, values[1] > 0, len(active), max(active, default=0))


def last_joiner(group: dist.ProcessGroup, is_last_joiner: bool) -> int:
    """The highest group rank among the last to join (every rank agrees), torch DDP's rule."""
    rank = dist.get_rank(group) if is_last_joiner else -1
    tensor = torch.tensor([rank], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


def disabled() -> _JoinConfig:
    """The join configuration outside a Join context."""
    return _JoinConfig.construct_disabled_join_config()


class OwnerJoinHook(JoinHook):
    """A joinable's ``Join`` hook, made of two of its owner's own steps (so the hook's behaviour
    lives beside its owner, as torch's ``_DDPJoinHook`` beside DDP, and this leaf knows no owner):
    ``main()`` on a joined rank, once per collective step of the ranks still training;
    ``post(is_last_joiner)`` once every rank has joined."""

    def __init__(self, main: Callable[[], None], post: Callable[[bool], None]) -> None:
        super().__init__()
        self.main, self.post = main, post

    def main_hook(self) -> None:
        self.main()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.post(is_last_joiner)


class GroupJoinable(Joinable):
    """A ``Joinable`` whose ``Join`` collectives go over its ``join_process_group``."""

    @property
    def join_device(self) -> torch.device:
        """Device of the ``Join`` context's own collectives (CUDA under NCCL)."""
        return collective_device(self.join_process_group)


def _numbers(value: Any) -> list[float] | None:
    """The numbers of a hyperparameter (a number, a bool, a tuple/list of them, or a one-element
    tensor), or None."""
    if isinstance(value, (bool, int, float)):
        return [float(value)]
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value):
        return [float(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return [float(value.item())]  # e.g. lr=torch.tensor(...), which schedulers fill_ in place
    return None


def sync_hyperparameters(
    groups: list[dict[str, Any]], group: dist.ProcessGroup, joined: bool
) -> None:
    """Give joined ranks the numeric hyperparameters of the ranks still training (e.g. the
    learning rate an LR scheduler set after this rank joined): one all-reduce of their maximum,
    joined ranks contributing -inf. Every rank must have the same keys (checked at construction)."""
    slots: list[tuple[dict[str, Any], str, Any, int]] = []
    flat: list[float] = []
    for g in groups:
        for key in sorted(k for k in g if k not in ("params", "param_names")):
            numbers = _numbers(g[key])
            if numbers is not None:
                slots.append((g, key, g[key], len(numbers)))
                flat += [-math.inf] * len(numbers) if joined else numbers
    if not flat:
        return
    tensor = torch.tensor(flat, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    if not joined:
        return
    values, i = tensor.tolist(), 0
    for g, key, old, n in slots:
        new = values[i : i + n]
        i += n
        if isinstance(old, torch.Tensor):  # in place: the local optimizer shares the tensor
            old.fill_(new[0])
        elif isinstance(old, (tuple, list)):
            g[key] = type(old)(type(o)(v) for o, v in zip(old, new, strict=True))
        else:
            g[key] = type(old)(new[0])
