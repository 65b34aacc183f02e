"""Rank bodies for tests/distributed/test_zero2.py: ZeRO-2 (BucketedDDP + ShardedOptimizer(...,
shard_gradients=True)) against ZeRO-1 and against one process training on the whole batch.

A case is a dict: seed, optimizer ("sgd" | "adam" | "adamw"), vocab, d, widths, tied, frozen,
scalar, groups, steps (as in zero_cases.py), plus
    dtype: "float64" (the whole model) | "mixed" (float32 with one float64 layer)
    bucket_mb: BucketedDDP's bucket_size_mb (None, 0, or small: many buckets per owner)
    micro: micro-batches per step (the first ones under no_sync())
    to_none: zero_grad(set_to_none=...) after each step
    clip: None or the norm type of ShardedOptimizer.clip_grad_norm_ (max_norm 0.5)
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.zero_cases import (
    OPTIMIZERS,
    ZeroNet,
    batch,
    hyperparameters,
    param_groups,
    state_bytes,
)
from torch_flashsys import BucketedDDP, ShardedOptimizer

MAX_NORM = 0.5


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model(case: dict, seed: int) -> ZeroNet:
    model = ZeroNet(dict(case, seed=seed, float64=case["dtype"] == "mixed"))
    if case["dtype"] == "float64":
        model.double()
    return model.to(_device())


def _grad_bytes(params: list[torch.Tensor]) -> int:
    """Bytes of gradient memory this rank holds: distinct storages referenced by ``.grad``."""
    storages = {}
    for p in params:
        if p.grad is not None:
            s = p.grad.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _wrap(
    model: ZeroNet, case: dict, shard_gradients: bool
) -> tuple[BucketedDDP, ShardedOptimizer]:
    """``model`` in a BucketedDDP, and the case's optimizer sharded over its param groups."""
    ddp = BucketedDDP(model, bucket_size_mb=case["bucket_mb"])
    opt = ShardedOptimizer(
        param_groups(model, case),
        OPTIMIZERS[case["optimizer"]],
        shard_gradients=shard_gradients,
        **hyperparameters(case, -1),
    )
    return ddp, opt


def _sharded(case: dict, rank: int, shard_gradients: bool) -> tuple[BucketedDDP, ShardedOptimizer]:
    torch.manual_seed(rank)
    # BucketedDDP broadcasts rank 0's parameters
    return _wrap(_model(case, case["seed"] + rank), case, shard_gradients)


