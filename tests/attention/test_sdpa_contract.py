"""The rest of SDPA's contract, against SDPA itself on the same inputs: float64 (gradcheck), a
value head dim different from the query/key one, any number of leading batch dimensions (2-D
included), empty query or key lengths. Both backends where the dtype allows (float64 is the
PyTorch backend's, on any device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.attention.cases import assert_close, max_err
from torch_flashsys import flash_attention
from torch_flashsys.attention._backend import triton_can_run_on

needs_interpreter = pytest.mark.skipif(
    not triton_can_run_on(torch.device("cpu")),
    reason="Triton kernels cannot run on CPU here (no triton or TRITON_INTERPRET unset)",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def _sdpa64(q, k, v, **kw):
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)


@st.composite
def contract_cases(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=3)))
    rank2 = draw(st.booleans()) and not lead
    heads, group = (1, 1) if rank2 else (draw(st.integers(1, 2)), draw(st.sampled_from([1, 2])))
    dims = draw(st.sampled_from([(16, 16), (32, 16), (16, 48), (24, 40)]))  # (qk, v)
    return {
        "lead": () if rank2 else lead,
        "rank2": rank2,
        "heads": heads,
        "group": group,
        "seq_q": draw(st.integers(0, 30)),
        "seq_k": draw(st.integers(0, 30)),
        "dims": dims,
        "causal": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _tensors(c, dtype):
    g = torch.Generator().manual_seed(c["seed"])
    kv_heads, heads = c["heads"], c["heads"] * c["group"]
    pre = lambda h: () if c["rank2"] else (*c["lead"], h)
    q = torch.randn(*pre(heads), c["seq_q"], c["dims"][0], generator=g)
    k = torch.randn(*pre(kv_heads), c["seq_k"], c["dims"][0], generator=g)
    v = torch.randn(*pre(kv_heads), c["seq_k"], c["dims"][1], generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=contract_cases(), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_shapes_and_lengths_like_sdpa(case, dtype, backend):
    """Leading dims (0-3), 2-D, value head dim != query head dim, empty lengths: SDPA's output
    and gradients (float64 SDPA math as the reference, SDPA in dtype as the error baseline)."""
    if backend == "triton" and case["dims"][1] not in (16, 24, 32, 40, 48):
        return
    q, k, v = _tensors(case, dtype)
    kw = {"is_causal": case["causal"], "enable_gqa": case["group"] > 1}
    out = flash_attention(q, k, v, **kw, backend=backend)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _sdpa64(q64, k64, v64, **kw)
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    base = F.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(), **kw).to(dtype)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_close("out", out, base, ref, dtype)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(case["seed"] + 1))
    out.backward(g.to(dtype))
    ref.backward(g.double())
    base.backward(g.to(dtype))
    for name, ours, b, r in (("dq", q.grad, qb.grad, q64.grad), ("dk", k.grad, kb.grad, k64.grad),
                             ("dv", v.grad, vb.grad, v64.grad)):  # fmt: skip
        assert ours.shape == r.shape
        assert_close(name, ours, b, r, dtype)


@given(case=contract_cases())
def test_float64_matches_sdpa_on_the_pytorch_backend(case):
    q, k, v = _tensors(case, torch.float64)
    kw = {"is_causal": case["causal"], "enable_gqa": case["group"] > 1}
    out = flash_attention(q, k, v, **kw)  # "auto": float64 goes to the PyTorch backend
    ref = _sdpa64(*(t.detach() for t in (q, k, v)), **kw)
    assert out.dtype == torch.float64 and max_err(out, ref) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 1, 7, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 1, 7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    mask = torch.rand(6, 7, generator=g) > 0.3
    fn = lambda q, k, v: flash_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True, softcap=3.0, return_lse=True
    )
    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))  # double backward (gradient penalties)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_keys_give_zeros_and_zero_gradients(backend):
    q = torch.randn(2, 3, 5, 16, requires_grad=True)
    k, v = (
        torch.randn(2, 3, 0, 16, requires_grad=True),
        torch.randn(2, 3, 0, 24, requires_grad=True),
    )
    out, lse = flash_attention(q, k, v, backend=backend, return_lse=True)
    assert out.shape == (2, 3, 5, 24) and torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert (lse == float("-inf")).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape


def test_output_of_a_transposed_query_keeps_its_layout_with_another_value_dim():
    q = torch.randn(2, 9, 4, 16).transpose(1, 2)  # (B, H, L, E) view of (B, L, H, E) memory
    v = torch.randn(2, 4, 9, 24)
    out = flash_attention(q, q, v, backend="torch")
    assert out.shape == (2, 4, 9, 24) and out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("dims", [(0, 16), (16, 0), (0, 0)], ids=["E0", "Ev0", "both0"])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_head_dim_zero_like_sdpa(scale, dims, backend):
    """Query/key head dim 0: every score is an empty dot product (0), so attention is uniform over
    the allowed keys (SDPA's result, whatever the scale); value head dim 0: an empty output."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 3, 5, dims[0], generator=g, requires_grad=True)
    k = torch.randn(2, 3, 7, dims[0], generator=g, requires_grad=True)
    v = torch.randn(2, 3, 7, dims[1], generator=g, requires_grad=True)
    kw = {"is_causal": True, "scale": scale}
    out = flash_attention(q, k, v, **kw, backend=backend)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _sdpa64(q64, k64, v64, **kw)
    assert out.shape == ref.shape and max_err(out, ref) < 1e-6
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    ref.backward(dout.double())
    for ours, r in ((q, q64), (k, k64), (v, v64)):
        assert ours.grad.shape == r.shape and max_err(ours.grad, r.grad) < 1e-6


SCALES = {
    "numpy float32": lambda: np.float32(0.3),
    "numpy float64": lambda: np.float64(0.7),
    "numpy int64": lambda: np.int64(1),
    "python int": lambda: 2,
    "0-d tensor": lambda: torch.tensor(0.5),
    "0-d float16 tensor": lambda: torch.tensor(0.25, dtype=torch.float16),
    "0-d int tensor": lambda: torch.tensor(1),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(SCALES))
def test_scale_takes_what_sdpa_takes(backend, kind):
    """Issue 25: numpy scalars and 0-d tensors raised TypeError; SDPA takes them."""
    scale = SCALES[kind]()
    g = torch.Generator().manual_seed(len(kind))
    q, k, v = (torch.randn(2, 2, 13, 16, generator=g) for _ in range(3))
    out = flash_attention(q, k, v, is_causal=True, scale=scale, backend=backend)
    ref = _sdpa64(q, k, v, is_causal=True, scale=float(scale))
    assert max_err(out, ref) < 2e-5
    assert max_err(ref, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)) < 2e-5
    same = flash_attention(q, k, v, is_causal=True, scale=float(scale), backend=backend)
    assert torch.equal(out, same)


