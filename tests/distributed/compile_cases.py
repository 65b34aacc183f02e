"""Rank bodies for tests/distributed/test_compile.py: BucketedDDP (and torch DDP) under
``torch.compile``, compiled outside (``torch.compile(BucketedDDP(m))``) and inside
(``BucketedDDP(torch.compile(m))``), against one float64 process training on the whole batch.

A case is a dict:
    model: "mlp" | "attn" (each with a parameter no forward uses) | "norm" (BatchNorm buffers:
        per-shard statistics have no whole-batch twin, so compared with the eager wrapper)
    wrap: "ours" | "torch"
    compile: "outer" | "inner" | "none"
    backend: a torch.compile backend ("aot_eager", "inductor")
    opt: "plain" (AdamW) | "zero1" | "zero2" (ShardedOptimizer over AdamW; zero2:
        shard_gradients=True)
    pattern: "plain" | "no_sync" (two micro-batches per step, the first under no_sync(), called
        on the compiled wrapper) | "no_grad" (a forward under torch.no_grad() before each step's
        forward and one between the forward and its backward)
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch._dynamo
import torch._dynamo.testing
import torch._inductor.config
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.distributed import ddp_cases
from tests.distributed.common import attempt
from torch_flashsys import BucketedDDP, ShardedOptimizer

F64 = torch.float64
STEPS = 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 12, dtype=F64), nn.Linear(12, 4, dtype=F64)
        self.unused = nn.Linear(6, 4, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Norm(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(12, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


class Attn(nn.Module):
    """Embedding, causal self-attention with a residual and LayerNorm, an MLP, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8, dtype=F64)
        self.qkv, self.proj = nn.Linear(8, 24, dtype=F64), nn.Linear(8, 8, dtype=F64)
        self.norm = nn.LayerNorm(8, dtype=F64)
        self.mlp = nn.Sequential(
            nn.Linear(8, 16, dtype=F64), nn.GELU(), nn.Linear(16, 8, dtype=F64)
        )
        self.head = nn.Linear(8, 4, dtype=F64)
        self.unused = nn.Linear(8, 8, dtype=F64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = self.norm(h + self.proj(a.transpose(1, 2).flatten(-2)))
        return self.head(h + self.mlp(h)).mean(1)


MODELS = {"mlp": MLP, "norm": Norm, "attn": Attn}


def shard(model: str, seed: int, step: int, rank: int, micro: int) -> tuple:
    """Rank ``rank``'s (input, target) of one micro-batch; the same on every process."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro * 101 + rank * 7)
    target = torch.randn(3, 4, generator=g, dtype=F64)
    if model == "attn":
        return torch.randint(0, 11, (3, 5), generator=g), target
    return torch.randn(3, 6, generator=g, dtype=F64), target


def _whole(model: str, seed: int, step: int, world: int, micro: int) -> tuple:
    parts = [shard(model, seed, step, r, micro) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _optimizer(params: Any, opt: str) -> torch.optim.Optimizer:
    kwargs = {"lr": 0.05, "weight_decay": 0.1}
    if opt == "plain":
        return torch.optim.AdamW(params, **kwargs)
    return ShardedOptimizer(params, torch.optim.AdamW, shard_gradients=opt == "zero2", **kwargs)


def train(case: dict, batches: list[list[tuple]], wrap: Any, module: nn.Module) -> dict[str, Any]:
    """Optimizer steps of ``wrap`` (``module``, maybe wrapped and compiled) over ``batches``
    (per step, its micro-batches). Per step: the gradients before ``step()`` (``None``: none),
    the parameters after it; at the end the buffers."""
    opt = _optimizer(module.parameters(), case.get("opt", "plain"))
    pattern = case.get("pattern", "plain")
    out: dict[str, Any] = {"grads": [], "params": []}
    for micro_batches in batches:
        opt.zero_grad(set_to_none=True)
        for i, (x, target) in enumerate(micro_batches):
            if pattern == "no_grad":
                with torch.no_grad():
                    wrap(x)
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else wrap.no_sync():
                loss = (wrap(x) - target).pow(2).mean()
                if pattern == "no_grad":
                    with torch.no_grad():
                        wrap(x)
                loss.backward()
        out["grads"].append(
            {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
        )
        opt.step()
        out["params"].append({n: p.detach().clone() for n, p in module.named_parameters()})
    out["buffers"] = {n: b.clone() for n, b in module.named_buffers()}
    return out


def _torch_ddp(module: nn.Module) -> TorchDDP:
    return TorchDDP(module, find_unused_parameters=True)  # the unused parameter


def _wrapped(case: dict, model: nn.Module, backend: Any) -> nn.Module:
    make = BucketedDDP if case["wrap"] == "ours" else _torch_ddp
    if case["compile"] == "none":
        return make(model)
    if case["compile"] == "outer":
        return torch.compile(make(model), backend=backend)
    return make(torch.compile(model, backend=backend))


def run_case(rank: int, world: int, seed: int, case: dict) -> dict[str, Any]:
    """One case on this rank, from a fresh Dynamo state: its training run, the graphs compiled
    (``frames``: how many; ``ops``: their operators) and the graph breaks; on rank 0 also the
    single-process float64 reference over the whole batch."""
    torch._dynamo.reset()
    counters.clear()
    if case["backend"] == "inductor":  # no pool of compile workers (2 cores, 2 ranks)
        torch._inductor.config.compile_threads = 1
    micro = 2 if case.get("pattern") == "no_sync" else 1
    torch.manual_seed(seed)
    model = MODELS[case["model"]]()
    reference = copy.deepcopy(model)
    with torch.no_grad():  # rank-dependent buffers: the wrapper broadcasts rank 0's
        for buf in (b for b in model.buffers() if b.is_floating_point()):
            buf.add_(0.1 * rank)
    counter = torch._dynamo.testing.CompileCounterWithBackend(case["backend"])
    mine = [[shard(case["model"], seed, s, rank, m) for m in range(micro)] for s in range(STEPS)]
    out = train(case, mine, _wrapped(case, model, counter), model)
    out["frames"], out["ops"] = counter.frame_count, counter.op_count
    out["graph_breaks"] = sum(counters["graph_break"].values())
    if rank == 0 and case["model"] != "norm":
        whole = [
            [_whole(case["model"], seed, s, world, m) for m in range(micro)] for s in range(STEPS)
        ]
        plain = dict(case, opt="plain", pattern="plain")  # no wrapper: no no_sync
        out["reference"] = train(plain, whole, _Plain(reference), reference)
    return out


class _Plain(nn.Module):
    """The reference model with a ``no_sync()`` that does nothing (one process)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def cases(rank: int, world: int, seed: int, todo: list[dict]) -> list[dict[str, Any]]:
    """:func:`run_case` for each case of ``todo``, in one process group."""
    return [run_case(rank, world, seed, case) for case in todo]


PATTERNS = [p for p in ddp_cases.GRAPH_PATTERNS if p != "grad_penalty"]  # double backward:
# torch.compile refuses it ("aot_autograd does not currently support double backward")


def graph_patterns(rank: int, world: int, seed: int, backend: str) -> dict[str, Any]:
    """docs/ddp.md's "Which backwards synchronize" patterns with the wrapper compiled, beside one
    process running the compiled model on the whole batch (a compiled graph gives a parameter
    that the backward does not reach a zero gradient, not ``None``). One SGD step per pattern;
    the gradients before each. Also ``fullgraph=True``: over the wrapper (raises on every rank),
    over the model inside it."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    base = ddp_cases._Checkpointed().to(F64)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randn(4 * world, 3, generator=g, dtype=F64) for _ in PATTERNS]
    out: dict[str, Any] = {}
    for kind in ("ours", "single"):
        model = copy.deepcopy(base)
        inner = BucketedDDP(model, 0) if kind == "ours" else model
        wrapped = torch.compile(inner, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for pattern, x in zip(PATTERNS, batches, strict=True):
            mine = x.view(world, 4, 3)[rank] if kind == "ours" else x
            ddp_cases._graph_pattern_loss(wrapped, pattern, mine)
            grads.append(
                {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            )
            opt.step()
            opt.zero_grad()
        out[kind] = grads
    torch._dynamo.reset()  # else the cached graphs of the wrapper's forward are reused unchecked
    full = torch.compile(BucketedDDP(MLP()), backend=backend, fullgraph=True)
    out["fullgraph"] = attempt(lambda: full(torch.randn(2, 6, dtype=F64)))
    inner_full = BucketedDDP(torch.compile(MLP(), backend=backend, fullgraph=True))
    out["inner_fullgraph"] = attempt(
        lambda: inner_full(torch.randn(2, 6, dtype=F64)).sum().backward()
    )
    return out
