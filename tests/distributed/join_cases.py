"""Rank bodies for tests/distributed/test_ddp_join.py: uneven inputs under ``join()`` / ``Join``.

Rank ``r`` trains on ``batches_of(seed, r, world)`` batches, a different number per rank. Every
configuration is run by BucketedDDP (with AdamW or ShardedOptimizer) and by torch DDP doing the
same thing; the model has BatchNorm, so buffer broadcasts are shadowed too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.distributed import sparse_cases
from tests.distributed.common import attempt
from torch_flashsys import BucketedDDP, ShardedOptimizer
from torch_flashsys.distributed import _buckets

F64 = torch.float64


class JoinNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 12), nn.Linear(12, 4)
        )
        self.to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batches_of(seed: int, rank: int, world: int) -> int:
    """Uneven: between 1 and ``world`` batches, rank 0 the most or the fewest by seed."""
    return 1 + (rank + seed) % world


def batch(seed: int, step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro * 101 + rank * 7)
    return torch.randn(6, 8, generator=g, dtype=F64), torch.randn(6, 4, generator=g, dtype=F64)


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.cpu().clone() for n, b in model.named_buffers()},
    }


def run_uneven(
    seed: int,
    rank: int,
    world: int,
    wrap: Callable[[nn.Module], nn.Module],
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    context: Callable[[nn.Module, torch.optim.Optimizer], Any],
    micro: int = 1,
    build: Callable[[], nn.Module] = JoinNet,
    data: Callable[..., tuple] = batch,
    device: str = "cpu",
    schedule: bool = False,
) -> dict[str, Any]:
    """Train inside ``context(model, opt)`` on this rank's uneven share of batches; each step has
    ``micro`` micro-batches, all but the last under ``no_sync()``; ``schedule``: the learning
    rate halves after every step (an LR scheduler, stepped by the ranks still training)."""
    torch.manual_seed(seed + rank)  # the wrappers broadcast rank 0's initial state
    model = wrap(build().to(device))
    opt = make_opt(model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if schedule else None
    with context(model, opt):
        for step in range(batches_of(seed, rank, world)):
            for m in range(micro):
                x, target = _to(data(seed, step, rank, m), device)
                with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    out = model(*x) if isinstance(x, tuple) else model(x)
                    (out - target).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return snapshot(model.module)


def _to(tree: Any, device: str) -> Any:
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to(t, device) for t in tree)
    return tree.to(device)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _sharded(shard_gradients: bool) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: ShardedOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        shard_gradients=shard_gradients,
        lr=0.05,
        weight_decay=0.1,
    )


def _sharded_tensor_lr(model: nn.Module) -> torch.optim.Optimizer:
    lr = torch.tensor(0.05, dtype=torch.float64)
    return ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, weight_decay=0.1)


def _zero(model: nn.Module) -> torch.optim.Optimizer:
    return ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1)


def _model_join(divide: bool) -> Callable:
    return lambda model, opt: model.join(divide_by_initial_world_size=divide)


def _join_both(model: nn.Module, opt: torch.optim.Optimizer) -> Join:
    return Join([model, opt])


def _torch_ddp(model: nn.Module) -> TorchDDP:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TorchDDP(model)


def _with_hook(wrap: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    def wrapped(model: nn.Module) -> nn.Module:
        ddp = wrap(model)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp

    return wrapped


def _sparse_data(seed: int, step: int, rank: int, micro: int = 0) -> tuple:
    return sparse_cases.shard(seed, step, rank, micro)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def _averaging(model: nn.Module) -> BucketedDDP:
    """BucketedDDP reducing with ReduceOp.AVG where it may, as on NCCL."""
    ddp = BucketedDDP(model, 0)
    ddp._reducer._reduce_avg = True
    return ddp


@contextlib.contextmanager
def _emulated_avg(ops: list[str]) -> Iterator[None]:
    """BucketedDDP's all-reduces take ReduceOp.AVG as NCCL does for floating types (each rank's
    input times 1 / group size, then summed), on gloo; ``ops`` records "avg" or "sum" per call."""
    real = _buckets.all_reduce

    def all_reduce(group: dist.ProcessGroup, tensor: torch.Tensor, op: dist.ReduceOp) -> Any:
        ops.append("avg" if op == dist.ReduceOp.AVG else "sum")
        if op == dist.ReduceOp.AVG:
            tensor.div_(group.size())
            op = dist.ReduceOp.SUM
        return real(group, tensor, op)

    _buckets.all_reduce = all_reduce
    try:
        yield
    finally:
        _buckets.all_reduce = real


def single_uneven(seed: int, world: int, build: Callable, data: Callable) -> dict[str, Any]:
    """One process doing what join(divide_by_initial_world_size=True) computes: at step t the
    gradient of the sum of the mean losses of the ranks that still have a batch, / world."""
    torch.manual_seed(seed)  # rank 0's initial parameters
    model = build()
    opt = _sgd(model)
    counts = [batches_of(seed, r, world) for r in range(world)]
    for step in range(max(counts)):
        loss = 0.0
        for r in range(world):
            if step < counts[r]:
                x, target = data(seed, step, r)
                loss = loss + (model(*x) - target).pow(2).mean()
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
    return snapshot(model)


def _early_termination(rank: int, wrap: Callable, seed: int, world: int) -> str:
    """``throw_on_early_termination=True``: every rank raises once one runs out of inputs."""
    try:
        run_uneven(
            seed,
            rank,
            world,
            wrap,
            _adamw,
            lambda model, opt: model.join(throw_on_early_termination=True),
        )
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def uneven(rank: int, world: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ours = lambda bs: lambda m: BucketedDDP(m, bs)
    for divide in (True, False):
        ctx = _model_join(divide)
        out[f"divide={divide}/torch"] = run_uneven(seed, rank, world, _torch_ddp, _adamw, ctx)
        for bs in (0, None):
            out[f"divide={divide}/ours[{bs}]"] = run_uneven(
                seed, rank, world, ours(bs), _adamw, ctx
            )
    # ReduceOp.AVG (NCCL's averaging in the collective; emulated here, gloo has none): only
    # while every rank trains; once ranks have joined, the sum is divided by the ranks left.
    out["avg/ops"] = ops = []
    with _emulated_avg(ops):
        out["avg/ours"] = run_uneven(seed, rank, world, _averaging, _adamw, _model_join(False))
    # ShardedOptimizer in the same Join: every rank (joined or not) steps its shard with the
    # averaged gradients, so the result is plain AdamW's on the last rank to join.
    for name, shard in (("zero1", False), ("zero2", True)):
        out[f"sharded/ours_{name}"] = run_uneven(
            seed, rank, world, ours(0.0003), _sharded(shard), _join_both
        )
    # An LR scheduler stepped only by the ranks still training: joined ranks step their shard
    # with the current learning rate, not the one they had when they joined.
    out["schedule/torch"] = run_uneven(
        seed, rank, world, _torch_ddp, _adamw, _model_join(True), schedule=True
    )
    out["schedule/ours_zero1"] = run_uneven(
        seed, rank, world, ours(0), _sharded(False), _join_both, schedule=True
    )
    # ... also when the learning rate is a tensor (the scheduler fill_s it in place)
    out["schedule/ours_tensor_lr"] = run_uneven(
        seed, rank, world, ours(0), _sharded_tensor_lr, _join_both, schedule=True
    )
    # As torch's ZeroRedundancyOptimizer behind torch DDP (a joined rank steps with the
    # gradients it has; here None after zero_grad(), so its shard stays as it was).
    out["zero/torch"] = run_uneven(seed, rank, world, _torch_ddp, _zero, _join_both)
    out["zero/ours_behind_torch_ddp"] = run_uneven(
        seed, rank, world, _torch_ddp, _sharded(False), _join_both
    )
    # Gradient accumulation inside join: no_sync micro-batches are not shadowed as steps.
    ctx = _model_join(True)
    out["no_sync/torch"] = run_uneven(seed, rank, world, _torch_ddp, _adamw, ctx, micro=2)
    out["no_sync/ours"] = run_uneven(seed, rank, world, ours(0), _adamw, ctx, micro=2)
    out["no_sync/ours_zero2"] = run_uneven(
        seed, rank, world, ours(0), _sharded(True), _join_both, micro=2
    )
    # A communication hook: joined ranks run it on zero buckets, as torch DDP does.
    out["hook/torch"] = run_uneven(seed, rank, world, _with_hook(_torch_ddp), _adamw, ctx)
    out["hook/ours"] = run_uneven(seed, rank, world, _with_hook(ours(0)), _adamw, ctx)
    # Sparse gradients: joined ranks shadow their exchange too. (torch DDP's join cannot: its
    # joined ranks fail to build zero sparse buckets, so one process is the reference.)
    sparse = {"build": lambda: sparse_cases.SparseNet("plain"), "data": _sparse_data}
    out["sparse/ours"] = run_uneven(seed, rank, world, ours(0), _sgd, ctx, **sparse)
    out["sparse/single"] = single_uneven(seed, world, **sparse)

    out["early/torch"] = _early_termination(rank, _torch_ddp, seed, world)
    out["early/ours"] = _early_termination(rank, ours(0), seed, world)
    probe = torch.tensor([1.0])
    dist.all_reduce(probe)  # every rank left the Join contexts in step
    out["probe"] = probe.item()

    # enable=False: no uneven-input handling and no extra collective (even inputs)
    ddp = BucketedDDP(JoinNet(), 0)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with ddp.join(enable=False):
            x, target = batch(seed, 0, rank)
            (ddp(x) - target).pow(2).mean().backward()
    finally:
        dist.all_reduce = real
    out["disabled_calls"] = len(calls)
    ddp = BucketedDDP(JoinNet(), 0)
    out["bad_arguments"] = [
        attempt(lambda: ddp.join(divide_by_initial_world_size=1)),
        attempt(lambda: ddp.join(enable="yes")),
        attempt(lambda: Join([ddp], divide_by_initial_world_size=None)),
        attempt(lambda: run_uneven(seed, rank, world, ours(0), _adamw, _model_join(rank == 0))),
    ]
    out["wrong_order"] = wrong_order(rank)
    out["model_left_out"] = model_left_out(rank)
    return out


def wrong_order(rank: int) -> str:
    """Join([optimizer, model]): the model must come first (its forward opens an iteration)."""
    model = BucketedDDP(JoinNet(), 0)
    opt = _sharded(False)(model)
    try:
        with Join([opt, model]):
            x, target = batch(0, 0, rank)
            (model(x) - target).pow(2).mean().backward()
    except ValueError as exc:
        return str(exc)
    return "no error"


def nccl_uneven(rank: int, world: int, seed: int) -> dict[str, Any]:
    """On cuda:<rank> under NCCL: join() against torch DDP's, Join with ShardedOptimizer
    (ZeRO-1, ZeRO-2) against torch DDP + AdamW, a hook (world size 1: one rank, even inputs)."""
    torch.cuda.set_device(rank)
    device, out = f"cuda:{rank}", {}
    ours = lambda m: BucketedDDP(m, 0)
    ctx = _model_join(True)
    out["torch"] = run_uneven(seed, rank, world, _torch_ddp, _adamw, ctx, device=device)
    out["ours"] = run_uneven(seed, rank, world, ours, _adamw, ctx, device=device)
    for name, shard in (("zero1", False), ("zero2", True)):
        out[name] = run_uneven(seed, rank, world, ours, _sharded(shard), _join_both, device=device)
    out["hook/torch"] = run_uneven(
        seed, rank, world, _with_hook(_torch_ddp), _adamw, ctx, device=device
    )
    out["hook/ours"] = run_uneven(seed, rank, world, _with_hook(ours), _adamw, ctx, device=device)
    return out


def model_left_out(rank: int) -> str:
    """Join([optimizer]) over a BucketedDDP's parameters: its joined ranks would not shadow the
    gradient reductions, so the first step() raises (on every rank alike)."""
    model = BucketedDDP(JoinNet(), 0)
    opt = _sharded(False)(model)
    try:
        with Join([opt]):
            x, target = batch(0, 0, rank)
            (model(x) - target).pow(2).mean().backward()
            opt.step()
    except ValueError as exc:
        return str(exc)
    return "no error"
