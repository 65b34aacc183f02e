"""Double backward: a gradient penalty (``torch.autograd.grad(..., create_graph=True)``, then a
backward through those gradients) through flash_attention on both backends, and through the custom
ops that torch.compile uses, against float64 references (a silently dropped second-order term
fails)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention.cases import Case, assert_close
from tests.attention.test_features import (
    BACKENDS,
    FeatureCase,
    feature_cases,
    needs_interpreter,
    run_features,
)
from tests.reference import attention_reference, modded_attention, naive_attention, scores


def penalised_grads(out, lse, inputs, seed: int):
    """``loss = <out, w> + <lse, u>`` (lse where finite), ``g = d loss / d inputs`` with
    ``create_graph``, then ``(loss + sum <g, c>).backward()``: returns ``g`` and the inputs'
    ``.grad`` (first order plus the Hessian-vector product)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=gen).to(out)
    u = torch.randn(lse.shape, generator=gen).to(device=lse.device, dtype=lse.dtype)
    finite = lse.isfinite()
    loss = (out * w).sum() + (torch.where(finite, lse, 0.0) * u).sum()
    grads = torch.autograd.grad(loss, inputs, create_graph=True)
    cs = [torch.randn(g.shape, generator=gen).to(g) for g in grads]
    (loss + sum((g * c).sum() for g, c in zip(grads, cs, strict=True))).backward()
    return grads, [t.grad for t in inputs]


def compare(ours, ref_fn, inputs, dtype, seed):
    """``ours = (out, lse, inputs)``; ``ref_fn(q, k, v) -> (out, lse)`` gives the float64 reference
    and PyTorch's own error in ``dtype`` (the tolerance)."""
    g, second = penalised_grads(*ours, seed)
    r64 = [t.detach().double().requires_grad_() for t in inputs]
    g64, second64 = penalised_grads(*ref_fn(*r64), r64, seed)
    rb = [t.detach().clone().requires_grad_() for t in inputs]
    gb, secondb = penalised_grads(*ref_fn(*rb), rb, seed)
    for i, name in enumerate("qkv"):
        assert_close(f"d{name}", g[i], gb[i], g64[i], dtype)
        assert_close(f"d{name} with the penalty", second[i], secondb[i], second64[i], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(deadline=None, max_examples=6)
@given(case=feature_cases(max_seq=24), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_gradient_penalty_matches_float64(backend, case, dtype):
    """Every score modification (mask, window, softcap, ALiBi, dropout), GQA, causal."""
    q, k, v, out, lse, ref_kw = run_features(case, dtype, backend)
    compare((out, lse, (q, k, v)), lambda *t: modded_attention(*t, **ref_kw), (q, k, v), dtype,
            case.seed)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [538, 0])
def test_gradient_penalty_over_one_key_in_float16(backend, seed):
    """13 queries over one key, window (6, 0): P = 1 exactly, so the exact second-order terms
    vanish and PyTorch's own float16 error (the tolerance) is unusually small. The penalty's
    terms through the saved out and lse (an out gradient rounded to float16, a dS rounded to
    float16 in the forward's backward) cancelled the same terms of the recorded graph, in
    float32, only up to float16 rounding: dk 0.0165 off against a tolerance of 0.0091 (seed
    538), dv 0.0154 against 0.0142 (seed 0); now 0.0008 and 0.0014."""
    case = FeatureCase(1, 2, 1, 13, 1, 16, False, "none", (6, 0), None, "none", 0.0, seed)
    q, k, v, out, lse, ref_kw = run_features(case, torch.float16, backend)
    compare((out, lse, (q, k, v)), lambda *t: modded_attention(*t, **ref_kw), (q, k, v),
            torch.float16, seed)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_penalty_float64_matches_sdpa_math(backend):
    """float64 (the PyTorch backend; float32 through the Triton kernels) against SDPA's math path
    in float64: the penalised gradients agree to the precision of the dtype."""
    from torch_flashsys import flash_attention

    dtype = torch.float64 if backend == "torch" else torch.float32
    case = Case(2, 2, 2, 19, 23, 16, True, None, False, True, seed=5)
    q, k, v = case.make(dtype)
    out, lse = flash_attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend,
                               return_lse=True)  # fmt: skip
    g, second = penalised_grads(out, lse, (q, k, v), seed=6)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    g64, second64 = penalised_grads(*attention_reference(*r, is_causal=True), r, seed=6)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for ours, ref in zip([*g, *second], [*g64, *second64], strict=True):
        torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_penalty_of_a_packed_batch(backend):
    """cu_seqlens: the penalised gradients of each sequence on its own."""
    from torch_flashsys import flash_attention

    g = torch.Generator().manual_seed(3)
    lens = [7, 0, 12]
    q, k, v = (torch.randn(19, 2, 16, generator=g).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
    out, lse = flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, is_causal=True,
                               softcap=3.0, backend=backend, return_lse=True)  # fmt: skip

    def per_sequence(q, k, v):
        outs, lses, start = [], [], 0
        for n in lens:
            qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
            o, s = modded_attention(qs, ks, vs, is_causal=True, softcap=3.0)
            outs.append(o.transpose(0, 1))
            lses.append(s.transpose(0, 1))
            start += n
        return torch.cat(outs), torch.cat(lses)

    compare((out, lse, (q, k, v)), per_sequence, (q, k, v), torch.float32, seed=4)


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_gradient_penalty_through_the_custom_ops(causal):
    """The ``register_autograd`` path (what torch.compile traces) called eagerly."""
    from torch_flashsys.attention._extras import CAUSAL, PLAIN
    from torch_flashsys.attention._ops import _op_args, attn_fwd

    case = Case(1, 2, 2, 17, 9, 16, causal, 0.3, False, True, seed=7)
    q, k, v = case.make(torch.float32)
    extras = _op_args(0.3, CAUSAL if causal else PLAIN)  # the ops' trailing arguments
    out, lse = attn_fwd(q, k, v, *extras)

    def ref(q, k, v):  # plain attention in the inputs' dtype (float64: the reference)
        return naive_attention(q, k, v, causal, 0.3), scores(q, k, causal, 0.3).logsumexp(-1)

    compare((out, lse, (q, k, v)), ref, (q, k, v), torch.float32, seed=8)


@needs_interpreter
def test_gradient_penalty_under_torch_compile_raises():
    """A compiled graph has no double backward (AOTAutograd refuses it): an error, never a
    silently dropped term."""
    from torch_flashsys import flash_attention

    q, k, v = Case(1, 2, 1, 17, 17, 16, True, None, False, False, seed=9).make(torch.float32)
    torch._dynamo.reset()
    f = torch.compile(lambda *t: flash_attention(*t, is_causal=True), backend="aot_eager",
                      fullgraph=True)  # fmt: skip
    out = f(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        (out.sum() + sum(g.square().sum() for g in grads)).backward()
