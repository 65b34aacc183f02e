"""The dK/dV kernel SPLIT: two programs per key tile, one accumulating dK and one dV (each holds
one accumulator; ``_triton_bwd.DKDV_SPLIT_MIN_DIM`` says from which head dims it runs). Here every
head dim is made to take it and the results are held to the float64 rules the unsplit kernel
meets: every feature (through the Triton interpreter, float32/float16), GQA, packed batches, a
dV head dim other than the query's; and the kernel must have run split."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.attention.test_features import (
    FeatureCase,
    check_features,
    feature_cases,
    needs_interpreter,
)
from tests.attention.test_varlen import check_packed, packed_cases
from torch_flashsys import flash_attention
from torch_flashsys.attention import _triton_bwd

pytestmark = needs_interpreter


@contextlib.contextmanager
def split_dkdv():
    """Every head dim takes the SPLIT dK/dV kernel (plans made before are not reused), and the
    dK/dV kernel runs for every problem (never the dQ kernel's KV_GRADS, which takes few query
    rows over many keys without it); yields the SPLIT value of each dK/dV launch."""
    seen: list[bool] = []
    real = _triton_bwd._launch_dkdv

    def spy(plan, grid, args, constexprs):
        seen.append(constexprs["SPLIT"])
        return real(plan, grid, args, constexprs)

    with (
        mock.patch.object(_triton_bwd, "DKDV_SPLIT_MIN_DIM", 1),
        mock.patch.object(_triton_bwd, "KV_GRADS_MAX_Q", 0),
        mock.patch.object(_triton_bwd, "_PLANS", {}),
        mock.patch.object(_triton_bwd, "_launch_dkdv", side_effect=spy),
    ):
        yield seen


# One query row over four keys: a problem the dQ kernel's KV_GRADS takes unless split_dkdv()
# turns it off (CI drew it once, before split_dkdv() did).
ONE_ROW = FeatureCase(batch=1, kv_heads=1, group=1, seq_q=1, seq_k=4, head_dim=16, is_causal=False,
                      mask="none", window=None, softcap=None, alibi="none", dropout_p=0.0, seed=0)  # fmt: skip


@settings(deadline=None, max_examples=12)
@given(case=feature_cases(max_seq=36), dtype=st.sampled_from([torch.float32, torch.float16]))
@example(case=ONE_ROW, dtype=torch.float16)
def test_split_dkdv_features_match_float64(case, dtype):
    with split_dkdv() as seen:
        check_features(case, dtype, "triton")
    assert seen and all(seen)


@settings(deadline=None, max_examples=6)
@given(case=packed_cases(max_len=36), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_split_dkdv_packed_batches_match_per_sequence_float64(case, dtype):
    with split_dkdv() as seen:
        check_packed(case, dtype, "triton")
    assert all(seen) and (bool(seen) or not sum(case["lens_q"]) or not sum(case["lens_k"]))


@pytest.mark.parametrize(("dim", "dim_v", "group"), [(32, 16, 1), (16, 48, 3), (24, 24, 2)])
def test_split_dkdv_gives_the_unsplit_gradients(dim, dim_v, group):
    """Query/key and value head dims apart, GQA: split and unsplit dK, dV agree to rounding
    (each program runs the unsplit kernel's operations on its accumulator, in the same order)."""
    gen = torch.Generator().manual_seed(dim * 7 + dim_v + group)
    q = torch.randn(2, 2 * group, 37, dim, generator=gen)
    k = torch.randn(2, 2, 29, dim, generator=gen)
    v = torch.randn(2, 2, 29, dim_v, generator=gen)
    dout = torch.randn(2, 2 * group, 37, dim_v, generator=gen)
    grads = []
    for split in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with split_dkdv() if split else contextlib.nullcontext():
            out = flash_attention(qq, kk, vv, is_causal=True, enable_gqa=True, backend="triton")
            out.backward(dout)
        grads.append((qq.grad, kk.grad, vv.grad))
    for name, a, b in zip(("dq", "dk", "dv"), *grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


def test_split_rule_follows_the_larger_head_dim():
    """Split past head dim 128 (measured: 0.51-0.64x the time at 256, slower at 128)."""
    assert not _triton_bwd.dkdv_split(128, 128)
    assert not _triton_bwd.dkdv_split(64, 96)
    assert _triton_bwd.dkdv_split(256, 256)
    assert _triton_bwd.dkdv_split(256, 128)
    assert _triton_bwd.dkdv_split(64, 136)
