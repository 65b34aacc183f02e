"""Rank bodies for tests/distributed/test_context_parallel.py (context-parallel attention).

Every body loops over many cases in one spawned world (spawning costs seconds). Shapes are tiny
and float64 with ``backend="torch"``: the results must equal single-process ``flash_attention``
on the whole sequence to float64 rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.common import attempt
from torch_flashsys import BucketedDDP, flash_attention, sdpa_override
from torch_flashsys.distributed import (
    _cp_ring,
    context_parallel_attention,
    context_parallel_sdpa,
    gather_sequence,
    shard_position_ids,
    shard_sequence,
)
from torch_flashsys.models import ModelConfig, TransformerLM

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    batch: int
    heads: int
    kv_heads: int
    chunk: int  # tokens per layout chunk: seq = chunk * world * (2 zigzag, 1 contiguous)
    head_dim: int
    head_dim_v: int
    causal: bool
    mode: str
    layout: str
    scale: float | None

    def seq(self, world: int) -> int:
        return self.chunk * world * (2 if self.layout == "zigzag" else 1)


def _full_inputs(case: Case, world: int):
    g = torch.Generator().manual_seed(case.seed)
    seq = case.seq(world)

    def rnd(h, d):
        return torch.randn(case.batch, h, seq, d, generator=g, dtype=F64)

    q, k = rnd(case.heads, case.head_dim), rnd(case.kv_heads, case.head_dim)
    v = rnd(case.kv_heads, case.head_dim_v)
    return q, k, v, rnd(case.heads, case.head_dim_v)


def _count_flops(counts: list[int]):
    """Wrap the ring's block forward to add each block's score count to ``counts[0]``."""
    original = _cp_ring.block_forward

    def counting(q, k, v, scale, causal, backend):
        rows, cols = q.shape[-2], k.shape[-2]
        counts[0] += rows * (rows + 1) // 2 if causal else rows * cols
        return original(q, k, v, scale, causal, backend)

    return original, counting


def equivalence(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    """Each case: sharded fwd + bwd == flash_attention on the whole sequence; the score counts
    of the causal zigzag ring cases (for the balance test)."""
    flops = []
    for case in cases:
        q, k, v, dout = _full_inputs(case, world)
        gqa = case.kv_heads != case.heads
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = flash_attention(*full, is_causal=case.causal, scale=case.scale, enable_gqa=gqa,
                               backend="torch")  # fmt: skip
        want.backward(dout)
        local = [shard_sequence(t, dim=2, layout=case.layout).requires_grad_() for t in (q, k, v)]
        counts = [0]
        original, counting = _count_flops(counts)
        _cp_ring.block_forward = counting
        try:
            out = context_parallel_attention(
                *local, mode=case.mode, is_causal=case.causal, scale=case.scale, enable_gqa=gqa,
                layout=case.layout, backend="torch",
            )  # fmt: skip
        finally:
            _cp_ring.block_forward = original
        out.backward(shard_sequence(dout, dim=2, layout=case.layout))
        pairs = [("out", out, want)] + [
            (f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", local, full, strict=True)
        ]
        for name, got, ref in pairs:
            whole = gather_sequence(got.detach(), dim=2, layout=case.layout)
            torch.testing.assert_close(
                whole, ref, **TOL, msg=lambda m, n=name, c=case: f"{c} {n}: {m}"
            )
        if case.mode == "ring" and case.causal:
            flops.append((case.layout, case.chunk, counts[0]))
    return {"flops": flops, "helpers": _helpers(rank, world)}


def _helpers(rank: int, world: int) -> dict[str, Any]:
    """shard/gather round trips and the position ids, against the layouts' definitions."""
    out = {}
    for layout in ("zigzag", "contiguous"):
        n = world * (2 if layout == "zigzag" else 1)
        x = torch.arange(3 * 5 * n).view(3, 5 * n)
        shard = shard_sequence(x, layout=layout)
        chunks = x.chunk(n, dim=1)
        ids = [rank, 2 * world - 1 - rank] if layout == "zigzag" else [rank]
        assert torch.equal(shard, torch.cat([chunks[i] for i in ids], 1)), layout
        assert torch.equal(gather_sequence(shard, layout=layout), x), layout
        pos = shard_position_ids(5 * n, layout=layout)
        assert torch.equal(pos, shard_sequence(torch.arange(5 * n), dim=0, layout=layout))
        out[layout] = pos.tolist()
    # a group of one rank: exactly flash_attention (same function object result, no copy)
    singles = [dist.new_group([r]) for r in range(world)]
    q = torch.randn(1, 2, 6, 8, dtype=F64, requires_grad=True)
    got = context_parallel_attention(q, q, q, singles[rank], is_causal=True, backend="torch")
    want = flash_attention(q, q, q, is_causal=True, backend="torch")
    assert torch.equal(got, want) and type(got.grad_fn) is type(want.grad_fn)
    _nests_with_sdpa_override(world)
    return out


