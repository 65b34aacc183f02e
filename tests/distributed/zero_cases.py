"""Rank bodies for tests/distributed/test_sharded_optimizer.py (run through harness.run_distributed).

``run_training_cases`` trains, on every rank, one model with ShardedOptimizer and an identical copy
with the plain optimizer (same data on every rank, so the plain one is the exact reference), over
a list of drawn cases, and returns what the parent test compares. A case is a dict:

    seed, optimizer ("sgd" | "adam" | "adamw"), vocab, d, widths (hidden sizes), tied (output
    weight = embedding), frozen (a frozen layer), float64 (one layer in float64), scalar (a 0-dim
    parameter), groups (1-3 param groups with different hyperparameters), steps, closure,
    scheduler (StepLR), add_group (a layer unfrozen and added mid-training), checkpoint (None |
    "consolidated" | "sharded": save after half the steps, rebuild, load, continue),
    tiny_chunks (exchange chunks of a few bytes, so the pipelined step runs in several chunks)
"""

from __future__ import annotations

import copy
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn

from torch_flashsys import ShardedOptimizer
from torch_flashsys.distributed import _sharding

_DEFAULT_MIN_CHUNK, _DEFAULT_CHUNKS = _sharding._MIN_CHUNK_BYTES, _sharding._CHUNKS_PER_RANK

# The process group the training cases shard over (None: the world; see
# run_training_cases_on_subgroup), set per rank process.
_GROUP: dist.ProcessGroup | None = None


def _group_size() -> int:
    return dist.get_world_size(_GROUP)


def _group_rank() -> int:
    return dist.get_rank(_GROUP)


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


class ZeroNet(nn.Module):
    """tokens (batch,) -> logits (batch, vocab): embedding, MLP (maybe one float64 layer), head."""

    def __init__(self, case: dict) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(case["seed"])
        vocab, d = case["vocab"], case["d"]
        self.embed = nn.Embedding(vocab, d)
        dims = [d, *case["widths"], d]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        if case["float64"]:
            self.layers[0].double()
        self.late = nn.Linear(d, d)  # frozen until added mid-training (case["add_group"])
        self.late.requires_grad_(False)
        self.head = nn.Linear(d, vocab, bias=False)
        if case["tied"]:
            self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.tensor(1.0)) if case["scalar"] else None
        self.unused = nn.Linear(2, 3)  # in the optimizer, never gets a gradient
        if case["frozen"]:
            self.layers[-1].requires_grad_(False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype))).to(self.embed.weight.dtype)
        x = x + self.late(x)
        if self.scale is not None:
            x = x * self.scale
        return self.head(x)


def hyperparameters(case: dict, group: int) -> dict:
    """Different hyperparameters per group (group -1: the defaults passed as kwargs)."""
    lr = 0.05 * (1 + group + 1) / 2
    if case["optimizer"] == "sgd":
        return {"lr": lr, "momentum": 0.9, "weight_decay": 0.01 * (group + 1)}
    if case["optimizer"] == "adam":
        return {"lr": lr, "betas": (0.9, 0.99 - 0.01 * (group + 1)), "weight_decay": 0.0}
    return {"lr": lr, "weight_decay": 0.1 * (group + 1)}


def param_groups(model: ZeroNet, case: dict) -> list[dict]:
    """The model's parameters (frozen and unused included, ``late`` excluded) in case["groups"]."""
    params = [p for n, p in model.named_parameters() if not n.startswith("late.")]
    groups = [
        {"params": params[i :: case["groups"]], **hyperparameters(case, i)}
        for i in range(case["groups"])
    ]
    return [g for g in groups if g["params"]]


def _device() -> torch.device:
    """cuda:<local rank> under NCCL (the multigpu test), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def batch(case: dict, step: int, n: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["seed"] * 1000 + step)
    return torch.randint(0, case["vocab"], (n,), generator=g).to(_device())


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-element state (state tensors shaped like their parameter; not step counts)."""
    return sum(
        v.numel() * v.element_size()
        for p, s in optimizer.state.items()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0
    )


