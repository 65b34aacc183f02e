"""Per-rank bodies for tests/distributed/test_torch_args.py: torch's own constructor calls of
DistributedDataParallel and ZeroRedundancyOptimizer, passed unchanged to BucketedDDP and
ShardedOptimizer (run via run_distributed, gloo on the CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.distributed.ddp_cases import _torch_ddp_local_buffers, build, shard, snapshot, train
from torch_flashsys import BucketedDDP, ShardedOptimizer

# torch DDP's call as users write it (device_ids=None: the module is on the CPU here; the NCCL
# test passes device_ids=[rank], output_device=rank). Every value is torch's meaning.
TORCH_CALL: dict[str, Any] = {
    "device_ids": None,
    "output_device": None,
    "dim": 0,
    "broadcast_buffers": True,
    "init_sync": True,
    "bucket_cap_mb": 0.0005,
    "find_unused_parameters": True,
    "check_reduction": False,
    "gradient_as_bucket_view": True,
    "static_graph": False,
}


def _with_rank0_buffers(kind: str, seed: int) -> Callable[[nn.Module], nn.Module]:
    """torch DDP without buffer broadcasts, on a module given rank 0's initial buffers: what
    ``forward_sync_buffers=False`` means (buffers synced at construction only)."""

    def wrap(module: nn.Module) -> nn.Module:
        with torch.no_grad():
            for mine, first in zip(module.buffers(), build(kind, seed, 0).buffers(), strict=True):
                mine.copy_(first)
        return _torch_ddp_local_buffers(module)

    return wrap


def ddp_names(rank: int, world: int, seed: int, steps: int = 3) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("branches", "norm", "mixed", "tied"):
        mine = [[shard(kind, seed, s, rank)] for s in range(steps)]
        out[f"call/{kind}/torch"] = train(
            kind, seed, rank, lambda m: TorchDDP(m, **TORCH_CALL), mine
        )
        out[f"call/{kind}/ours_torch_call"] = train(
            kind, seed, rank, lambda m: BucketedDDP(m, **TORCH_CALL), mine
        )
        out[f"call/{kind}/ours"] = train(kind, seed, rank, lambda m: BucketedDDP(m, 0.0005), mine)

    # init_sync=False: no broadcast at construction, each rank keeps its own initial values
    for kind in ("norm", "tied"):
        mine = [[shard(kind, seed, s, rank)] for s in range(steps)]
        out[f"nosync/{kind}/local"] = snapshot(build(kind, seed, rank))
        out[f"nosync/{kind}/constructed"] = snapshot(
            BucketedDDP(build(kind, seed, rank), init_sync=False).module
        )
        out[f"nosync/{kind}/torch"] = train(
            kind, seed, rank, lambda m: TorchDDP(m, init_sync=False), mine
        )
        out[f"nosync/{kind}/ours"] = train(
            kind, seed, rank, lambda m: BucketedDDP(m, init_sync=False), mine
        )

    # Buffers: forward_sync_buffers=False (torch 2.13) syncs them at construction only;
    # broadcast_buffers=None (torch 2.13's default) means True.
    mine = [[shard("norm", seed, s, rank)] for s in range(steps)]
    out["buffers/forward_sync_off/ours"] = train(
        "norm", seed, rank, lambda m: BucketedDDP(m, forward_sync_buffers=False), mine
    )
    out["buffers/forward_sync_off/torch"] = train(
        "norm", seed, rank, _with_rank0_buffers("norm", seed), mine
    )
    out["buffers/none/ours"] = train(
        "norm", seed, rank, lambda m: BucketedDDP(m, broadcast_buffers=None), mine
    )
    out["buffers/none/torch"] = train("norm", seed, rank, TorchDDP, mine)

    # A process group this rank is not a member of (new_group's answer to the others: an int)
    group = dist.new_group([0])
    try:
        BucketedDDP(nn.Linear(3, 2), process_group=group)
        out["non_member"] = None
    except Exception as exc:
        out["non_member"] = f"{type(exc).__name__}: {exc}"
    return out


def _zero_train(make: Callable[[Any], torch.optim.Optimizer], seed: int, steps: int = 3) -> dict:
    """Steps with the same gradients on every rank (as after DDP): the parameters must equal the
    plain optimizer's whatever the sharding."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 3)).double()
    opt = make(model.parameters())
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 31 + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


ADAMW = torch.optim.AdamW
HYPER = {"lr": 0.01, "weight_decay": 0.1}
# ZeroRedundancyOptimizer's calls: (params, optimizer_class, process_group=None,
# parameters_as_bucket_view=False, overlap_with_ddp=False, **defaults)
ZERO_CALLS: dict[str, tuple[tuple, dict]] = {
    "optimizer_class": ((), {"optimizer_class": ADAMW, **HYPER}),
    "positional": ((ADAMW, None, True, False), HYPER),
    "keywords": (
        (),
        {
            "optimizer_class": ADAMW,
            "process_group": None,
            "parameters_as_bucket_view": False,
            "overlap_with_ddp": False,
            **HYPER,
        },
    ),
}


def zero_names(rank: int, world: int, seed: int) -> dict[str, Any]:
    out = {"ours": _zero_train(lambda ps: ShardedOptimizer(ps, ADAMW, **HYPER), seed)}
    for name, (args, kwargs) in ZERO_CALLS.items():
        for tag, cls in (("ours", ShardedOptimizer), ("torch", ZeroRedundancyOptimizer)):
            out[f"{name}/{tag}"] = _zero_train(
                lambda ps, cls=cls, args=args, kwargs=kwargs: cls(ps, *args, **kwargs), seed
            )
    return out