def train_zero2_case(rank: int, world: int, case: dict) -> dict:
    """ZeRO-2, ZeRO-1 and the plain optimizer on the whole batch, side by side, ``steps`` steps."""
    zero2, zero1 = _sharded(case, rank, True), _sharded(case, rank, False)
    reference = _model(case, case["seed"])  # rank 0's initial parameters
    plain = OPTIMIZERS[case["optimizer"]](
        param_groups(reference, case), **hyperparameters(case, -1)
    )
    out: dict = {
        "grad_bytes": [],
        "zero1_grad_bytes": [],
        "norms": [],
        "norm_dtypes": [],
        "kept": [],
    }
    out["owned_equal"], out["others_none"], out["released"] = [], [], []
    per = 4
    for step in range(case["steps"]):
        for m in range(case["micro"]):
            tokens = batch(dict(case, seed=case["seed"] * 31 + m), step, per * world)
            mine = tokens.view(world, per)[rank]
            last = m == case["micro"] - 1
            for ddp, _ in (zero2, zero1):
                with contextlib.nullcontext() if last else ddp.no_sync():
                    nn.functional.cross_entropy(ddp(mine), mine).backward()
            # the full batch at once is the same as the mean of the micro-batches' means x micro
            loss = nn.functional.cross_entropy(reference(tokens), tokens) / case["micro"]
            loss.backward()
        for ddp, _ in (zero2, zero1):
            for p in ddp.parameters():  # micro-batch sums -> means, as the reference
                if p.grad is not None and case["micro"] > 1:
                    p.grad.div_(case["micro"])
        # After the backward: ZeRO-2 keeps only this rank's gradients, equal to ZeRO-1's.
        ddp2, opt2 = zero2
        ddp1, _ = zero1
        params2, params1 = list(ddp2.parameters()), list(ddp1.parameters())
        owned = {id(p) for p in opt2._owned(opt2._params)}
        out["grad_bytes"].append(_grad_bytes(params2))
        out["zero1_grad_bytes"].append(_grad_bytes(params1))
        out["others_none"].append(
            all(p.grad is None for p in params2 if id(p) not in owned and p.requires_grad)
        )
        same = True
        for p2, p1 in zip(params2, params1, strict=True):
            if id(p2) in owned and p2.requires_grad:
                if (p2.grad is None) != (p1.grad is None):
                    same = False
                elif p2.grad is not None:
                    same &= torch.allclose(p2.grad, p1.grad, rtol=1e-6, atol=1e-7)
        out["owned_equal"].append(same)
        out["released"].append(all(b.buffer is None for b in ddp2._reducer.buckets if not b.keeps))
        out["kept"].append(sum(t.nbytes for t in ddp2._reducer.kept_buffers()))
        # each kept bucket after the first of a shared storage may start up to 63 bytes further
        out["pad_bytes"] = 64 * sum(b.keeps for b in ddp2._reducer.buckets)
        if case["clip"] is not None:
            norms = [opt.clip_grad_norm_(MAX_NORM, case["clip"]) for _, opt in (zero2, zero1)]
            ref = torch.nn.utils.clip_grad_norm_(
                [p for p in reference.parameters() if p.grad is not None], MAX_NORM, case["clip"]
            )
            out["norms"].append(tuple(n.item() for n in (*norms, ref)))
            out["norm_dtypes"].append(tuple(str(n.dtype) for n in (*norms, ref)))
        for _, opt in (zero2, zero1):
            opt.step()
            opt.zero_grad(set_to_none=case["to_none"])
        plain.step()
        plain.zero_grad(set_to_none=case["to_none"])
    trainable = [p for p in zero2[0].module.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in trainable]
    out["bound"] = sum(sizes) / world + max(sizes)
    out["flags_bytes"] = sum(8 for _ in trainable)  # one flag per parameter, <= 8 bytes each
    out["zero2"] = [p.detach().cpu() for p in zero2[0].module.parameters()]
    out["zero1"] = [p.detach().cpu() for p in zero1[0].module.parameters()]
    out["plain"] = [p.detach().cpu() for p in reference.parameters()]
    out["state_bytes"] = state_bytes(zero2[1].optim)
    return out


def run_zero2_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return [train_zero2_case(rank, world, case) for case in cases]


def run_world_one(rank: int, world: int, case: dict) -> dict:
    """World size 1: ShardedOptimizer is the plain optimizer (no copies, no collectives), with
    ZeRO-1 and ZeRO-2 alike; BucketedDDP still reduces (identity)."""
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(0)
    counts = {"collectives": 0}
    names = ("broadcast", "all_gather", "all_gather_into_tensor", "all_reduce", "reduce")
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*a, **k):
            counts["collectives"] += 1
            return real[name](*a, **k)

        return call

    out = {}
    for shard_gradients in (False, True):
        model = _model(case, case["seed"])
        ptrs = [p.data_ptr() for p in model.parameters()]
        ddp, opt = _wrap(model, case, shard_gradients)
        reference = _model(case, case["seed"])
        plain = OPTIMIZERS[case["optimizer"]](
            param_groups(reference, case), **hyperparameters(case, -1)
        )
        out[f"no_copies[{shard_gradients}]"] = ptrs == [p.data_ptr() for p in model.parameters()]
        for step in range(case["steps"]):
            tokens = batch(case, step, 4)
            nn.functional.cross_entropy(ddp(tokens), tokens).backward()
            nn.functional.cross_entropy(reference(tokens), tokens).backward()
            counts["collectives"] = 0
            for n in names:
                setattr(dist, n, counting(n))
            try:
                opt.step()
            finally:
                for n in names:
                    setattr(dist, n, real[n])
            out.setdefault(f"step_collectives[{shard_gradients}]", []).append(counts["collectives"])
            plain.step()
            opt.zero_grad()
            plain.zero_grad()
        out[f"params[{shard_gradients}]"] = [p.detach().cpu() for p in model.parameters()]
        out[f"plain[{shard_gradients}]"] = [p.detach().cpu() for p in reference.parameters()]
        out[f"buckets[{shard_gradients}]"] = len(opt._buckets)
    return out