class _CountBroadcasts:
    """Counts torch.distributed.broadcast calls while active (ShardedOptimizer calls it by name)."""

    def __enter__(self):
        self.count, self._orig = 0, dist.broadcast

        def counting(*args, **kwargs):
            self.count += 1
            return self._orig(*args, **kwargs)

        dist.broadcast = counting
        return self

    def __exit__(self, *exc):
        dist.broadcast = self._orig


class _Trainer:
    """One model + optimizer (sharded or plain) following a case's schedule."""

    def __init__(self, case: dict, sharded: bool, model: ZeroNet | None = None) -> None:
        self.case, self.sharded = case, sharded
        self.model = model if model is not None else ZeroNet(case).to(_device())
        cls, groups = OPTIMIZERS[case["optimizer"]], param_groups(self.model, case)
        defaults = hyperparameters(case, -1)
        if sharded:
            self.opt = ShardedOptimizer(groups, cls, process_group=_GROUP, **defaults)
        else:
            self.opt = cls(groups, **defaults)
        self.sched = (
            torch.optim.lr_scheduler.StepLR(self.opt, 1, 0.7) if case["scheduler"] else None
        )

    def add_late_group(self) -> None:
        self.model.late.requires_grad_(True)
        self.opt.add_param_group({"params": list(self.model.late.parameters()), "lr": 0.02})

    def step(self, step: int) -> float:
        tokens = batch(self.case, step)

        def closure():
            self.opt.zero_grad()
            loss = nn.functional.cross_entropy(self.model(tokens), tokens)
            loss.backward()
            return loss

        if self.case["closure"]:
            loss = self.opt.step(closure)
        else:
            loss = closure()
            self.opt.step()
        if self.sched is not None:
            self.sched.step()
        self.opt.zero_grad(set_to_none=step % 2 == 0)
        return float(loss.detach())


def _rebuild(old: _Trainer, added: bool) -> _Trainer:
    """A fresh model (same parameter values) and a fresh optimizer, as after a restart."""
    model = copy.deepcopy(old.model)
    case = dict(old.case, scheduler=False)
    new = _Trainer(case, old.sharded, model)
    if added:
        new.opt.add_param_group({"params": list(model.late.parameters()), "lr": 0.02})
    new.case = old.case
    if old.sched is not None:
        new.sched = torch.optim.lr_scheduler.StepLR(new.opt, 1, 0.7)
        new.sched.load_state_dict(old.sched.state_dict())
    return new


def _checkpoint(trainer: _Trainer, plain: _Trainer, tmpdir: str, tag: str) -> dict:
    """Save trainer's optimizer in case["checkpoint"] form, rebuild, load; compare formats."""
    rank, out = _group_rank(), {}
    kind, added = trainer.case["checkpoint"], trainer.model.late.weight.requires_grad
    if kind == "consolidated":
        trainer.opt.consolidate_state_dict(to=_group_size() - 1)
        path = os.path.join(tmpdir, f"{tag}.pt")
        if rank == _group_size() - 1:
            sd = trainer.opt.state_dict()
            torch.save(sd, path)
            # The plain format, loadable by the plain optimizer class:
            fresh = _rebuild(plain, added)
            fresh.opt.load_state_dict(copy.deepcopy(sd))
            out["consolidated"], out["plain_sd"] = sd, copy.deepcopy(plain.opt.state_dict())
            out["reloaded_plain_sd"] = fresh.opt.state_dict()
        dist.barrier(group=_GROUP)
        sd = torch.load(path)
        new = _rebuild(trainer, added)
        new.opt.load_state_dict(sd)
    else:
        path = os.path.join(tmpdir, f"{tag}_rank{rank}.pt")
        torch.save(trainer.opt.sharded_state_dict(), path)
        new = _rebuild(trainer, added)
        new.opt.load_sharded_state_dict(torch.load(path))
    trainer.model, trainer.opt, trainer.sched = new.model, new.opt, new.sched
    return out