def _nests_with_sdpa_override(world: int) -> None:
    """context_parallel_sdpa inside sdpa_override (and the reverse): calls inside the inner block
    take its route, and each block restores what it found."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    full = torch.randn(1, 2, 4 * world, 8, dtype=F64, generator=torch.Generator().manual_seed(5))
    local = shard_sequence(full, dim=2)
    want = shard_sequence(flash_attention(full, full, full, is_causal=True), dim=2)
    with sdpa_override(backend="torch"):
        override = torch.nn.functional.scaled_dot_product_attention
        with context_parallel_sdpa(backend="torch"):
            got = torch.nn.functional.scaled_dot_product_attention(
                local, local, local, is_causal=True
            )
            torch.testing.assert_close(got, want, **TOL)
        assert torch.nn.functional.scaled_dot_product_attention is override
    with context_parallel_sdpa(backend="torch"), sdpa_override(backend="torch"):
        local_only = torch.nn.functional.scaled_dot_product_attention(local, local, local)
        torch.testing.assert_close(local_only, flash_attention(local, local, local), **TOL)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa


# ------------------------------------------------------------------------------ bad inputs


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    """Each scenario's error on this rank (every rank must raise; none may hang)."""
    t = torch.randn(1, 3, 4, 8, dtype=F64)
    g = torch.randn(1, 4, 4, 8, dtype=F64)
    mine = torch.randn(1, 2, 4 + 2 * rank, 8, dtype=F64)  # a different length on every rank

    def cpa(*args, **kw):
        return context_parallel_attention(*args, backend="torch", **kw)

    return {
        "ulysses_heads": attempt(lambda: cpa(t, t, t, mode="ulysses")),
        "ulysses_kv_heads": attempt(
            lambda: cpa(g, t[:, :1], t[:, :1], mode="ulysses", enable_gqa=True)
        ),
        "odd_zigzag": attempt(lambda: cpa(t[:, :, :3], t[:, :, :3], t[:, :, :3], is_causal=True)),
        "odd_zigzag_ulysses": attempt(
            lambda: cpa(g[:, :, :3], g[:, :, :3], g[:, :, :3], is_causal=True, mode="ulysses")
        ),
        "mismatched_shards": attempt(lambda: cpa(mine, mine, mine, is_causal=True)),
        "mismatched_mode": attempt(lambda: cpa(g, g, g, mode="ring" if rank else "ulysses")),
        "not_a_tensor_on_one_rank": attempt(lambda: cpa(g, g, g if rank else None)),
        "kv_length": attempt(lambda: cpa(g, g[:, :, :2], g[:, :, :2])),
        "gqa_flag": attempt(lambda: cpa(g, t[:, :1], t[:, :1])),
        "shard_length": attempt(lambda: shard_sequence(torch.zeros(1, 6 * world - 1))),
        "bad_mode": attempt(lambda: cpa(g, g, g, mode="star")),
        "gather_mismatch": attempt(lambda: gather_sequence(mine)),
        # equal shapes, but rank 1 gathers another dim / layout: each rank got a different tensor
        "gather_dim_mismatch": attempt(lambda: gather_sequence(torch.zeros(4, 4), dim=rank % 2)),
        "gather_layout_mismatch": attempt(
            lambda: gather_sequence(torch.zeros(4, 4), layout=("zigzag", "contiguous")[rank % 2])
        ),
        "gather_negative_dim": attempt(
            lambda: gather_sequence(torch.zeros(4, 4), dim=(1, -1)[rank % 2])
        ),
        "sdpa_mask": attempt(lambda: _sdpa_with_mask(g)),
        "after_errors_still_works": attempt(lambda: cpa(g, g, g, is_causal=True)),
        # a backward on rank 0 only would leave rank 1 out of the ring: refused up front
        "requires_grad_one_rank": attempt(lambda: cpa(g.clone().requires_grad_(rank == 0), g, g)),
        "head_dim_zero": attempt(lambda: cpa(*(torch.randn(1, 2, 4, 0, dtype=F64),) * 3)),
        "shard_dim": attempt(lambda: shard_sequence(torch.zeros(2, 8), dim=5)),
        "position_ids_length": attempt(lambda: shard_position_ids(6 * world - 2)),
        "gather_odd_zigzag": attempt(lambda: gather_sequence(torch.zeros(1, 3))),
        "not_a_member": attempt(lambda: cpa(g, g, g, dist.new_group([0]) if world > 1 else None)),
        "autocast_mixed_dtypes": attempt(lambda: _autocast_mixed(g)),
    }