def _accum_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def accumulate_across_backwards(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Gradient accumulation across synchronizing backwards (no zero_grad between them), with
    ZeRO-2, ZeRO-1 and one process on the whole batch (float64, SGD lr 0.1).

    A case: seed, bucket_mb, to_none (zero_grad mode after each step), and per step a list of
    backwards, each ``"sync"`` or ``"local"`` (a forward under no_sync()); every step ends with a
    synchronizing one. Returns per step each trainable parameter's gradient before the step
    (``None`` where this rank holds none: ZeRO-2's other ranks' parameters) and the final
    parameters."""
    per = 2
    results = []
    for case in cases:
        base = _accum_model(case["seed"])
        g = torch.Generator().manual_seed(case["seed"] + 1)
        batches = [
            [torch.randn(per * world, 3, generator=g, dtype=torch.float64) for _ in step]
            for step in case["steps"]
        ]
        out: dict = {}
        for kind in ("zero2", "zero1", "single"):
            model = copy.deepcopy(base)
            if kind == "single":
                wrapped = model
                opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            else:
                wrapped = BucketedDDP(model, bucket_size_mb=case["bucket_mb"])
                opt = ShardedOptimizer(
                    model.parameters(), torch.optim.SGD, lr=0.1, shard_gradients=kind == "zero2"
                )
            grads = []
            for modes, xs in zip(case["steps"], batches, strict=True):
                for mode, x in zip(modes, xs, strict=True):
                    mine = x if kind == "single" else x.view(world, per, 3)[rank]
                    local = mode == "local" and kind != "single"
                    with wrapped.no_sync() if local else contextlib.nullcontext():
                        wrapped(mine).pow(2).mean().backward()
                grads.append(
                    [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                )
                opt.step()
                opt.zero_grad(set_to_none=case["to_none"])
            out[kind] = {"grads": grads, "params": [p.detach().clone() for p in model.parameters()]}
            if kind == "zero2":
                owned = {id(p) for p in opt._owned(opt._params)}
                out["owned"] = [id(p) in owned for p in model.parameters()]
        results.append(out)
    return results


class _DeadNet(nn.Module):
    """Linear -> tanh -> Linear, plus ``dead``: in the graph, its gradient exactly zero (what
    makes the order-0 and order--inf norms differ from a sum of powers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 2)
        self.dead = nn.Parameter(torch.ones(4))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) + 0.0 * self.dead.sum()


def clip_every_norm_type(
    rank: int, world: int, norm_types: list[float], foreach: bool | None = None
) -> list[dict]:
    """Per norm type: one backward, then ShardedOptimizer.clip_grad_norm_ with ZeRO-1 and
    ZeRO-2 and torch.nn.utils.clip_grad_norm_ on one process's whole-batch gradients (float64).
    Returns the three norms and each parameter's clipped gradient (ZeRO-2: ``None`` where
    another rank owns it)."""
    per, out = 3, []
    x = torch.randn(per * world, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    zeros = {}
    for kind in ("zero2", "zero1"):
        ddp = BucketedDDP(_DeadNet())
        opt = ShardedOptimizer(
            ddp.parameters(), torch.optim.SGD, lr=0.1, shard_gradients=kind == "zero2"
        )
        zeros[kind] = (ddp, opt)
    reference = _DeadNet()
    for norm_type in norm_types:
        result: dict = {"norm_type": norm_type}
        for kind, (ddp, opt) in zeros.items():
            ddp(x.view(world, per, 3)[rank]).pow(2).mean().backward()
            result[kind] = opt.clip_grad_norm_(MAX_NORM, norm_type, foreach=foreach).item()
            result[kind + "_grads"] = [
                None if p.grad is None else p.grad.clone() for p in ddp.module.parameters()
            ]
            opt.zero_grad()
        reference(x).pow(2).mean().backward()
        result["single"] = torch.nn.utils.clip_grad_norm_(
            reference.parameters(), MAX_NORM, norm_type, foreach=foreach
        ).item()
        result["single_grads"] = [p.grad.clone() for p in reference.parameters()]
        reference.zero_grad()
        out.append(result)
    return out
