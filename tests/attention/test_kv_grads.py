"""Few query rows over many keys: the portable dQ kernel computes each key tile's dK and dV too
(``_triton_bwd.KV_GRADS``) and the dK/dV kernel does not run."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention.cases import Case, check_against_reference, triton_run
from torch_flashsys.attention import _kernel_config, _triton_bwd
from torch_flashsys.attention._extras import PLAIN, make_extras


@settings(max_examples=6, deadline=None)
@given(
    batch=st.integers(1, 2), heads=st.integers(1, 2), seq_q=st.integers(1, 64),
    keys_per_row=st.integers(4, 7), extra_keys=st.integers(0, 20),
    head_dim=st.sampled_from([16, 32, 48, 64]), scale=st.one_of(st.none(), st.floats(0.05, 1.0)),
    layout=st.sampled_from(["4d", "3d", "transposed"]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_few_query_rows_get_their_key_gradients_from_the_dq_kernel(
    batch, heads, seq_q, keys_per_row, extra_keys, head_dim, scale, layout, seed
):
    """Up to 64 query rows over 4-7 times as many keys (and a ragged end), head dims 16-64, 3-D,
    4-D and (B, L, H, D) layouts: out, lse, dQ, dK and dV match float64 (the Triton kernels
    in the interpreter, float16), and the dK/dV kernel was never launched."""
    case = Case(batch, 1 if layout == "3d" else heads, 1, seq_q, keys_per_row * seq_q + extra_keys,
                head_dim, False, scale, layout == "3d", layout == "transposed", seed)  # fmt: skip
    with mock.patch.object(_triton_bwd, "_launch_dkdv", wraps=_triton_bwd._launch_dkdv) as dkdv:
        check_against_reference(case, torch.float16, triton_run(case))
    assert not dkdv.called


def _tile(batch, heads, kv_heads, seq_q, seq_k, d, causal=False, dtype=torch.bfloat16, sms=132,
          ex=None, smem=232448):  # fmt: skip
    """kv_grads_tile for a CUDA problem of these sizes (stand-in tensors, ``sms`` SMs, ``smem``
    bytes of shared memory per block: an H100's by default)."""
    q = torch.empty(batch, heads, seq_q, d, dtype=dtype, device="meta")
    v = torch.empty(batch, kv_heads, seq_k, d, dtype=dtype, device="meta")
    ex = ex or make_extras(q.shape, seq_k, q.device, dtype, None, 0.0, causal, None, None, None)
    with (
        mock.patch.object(torch.Tensor, "is_cuda", new=True),
        mock.patch.object(_triton_bwd, "_sm_count", return_value=sms),
        mock.patch.object(_kernel_config, "shared_memory_bytes", return_value=smem),
    ):
        return _triton_bwd.kv_grads_tile(q, v, ex, heads, kv_heads, seq_q, seq_k)


@pytest.mark.parametrize(
    ("sizes", "tile"),
    [((8, 16, 16, 256, 8192, 64), (256, 64, 8, 3)), ((8, 16, 16, 200, 1500, 64), (256, 64, 8, 3)),
     ((8, 16, 16, 128, 8192, 64), (128, 64, 8, 3)), ((32, 16, 16, 64, 2048, 64), (64, 64, 4, 3)),
     ((32, 16, 16, 1, 4, 64), (64, 64, 4, 3)), ((16, 16, 16, 128, 4096, 128), (128, 32, 8, 3)),
     ((8, 16, 16, 256, 8192, 128), None), ((8, 16, 16, 257, 8192, 64), None),
     ((8, 16, 16, 256, 1023, 64), None), ((8, 16, 4, 256, 8192, 64), None),
     ((2, 8, 8, 256, 8192, 64), None), ((7, 14, 14, 256, 8192, 64), None),
     ((9, 11, 11, 256, 8192, 64), (256, 64, 8, 3))],
)  # fmt: skip
def test_the_dq_kernel_takes_the_key_gradients_where_one_program_holds_a_heads_rows(sizes, tile):
    """The rule (H100, docs/benchmarks.md): plain problems, one query head per key head, up to
    256 query rows at head dims <= 64 and 128 at <= 128 (the tile holds them), at least 4 keys
    per row, at least 3/4 of the SMs' worth of heads (one program each)."""
    assert _tile(*sizes) == tile


def test_the_dq_kernel_leaves_the_key_gradients_to_their_kernel_otherwise():
    """A causal mask, a float mask, float32 inputs, or the opt-in autotuner (whose tiles may not
    hold the rows): the dK/dV kernel runs."""
    sizes = (8, 16, 16, 256, 8192, 64)
    assert _tile(*sizes) is not None
    assert _tile(*sizes, causal=True) is None
    assert _tile(*sizes, dtype=torch.float32) is None
    mask = torch.zeros(1, 1, 256, 8192, device="meta")
    masked = make_extras((8, 16, 256, 64), 8192, "meta", torch.bfloat16, mask, 0.0, False, None,
                         None, None)  # fmt: skip
    assert masked is not PLAIN and _tile(*sizes, ex=masked) is None
    with mock.patch.object(_triton_bwd, "AUTOTUNE", True):
        assert _tile(*sizes) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "case",
    [Case(8, 13, 1, 256, 1100, 64, False, None, False, False, seed=0),
     Case(8, 13, 1, 200, 900, 64, False, 0.3, False, True, seed=1),
     Case(8, 13, 1, 128, 600, 128, False, None, False, False, seed=2),
     Case(8, 13, 1, 100, 500, 96, False, None, False, True, seed=3),
     Case(104, 1, 1, 40, 4000, 64, False, None, True, False, seed=4)],
)  # fmt: skip
def test_few_query_rows_get_their_key_gradients_from_the_dq_kernel_on_the_gpu(case):
    """bfloat16 on the GPU with the committed tiles (256, 128 and 64 rows; head dims 64, 96,
    128; (B, L, H, D) and 3-D layouts; enough heads for the rule): results match float64 and
    the dK/dV kernel was never launched."""
    with mock.patch.object(_triton_bwd, "_launch_dkdv", wraps=_triton_bwd._launch_dkdv) as dkdv:
        check_against_reference(case, torch.bfloat16, triton_run(case), device="cuda")
    assert not dkdv.called


@pytest.mark.parametrize(
    ("sizes", "smem", "fits"),
    [((8, 16, 16, 256, 8192, 64), 232448, True), ((8, 16, 16, 256, 8192, 64), 166912, False),
     ((8, 16, 16, 128, 8192, 64), 166912, True), ((8, 16, 16, 128, 8192, 64), 101376, False),
     ((32, 16, 16, 64, 2048, 64), 101376, True), ((16, 16, 16, 128, 4096, 128), 232448, True),
     ((16, 16, 16, 128, 4096, 128), 166912, False), ((32, 16, 16, 64, 2048, 128), 101376, False)],
)  # fmt: skip
def test_a_gpu_with_less_shared_memory_takes_the_two_kernels_where_the_tile_does_not_fit(
    sizes, smem, fits
):
    """The tiles were measured on an H100 (227 KB a block), where all fit; by the estimate
    pick_tile uses (a quarter spare) an A100's 163 KB takes the head-dim-64 tiles up to 128
    rows, a 99 KB GPU only the head-dim-64 64-row tile; the rest take the two kernels."""
    assert (_tile(*sizes, smem=smem) is not None) is fits