def _autocast_mixed(x: torch.Tensor) -> None:
    """float32 query and value with a bfloat16 key under CPU autocast: valid for SDPA and
    flash_attention (autocast casts first), so valid here."""
    q = x.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = context_parallel_attention(q, q.bfloat16(), q, is_causal=True, backend="torch")
        want = flash_attention(q, q.bfloat16(), q, backend="torch")  # (its dtype only)
    assert out.dtype == want.dtype == torch.bfloat16, (out.dtype, want.dtype)


def _sdpa_with_mask(x: torch.Tensor) -> None:
    with context_parallel_sdpa():
        torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(4, 4) > 0)


# ---------------------------------------------------------- DDP x CP on a 2-D layout (4 ranks)

SEQ, VOCAB, STEPS = 16, 40, 2


class _WithLoss(torch.nn.Module):
    """The LM with its loss as ``forward`` (a data-parallel wrapper must see the forward)."""

    def __init__(self, long_context_options: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1234)
        cfg = ModelConfig.from_size(
            "tiny", context_length=SEQ, vocab_size=VOCAB, attention="sdpa",
            activation_checkpointing=long_context_options,
        )  # fmt: skip
        self.lm = TransformerLM(cfg).to(F64)
        self.chunk = 3 if long_context_options else None

    def forward(self, tokens, targets, position_ids=None):
        return self.lm.loss(tokens, targets, position_ids=position_ids, chunk_size=self.chunk)


def _data(seed: int, step: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + step)
    return torch.randint(0, VOCAB, (dp, SEQ + 1), generator=g)  # inputs and shifted targets


def _train(model, opt, loss_fn, batches) -> dict[str, Any]:
    """Train; the first step's gradients and the final parameters."""
    grads = None
    for seqs in batches:
        opt.zero_grad()
        loss_fn(model, seqs).backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def ddp_x_cp(rank: int, world: int, seed: int, mode: str, cp: int) -> dict[str, Any]:
    """dp = world / cp data-parallel replicas, each sequence split over a cp group; BucketedDDP
    over all ranks (the flattened data x context group) against single-process training."""
    dp = world // cp
    cp_groups = [dist.new_group(list(range(d * cp, d * cp + cp))) for d in range(dp)]
    my_dp, cp_group = rank // cp, cp_groups[rank // cp]
    batches = [_data(seed, s, dp) for s in range(STEPS)]

    def cp_loss(model, seqs):
        seq = seqs[my_dp : my_dp + 1]
        tokens, targets = (shard_sequence(t, cp_group) for t in (seq[:, :-1], seq[:, 1:]))
        positions = shard_position_ids(SEQ, cp_group)
        with context_parallel_sdpa(cp_group, mode=mode, backend="torch"):
            return model(tokens, targets, positions)  # this shard's mean

    # the CP model recomputes its blocks in the backward, outside the context_parallel_sdpa block
    ddp = BucketedDDP(_WithLoss(long_context_options=True), bucket_size_mb=0.01)
    got = _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.5), cp_loss, batches)
    ref = _WithLoss()
    want = _train(
        ref, torch.optim.SGD(ref.parameters(), lr=0.5),
        lambda m, seqs: m(seqs[:, :-1], seqs[:, 1:]), batches,
    )  # fmt: skip
    got = {key: {n.removeprefix("module."): t for n, t in d.items()} for key, d in got.items()}
    return {"got": got, "want": want}