DROPOUTS = {
    "numpy float32": lambda: np.float32(0.25),
    "numpy float64": lambda: np.float64(0.5),
    "numpy int64": lambda: np.int64(0),
    "python int": lambda: 1,
    "0-d tensor": lambda: torch.tensor(0.25),
    "0-d float16 tensor": lambda: torch.tensor(0.5, dtype=torch.float16),
    "0-d int tensor": lambda: torch.tensor(0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(DROPOUTS))
def test_dropout_p_takes_what_sdpa_takes(backend, kind):
    """numpy scalars and 0-d tensors as ``dropout_p`` (SDPA takes them; they raised ValueError
    "must be a float in [0, 1]" although in range): the call equals the one with
    ``float(dropout_p)`` under the same seed, output and gradients."""
    p = DROPOUTS[kind]()
    F.scaled_dot_product_attention(*(torch.randn(1, 1, 4, 16) for _ in range(3)), dropout_p=p)
    g = torch.Generator().manual_seed(len(kind))
    q, k, v = (torch.randn(2, 2, 13, 16, generator=g) for _ in range(3))
    runs = []
    for value in (p, float(p)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        torch.manual_seed(5)
        out = flash_attention(qq, kk, vv, dropout_p=value, is_causal=True, backend=backend)
        out.backward(torch.ones_like(out))
        runs.append((out, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("dropout_p", "match"),
    [
        (torch.tensor([0.5]), r"dropout_p must be a real number .* got a tensor of shape \(1,\)"),
        (torch.tensor(True), "dropout_p must be a real number .* dtype torch.bool"),
        (np.bool_(True), r"dropout_p must be a real number .* got numpy\.bool_? (np\.)?True_?"),
        (np.float32(1.5), "dropout_p must be a real number in \\[0, 1\\]"),
        ("0.1", "dropout_p must be a real number .* got str '0.1'"),
    ],
)
def test_dropout_p_errors_name_the_argument(dropout_p, match):
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match=match) as info:
        flash_attention(q, q, q, dropout_p=dropout_p)
    assert str(info.value).startswith("flash_attention: dropout_p")


def test_flag_errors_name_numpy_types():
    """A numpy bool as ``is_causal`` is refused as SDPA refuses it, naming the numpy type (the
    message said "must be a bool, got bool")."""
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got numpy\.bool"):
        flash_attention(q, q, q, is_causal=np.bool_(True))


@pytest.mark.parametrize(
    ("scale", "error", "match"),
    [
        (
            torch.tensor([0.5]), TypeError,
            r"scale must be a finite real number .* got a tensor of shape \(1,\)",
        ),
        (torch.tensor(0.5, requires_grad=True), TypeError, "scale gets no gradient"),
        (np.bool_(True), TypeError, "scale must be a finite real number"),
        # a real number of the wrong value: ValueError (SDPA returns NaN rows for these)
        (torch.tensor(float("inf")), ValueError, r"scale must be finite, got tensor\(inf\)"),
        (float("-inf"), ValueError, "scale must be finite, got -inf"),
        (np.float32("nan"), ValueError, "scale must be finite, got "),
    ],
)  # fmt: skip
def test_scale_errors_name_the_argument(scale, error, match):
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(error, match=match) as info:
        flash_attention(q, q, q, scale=scale)
    assert str(info.value).startswith("flash_attention: scale")