def train_case(case: dict, tmpdir: str, tag: str) -> dict:
    torch.manual_seed(0)
    _sharding._MIN_CHUNK_BYTES = 1 if case.get("tiny_chunks") else _DEFAULT_MIN_CHUNK
    _sharding._CHUNKS_PER_RANK = 10**6 if case.get("tiny_chunks") else _DEFAULT_CHUNKS
    sharded, plain = _Trainer(case, True), _Trainer(case, False)
    out: dict = {"broadcasts": []}
    for step in range(case["steps"]):
        if case["add_group"] and step == 1:
            sharded.add_late_group()
            plain.add_late_group()
        if case["checkpoint"] and step == case["steps"] // 2:
            out.update(_checkpoint(sharded, plain, tmpdir, tag))
        with _CountBroadcasts() as counter:
            out.setdefault("losses", []).append((sharded.step(step), plain.step(step)))
        out["broadcasts"].append(counter.count)
    trainable_dtypes = {p.dtype for p in sharded.model.parameters() if p.requires_grad}
    # Coalesced: one broadcast per (owner, dtype) and chunk, not one per parameter (tiny
    # chunks: one parameter per chunk, so no bound).
    chunks = _DEFAULT_CHUNKS + 1 if not case.get("tiny_chunks") else 10**6
    out["max_broadcasts"] = _group_size() * len(trainable_dtypes) * chunks
    out["pipelined"] = len(getattr(sharded.opt, "_chunks", ())) > 1
    out["owned_trainable"] = sum(p.requires_grad for p in sharded.opt._owned(sharded.opt._params))
    out["sharded"] = [p.detach().cpu().clone() for p in sharded.model.parameters()]
    out["plain"] = [p.detach().cpu().clone() for p in plain.model.parameters()]
    out["state_bytes"] = state_bytes(sharded.opt.optim)
    out["total_state_bytes"] = state_bytes(plain.opt)
    # Owners are balanced by parameter bytes (greedy, so each rank owns at most an equal share
    # plus the largest parameter), but only parameters that received a gradient have state (the
    # model's `unused` layer has none): bound a rank's state by its worst-case owned bytes times
    # the most state per parameter byte.
    params = {id(p): p for g in plain.opt.param_groups for p in g["params"] if p.requires_grad}
    sizes = [p.numel() * p.element_size() for p in params.values()]
    per_byte = max(
        (
            sum(v.numel() * v.element_size() for v in s.values() if v.shape == p.shape)
            / (p.numel() * p.element_size())
            for p, s in plain.opt.state.items()
            if p.numel()
        ),
        default=0.0,
    )
    out["state_bound"] = per_byte * (sum(sizes) / _group_size() + max(sizes, default=0))
    out["lr"] = [g["lr"] for g in sharded.opt.param_groups]
    out["plain_lr"] = [g["lr"] for g in plain.opt.param_groups]
    return out


def run_training_cases(rank: int, world_size: int, cases: list[dict], tmpdir: str) -> list[dict]:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return [train_case(case, tmpdir, f"case{i}") for i, case in enumerate(cases)]


def run_training_cases_on_subgroup(
    rank: int, world_size: int, cases: list[dict], tmpdir: str
) -> list[dict] | None:
    """The training cases on ``process_group=new_group([1, ..., world_size - 1])``: rank 0 only
    takes part in creating the group, so group rank r is global rank r + 1 (each owner's
    broadcast must name its global rank)."""
    global _GROUP
    group = dist.new_group(list(range(1, world_size)))
    if rank == 0:
        return None
    _GROUP = group
    try:
        return run_training_cases(rank, world_size, cases, tmpdir)
    finally:
        _GROUP = None


def run_with_ddp(rank: int, world_size: int, case: dict) -> dict[str, dict]:
    """Both wrappers, each built before and after the optimizer."""
    return {
        f"{wrapper}{' optimizer first' * first}": _train_with_ddp(rank, case, wrapper, first)
        for wrapper in ("bucketed", "torch")
        for first in (False, True)
    }


