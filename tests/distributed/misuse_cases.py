"""Rank bodies for tests/distributed/test_misuse.py: misuses that used to give silently wrong
results or hang, each of which must now raise on every rank (or, for GradScaler with ZeRO-2,
work as with ZeRO-1).

Bodies run their collectives on a process group with a short timeout, so that a regression
fails in seconds (a timeout error, or the harness's own bound) instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import gc
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from torch_flashsys import BucketedDDP, ShardedOptimizer

SHORT = datetime.timedelta(seconds=10)  # a group's collective timeout: a hang fails fast


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _backward(model: nn.Module) -> None:
    model(torch.randn(5, 4)).square().sum().backward()


# ------------------------------------------------------------------ double wrapping


def _ours_around_ours(group):
    BucketedDDP(BucketedDDP(_net(), process_group=group), process_group=group)


def _ours_twice(group):
    net = _net()
    first = BucketedDDP(net, process_group=group)
    BucketedDDP(net, process_group=group)
    del first


def _shared_parameters(group):
    shared = nn.Linear(4, 4)
    first = BucketedDDP(nn.Sequential(shared, nn.Linear(4, 2)), process_group=group)
    BucketedDDP(nn.Sequential(shared, nn.Linear(4, 3)), process_group=group)
    del first


def _ours_around_model_with_ours(group):
    net = _net()
    net[2] = BucketedDDP(net[2], process_group=group)
    BucketedDDP(net, process_group=group)


def _ours_around_torch(group):
    BucketedDDP(TorchDDP(_net(), process_group=group), process_group=group)


def _ours_around_model_with_torch(group):
    net = _net()
    net[0] = TorchDDP(net[0], process_group=group)
    BucketedDDP(net, process_group=group)


def _torch_around_ours(group):
    _backward(TorchDDP(BucketedDDP(_net(), process_group=group), process_group=group))


def _torch_on_our_module(group):
    net = _net()
    ours = BucketedDDP(net, process_group=group)
    _backward(TorchDDP(net, process_group=group))
    del ours


def _rewrap_after_delete(group):
    net = _net()
    first = BucketedDDP(net, process_group=group)
    _backward(first)
    del first
    gc.collect()
    _backward(BucketedDDP(net, process_group=group))


DOUBLE_WRAP: dict[str, Callable] = {
    "BucketedDDP(BucketedDDP(m))": _ours_around_ours,
    "BucketedDDP(m) twice": _ours_twice,
    "two BucketedDDP sharing a parameter": _shared_parameters,
    "BucketedDDP around a model holding a BucketedDDP": _ours_around_model_with_ours,
    "BucketedDDP(DDP(m))": _ours_around_torch,
    "BucketedDDP around a model holding a DDP": _ours_around_model_with_torch,
    "DDP(BucketedDDP(m))": _torch_around_ours,
    "DDP(m) beside BucketedDDP(m)": _torch_on_our_module,
    "rewrap after the first wrapper is gone": _rewrap_after_delete,
}


def double_wrap_errors(rank: int, world: int) -> dict[str, str]:
    """Each DOUBLE_WRAP case -> 'Type: message' or 'no error'; then a probe all-reduce."""
    group = dist.new_group(timeout=SHORT)
    out = {}
    for name, case in DOUBLE_WRAP.items():
        torch.manual_seed(rank)
        try:
            case(group)
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    probe = torch.ones(1)
    dist.all_reduce(probe, group=group)  # a rank left inside a collective would break this
    out["probe"] = probe.item()
    return out


# ------------------------------------------------------------------ requires_grad on one rank


def _layout_params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in [(3, 4), (5,), (2, 2), ()]]


def _step(opt: ShardedOptimizer, params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.step()


def requires_grad_one_rank(rank: int, world: int, frozen: list[int]) -> dict:
    """ShardedOptimizer.step after requires_grad_(False) on parameters ``frozen`` on the last
    rank only (must raise everywhere), then on every rank (must work, as the plain optimizer)."""
    group = dist.new_group(timeout=SHORT)
    params, ref = _layout_params(), _layout_params()
    opt = ShardedOptimizer(params, torch.optim.SGD, process_group=group, lr=0.1)
    plain = torch.optim.SGD(ref, lr=0.1)
    _step(opt, params)
    _step(plain, ref)
    out: dict = {}
    if rank == world - 1:
        for i in frozen:
            params[i].requires_grad_(False)
    try:
        _step(opt, params)
        out["one rank"] = "no error"
    except Exception as exc:
        out["one rank"] = f"{type(exc).__name__}: {exc}"
    for i in frozen:  # now the same on every rank: allowed
        params[i].requires_grad_(False)
        ref[i].requires_grad_(False)
    _step(opt, params)
    _step(plain, ref)
    out["params"] = [p.detach().clone() for p in params]
    out["plain"] = [p.detach().clone() for p in ref]
    return out


# ------------------------------------------------------------------ GradScaler with ZeRO


def _scaled_run(rank: int, group, zero2: bool | None, overflows: dict[int, int]) -> dict:
    """4 steps with torch.amp.GradScaler; at step s, ``overflows[s]`` is the index of the
    parameter whose gradient becomes inf on the last rank. ``zero2=None``: one process on the
    whole batch with the plain optimizer (the reference). Returns params and scales per step."""
    world = dist.get_world_size(group)
    torch.manual_seed(0)
    net = _net()
    if zero2 is None:
        model, opt = net, torch.optim.Adam(net.parameters(), lr=0.05)
    else:
        model = BucketedDDP(net, bucket_size_mb=0, process_group=group)
        opt = ShardedOptimizer(
            net.parameters(),
            torch.optim.Adam,
            process_group=group,
            shard_gradients=zero2,
            lr=0.05,
        )
    params = list(net.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    out: dict = {"params": [], "scales": []}
    for step in range(4):
        torch.manual_seed(100 + step)
        x = torch.randn(4 * world, 4)
        mine = x if zero2 is None else x[4 * rank : 4 * rank + 4]
        loss = model(mine).square().sum() / len(mine)  # mean: the ranks' average
        hit = overflows.get(step)
        handle = None
        if hit is not None and (zero2 is None or rank == world - 1):
            handle = params[hit].register_hook(lambda g: torch.full_like(g, float("inf")))
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out["params"].append([p.detach().clone() for p in params])
        out["scales"].append(scaler.get_scale())
    if zero2 is not None:
        out["owners"] = list(opt._owners)
    return out


def grad_scaler_overflow(rank: int, world: int, overflows: dict[int, int]) -> dict:
    """ZeRO-2, ZeRO-1 and one process, each with GradScaler and the same injected overflows."""
    group = dist.new_group(timeout=SHORT)
    return {
        "zero2": _scaled_run(rank, group, True, overflows),
        "zero1": _scaled_run(rank, group, False, overflows),
        "single": _scaled_run(rank, group, None, overflows),
    }
