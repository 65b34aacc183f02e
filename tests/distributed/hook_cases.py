"""Rank bodies for tests/distributed/test_ddp_comm_hook.py: BucketedDDP.register_comm_hook with
torch's own hooks, against torch DDP with the same hook and state.

Models from ddp_cases ("tied": a parameter used twice; "branches": parameters unused on some
ranks or everywhere, torch DDP with find_unused_parameters=True), and a bias-free MLP for
PowerSGD, whose result depends on the order of the tensors in a bucket (both wrappers put every
parameter in one bucket, in reverse registration order).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.distributed import ddp_cases
from tests.distributed.common import attempt
from torch_flashsys import BucketedDDP, ShardedOptimizer

F64 = torch.float64
LR = 0.1  # train()'s SGD


def _torch_bf16_hook(process_group, bucket):  # no annotations: torch checks them by identity
    """torch's bf16_compress_hook, whose name-based CUDA check refuses gloo on CPU builds."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def _powersgd_state(group: Any = None) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(
        process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=7
    )


# name -> (state factory, our hook, torch DDP's hook (the same unless torch refuses it on CPU))
HOOKS: dict[str, tuple[Callable[[], Any], Callable, Callable]] = {
    "allreduce": (lambda: None, default_hooks.allreduce_hook, default_hooks.allreduce_hook),
    "fp16": (lambda: None, default_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook),
    "bf16": (lambda: None, default_hooks.bf16_compress_hook, _torch_bf16_hook),
    "powerSGD": (_powersgd_state, powerSGD_hook.powerSGD_hook, powerSGD_hook.powerSGD_hook),
    "fp16_powerSGD": (  # set_buffer(): the wrapper hands PowerSGD an fp16 copy
        _powersgd_state,
        default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook),
        default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook),
    ),
}