def _train_with_ddp(rank: int, case: dict, wrapper: str, optimizer_first: bool) -> dict:
    """ShardedOptimizer under a DDP wrapper, each rank on its own slice of the batch, vs the plain
    optimizer on the whole batch in one process (float64, so only summation order differs)."""
    from torch_flashsys import BucketedDDP

    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.manual_seed(rank)  # the wrappers broadcast rank 0's parameters: start from different ones
    model = ZeroNet(dict(case, seed=case["seed"] + rank)).double().to(_device())
    cls, defaults = OPTIMIZERS[case["optimizer"]], hyperparameters(case, -1)
    if optimizer_first:
        opt = ShardedOptimizer(param_groups(model, case), cls, **defaults)
    if wrapper == "bucketed":
        ddp = BucketedDDP(model, bucket_size_mb=case["bucket_mb"])
    else:
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    if not optimizer_first:
        opt = ShardedOptimizer(param_groups(model, case), cls, **defaults)
    reference = ZeroNet(case).double().to(_device())  # rank 0's initial parameters
    plain = cls(param_groups(reference, case), **defaults)
    world_size = dist.get_world_size()
    for step in range(case["steps"]):
        tokens = batch(case, step, 4 * world_size)
        mine = tokens.view(world_size, 4)[rank]
        nn.functional.cross_entropy(ddp(mine), mine).backward()
        opt.step()
        opt.zero_grad()
        nn.functional.cross_entropy(reference(tokens), tokens).backward()
        plain.step()
        plain.zero_grad()
    return {
        "sharded": [p.detach().cpu() for p in model.parameters()],
        "plain": [p.detach().cpu() for p in reference.parameters()],
        "state_bytes": state_bytes(opt.optim),
        "total_state_bytes": state_bytes(plain),
    }


# ------------------------------------------------------------ hooks and loads (plain's contract)


def _small_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def hooks_and_loads(rank: int, world_size: int) -> dict:
    """Per optimizer kind ("ours", "plain"): the load_state_dict pre/post hooks' calls and the lr
    a pre-hook's replacement dict set; the AdamW flag after loading an Adam checkpoint; and,
    under Join with rank 0 training 4 steps and the others 2 (BucketedDDP), the step pre/post
    hook calls on this rank (a joined rank's shadow steps count, as torch ZeRO's)."""
    from torch.distributed.algorithms import Join

    from torch_flashsys import BucketedDDP

    adam = torch.optim.Adam(_small_net(0).parameters(), lr=1e-2, weight_decay=0.1)
    out: dict = {}
    for kind in ("ours", "plain"):
        net = _small_net(1)
        if kind == "ours":
            opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        calls: list[str] = []

        def pre(o, sd, calls=calls):
            calls.append("pre")
            sd = copy.deepcopy(sd)
            sd["param_groups"][0]["lr"] = 0.123
            return sd

        opt.register_load_state_dict_pre_hook(pre)
        opt.register_load_state_dict_post_hook(lambda o, calls=calls: calls.append("post"))
        opt.load_state_dict(adam.state_dict())
        out[f"{kind}/load hooks"] = calls
        out[f"{kind}/lr"] = opt.param_groups[0]["lr"]
        out[f"{kind}/decoupled"] = opt.param_groups[0].get("decoupled_weight_decay")
    net = _small_net(2)
    model = BucketedDDP(net)
    opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
    counts = [0, 0]
    opt.register_step_pre_hook(lambda o, a, k: counts.__setitem__(0, counts[0] + 1))
    opt.register_step_post_hook(lambda o, a, k: counts.__setitem__(1, counts[1] + 1))
    g = torch.Generator().manual_seed(rank)
    with Join([model, opt]):
        for _ in range(4 if rank == 0 else 2):
            opt.zero_grad()
            model(torch.randn(3, 4, generator=g, dtype=torch.float64)).pow(2).mean().backward()
            opt.step()
    out["join step hooks"] = counts
    return out