# --------------------------------------------------------- DTensor inputs sharded on the heads


def dtensor_heads(rank: int, world: int) -> dict[str, Any]:
    """flash_attention on head-sharded DTensors (eager, and the custom op's sharding rule through
    the Triton interpreter) == the plain call; bad layouts raise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    errors = {}
    for dtype, backend, heads, kv in ((F64, "torch", 4, 2), (torch.float32, "triton", 2, 2)):
        q = torch.randn(2, heads, 16, 16, generator=g, dtype=dtype)
        k, v = (torch.randn(2, kv, 16, 16, generator=g, dtype=dtype) for _ in range(2))
        dout = torch.randn(2, heads, 16, 16, generator=g, dtype=dtype)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        kw = {"is_causal": True, "enable_gqa": heads != kv, "backend": backend}
        want, want_lse = flash_attention(*ref, return_lse=True, **kw)
        want.backward(dout)
        dts = [distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (q, k, v)]
        out, lse = flash_attention(*dts, return_lse=True, **kw)
        assert isinstance(out, DTensor) and out.placements == (Shard(1),)
        out.backward(distribute_tensor(dout, mesh, [Shard(1)]))
        tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == F64 else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(out.full_tensor(), want, **tol)
        torch.testing.assert_close(lse.full_tensor(), want_lse, **tol)
        for d, r in zip(dts, ref, strict=True):
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, **tol)
        if backend == "triton":  # the custom op on DTensors: the registered sharding rule
            from torch_flashsys.attention._extras import CAUSAL
            from torch_flashsys.attention._ops import _op_args

            extras = _op_args(0.25, CAUSAL)  # (the ops' trailing arguments, in their order)
            o, o_lse = torch.ops.torch_flashsys.attn_fwd(*(t.detach() for t in dts), *extras)
            assert o.placements == (Shard(1),), o.placements
            plain = torch.ops.torch_flashsys.attn_fwd(q, k, v, *extras)
            torch.testing.assert_close(o.full_tensor(), plain[0], **tol)
            torch.testing.assert_close(o_lse.full_tensor(), plain[1], **tol)
    q = torch.randn(1, 3, 8, 8, dtype=F64)
    seq_sharded = distribute_tensor(torch.randn(1, 2, 8, 8, dtype=F64), mesh, [Shard(2)])
    heads_sharded = distribute_tensor(torch.randn(1, 2, 8, 8, dtype=F64), mesh, [Shard(1)])
    bad = {
        "sequence_sharded": lambda: flash_attention(seq_sharded, seq_sharded, seq_sharded),
        "mixed": lambda: flash_attention(heads_sharded, q[:, :2], q[:, :2]),
        "uneven_heads": lambda: flash_attention(*[distribute_tensor(q, mesh, [Shard(1)])] * 3),
        "mask": lambda: flash_attention(
            heads_sharded, heads_sharded, heads_sharded, attn_mask=torch.ones(8, 8) > 0
        ),
        "context_parallel": lambda: context_parallel_attention(
            heads_sharded, heads_sharded, heads_sharded, backend="torch"
        ),
    }
    for name, fn in bad.items():
        errors[name] = attempt(fn)
    rep = distribute_tensor(torch.randn(1, 2, 8, 8, dtype=F64), mesh, [Replicate()])
    out = flash_attention(rep, rep, rep, backend="torch")
    assert out.placements == (Replicate(),)
    torch.testing.assert_close(out.full_tensor(), flash_attention(*[rep.full_tensor()] * 3))
    return errors


# -------------------------------------------------------------- NCCL, Triton kernels (GPU only)


def nccl_equivalence(rank: int, world: int) -> dict[str, float]:
    """Ring and Ulysses on CUDA (Triton kernels, NCCL) against flash_attention on the whole
    sequence: float32 to 1e-4 and bfloat16 to a few times bf16's own error (float64 reference)."""
    torch.cuda.set_device(rank)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        for mode in ("ring", "ulysses"):
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(3)
                shape = (2, 4 * world, 256 * world, 64)
                q, k, v, dout = (torch.randn(shape, device="cuda", generator=g) for _ in range(4))
                ref64 = [t.double().requires_grad_() for t in (q, k, v)]
                want64 = flash_attention(*ref64, is_causal=causal, backend="torch")
                want64.backward(dout.double())
                # fresh leaves: ``t.to(float32)`` is ``t`` itself, so marking it would make the
                # shards below non-leaf tensors whose ``.grad`` stays None
                ref = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
                want = flash_attention(*ref, is_causal=causal)  # Triton on CUDA
                want.backward(dout.to(dtype))
                local = [
                    shard_sequence(t.to(dtype), dim=2).detach().requires_grad_() for t in (q, k, v)
                ]
                out = context_parallel_attention(*local, mode=mode, is_causal=causal)
                out.backward(shard_sequence(dout.to(dtype), dim=2))
                pairs = [(out, want, want64)] + [
                    (a.grad, b.grad, c.grad) for a, b, c in zip(local, ref, ref64, strict=True)
                ]
                for name, (got, single, exact) in zip(
                    ("out", "dq", "dk", "dv"), pairs, strict=True
                ):
                    whole = gather_sequence(got.detach(), dim=2).double()
                    err = (whole - exact).abs().max().item()
                    own = (single.detach().double() - exact).abs().max().item()
                    key = f"{dtype} {mode} causal={causal} {name}"
                    errors[key] = err
                    floor = 1e-5 if dtype == torch.float32 else 1e-3
                    assert err <= 3 * own + floor, (
                        f"{key}: {err:.3g} vs flash_attention's {own:.3g}"
                    )
    return errors


