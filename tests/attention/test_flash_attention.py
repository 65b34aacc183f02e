"""flash_attention against float64 SDPA (math path), both backends, on CPU.

The Triton backend runs through the Triton interpreter here (conftest sets TRITON_INTERPRET=1 on
machines without CUDA); bfloat16 is covered on CPU by the torch backend only, because the
interpreter's bf16 tl.dot is broken (tests/attention/test_gpu.py covers it on CUDA).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention.cases import Case, cases, check_against_reference
from torch_flashsys import flash_attention
from torch_flashsys.attention._backend import triton_can_run_on

needs_interpreter = pytest.mark.skipif(
    not triton_can_run_on(torch.device("cpu")),
    reason="Triton kernels cannot run on CPU here (no triton or TRITON_INTERPRET unset)",
)


def _run(backend):
    def run(q, k, v, case: Case):
        return flash_attention(
            q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=case.gqa,
            backend=backend, return_lse=True,
        )  # fmt: skip

    return run


@given(
    case=cases(max_seq=150), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
)
def test_torch_backend_matches_float64(case, dtype):
    run = _run("torch")
    check_against_reference(case, dtype, lambda q, k, v: run(q, k, v, case))


@needs_interpreter
@settings(max_examples=12)
@given(case=cases(max_seq=40), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_triton_backend_matches_float64(case, dtype):
    run = _run("triton")
    check_against_reference(case, dtype, lambda q, k, v: run(q, k, v, case))


@needs_interpreter
@settings(max_examples=8)
@given(
    case=cases(max_seq=40),
    scale=st.one_of(st.just(0.0), st.floats(-1.0, -0.01)),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_triton_backend_zero_and_negative_scales(case, scale, dtype):
    """SDPA takes any finite scale. The forward folds a positive scale into its exponent (the row
    maximum over raw scores); zero and negative scales must take the unfolded path."""
    case = dataclasses.replace(case, scale=scale)
    run = _run("triton")
    check_against_reference(case, dtype, lambda q, k, v: run(q, k, v, case))


@needs_interpreter
@pytest.mark.parametrize(
    "shape",
    [
        # (batch, kv_heads, group, seq_q, seq_k, head_dim, causal): edges of the tiling
        (1, 1, 1, 1, 1, 16, True),  # single position
        (1, 1, 1, 16, 16, 16, True),  # exactly one tile
        (1, 1, 1, 17, 33, 80, True),  # ragged tiles, non-power-of-two head dim, L < S
        (1, 1, 2, 48, 17, 40, True),  # L > S causal: rows past S see every key
        (2, 1, 4, 20, 20, 96, False),  # MQA-style group of 4, padded head dim 96 -> 128
    ],
)
def test_triton_backend_tile_edges(shape):
    b, hk, g, lq, lk, d, causal = shape
    case = Case(b, hk, g, lq, lk, d, causal, None, False, False, seed=sum(shape))
    run = _run("triton")
    check_against_reference(case, torch.float32, lambda q, k, v: run(q, k, v, case))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_output_keeps_query_layout_and_autograd_node_saves_inputs(backend):
    case = Case(2, 2, 1, 19, 23, 32, True, None, False, True, seed=7)
    q, k, v = case.make(torch.float32)
    out = flash_attention(q, k, v, is_causal=True, backend=backend)
    assert out.stride() == q.stride(), "output should keep the (B, L, H, E) layout of the query"
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 5
    lse_like = [t for t in saved if t.shape == q.shape[:-1]]
    assert len(lse_like) == 1 and lse_like[0].dtype == torch.float32
    for t in (q, k, v):
        assert any(s.data_ptr() == t.data_ptr() and s.shape == t.shape for s in saved)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("dim_v", [32, 48])
def test_output_keeps_the_layout_of_a_query_whose_last_dimension_is_strided(backend, dim_v):
    """Issue 25: the Triton backend returned a contiguous output for such a query."""
    _check_strided_query_layout(backend, dim_v, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dim_v", [32, 48])
def test_output_keeps_the_layout_of_a_strided_query_on_cuda(dim_v):
    _check_strided_query_layout("triton", dim_v, "cuda")


def _check_strided_query_layout(backend: str, dim_v: int, device: str) -> None:
    g = torch.Generator().manual_seed(dim_v)
    q = torch.randn(2, 3, 32, 21, generator=g).transpose(-1, -2)  # (2, 3, 21, 32), strided last
    q = q.to(device).requires_grad_()
    k, v = torch.randn(2, 3, 21, 32, generator=g), torch.randn(2, 3, 21, dim_v, generator=g)
    k, v = k.to(device), v.to(device)
    out = flash_attention(q, k, v, is_causal=True, backend=backend)
    expected = torch.empty(2, 3, dim_v, 21).transpose(-1, -2) if dim_v == 32 else None
    if expected is not None:
        assert out.stride() == q.stride() == expected.stride()
    else:  # another value head dim: the same order of the other dimensions, last one dense
        assert out.stride() == (3 * 21 * dim_v, 21 * dim_v, dim_v, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.detach().double() for t in (q, k, v)), is_causal=True
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    out.sum().backward()
    assert q.grad.shape == q.shape and q.grad.isfinite().all()


@needs_interpreter
def test_triton_backward_is_deterministic():
    case = Case(1, 2, 2, 37, 45, 32, True, None, False, False, seed=3)
    grads = []
    for _ in range(2):
        q, k, v = case.make(torch.float32)
        out = flash_attention(q, k, v, is_causal=True, enable_gqa=True, backend="triton")
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in (q, k, v)])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize(
    ("shape", "gqa"),
    [((0, 2, 5, 16), False), ((0, 5, 16), False), ((2, 0, 5, 16), False), ((2, 0, 5, 16), True),
     ((0, 3, 2, 5, 16), False)],
)  # fmt: skip
def test_empty_batch(backend, shape, gqa):
    """No batch entries or no heads (3-D inputs' first dim is their batch): empty results and
    gradients of the inputs' shapes, as SDPA's (the torch backend divided by the zero head count
    of 3-D batch-0 and 0-head inputs)."""
    q = torch.randn(shape, requires_grad=True)
    out = flash_attention(q, q, q, backend=backend, enable_gqa=gqa)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, enable_gqa=gqa)
    assert out.shape == expected.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_autocast_casts_inputs_like_sdpa(backend):
    """Under torch.autocast, inputs are cast to the autocast dtype, as SDPA's are."""
    dtype = torch.bfloat16 if backend == "torch" else torch.float16  # interpreter: no bf16 dot
    case = Case(1, 2, 1, 24, 24, 32, True, None, False, False, seed=13)
    q, k, v = case.make(torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        out = flash_attention(q, k, v, is_causal=True, backend=backend)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == expected.dtype == dtype
    plain = flash_attention(
        *(t.detach().to(dtype) for t in (q, k, v)), is_causal=True, backend=backend
    )
    assert torch.equal(out, plain)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32
