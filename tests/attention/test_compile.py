"""torch.compile(fullgraph=True) with no graph break, on both backends, and torch.library.opcheck on
the custom ops (the Triton backend's route under compile)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.attention.cases import Case
from torch_flashsys import flash_attention
from torch_flashsys.attention._backend import triton_can_run_on
from torch_flashsys.attention._tensors import empty_like_layout

needs_kernels = pytest.mark.skipif(
    not triton_can_run_on(torch.device("cpu")) and not torch.cuda.is_available(),
    reason="the custom ops wrap Triton kernels: needs CUDA or the Triton interpreter",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# "triton" on CPU runs the kernels through the interpreter (TRITON_INTERPRET=1, set by conftest).
BACKENDS = [pytest.param("triton", marks=needs_kernels), "torch"]


class TinyAttentionModel(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2, backend: str = "triton"):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = flash_attention(q, k, v, is_causal=True, backend=self.backend)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("attn_backend", BACKENDS)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
def test_model_compiles_fullgraph_and_matches_eager(backend, attn_backend):
    torch.manual_seed(0)
    model = TinyAttentionModel(backend=attn_backend).to(DEVICE)
    x = torch.randn(2, 19, 32, device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out_c = compiled(x)
    out_c.sum().backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out_e = model(x)
    out_e.sum().backward()
    torch.testing.assert_close(out_c, out_e, atol=2e-5, rtol=1e-4)
    for gc, p in zip(grads_c, model.parameters(), strict=True):
        torch.testing.assert_close(gc, p.grad, atol=2e-5, rtol=1e-4)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0


@pytest.mark.parametrize("attn_backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_on_one_tensor_compiles_fullgraph(causal, attn_backend):
    """Issue 25: flash_attention(x, x, x) under fullgraph raised "duplicate tensor input"."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 2, 19, 16, generator=gen).to(DEVICE).requires_grad_()
    dout = torch.randn(2, 2, 19, 16, generator=gen).to(DEVICE)

    def f(x):
        return flash_attention(x, x, x, is_causal=causal, backend=attn_backend)

    out_c = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    (grad_c,) = torch.autograd.grad(out_c, x, dout)
    x64 = x.detach().double().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(x64, x64, x64, is_causal=causal)
    (grad_ref,) = torch.autograd.grad(ref, x64, dout.double())
    torch.testing.assert_close(out_c.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grad_c.double(), grad_ref, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_custom_ops(causal):
    from torch_flashsys.attention._extras import CAUSAL, PLAIN
    from torch_flashsys.attention._ops import _op_args, attn_bwd, attn_fwd

    case = Case(1, 1, 2, 17, 9, 16, causal, None, False, True, seed=11)
    q, k, v = case.make(torch.float32, DEVICE, requires_grad=True)
    extras = _op_args(0.25, CAUSAL if causal else PLAIN)  # the ops' trailing arguments
    torch.library.opcheck(attn_fwd, (q, k, v, *extras))
    out, lse = attn_fwd(q.detach(), k.detach(), v.detach(), *extras)
    dout = torch.randn_like(out)
    qkv = (q.detach(), k.detach(), v.detach())
    torch.library.opcheck(attn_bwd, (dout, *qkv, out, lse, None, *extras))
    torch.library.opcheck(attn_bwd, (dout, *qkv, out, lse, torch.randn_like(lse), *extras))


@needs_kernels
def test_opcheck_custom_ops_with_score_modifications():
    """The ops' schema carries the mask, ALiBi slopes, dropout seed, window and softcap."""
    from torch_flashsys.attention._extras import Extras
    from torch_flashsys.attention._ops import _op_args, attn_bwd, attn_fwd

    case = Case(2, 1, 2, 19, 23, 16, False, None, False, False, seed=12)
    q, k, v = case.make(torch.float32, DEVICE, requires_grad=True)
    mask = (torch.rand(2, 1, 1, 23, device=DEVICE) > 0.3).expand(2, 2, 19, 23)
    slopes = torch.rand(2, device=DEVICE).expand(2, 2)
    seed = torch.tensor([1234], device=DEVICE)
    ex = Extras(mask=mask, left=5, right=2, softcap=4.0, alibi=slopes, dropout_p=0.2, seed=seed)
    extras = _op_args(0.3, ex)
    torch.library.opcheck(attn_fwd, (q, k, v, *extras))
    out, lse = attn_fwd(q.detach(), k.detach(), v.detach(), *extras)
    qkv = (q.detach(), k.detach(), v.detach())
    torch.library.opcheck(attn_bwd, (torch.randn_like(out), *qkv, out, lse, None, *extras))


class MaskedWindowedModel(TinyAttentionModel):
    """Key-padding mask, sliding window, softcap, ALiBi and (optionally) dropout in one call."""

    def __init__(self, dropout_p: float = 0.0, backend: str = "triton"):
        super().__init__(backend=backend)
        self.dropout_p = dropout_p
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = flash_attention(
            q, k, v, attn_mask=pad[:, None, None, :], dropout_p=self.dropout_p, is_causal=True,
            window_size=(6, 0), softcap=5.0, alibi_slopes=self.slopes, backend=self.backend,
        )  # fmt: skip
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("attn_backend", BACKENDS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_score_modifications_compile_fullgraph(dropout_p, attn_backend):
    torch.manual_seed(0)
    model = MaskedWindowedModel(dropout_p, attn_backend).to(DEVICE)
    x = torch.randn(2, 19, 32, device=DEVICE)
    pad = torch.ones(2, 19, dtype=torch.bool, device=DEVICE)
    pad[1, 12:] = False
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out_c = compiled(x, pad)
    out_c.sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert torch._dynamo.explain(model)(x, pad).graph_break_count == 0
    if not dropout_p:
        torch.testing.assert_close(out_c, model(x, pad), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_custom_ops_hand_the_rules_the_plain_and_causal_extras_themselves(causal):
    """Under torch.compile the kernels are reached through the custom ops, which rebuild
    ``Extras`` from their arguments; the Hopper rules test ``ex is CAUSAL`` / ``ex is PLAIN``, so
    a rebuilt equal copy sent every compiled call on an H100 to the portable kernels (the e2e
    training step's attention took 52 instead of 32 ms). The ops must pass the singletons on."""
    from torch_flashsys.attention import _ops, _sm90
    from torch_flashsys.attention._extras import CAUSAL, PLAIN

    expected = CAUSAL if causal else PLAIN
    q = torch.randn(1, 2, 8, 16)
    seen = []

    def takes(q, k, v, scale, ex):
        seen.append(ex)
        return True

    def forward(q, k, v, scale, is_causal):
        seen.append(is_causal)
        return torch.zeros_like(q), q.new_zeros(q.shape[:-1])

    def backward(dout, q, k, v, out, lse, dlse, scale, ex):
        seen.append(ex)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    args = _ops._op_args(0.25, expected)
    with (
        mock.patch.object(_sm90, "forward_takes", takes),
        mock.patch.object(_sm90, "forward", forward),
        mock.patch.object(_ops, "_backward", backward),
    ):
        out, lse = _ops.attn_fwd(q, q, q, *args)
        _ops.attn_bwd(out, q, q, q, out, lse, None, *args)
    assert seen[0] is expected and seen[1] is causal and seen[2] is expected
    for ex in (PLAIN, CAUSAL):
        assert _ops._from_op_args(_ops._op_args(0.5, ex)) == (0.5, ex)
        assert _ops._from_op_args(_ops._op_args(0.5, ex))[1] is ex


def test_canonical_extras_pass_every_tensor_field_through():
    """``canonical`` leaves an Extras holding any tensor alone (dataclass equality would compare
    tensors); it finds the tensor fields from the class itself, so a field added later counts."""
    import dataclasses

    from torch_flashsys.attention._extras import PLAIN, Extras, canonical

    fields = [f.name for f in dataclasses.fields(Extras) if "Tensor" in str(f.type)]
    assert len(fields) >= 6
    for name in fields:
        ex = Extras(**{name: torch.zeros(2)})
        assert canonical(ex) is ex
    assert canonical(Extras()) is PLAIN


@pytest.mark.parametrize("attn_backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_value_head_dim_compiles_fullgraph_with_dynamic_lengths(layout, attn_backend):
    """A value head dim other than the query's (DeepSeek's MLA: 192 and 128) at a second sequence
    length (automatic dynamic shapes): the PyTorch backend's output allocation sorted symbolic
    strides, which Dynamo refuses ("Unsupported sort with non-constant keys")."""
    torch._dynamo.reset()

    def f(q, k, v):
        return flash_attention(q, k, v, is_causal=True, backend=attn_backend)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(3)
    for seq in (9, 13, 17):
        q, k, v = (torch.randn(2, seq, 3, d, generator=gen) for d in (24, 24, 16))
        if layout == "bhld":
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k, v = (t.to(DEVICE).requires_grad_() for t in (q, k, v))
        out = compiled(q, k, v)
        assert out.stride() == empty_like_layout(q, 16).stride()
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
        refs = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
        for g, r in zip(grads, refs, strict=True):
            torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)


def test_backward_compiles_after_dynamic_recompile_in_either_layout():
    """3-D, then (B, H, L, E), then (B, L, H, E) memory viewed as (B, H, L, E): the rank change
    turns the shapes dynamic, and Dynamo's backward graph of the Function read the head dim from
    the gradient's stride (``sym_stride(dout, 2)``), which under AOTAutograd is the output's
    layout: the third backward failed to compile ("size of tensor a (9*s3) must match ...")."""
    torch._dynamo.reset()

    def f(q, k, v):
        return flash_attention(q, k, v, backend="torch")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(4)
    shapes = [(4, 9, 16), (2, 4, 9, 16), (2, 9, 4, 16)]
    for n, shape in enumerate(shapes):
        q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
        if n == 2:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k, v = (t.to(DEVICE).requires_grad_() for t in (q, k, v))
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out.sum(), (q, k, v))  # an expanded gradient: strides 0
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64)
        refs = torch.autograd.grad(ref.sum(), (q64, k64, v64))
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
        for g, r in zip(grads, refs, strict=True):
            torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