# ---------------------------------------------------- double backward; the reference LM's flash


def double_backward(rank: int, world: int) -> dict[str, Any]:
    """A gradient penalty through the attention (``create_graph=True``, then a backward of the
    gradient), float64: the outcome per mode and, where it ran, the gathered input gradient's
    largest difference from one process on the whole sequence."""
    gen = torch.Generator().manual_seed(0)
    x_full, w_full = (torch.randn(1, 4, 4 * world, 16, generator=gen, dtype=F64) for _ in range(2))

    def penalty(x, w, attend):
        loss = (attend(x * 1.5, x * 0.7, x * -1.1) * w).sum() + (x**3).sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        gx.pow(2).sum().backward()

    ref = x_full.clone().requires_grad_()
    penalty(ref, w_full, lambda q, k, v: flash_attention(q, k, v, is_causal=True, backend="torch"))
    out: dict[str, Any] = {}
    for mode in ("ring", "ulysses"):
        x = shard_sequence(x_full, dim=2).requires_grad_()

        def attend(q, k, v, mode=mode):
            return context_parallel_attention(
                q, k, v, mode=mode, is_causal=True, backend="torch"
            )  # fmt: skip

        out[mode] = attempt(
            lambda x=x, attend=attend: penalty(x, shard_sequence(w_full, dim=2), attend)
        )
        if out[mode] == "no error":
            out[f"{mode} error"] = (gather_sequence(x.grad, dim=2) - ref.grad).abs().max().item()
    return out


def reference_lm(rank: int, world: int, mode: str) -> dict[str, Any]:
    """The reference LM with its default attention ("flash") under context_parallel_sdpa: the
    loss (mean over the ranks' shard means) and the gradients against one process on the whole
    sequence; and "naive" attention's outcome there."""
    cfg = ModelConfig.from_size(
        "tiny", context_length=SEQ, vocab_size=VOCAB, attention="flash", flash_backend="torch"
    )  # fmt: skip
    torch.manual_seed(1234)
    lm = TransformerLM(cfg).to(F64)
    seq = _data(7, 0, 1)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    want = lm.loss(tokens, targets)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    with context_parallel_sdpa(mode=mode, backend="torch"):
        got = lm.loss(shard_sequence(tokens), shard_sequence(targets),
                      position_ids=shard_position_ids(SEQ))  # fmt: skip
    got.backward()
    loss = got.detach().clone()
    dist.all_reduce(loss)
    grads = {}
    for n, p in lm.named_parameters():
        grad = p.grad / world  # each rank's gradient is of its shard's mean
        dist.all_reduce(grad)
        grads[n] = grad
    naive = ModelConfig.from_size("tiny", context_length=SEQ, vocab_size=VOCAB, attention="naive")
    with context_parallel_sdpa(mode=mode, backend="torch"):
        refused = attempt(lambda: TransformerLM(naive).to(F64).loss(shard_sequence(tokens),
                                                                    shard_sequence(targets)))  # fmt: skip
    return {"loss": (loss / world).item(), "want": want.item(), "grads": grads,
            "want_grads": want_grads, "naive": refused}  # fmt: skip