class Mlp(nn.Module):
    """Bias-free: the backward produces the weights' gradients in reverse registration order,
    the order of BucketedDDP's bucket and of torch DDP's rebuilt bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (
            nn.Linear(8, 16, bias=False),
            nn.Linear(16, 12, bias=False),
            nn.Linear(12, 4, bias=False),
        )
        self.to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _batches(kind: str, seed: int, rank: int, steps: int, micro: int) -> list[list[tuple]]:
    if kind == "mlp":
        return [
            [ddp_cases.shard("frozen", seed, s, rank, m) for m in range(micro)]
            for s in range(steps)
        ]
    return [[ddp_cases.shard(kind, seed, s, rank, m) for m in range(micro)] for s in range(steps)]


def train(
    kind: str,
    seed: int,
    rank: int,
    wrap: Callable,
    steps: int,
    micro: int = 1,
    device: torch.device | str = "cpu",
    spread: bool = False,
) -> dict:
    """SGD steps (all but the last micro-batch under no_sync()); returns the final parameters and
    the gradients of the last step, and with ``spread`` the last step's ``sum_r |g_r| / world``
    per gradient element (``g_r``: rank r's own gradient, the sum of its micro-batches'; what a
    compression hook rounds and adds)."""
    torch.manual_seed(seed + rank)  # the wrappers broadcast rank 0's parameters
    model = Mlp() if kind == "mlp" else ddp_cases.MODELS[kind]()
    wrapped = wrap(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    out: dict[str, Any] = {}
    for micro_batches in _batches(kind, seed, rank, steps, micro):
        if spread:  # (each step's: the last one's is kept)
            out["spread"] = _spread(model, micro_batches, device)
        opt.zero_grad()
        for i, (args, target) in enumerate(micro_batches):
            args, target = tuple(a.to(device) for a in args), target.to(device)
            unsynced = i < len(micro_batches) - 1
            with wrapped.no_sync() if unsynced else torch.enable_grad():
                (wrapped(*args) - target).pow(2).mean().backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["grads"] = grads
    return out


def _spread(model: nn.Module, micro_batches: list, device) -> dict[str, torch.Tensor]:
    """``sum_r |g_r| / world`` per parameter for this step's batches: each rank's own gradient
    (a plain copy of the synchronized model, no wrapper), its magnitude summed over ranks."""
    local = copy.deepcopy(model)
    for args, target in micro_batches:
        args, target = tuple(a.to(device) for a in args), target.to(device)
        (local(*args) - target).pow(2).mean().backward()
    spread: dict[str, torch.Tensor] = {}
    for name, p in local.named_parameters():  # every rank, in one order (a locally unused one: 0)
        magnitude = torch.zeros_like(p) if p.grad is None else p.grad.abs()
        dist.all_reduce(magnitude)
        spread[name] = magnitude / dist.get_world_size()
    return spread


def _ours(name: str, bucket_mb: float | None) -> Callable[[nn.Module], nn.Module]:
    def wrap(model: nn.Module) -> nn.Module:
        ddp = BucketedDDP(model, bucket_mb)
        state, hook, _ = HOOKS[name]
        ddp.register_comm_hook(state(), hook)
        return ddp

    return wrap


def _theirs(name: str, unused: bool) -> Callable[[nn.Module], nn.Module]:
    def wrap(model: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ddp = TorchDDP(model, find_unused_parameters=unused)
        state, _, hook = HOOKS[name]
        ddp.register_comm_hook(state(), hook)
        return ddp

    return wrap


def equivalence(rank: int, world: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("allreduce", "fp16", "bf16"):  # element-wise hooks
        # The 16-bit sums' order depends on the buckets (gloo's ring chunks): one step, whose
        # difference test_ddp_comm_hook bounds by the ranks' gradients (``spread``); over more
        # steps the parameters drift apart and the bound no longer holds. allreduce: 3 steps.
        lossy = name != "allreduce"
        steps = 1 if lossy else 3
        for kind in ("tied", "branches"):
            for micro in (1, 2):
                key = f"{name}/{kind}/micro={micro}"
                theirs = _theirs(name, kind == "branches")
                out[f"{key}/torch"] = train(kind, seed, rank, theirs, steps, micro, spread=lossy)
                for bs in (0, None):
                    out[f"{key}/ours[{bs}]"] = train(
                        kind, seed, rank, _ours(name, bs), steps, micro
                    )
    for name in ("powerSGD", "fp16_powerSGD"):  # iterations 0, 1 uncompressed, then PowerSGD
        out[f"{name}/mlp/torch"] = train("mlp", seed, rank, _theirs(name, False), 5)
        out[f"{name}/mlp/ours[None]"] = train("mlp", seed, rank, _ours(name, None), 5)
    out["plain/mlp"] = train("mlp", seed, rank, TorchDDP, 5)  # PowerSGD must differ from it
    out["errors"] = errors(rank, world)
    return out


def _backward(ddp: BucketedDDP, seed: int = 0) -> None:
    (args, target) = ddp_cases.shard("frozen", seed, 0, dist.get_rank())
    (ddp(*args) - target).pow(2).mean().backward()


def errors(rank: int, world: int) -> dict[str, str]:
    """Each misuse raises a clear error (and every rank stays in step: checked by a probe)."""
    hook = default_hooks.allreduce_hook
    out: dict[str, str] = {}

    def model() -> nn.Module:
        return ddp_cases.build("frozen", 0, rank)

    ddp = BucketedDDP(model())
    ddp.register_comm_hook(None, hook)
    out["twice"] = attempt(lambda: ddp.register_comm_hook(None, hook))
    out["compression"] = attempt(
        lambda: BucketedDDP(model(), grad_compression="bf16").register_comm_hook(None, hook)
    )
    out["not_callable"] = attempt(lambda: BucketedDDP(model()).register_comm_hook(None, "hook"))
    out["arity"] = attempt(lambda: BucketedDDP(model()).register_comm_hook(None, lambda b: b))
    late = BucketedDDP(model())
    _backward(late)
    out["after_backward"] = attempt(lambda: late.register_comm_hook(None, hook))
    zero2 = BucketedDDP(model())
    ShardedOptimizer(zero2.parameters(), torch.optim.SGD, shard_gradients=True, lr=0.1)
    out["zero2_after"] = attempt(lambda: zero2.register_comm_hook(None, hook))
    hooked = BucketedDDP(model())
    hooked.register_comm_hook(None, hook)
    out["zero2_before"] = attempt(
        lambda: ShardedOptimizer(hooked.parameters(), torch.optim.SGD, shard_gradients=True, lr=1)
    )
    sub = dist.new_group(list(range(world)))
    in_sub = BucketedDDP(model(), process_group=sub)
    out["subgroup_none"] = attempt(lambda: in_sub.register_comm_hook(None, hook))
    out["other_group"] = attempt(
        lambda: in_sub.register_comm_hook(_powersgd_state(dist.group.WORLD), hook)
    )
    in_sub.register_comm_hook(sub, hook)  # the right group: fine
    # A hook on some ranks only: caught at the first synchronizing backward, on every rank.
    mixed = BucketedDDP(model())
    if rank == 0:
        mixed.register_comm_hook(None, functools.partial(hook))
    out["mismatch"] = attempt(lambda: _backward(mixed))
    if rank != 0:  # fixed on the other ranks: the wrapper is still usable
        mixed.register_comm_hook(None, functools.partial(hook))
    out["after_mismatch"] = attempt(lambda: _backward(mixed))
    # A backward that raises half-way (on every rank alike): under no_sync nothing was
    # communicated and training goes on; a synchronizing one leaves the next forward refusing.
    for name, sync in (("unfinished_no_sync", False), ("unfinished_sync", True)):
        ddp = BucketedDDP(model(), 0)
        handle = ddp.module.a.weight.register_hook(_raise_in_backward)
        with contextlib.nullcontext() if sync else ddp.no_sync():
            caught = attempt(lambda ddp=ddp: _backward(ddp))
        handle.remove()
        out[name] = f"{caught} / then: {attempt(lambda ddp=ddp: _backward(ddp))}"
    probe = torch.tensor([1.0])
    dist.all_reduce(probe)
    out["probe"] = str(probe.item())
    return out


def _raise_in_backward(grad: torch.Tensor) -> None:
    raise ValueError("injected in backward")


def nccl_run(rank: int, world: int, seed: int) -> dict[str, Any]:
    """On cuda:<rank> under NCCL: every hook (bf16 unwrapped: torch accepts it with NCCL)."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    HOOKS["bf16"] = (
        lambda: None,
        default_hooks.bf16_compress_hook,
        default_hooks.bf16_compress_hook,
    )

    def on_gpu(wrap: Callable) -> Callable:
        return lambda model: wrap(model.to(device))

    out = {}
    for name in HOOKS:
        out[f"{name}/torch"] = _cpu(
            train("mlp", seed, rank, on_gpu(_theirs(name, False)), 4, device=device)
        )
        out[f"{name}/ours"] = _cpu(
            train("mlp", seed, rank, on_gpu(_ours(name, None)), 4, device=device)
        )
    return out


def _cpu(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return tree.cpu() if isinstance(tree, torch.Tensor) else tree
