"""torch.func transforms over flash_attention (issue 25): vmap, grad, vjp, jacrev and vmap over grad
(per-sample gradients) work on both backends, as they do for SDPA; what is not supported raises
NotImplementedError (naming the transforms that work, except forward-mode AD, whose message is
PyTorch's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_flashsys import flash_attention
from torch_flashsys.attention._backend import triton_can_run_on

needs_interpreter = pytest.mark.skipif(
    not triton_can_run_on(torch.device("cpu")),
    reason="Triton kernels cannot run on CPU here (no triton or TRITON_INTERPRET unset)",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def _sdpa64(q, k, v, causal, gqa):
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=gqa
    )


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=5)
@given(
    seed=st.integers(0, 2**31 - 1),
    rank=st.sampled_from([3, 4]),
    mapped=st.sampled_from(["qkv", "q", "kv"]),
    dim=st.sampled_from([0, 1, -1]),
    causal=st.booleans(),
    group=st.sampled_from([1, 2]),
)
def test_vmap_matches_sdpa_float64(backend, seed, rank, mapped, dim, causal, group):
    gen = torch.Generator().manual_seed(seed)
    n, heads, seq, e = 3, 2 * group, 11, 16
    lead = (2, heads) if rank == 4 else (heads,)

    def make(h, is_mapped):
        shape = [*lead[:-1], h, seq, e]
        if is_mapped:
            shape.insert(dim if dim >= 0 else len(shape) + 1 + dim, n)
        return torch.randn(shape, generator=gen)

    q = make(heads, "q" in mapped)
    k, v = (make(heads // group, "k" in mapped) for _ in range(2))
    dims = tuple(dim if name in mapped else None for name in "qkv")
    fn = lambda q, k, v: flash_attention(
        q, k, v, is_causal=causal, enable_gqa=group > 1, backend=backend
    )
    out = torch.func.vmap(fn, in_dims=dims)(q, k, v)
    ref = torch.func.vmap(lambda q, k, v: _sdpa64(q, k, v, causal, group > 1), in_dims=dims)(
        q, k, v
    )
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_and_vjp_match_sdpa_float64(backend):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 13, 16, generator=gen) for _ in range(3))
    w = torch.randn(2, 2, 13, 16, generator=gen)

    def loss(f, q, k, v):
        return (f(q, k, v) * w.to(q.dtype)).sum()

    ours = lambda q, k, v: flash_attention(q, k, v, is_causal=True, backend=backend)
    theirs = lambda q, k, v: _sdpa64(q, k, v, True, False)
    grads = torch.func.grad(lambda *t: loss(ours, *t), argnums=(0, 1, 2))(q, k, v)
    refs = torch.func.grad(lambda *t: loss(theirs, *t), argnums=(0, 1, 2))(
        *(t.double() for t in (q, k, v))
    )
    for g, r in zip(grads, refs, strict=True):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
    out, pullback = torch.func.vjp(ours, q, k, v)
    torch.testing.assert_close(out.double(), theirs(q, k, v), atol=2e-5, rtol=1e-4)
    for g, r in zip(pullback(w), refs, strict=True):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    mapped=st.sampled_from(["qkv", "q", "kv"]),
    causal=st.booleans(),
    group=st.sampled_from([1, 2]),
    window=st.sampled_from([None, (3, 0)]),
)
def test_per_sample_gradients_match_sdpa_float64(backend, seed, mapped, causal, group, window):
    """vmap over grad (per-sample gradients, as Opacus-style code computes them), vmap over vjp
    and jacrev give SDPA's float64 gradients; they raised or failed with a shape error before
    (the backward wrote batched terms into unbatched buffers)."""
    gen = torch.Generator().manual_seed(seed)
    n, heads, seq, e = 3, 2 * group, 10, 16
    q = torch.randn(n, heads, seq, e, generator=gen)
    k, v = (torch.randn(n, heads // group, seq, e, generator=gen) for _ in range(2))
    w = torch.randn(heads, seq, e, generator=gen)
    dims = tuple(0 if name in mapped else None for name in "qkv")
    q, k, v = (t if d == 0 else t[0] for t, d in zip((q, k, v), dims, strict=True))
    causal = causal and window is None  # a window (3, 0) is itself causal
    kw = dict(is_causal=causal, enable_gqa=group > 1)

    def ours(q, k, v):
        return flash_attention(q, k, v, window_size=window, backend=backend, **kw)

    def theirs(q, k, v):
        mask = None
        if window is not None:
            i = torch.arange(q.shape[-2])
            mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - window[0])
        return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                              **kw)  # fmt: skip

    def per_sample(f, *t):
        loss = lambda q, k, v: (f(q, k, v) * w.to(q.dtype)).sum()
        return torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)), in_dims=dims)(*t)

    grads = per_sample(ours, q, k, v)
    refs = per_sample(theirs, *(t.double() for t in (q, k, v)))
    for g, r in zip(grads, refs, strict=True):
        assert g.shape == r.shape
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
    cts = torch.randn(2, *w.shape, generator=gen)
    q0, k0, v0 = (t[0] if d == 0 else t for t, d in zip((q, k, v), dims, strict=True))
    pulled = torch.func.vmap(lambda c: torch.func.vjp(ours, q0, k0, v0)[1](c))(cts)
    expected = torch.func.vmap(lambda c: torch.func.vjp(theirs, q0, k0, v0)[1](c.double()))(cts)
    for g, r in zip(pulled, expected, strict=True):  # (float32: the inputs', cast from float64)
        torch.testing.assert_close(g.double(), r.double(), atol=1e-4, rtol=1e-4)
    jac = torch.func.jacrev(ours)(q0[..., :4, :], k0[..., :4, :], v0[..., :4, :])
    ref = torch.func.jacrev(theirs)(*(t[..., :4, :].double() for t in (q0, k0, v0)))
    torch.testing.assert_close(jac.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_forward_then_backward_outside(backend):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, 9, 16, generator=gen, requires_grad=True)
    out = torch.func.vmap(lambda q: flash_attention(q, q, q, backend=backend))(q)
    out.sum().backward()
    q64 = q.detach().double().requires_grad_()
    torch.func.vmap(lambda q: _sdpa64(q, q, q, False, False))(q64).sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_transforms_raise_naming_what_works(backend):
    q = torch.randn(2, 9, 16)
    fn = lambda q: flash_attention(q, q, q, backend=backend)
    mask = torch.ones(9, 9, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="forward mode AD"):  # PyTorch's own message
        torch.func.jvp(fn, (q,), (torch.ones_like(q),))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = lambda q: flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, backend=backend)
    calls = {
        "mask under vmap": lambda: torch.func.vmap(
            lambda q: flash_attention(q, q, q, attn_mask=mask, backend=backend)
        )(q[None].expand(2, -1, -1, -1)),
        "packed backward under vmap": lambda: torch.func.jacrev(packed)(q[:2].transpose(0, 1)),
    }
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=r"supported: torch\.func\.grad") as info:
            call()
        assert str(info.value).startswith("flash_attention: "), name


@pytest.mark.gpu
def test_vmap_and_grad_on_cuda_match_sdpa_float64():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, 4, 70, 64, generator=gen).cuda() for _ in range(3))
    fn = lambda q, k, v: flash_attention(q, k, v, is_causal=True, backend="triton")
    out = torch.func.vmap(fn)(q, k, v)
    ref = torch.func.vmap(lambda q, k, v: _sdpa64(q, k, v, True, False))(q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    grad = torch.func.grad(lambda q: fn(q[0], k[0], v[0]).sum())(q)
    q64 = q.double().requires_grad_()
    _sdpa64(q64[0], k[0], v[0], True, False).sum().backward()
    torch.testing.assert_close(grad.double(), q64.grad, atol=1e-4, rtol=1e-4)
    # per-sample gradients (vmap over grad): the kernels' forward, PyTorch ops' backward
    w = torch.randn(2, 4, 70, 64, generator=gen).cuda()
    per_sample = lambda f: torch.func.vmap(
        torch.func.grad(lambda q, k, v: (f(q, k, v) * w.to(q.dtype)).sum(), argnums=(0, 1, 2))
    )
    grads = per_sample(fn)(q, k, v)
    refs = per_sample(lambda q, k, v: _sdpa64(q, k, v, True, False))(q, k, v)
    for g, r in zip(grads, refs, strict=True):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-4, rtol=1e-4)
