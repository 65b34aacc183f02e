"""Models, data and per-rank bodies for tests/distributed/test_ddp.py (run via run_distributed).

Every body trains the same model three ways on the same data: BucketedDDP, torch DDP, and plain
single-process training on the full batch (the concatenation of every rank's shard). Losses are
means over equal-sized shards, so the averaged DDP gradient equals the full-batch gradient.
"""

from __future__ import annotations

import contextlib
import copy as _copy
import gc
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed.common import Batches, Wrap, attempt
from torch_flashsys.distributed import BucketedDDP, _buckets, _release

F64 = torch.float64


class Tied(nn.Module):
    """Embedding tied to the output head; ``mix`` is applied twice (one grad hook per backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, dtype=F64)
        self.mix = nn.Linear(6, 6, dtype=F64)
        self.head = nn.Linear(6, 11, bias=False, dtype=F64)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(torch.tanh(self.mix(self.emb(tokens)))))


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.to(F64)
        self.b.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class Branches(nn.Module):
    """``sometimes`` runs only on flagged samples (some ranks/steps have none); ``never`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.sometimes, self.never = (nn.Linear(8, 4, dtype=F64) for _ in range(3))

    def forward(self, x: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        out = self.trunk(x)
        if flags.any():
            extra = torch.zeros_like(out)
            extra[flags] = self.sometimes(x[flags])
            out = out + extra
        return out


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        self.to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Mixed(nn.Module):
    """float64 and float32 parameters: one bucket buffer per dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16, dtype=F64)
        self.b = nn.Linear(16, 16, dtype=torch.float32)
        self.c = nn.Linear(16, 4, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)).float())).double())


MODELS: dict[str, type[nn.Module]] = {
    "tied": Tied,
    "frozen": Frozen,
    "branches": Branches,
    "norm": Norm,
    "mixed": Mixed,
}


def build(kind: str, seed: int, rank: int) -> nn.Module:
    """A model whose initial state depends on ``rank`` (the wrappers must broadcast rank 0's)."""
    torch.manual_seed(seed * 7 + rank)
    model = MODELS[kind]()
    with torch.no_grad():
        for buf in model.buffers():
            if buf.is_floating_point():
                buf.add_(0.1 * rank + 0.05)
    return model


def shard(kind: str, seed: int, step: int, rank: int, micro: int = 0) -> tuple[tuple, torch.Tensor]:
    """Rank ``rank``'s (inputs, target) for one (micro)step; the same on every process."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro * 101 + rank * 7)
    if kind == "tied":
        return (torch.randint(0, 11, (3, 5), generator=g),), torch.randn(
            3, 5, 11, generator=g, dtype=F64
        )
    x, target = torch.randn(6, 8, generator=g, dtype=F64), torch.randn(6, 4, generator=g, dtype=F64)
    if kind == "branches":  # rank 0 only, even (micro)steps only: locally and globally unused
        flags = torch.zeros(6, dtype=torch.bool)
        flags[:3] = rank == 0 and (step + micro) % 2 == 0
        return (x, flags), target
    return (x,), target


def full_batch(
    kind: str, seed: int, step: int, ranks: Sequence[int], micro: int = 0
) -> tuple[tuple, torch.Tensor]:
    """The concatenation of the shards of ``ranks``: what one process would train on."""
    parts = [shard(kind, seed, step, r, micro) for r in ranks]
    args = tuple(torch.cat([p[0][i] for p in parts]) for i in range(len(parts[0][0])))
    return args, torch.cat([p[1] for p in parts])


def snapshot(model: nn.Module) -> dict[str, dict[str, Any]]:
    grads = {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}
    return {
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
        "grads": grads,
        "buffers": {n: b.cpu() for n, b in model.named_buffers()},
    }


def grads_are_bucket_views(ddp: BucketedDDP) -> bool:
    storages = _bucket_storages(ddp)
    return all(
        p.grad.untyped_storage().data_ptr() in storages
        for p in ddp.module.parameters()
        if p.grad is not None
    )


def train(
    kind: str,
    seed: int,
    init_rank: int,
    wrap: Wrap,
    batches: Batches,
    zero_grad_to_none: bool = True,
    unsynced: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """AdamW steps from ``build(kind, seed, init_rank)``; each step's list holds micro-batches,
    the first ``unsynced`` of them run (forward and backward) under ``no_sync()``."""
    wrapped = wrap(build(kind, seed, init_rank).to(device))
    module = getattr(wrapped, "module", wrapped)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05, weight_decay=0.1)
    for micro_batches in batches:
        opt.zero_grad(set_to_none=zero_grad_to_none)
        for i, (args, target) in enumerate(micro_batches):
            args, target = tuple(a.to(device) for a in args), target.to(device)
            with wrapped.no_sync() if i < unsynced else contextlib.nullcontext():
                loss = (wrapped(*args) - target).pow(2).mean()
                loss.backward()
        opt.step()
    out = snapshot(module)
    if isinstance(wrapped, BucketedDDP):
        out["views"] = grads_are_bucket_views(wrapped)
    return out


def _torch_ddp(kind: str) -> Wrap:
    """torch DDP for model ``kind`` (``branches`` leaves parameters unused: it needs
    find_unused_parameters)."""
    return lambda m: TorchDDP(m, find_unused_parameters=kind == "branches")


def _torch_ddp_local_buffers(module: nn.Module) -> TorchDDP:
    with warnings.catch_warnings():  # torch 2.13 deprecates the name (forward_sync_buffers)
        warnings.simplefilter("ignore", FutureWarning)
        return TorchDDP(module, broadcast_buffers=False)


def equivalence(rank: int, world: int, seed: int, bucket_sizes: list, steps: int = 3) -> dict:
    """Per model kind: single-process reference (rank 0), torch DDP and BucketedDDP per bucket size."""
    out: dict[str, Any] = {}
    for kind in MODELS:
        mine = [[shard(kind, seed, s, rank)] for s in range(steps)]
        res: dict[str, Any] = {}
        if kind != "norm" and rank == 0:  # BatchNorm statistics are per shard: no full-batch twin
            full = [[full_batch(kind, seed, s, range(world))] for s in range(steps)]
            res["single"] = train(kind, seed, 0, lambda m: m, full)
        res["torch"] = train(
            kind,
            seed,
            rank,
            _torch_ddp(kind),
            mine,
        )
        for bs in bucket_sizes:
            res[f"ours[{bs}]"] = train(kind, seed, rank, lambda m, bs=bs: BucketedDDP(m, bs), mine)
        if kind == "norm":
            res["torch[no_bcast]"] = train(kind, seed, rank, _torch_ddp_local_buffers, mine)
            res["ours[no_bcast]"] = train(
                kind, seed, rank, lambda m: BucketedDDP(m, broadcast_buffers=False), mine
            )
        out[kind] = res
    return out


def _identity(m: nn.Module) -> nn.Module:
    return m


def _grads_after_backward(wrapped: nn.Module, args: tuple, target: torch.Tensor) -> dict:
    (wrapped(*args) - target).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in wrapped.module.named_parameters() if p.grad is not None}


def _bf16_compress_hook(process_group, bucket):  # no annotations: torch checks them by identity
    """torch's bf16_compress_hook, whose name-based CUDA check would refuse gloo on CPU."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def behaviours(rank: int, world: int, seed: int) -> dict:
    """no_sync accumulation, zero_grad modes, compression, explicit finish, subgroups, keys."""
    out: dict[str, Any] = {}
    micro, steps = 3, 2
    for kind in ("tied", "branches"):
        mine = [[shard(kind, seed, s, rank, m) for m in range(micro)] for s in range(steps)]
        for to_none in (True, False):
            res: dict[str, Any] = {}
            if kind == "tied":  # torch DDP's no_sync as the reference
                res["torch"] = train(kind, seed, rank, TorchDDP, mine, to_none, micro - 1)
            elif rank == 0:  # "sometimes" is used in micro-batch 0 only: synced from accumulation
                full = [
                    [full_batch(kind, seed, s, range(world), m) for m in range(micro)]
                    for s in range(steps)
                ]
                res["single"] = train(kind, seed, 0, _identity, full, to_none)
            for bs in (0, None):
                wrap = lambda m, bs=bs: BucketedDDP(m, bs)
                res[f"ours[{bs}]"] = train(kind, seed, rank, wrap, mine, to_none, micro - 1)
            res["ours[every]"] = train(kind, seed, rank, BucketedDDP, mine, to_none, 0)
            out[f"no_sync/{kind}/set_to_none={to_none}"] = res

    args, target = shard("mixed", seed, 0, rank)
    out["compress/plain"] = _grads_after_backward(
        TorchDDP(build("mixed", seed, rank)), args, target
    )
    for name, hook in (
        ("bf16", _bf16_compress_hook),
        ("fp16", default_hooks.fp16_compress_hook),
    ):
        ref = TorchDDP(build("mixed", seed, rank))
        ref.register_comm_hook(None, hook)
        out[f"compress/torch_{name}"] = _grads_after_backward(ref, args, target)
        ours = BucketedDDP(build("mixed", seed, rank), 0.0005, grad_compression=name)
        out[f"compress/ours_{name}"] = _grads_after_backward(ours, args, target)

    # finish_gradient_synchronization: a no-op after backward, and issues no stray collective
    ddp = BucketedDDP(build("tied", seed, rank), 0)
    uses = [0]
    ddp.module.mix.weight.register_post_accumulate_grad_hook(
        lambda p: uses.__setitem__(0, uses[0] + 1)
    )
    args, target = shard("tied", seed, 0, rank)
    before = _grads_after_backward(ddp, args, target)
    ddp.finish_gradient_synchronization()
    out["finish/unchanged"] = all(
        torch.equal(before[n], p.grad) for n, p in ddp.module.named_parameters()
    )
    if rank == 0:
        ddp.finish_gradient_synchronization()
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)
    out["finish/probe"] = probe.item()
    _grads_after_backward(ddp, args, target)
    out["hook_calls_for_twice_used_param"] = uses[0]  # two backwards

    # Communication: none under no_sync; one all-reduce per bucket, all launched during backward
    calls: list[int] = []
    real_all_reduce = _buckets.all_reduce  # BucketedDDP's collectives go through it

    def counting_all_reduce(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real_all_reduce(*a, **k)

    ddp = BucketedDDP(build("frozen", seed, rank), 0)
    launched = []
    for p in (ddp.module.a.weight, ddp.module.a.bias):  # the last two to get their gradients
        p.register_post_accumulate_grad_hook(lambda p: launched.append(ddp._reducer.bw.next_bucket))
    args, target = shard("frozen", seed, 0, rank)
    _buckets.all_reduce = counting_all_reduce
    try:
        with ddp.no_sync():
            _grads_after_backward(ddp, args, target)
        out["comm/no_sync"] = len(calls)
        _grads_after_backward(ddp, args, target)
        out["comm/sync"] = len(calls)
    finally:
        _buckets.all_reduce = real_all_reduce
    out["comm/buckets"] = len(ddp._reducer.buckets)
    out["comm/launched_in_hooks"] = max(launched[2:])  # of the synchronizing backward

    # A dropped wrapper is freed (its buffers too) and its hooks go with it
    module = build("frozen", seed, rank)
    alive = weakref.ref(BucketedDDP(module, 0))
    gc.collect()
    out["dropped/collected"] = alive() is None
    (module(*args) - target).pow(2).mean().backward()  # plain local backward: no collective
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)
    out["dropped/probe"] = probe.item()

    # state_dict keys: .module's untouched; the wrapper's prefixed with "module." like torch DDP
    plain = build("norm", seed, rank)
    out["keys"] = {
        "plain": list(plain.state_dict()),
        "module": list(BucketedDDP(build("norm", seed, rank)).module.state_dict()),
        "ours": list(BucketedDDP(build("norm", seed, rank)).state_dict()),
        "torch": list(TorchDDP(build("norm", seed, rank)).state_dict()),
    }

    # process_group: ranks 1, 2 average among themselves (rank 1's init), rank 0 is alone
    groups = {0: dist.new_group([0]), 1: dist.new_group([1, 2])}
    members = [0] if rank == 0 else [1, 2]
    group = groups[0 if rank == 0 else 1]
    wrap = lambda m: BucketedDDP(m, 0.0005, process_group=group)
    batches = [[shard("frozen", seed, s, rank)] for s in range(steps)]
    out["subgroup/ours"] = train("frozen", seed, rank, wrap, batches)
    full = [[full_batch("frozen", seed, s, members)] for s in range(steps)]
    out["subgroup/single"] = train("frozen", seed, members[0], _identity, full)
    return out


class _NoTrainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).requires_grad_(False)


def _last(rank: int, world: int) -> bool:
    return rank == world - 1


def _linear(kwargs: dict) -> Callable[[int, int], tuple[nn.Module, dict]]:
    """A case building a fresh ``nn.Linear(4, 4)`` with the same ``kwargs`` on every rank."""
    return lambda r, w: (nn.Linear(4, 4), dict(kwargs))


def _ignoring(rank: int, world: int) -> tuple[nn.Module, dict]:
    """A module marked by torch's DDP._set_params_and_buffers_to_ignore_for_model."""
    module = nn.Linear(4, 4)
    TorchDDP._set_params_and_buffers_to_ignore_for_model(module, ["bias"])
    return module, {}


# Constructor error table: case -> (inputs builder (rank, world) -> (module, kwargs), error, text).
# Every case must raise on every rank, never hang; mismatches name the first difference.
ERROR_CASES: dict[str, tuple[Callable[[int, int], tuple[Any, dict]], type, str]] = {
    "params_and_buffers_to_ignore": (
        _ignoring,
        NotImplementedError,
        "module._ddp_params_and_buffers_to_ignore is set (['bias']",
    ),
    "bucket_size_negative": (
        _linear({"bucket_size_mb": -1.0}),
        ValueError,
        "bucket_size_mb must be finite and >= 0",
    ),
    "bucket_size_nan": (_linear({"bucket_size_mb": float("nan")}), ValueError, "got nan"),
    "bucket_size_inf": (_linear({"bucket_size_mb": float("inf")}), ValueError, "got inf"),
    "bucket_size_str": (
        _linear({"bucket_size_mb": "25"}),
        TypeError,
        "bucket_size_mb must be a number or None, got str",
    ),
    "bucket_size_bool": (_linear({"bucket_size_mb": True}), TypeError, "got bool"),
    "compression_unknown": (
        _linear({"grad_compression": "int8"}),
        ValueError,
        "must be None, 'bf16' or 'fp16', got 'int8'",
    ),
    "compression_dtype": (
        _linear({"grad_compression": torch.bfloat16}),
        ValueError,
        "got torch.bfloat16",
    ),
    "broadcast_buffers_str": (
        _linear({"broadcast_buffers": "yes"}),
        TypeError,
        "broadcast_buffers must be a bool or None, got str",
    ),
    "process_group_str": (
        _linear({"process_group": "world"}),
        TypeError,
        "ProcessGroup or None, got str",
    ),
    "module_not_module": (
        lambda r, w: ([nn.Linear(4, 4)], {}),
        TypeError,
        "module must be a torch.nn.Module",
    ),
    "no_trainable": (
        lambda r, w: (_NoTrainable(), {}),
        ValueError,
        "no parameter that requires a gradient",
    ),
    "mismatch_shape": (
        lambda r, w: (nn.Linear(4, 5 if _last(r, w) else 4), {}),
        RuntimeError,
        "shape=(5, 4)",
    ),
    "mismatch_count": (
        lambda r, w: (nn.Linear(4, 4, bias=not _last(r, w)), {}),
        RuntimeError,
        "different numbers of entries",
    ),
    "mismatch_dtype": (
        lambda r, w: (nn.Linear(4, 4, dtype=F64 if _last(r, w) else None), {}),
        RuntimeError,
        "dtype=torch.float64",
    ),
    "mismatch_requires_grad": (
        lambda r, w: (nn.Linear(4, 4).requires_grad_(not _last(r, w)), {}),
        RuntimeError,
        "requires_grad=False",
    ),
    "mismatch_buffer": (
        lambda r, w: (nn.BatchNorm1d(4, track_running_stats=not _last(r, w)), {}),
        RuntimeError,
        "differs across ranks",
    ),
    "mismatch_option": (
        lambda r, w: (nn.Linear(4, 4), {"bucket_size_mb": 1.0 if _last(r, w) else 25.0}),
        RuntimeError,
        "option bucket_size_mb",
    ),
    "bad_option_one_rank": (
        lambda r, w: (nn.Linear(4, 4), {"bucket_size_mb": -1.0 if _last(r, w) else 25.0}),
        RuntimeError,
        "bucket_size_mb must be finite and >= 0",
    ),
    # torch DDP's arguments (issue: a drop-in that accepts torch's own calls). Rank-specific
    # values (device_ids=[rank]) must still raise the same error type on every rank.
    "device_ids_cpu_module": (
        lambda r, w: (nn.Linear(4, 4), {"device_ids": [r]}),
        ValueError,
        "device_ids must be None for a module on the CPU",
    ),
    "device_ids_positional": (
        lambda r, w: (nn.Linear(4, 4), {"bucket_size_mb": [r]}),
        TypeError,
        "pass device_ids= by keyword",
    ),
    "device_ids_not_a_list": (
        lambda r, w: (nn.Linear(4, 4), {"device_ids": r}),
        TypeError,
        "device_ids must be None or a list of one device, got int",
    ),
    "output_device_cpu_module": (
        lambda r, w: (nn.Linear(4, 4), {"output_device": r}),
        ValueError,
        "output_device must be None for a module on the CPU",
    ),
    "bucket_cap_and_size": (
        _linear({"bucket_size_mb": 10.0, "bucket_cap_mb": 10}),
        TypeError,
        "bucket_cap_mb is torch DDP's name for bucket_size_mb; pass one of them",
    ),
    "bucket_cap_negative": (
        _linear({"bucket_cap_mb": -1}),
        ValueError,
        "bucket_cap_mb must be finite and >= 0",
    ),
    "init_sync_str": (_linear({"init_sync": "no"}), TypeError, "init_sync must be a bool, got str"),
    "static_graph_str": (
        _linear({"static_graph": "yes"}),
        TypeError,
        "static_graph must be a bool, got str",
    ),
    "dim_str": (_linear({"dim": "0"}), TypeError, "dim must be an int, got str"),
    "forward_sync_buffers_str": (
        _linear({"forward_sync_buffers": "no"}),
        TypeError,
        "forward_sync_buffers must be a bool or None, got str",
    ),
    "mixed_precision": (
        _linear({"mixed_precision": object()}),
        NotImplementedError,
        "mixed_precision is not supported",
    ),
    "delay_all_reduce": (
        _linear({"delay_all_reduce_named_params": []}),
        NotImplementedError,
        "delay_all_reduce_named_params is not supported",
    ),
    "param_to_hook_all_reduce": (
        _linear({"param_to_hook_all_reduce": nn.Parameter(torch.ones(1))}),
        NotImplementedError,
        "param_to_hook_all_reduce is not supported",
    ),
    "device_mesh": (
        _linear({"device_mesh": object()}),
        NotImplementedError,
        "process_group=device_mesh.get_group(0)",
    ),
    "bucket_cap_mb_list": (
        _linear({"bucket_cap_mb_list": [1, 25]}),
        NotImplementedError,
        "bucket_cap_mb_list is not supported",
    ),
}


def constructor_errors(rank: int, world: int, names: list[str]) -> dict[str, str]:
    """Try each case; return 'Type: message' per case (all ranks keep in lockstep)."""
    out = {}
    for name in names:
        module, kwargs = ERROR_CASES[name][0](rank, world)
        try:
            BucketedDDP(module, **kwargs)
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    probe = torch.tensor([1.0])
    dist.all_reduce(probe)  # a rank left behind in a collective would hang or corrupt this
    out["probe"] = str(probe.item())
    return out


def nccl_equivalence(rank: int, world: int, seed: int) -> dict:
    """On CUDA/NCCL: BucketedDDP vs torch DDP (and compression vs torch's hook), per bucket size."""
    torch.cuda.set_device(rank)
    device, out = f"cuda:{rank}", {}
    for kind in ("tied", "branches", "mixed"):
        mine = [[shard(kind, seed, s, rank)] for s in range(3)]
        out[f"{kind}/torch"] = train(
            kind,
            seed,
            rank,
            _torch_ddp(kind),
            mine,
            device=device,
        )
        for bs in (0, 0.0005, None):
            wrap = lambda m, bs=bs: BucketedDDP(m, bs)
            out[f"{kind}/ours[{bs}]"] = train(kind, seed, rank, wrap, mine, device=device)
        # torch DDP's own call on a GPU, unchanged
        call = {"device_ids": [rank], "output_device": rank, "bucket_cap_mb": 0.0005}
        call |= {"find_unused_parameters": kind == "branches", "gradient_as_bucket_view": True}
        wrap = lambda m, call=call: BucketedDDP(m, **call)
        out[f"{kind}/ours[torch_call]"] = train(kind, seed, rank, wrap, mine, device=device)
    # device_ids given: inputs on the CPU are moved to the module's device, as torch DDP does
    args, target = shard("mixed", seed, 0, rank)
    target = target.to(device)
    for tag, cls in (("torch", TorchDDP), ("ours[device_ids]", BucketedDDP)):
        wrapped = cls(build("mixed", seed, rank).to(device), device_ids=[rank], output_device=rank)
        grads = {k: v.cpu() for k, v in _grads_after_backward(wrapped, args, target).items()}
        out[f"moved/{tag}"] = {"grads": grads}
        if cls is BucketedDDP:
            out[f"moved/{tag}"]["views"] = grads_are_bucket_views(wrapped)
    args = tuple(a.to(device) for a in args)
    ref = TorchDDP(build("mixed", seed, rank).to(device))
    ref.register_comm_hook(None, default_hooks.bf16_compress_hook)
    out["compress/torch_bf16"] = {
        k: v.cpu() for k, v in _grads_after_backward(ref, args, target).items()
    }
    ours = BucketedDDP(build("mixed", seed, rank).to(device), grad_compression="bf16")
    out["compress/ours_bf16"] = {
        k: v.cpu() for k, v in _grads_after_backward(ours, args, target).items()
    }
    return out


# ---------------------------------------------------------------- the loop people run

# Where the loop zeroes gradients (and how); every pattern must give single-process results.
#   default: backward; step; zero_grad()      (PyTorch's default set_to_none=True)
#   before:  zero_grad(); forward; backward; step
#   between: forward; zero_grad(); backward; step   (grads are None when the backward starts)
#   zeros:   backward; step; zero_grad(set_to_none=False)
#   manual:  backward; step; zero_grad(); then every other parameter's grad replaced by hand
#   no_sync: two micro-batches, the first under no_sync(); then step; zero_grad()
LOOP_PATTERNS = ("default", "before", "between", "zeros", "manual", "no_sync")


class _CountBucketCopies(TorchDispatchMode):
    """Counts copy_ calls into a gradient bucket of ``ddp`` (None: counts nothing). Buffers
    can be allocated during the backward (after release_idle), so they are looked up at each
    copy."""

    def __init__(self, ddp: BucketedDDP | None) -> None:
        super().__init__()
        self.ddp, self.count = ddp, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and self.ddp is not None:
            self.count += args[0].untyped_storage().data_ptr() in _bucket_storages(self.ddp)
        return func(*args, **(kwargs or {}))


def _bucket_storages(ddp: BucketedDDP) -> set[int]:
    """Data pointers of the storages of every gradient bucket buffer ``ddp`` holds now."""
    reducer = ddp._reducer
    buffers = [b.buffer for b in reducer.buckets if b.buffer is not None]
    return {t.untyped_storage().data_ptr() for t in buffers + reducer.kept_buffers()}


def train_loop(
    kind: str,
    seed: int,
    init_rank: int,
    wrap: Wrap,
    batches: Batches,
    pattern: str | Sequence[str],
    device: str = "cpu",
) -> dict[str, Any]:
    """AdamW steps as a user's loop would run them (``pattern``, see LOOP_PATTERNS; or one
    pattern per step); for BucketedDDP also the number of gradient copies into the buckets in
    each backward and, per step, whether its forward found the kept buckets without buffers."""
    wrapped = wrap(build(kind, seed, init_rank).to(device))
    module = getattr(wrapped, "module", wrapped)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05, weight_decay=0.1)
    ours = isinstance(wrapped, BucketedDDP)
    copies, released = [], []
    for step, micro_batches in enumerate(batches):
        if ours:
            released.append(None)
        pattern_ = pattern if isinstance(pattern, str) else pattern[step]
        if pattern_ == "before":
            opt.zero_grad()
        for i, (args, target) in enumerate(micro_batches):
            args, target = tuple(a.to(device) for a in args), target.to(device)
            unsynced = (
                pattern_ == "no_sync" and i < len(micro_batches) - 1 and wrapped is not module
            )
            with wrapped.no_sync() if unsynced else contextlib.nullcontext():
                loss = (wrapped(*args) - target).pow(2).mean()
                if ours and released[-1] is None:
                    released[-1] = not wrapped._reducer.kept_buffers()
                if pattern_ == "between":
                    opt.zero_grad()
                counter = _CountBucketCopies(wrapped if ours else None)
                with counter:
                    loss.backward()
                copies.append(counter.count)
        opt.step()
        if pattern_ in ("default", "manual", "no_sync"):
            opt.zero_grad()
        elif pattern_ == "zeros":
            opt.zero_grad(set_to_none=False)
        if pattern_ == "manual":
            for p in list(module.parameters())[::2]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
    out = snapshot(module)
    if ours:
        out["views"] = grads_are_bucket_views(wrapped)
        out["copies"] = copies
        out["released"] = released
    return out


def mixed_loop(
    rank: int, world: int, seed: int, bucket_mb: float | None, patterns: list[str]
) -> dict:
    """One loop pattern per step (so the buckets go from shared storage to released buffers,
    to buffers held by accumulated or zeroed grads, and back): single process (rank 0), torch
    DDP and BucketedDDP, per model kind."""
    out: dict[str, Any] = {}
    for kind in ("tied", "branches", "mixed"):
        micro = [2 if p == "no_sync" else 1 for p in patterns]
        mine = [[shard(kind, seed, s, rank, m) for m in range(n)] for s, n in enumerate(micro)]
        res: dict[str, Any] = {}
        if rank == 0:
            full = [
                [full_batch(kind, seed, s, range(world), m) for m in range(n)]
                for s, n in enumerate(micro)
            ]
            res["single"] = train_loop(kind, seed, 0, _identity, full, patterns)
        res["torch"] = train_loop(kind, seed, rank, _torch_ddp(kind), mine, patterns)
        res["ours"] = train_loop(
            kind, seed, rank, lambda m: BucketedDDP(m, bucket_mb), mine, patterns
        )
        out[kind] = res
    return out


def release_between_steps(rank: int, world: int) -> dict[str, Any]:
    """What BucketedDDP's forward does with the kept buckets' memory: after ``zero_grad()``
    (every grad None) it is freed (nothing references the old storage any more); after
    ``zero_grad(set_to_none=False)`` it is kept, the grads still views into it."""
    torch.manual_seed(0)
    ddp = BucketedDDP(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), 0.0001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    reducer, out = ddp._reducer, {}
    ddp(x).sum().backward()
    opt.step()
    opt.zero_grad()
    before = [weakref.ref(t) for t in reducer.kept_buffers()]
    out["had_buffers"] = len(before) > 0
    y = ddp(x)
    # A finished collective's alias of a buffer (_release.alias) lives until the backend's thread
    # destroys its Work, which under gloo may be just after the wait returned: give it that time
    # (bounded); then nothing may hold the old buffers any more.
    deadline = time.monotonic() + 5.0
    while _release._held() and time.monotonic() < deadline:
        time.sleep(0.001)
    out["freed_by_forward"] = all(ref() is None for ref in before)
    out["none_left"] = not reducer.kept_buffers()
    y.sum().backward()
    out["views_after_backward"] = grads_are_bucket_views(ddp) and all(
        p.grad is not None for p in ddp.parameters()
    )
    opt.step()
    opt.zero_grad(set_to_none=False)
    kept = {t.data_ptr() for t in reducer.kept_buffers()}
    ddp(x).sum().backward()
    out["zeroed_views_kept"] = bool(kept) and kept == {t.data_ptr() for t in reducer.kept_buffers()}
    return out


def default_loop(rank: int, world: int, seed: int, bucket_mb: float | None) -> dict:
    """Every (model kind, loop pattern): single process (rank 0), torch DDP, BucketedDDP, and
    BucketedDDP with the views not pointed ahead of the backward (the copy path, a control).
    With no_sync accumulation also BucketedDDP keeping its buckets' memory between steps
    (``ours_keep``), and every one of them starting with zero gradients (``*_warm``): in both the
    backwards start from the buckets' shared storage, which holds the accumulated gradients.
    On CUDA (cuda:<rank>) under NCCL, on the CPU otherwise."""
    device = "cpu"
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    out: dict[str, Any] = {}
    steps = 3
    for kind in ("tied", "frozen", "branches", "mixed"):
        for pattern in LOOP_PATTERNS:
            micro = 2 if pattern == "no_sync" else 1
            mine = [[shard(kind, seed, s, rank, m) for m in range(micro)] for s in range(steps)]
            res: dict[str, Any] = {}
            if rank == 0:
                full = [
                    [full_batch(kind, seed, s, range(world), m) for m in range(micro)]
                    for s in range(steps)
                ]
                res["single"] = train_loop(kind, seed, 0, _identity, full, pattern, device)
            res["torch"] = train_loop(
                kind,
                seed,
                rank,
                _torch_ddp(kind),
                mine,
                pattern,
                device,
            )
            res["ours"] = train_loop(
                kind, seed, rank, lambda m: BucketedDDP(m, bucket_mb), mine, pattern, device
            )
            if pattern == "default":

                def copying(m: nn.Module) -> BucketedDDP:
                    ddp = BucketedDDP(m, bucket_mb)
                    ddp._prepoint = False
                    return ddp

                res["ours_copying"] = train_loop(kind, seed, rank, copying, mine, pattern, device)
            if pattern == "no_sync":  # accumulation into buckets whose memory was never released
                res["ours_keep"] = train_loop(
                    kind, seed, rank, _keeping(bucket_mb), mine, pattern, device
                )
                if rank == 0:
                    res["single_warm"] = train_loop(
                        kind, seed, 0, _warm(_identity), full, pattern, device
                    )
                for tag, wrap in (("torch", _torch_ddp(kind)), ("ours", _bucketed(bucket_mb))):
                    res[f"{tag}_warm"] = train_loop(
                        kind, seed, rank, _warm(wrap), mine, pattern, device
                    )
            out[f"{kind}/{pattern}"] = res
    return out


def _bucketed(bucket_mb: float | None) -> Wrap:
    return lambda m: BucketedDDP(m, bucket_mb)


def _keeping(bucket_mb: float | None) -> Wrap:
    """BucketedDDP that keeps its buckets' memory between steps (benchmarks/ddp.py's -keep runs):
    every backward starts from the buckets' shared storage, not from released buffers."""

    def wrap(m: nn.Module) -> BucketedDDP:
        ddp = BucketedDDP(m, bucket_mb)
        ddp._reducer.release_between_steps = False
        return ddp

    return wrap


def _warm(wrap: Wrap) -> Wrap:
    """``wrap`` applied to a module whose trainable parameters already have zero gradients (as
    after a warm-up step and zero_grad(set_to_none=False)): the first forward finds gradients,
    so the buckets keep their memory into the first step's accumulation."""

    def warmed(m: nn.Module) -> nn.Module:
        for p in m.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        return wrap(m)

    return warmed


def local_backwards(rank: int, world: int, seed: int) -> dict[str, Any]:
    """Backwards that do not go through the wrapper's forward, beside torch DDP's: on rank 0
    only, a diagnostic backward through ``.module`` before the first forward and between two
    steps (its gradients zeroed before the next step); on every rank, after the synchronizing
    backward of step 1, the backward of a weight penalty computed from ``.module``'s parameters
    (its gradients added locally, not averaged). Per step the gradients before ``step()``, the
    diagnostics' gradients, BucketedDDP's collectives during them, and the final parameters."""
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64)
    g = torch.Generator().manual_seed(seed + rank)
    xs = [torch.randn(2, 3, generator=g, dtype=F64) for _ in range(3)]
    probe = torch.linspace(-1.0, 1.0, 3, dtype=F64).view(1, 3)
    calls: list[int] = []
    real_all_reduce = _buckets.all_reduce

    def counting_all_reduce(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real_all_reduce(*a, **k)

    out: dict[str, Any] = {}
    for kind in ("torch", "ours"):
        model = _copy.deepcopy(base)
        wrapped = TorchDDP(model) if kind == "torch" else BucketedDDP(model, 0)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        res: dict[str, Any] = {"grads": [], "probe": [], "probe_collectives": []}
        for step, x in enumerate(xs):
            if rank == 0 and step in (0, 2):  # diagnostic: local, zeroed after
                opt.zero_grad()
                before = len(calls)
                _buckets.all_reduce = counting_all_reduce
                try:
                    model(probe).sum().backward()
                finally:
                    _buckets.all_reduce = real_all_reduce
                res["probe_collectives"].append(len(calls) - before)
                res["probe"].append({n: p.grad.clone() for n, p in model.named_parameters()})
                opt.zero_grad()
            wrapped(x).pow(2).mean().backward()
            if step == 1:  # every rank: a penalty's gradient, added locally
                sum(p.pow(2).sum() for p in model.parameters()).backward()
            res["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        res["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[kind] = res
    return out


class _Checkpointed(nn.Module):
    """Linear -> tanh -> Linear, the first two under non-reentrant activation checkpointing; the
    forward also keeps a penalty of its hidden activations in ``self.aux`` (a loss term that
    the output does not lead to)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(self.a(t)), x, use_reentrant=False
        )
        self.aux = h.pow(2).mean()
        return self.b(h)


GRAPH_PATTERNS = ("retain_graph", "two_forwards", "grad_penalty", "aux_only", "aux_first")


def _graph_pattern_loss(wrapped: nn.Module, pattern: str, x: torch.Tensor) -> None:
    """One step's backwards for ``pattern`` (on one rank's shard or, single process, the whole
    batch: every loss is a mean, so the averages match)."""
    inner = getattr(wrapped, "module", wrapped)
    if pattern == "retain_graph":  # two backwards of one forward: both synchronize
        out = wrapped(x)
        out[:, 0].mean().backward(retain_graph=True)
        out[:, 1].mean().backward()
    elif pattern == "two_forwards":  # two forwards, one backward
        half = x.shape[0] // 2
        (wrapped(x[:half]).pow(2).mean() + wrapped(x[half:]).pow(2).mean()).backward()
    elif pattern == "grad_penalty":  # autograd.grad(create_graph=True), then one backward
        x = x.clone().requires_grad_(True)
        out = wrapped(x)
        (gx,) = torch.autograd.grad(out.pow(2).mean(), x, create_graph=True)
        (out.pow(2).mean() + gx.pow(2).sum() * x.shape[0]).backward()
    elif pattern == "aux_only":  # the loss is kept by the forward, not returned
        wrapped(x)
        inner.aux.backward()
    else:  # "aux_first": the returned output and the kept loss, the kept one first
        out = wrapped(x)
        (inner.aux + out.pow(2).mean()).backward()


def graph_patterns(rank: int, world: int, seed: int, patterns: list[str]) -> dict[str, Any]:
    """One step per pattern (SGD): BucketedDDP on this rank's shard, one process on the whole
    batch (rank 0); gradients before each step and the final parameters."""
    torch.manual_seed(seed)
    base = _Checkpointed().to(F64)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randn(4 * world, 3, generator=g, dtype=F64) for _ in patterns]
    out: dict[str, Any] = {}
    for kind in ("ours", "single"):
        if kind == "single" and rank != 0:
            continue
        model = _copy.deepcopy(base)
        wrapped = BucketedDDP(model, 0) if kind == "ours" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for pattern, x in zip(patterns, batches, strict=True):
            mine = x.view(world, 4, 3)[rank] if kind == "ours" else x
            _graph_pattern_loss(wrapped, pattern, mine)
            grads.append(
                {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            )
            opt.step()
            opt.zero_grad()
        out[kind] = {
            "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    return out


def copies(rank: int, world: int, seed: int) -> dict[str, Any]:
    """``copy.deepcopy`` of a wrapper after one step, trained two more steps, beside torch DDP's
    copy; ``AveragedModel`` of a wrapper; and a copy of a wrapper over a subgroup (refused)."""
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64)
    g = torch.Generator().manual_seed(seed + rank)
    xs = [torch.randn(2, 3, generator=g, dtype=F64) for _ in range(3)]
    out: dict[str, Any] = {}
    for kind in ("torch", "ours"):
        wrapped = (TorchDDP if kind == "torch" else BucketedDDP)(_copy.deepcopy(base))
        wrapped(xs[0]).pow(2).mean().backward()
        with torch.no_grad():
            for p in wrapped.parameters():
                p -= 0.1 * p.grad
        twin = _copy.deepcopy(wrapped)
        out[f"{kind}/separate"] = all(
            a.data_ptr() != b.data_ptr() and torch.equal(a, b)
            for a, b in zip(wrapped.module.parameters(), twin.module.parameters(), strict=True)
        )
        opt = torch.optim.SGD(twin.parameters(), lr=0.1)
        for x in xs[1:]:
            twin(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[f"{kind}/params"] = {n: p.detach().clone() for n, p in twin.module.named_parameters()}
        out[f"{kind}/original_unchanged"] = all(
            not torch.equal(a, b)
            for a, b in zip(wrapped.module.parameters(), twin.module.parameters(), strict=True)
        )
        averaged = torch.optim.swa_utils.AveragedModel(wrapped)
        averaged.update_parameters(wrapped)
        with torch.no_grad():
            out[f"{kind}/averaged"] = averaged(xs[0])
            out[f"{kind}/averaged_want"] = wrapped.module(xs[0])
    sub = BucketedDDP(_copy.deepcopy(base), process_group=dist.new_group(list(range(world))))
    out["subgroup"] = attempt(lambda: _copy.deepcopy(sub))
    return out


def require_backward_grad_sync(rank: int, world: int, seed: int) -> dict[str, Any]:
    """torch DDP's ``require_backward_grad_sync`` (what ``no_sync()`` toggles) set by hand: a
    forward with it False accumulates locally, the next with it True averages the sum; beside
    torch DDP. Also what it reads inside and after no_sync(), and a non-bool assignment."""
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64)
    g = torch.Generator().manual_seed(seed + rank)
    xs = [torch.randn(2, 3, generator=g, dtype=F64) for _ in range(2)]
    out: dict[str, Any] = {}
    for kind in ("torch", "ours"):
        wrapped = (TorchDDP if kind == "torch" else BucketedDDP)(_copy.deepcopy(base))
        out[f"{kind}/read"] = [wrapped.require_backward_grad_sync]
        with wrapped.no_sync():
            out[f"{kind}/read"].append(wrapped.require_backward_grad_sync)
        out[f"{kind}/read"].append(wrapped.require_backward_grad_sync)
        wrapped.require_backward_grad_sync = False
        wrapped(xs[0]).pow(2).mean().backward()
        out[f"{kind}/local"] = {n: p.grad.clone() for n, p in wrapped.module.named_parameters()}
        wrapped.require_backward_grad_sync = True
        wrapped(xs[1]).pow(2).mean().backward()
        out[f"{kind}/synced"] = {n: p.grad.clone() for n, p in wrapped.module.named_parameters()}
    ours = BucketedDDP(_copy.deepcopy(base))
    out["non_bool"] = attempt(lambda: setattr(ours, "require_backward_grad_sync", 1))
    return out
