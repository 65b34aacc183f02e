"""Rank bodies for tests/distributed/test_ddp_sparse.py: BucketedDDP over nn.Embedding and
nn.EmbeddingBag with ``sparse=True``, against torch DDP and one process on the whole batch.

Models (``kind``):
    plain:  Embedding(sparse) and EmbeddingBag(sparse) into a dense head (torch DDP handles it)
    unused: plus a sparse embedding used only by rank 0 on even steps (grad None elsewhere)
    tied:   the Embedding's weight also an output projection (sparse + dense -> dense grad)
    functional: plus F.embedding(..., sparse=True) on a plain parameter (not known as sparse:
            its gradient is summed into its dense bucket, so it ends dense)
Torch DDP raises for the last three (undefined sparse gradient; dense gradient of a sparse
parameter), so they are compared with single-process training only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.distributed.common import Batches, Wrap
from torch_flashsys import BucketedDDP, ShardedOptimizer

F64 = torch.float64
VOCAB, BAG_VOCAB, RARE_VOCAB, DIM = 23, 17, 9, 6


class SparseNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True, dtype=F64)
        self.bag = nn.EmbeddingBag(BAG_VOCAB, DIM, mode="sum", sparse=True, dtype=F64)
        self.head = nn.Linear(DIM, 4, dtype=F64)
        if kind == "unused":
            self.rare = nn.Embedding(RARE_VOCAB, DIM, sparse=True, dtype=F64)
        if kind == "tied":
            self.out = nn.Linear(DIM, VOCAB, bias=False, dtype=F64)
            self.out.weight = self.emb.weight
        if kind == "functional":
            self.table = nn.Parameter(torch.randn(VOCAB, DIM, dtype=F64))

    def forward(self, tokens: torch.Tensor, bag: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(1) + self.bag(bag)
        if self.kind == "unused" and flags.any():
            h = h + self.rare(tokens % RARE_VOCAB).mean(1) * flags[:, None].to(h.dtype)
        if self.kind == "functional":
            h = h + nn.functional.embedding(tokens, self.table, sparse=True).sum(1)
        out = self.head(torch.tanh(h))
        if self.kind == "tied":
            out = out + self.out(h)[:, :4]
        return out


def build(kind: str, seed: int) -> SparseNet:
    torch.manual_seed(seed)
    return SparseNet(kind)


def shard(seed: int, step: int, rank: int, micro: int = 0) -> tuple[tuple, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro * 101 + rank * 7)
    tokens = torch.randint(0, VOCAB, (3, 5), generator=g)
    bag = torch.randint(0, BAG_VOCAB, (3, 4), generator=g)
    flags = torch.zeros(3, dtype=torch.bool)
    flags[:2] = rank == 0 and (step + micro) % 2 == 0
    return (tokens, bag, flags), torch.randn(3, 4, generator=g, dtype=F64)


def full_batch(seed: int, step: int, world: int, micro: int = 0) -> tuple[tuple, torch.Tensor]:
    parts = [shard(seed, step, r, micro) for r in range(world)]
    args = tuple(torch.cat([p[0][i] for p in parts]) for i in range(3))
    return args, torch.cat([p[1] for p in parts])


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Parameters, gradients (dense copies: sparse ones compared by value) and their layouts."""
    named = list(model.named_parameters())
    sparse = [p.grad for _, p in named if p.grad is not None and p.grad.is_sparse]
    return {
        "params": {n: p.detach().cpu().clone() for n, p in named},
        "grads": {n: None if p.grad is None else p.grad.to_dense().cpu().clone() for n, p in named},
        "layouts": {n: None if p.grad is None else str(p.grad.layout) for n, p in named},
        "coalesced": all(g.is_coalesced() for g in sparse),
    }