# ---------------------------------------------- torch's attention modules under the SDPA router


def torch_attention_modules(rank: int, world: int) -> dict[str, Any]:
    """nn.MultiheadAttention and nn.TransformerEncoderLayer inside context_parallel_sdpa: each
    scenario's largest difference from one process on the whole sequence, or what it raised.
    (They reach SDPA only with need_weights=False and off their fused inference fast path.)"""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=F64)
    x = torch.randn(2, 4 * world, 8, dtype=F64)
    scenarios = {
        "mha need_weights": (lambda t: mha(t, t, t)[0], True, torch.enable_grad),
        "mha causal need_weights=False": (
            lambda t: mha(t, t, t, need_weights=False, attn_mask=_causal(t), is_causal=True)[0],
            True, torch.enable_grad,
        ),
        "mha fast path (eval, no_grad)": (lambda t: mha(t, t, t, need_weights=False)[0], False,
                                          torch.no_grad),
        "encoder layer fast path (eval, no_grad)": (layer, False, torch.no_grad),
    }  # fmt: skip
    state = (torch.nn.functional.multi_head_attention_forward,
             torch.backends.mha.get_fastpath_enabled())  # fmt: skip
    out: dict[str, Any] = {}
    for name, (fn, train, grad_mode) in scenarios.items():
        mha.train(train), layer.train(train)
        with grad_mode():
            want = fn(x)
            local = shard_sequence(x)
            with context_parallel_sdpa(backend="torch"):
                out[name] = attempt(lambda fn=fn, local=local: out.update(got=fn(local)))
            if out[name] == "no error":
                out[name] = (gather_sequence(out.pop("got").detach()) - want).abs().max().item()
    now = (torch.nn.functional.multi_head_attention_forward,
           torch.backends.mha.get_fastpath_enabled())  # fmt: skip
    out["restored"] = now == state
    return out


def _causal(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.Transformer.generate_square_subsequent_mask(t.shape[1], dtype=t.dtype)


def flash_attention_module(rank: int, world: int) -> dict[str, Any]:
    """torch_flashsys.FlashAttention (what replace_attention installs) inside
    context_parallel_sdpa: output and input gradient's largest difference from one process on
    the whole sequence per form (seq-first / batch-first, causal, GQA), or what it raised."""
    from torch_flashsys import FlashAttention

    out: dict[str, Any] = {}
    forms = {"seq-first": (False, False, 2), "batch-first causal": (True, True, 2),
             "gqa causal": (True, True, 1)}  # fmt: skip
    for name, (batch_first, causal, kv_heads) in forms.items():
        torch.manual_seed(0)
        attn = FlashAttention(8, 2, num_kv_heads=kv_heads, causal=causal, batch_first=batch_first,
                              backend="torch").to(F64)  # fmt: skip
        dim = 1 if batch_first else 0
        x = torch.randn((2, 4 * world, 8) if batch_first else (4 * world, 2, 8), dtype=F64)
        full = x.clone().requires_grad_()
        want = attn(full)
        want.backward(want.detach())
        local = shard_sequence(x, dim=dim).requires_grad_()
        with context_parallel_sdpa(backend="torch"):
            got = attn(local)
        got.backward(shard_sequence(want.detach(), dim=dim))
        pairs = [(got.detach(), want.detach()), (local.grad, full.grad)]
        out[name] = max((gather_sequence(a, dim=dim) - b).abs().max().item() for a, b in pairs)
    attn = FlashAttention(8, 2, batch_first=True, backend="torch").to(F64)
    x = shard_sequence(torch.randn(2, 4 * world, 8, dtype=F64))
    with context_parallel_sdpa(backend="torch"):
        out["padding mask"] = attempt(lambda: attn(x, x, x, key_padding_mask=x[..., 0] > 0))
        out["kv cache"] = attempt(lambda: attn(x, kv_cache=attn.new_cache(2, x.shape[1])))
    return out