def train(
    kind: str,
    seed: int,
    init_seed: int,
    wrap: Wrap,
    batches: Batches,
    sharded: str | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """SGD with momentum (it takes sparse gradients) over ``batches`` (per step, micro-batches:
    all but the last under no_sync()); ``sharded``: "zero1"/"zero2" for a ShardedOptimizer."""
    wrapped = wrap(build(kind, init_seed).to(device))
    module = getattr(wrapped, "module", wrapped)
    hyper = {"lr": 0.2, "momentum": 0.9}
    if sharded is None:
        opt = torch.optim.SGD(wrapped.parameters(), **hyper)
    else:
        opt = ShardedOptimizer(
            wrapped.parameters(), torch.optim.SGD, shard_gradients=sharded == "zero2", **hyper
        )
    for micro_batches in batches:
        opt.zero_grad()
        for i, (args, target) in enumerate(micro_batches):
            args, target = tuple(a.to(device) for a in args), target.to(device)
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last or wrapped is module else wrapped.no_sync():
                (wrapped(*args) - target).pow(2).mean().backward()
        if sharded is None:  # ZeRO-2: each rank holds its own gradients only
            grads = snapshot(module)
        opt.step()
    out = snapshot(module)
    if sharded is None:
        out["grads"], out["layouts"] = grads["grads"], grads["layouts"]
    else:
        del out["grads"], out["layouts"]
    return out


def torch_reference(rank: int, world: int, seed: int) -> dict[str, dict]:
    """Torch DDP on the ``plain`` model (gloo's sparse all-reduce), the batches of
    :func:`equivalence`. Its own spawned run: a process that dies (the suite saw two ranks die of
    heap corruption, once in BucketedDDP's first collective right after torch DDP had trained
    in that process) then says whose run it was."""
    out: dict[str, dict] = {}
    for micro in (1, 2):
        mine = [[shard(seed, s, rank, m) for m in range(micro)] for s in range(3)]
        out[f"plain/micro={micro}"] = train("plain", seed, seed + rank, TorchDDP, mine)
    return out


def equivalence(rank: int, world: int, seed: int) -> dict[str, dict]:
    out: dict[str, dict] = {}
    steps = 3
    for kind in ("plain", "unused", "tied"):
        for micro in (1, 2):
            mine = [[shard(seed, s, rank, m) for m in range(micro)] for s in range(steps)]
            res: dict[str, Any] = {}
            if rank == 0:
                full = [[full_batch(seed, s, world, m) for m in range(micro)] for s in range(steps)]
                res["single"] = train(kind, seed, seed, lambda m: m, full)
            for bs in (0, None):
                wrap = lambda m, bs=bs: BucketedDDP(m, bs)
                res[f"ours[{bs}]"] = train(kind, seed, seed + rank, wrap, mine)
            for sharded in ("zero1", "zero2"):
                res[sharded] = train(kind, seed, seed + rank, BucketedDDP, mine, sharded)
            out[f"{kind}/micro={micro}"] = res
    mine = [[shard(seed, s, rank)] for s in range(steps)]
    res = {}
    if rank == 0:
        full = [[full_batch(seed, s, world)] for s in range(steps)]
        res["single"] = train("functional", seed, seed, lambda m: m, full)
    res["ours"] = train("functional", seed, seed + rank, BucketedDDP, mine)
    res["ours_copying"] = train("functional", seed, seed + rank, _copying, mine)
    out["functional"] = res
    return out


def _copying(model: nn.Module) -> BucketedDDP:
    """BucketedDDP without pointing grads at their views first: every gradient, the sparse one of
    ``table`` included, reaches the bucket through its hook (the copy path)."""
    ddp = BucketedDDP(model)
    ddp._prepoint = False
    return ddp


def nccl_run(rank: int, world: int, seed: int) -> dict[str, dict]:
    """On cuda:<rank> under NCCL: BucketedDDP against one process (torch DDP cannot: NCCL has no
    sparse all-reduce)."""
    torch.cuda.set_device(rank)
    device, out, steps = f"cuda:{rank}", {}, 2
    for kind in ("plain", "unused"):
        mine = [[shard(seed, s, rank)] for s in range(steps)]
        full = [[full_batch(seed, s, world)] for s in range(steps)]
        out[kind] = {
            "single": train(kind, seed, seed, lambda m: m, full, device=device),
            "ours": train(kind, seed, seed + rank, BucketedDDP, mine, device=device),
        }
    return out
