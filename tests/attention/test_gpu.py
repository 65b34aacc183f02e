"""flash_attention on CUDA: bf16/fp16/fp32 (full precision by default, TF32 when allowed), long
sequences, huge batch*heads and >2**31 elements, CUDA graphs, the launch cache. Every test here is
`gpu`-marked and skips on machines without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.attention.cases import (
    ATOL_TF32,
    Case,
    cases,
    check_against_reference,
    max_err,
    triton_run,
)
from tests.attention.test_double_backward import compare
from tests.attention.test_features import FeatureCase, check_features, feature_cases, run_features
from tests.attention.test_kvcache import check_decode, decode_cases
from tests.attention.test_varlen import check_packed, packed_cases
from tests.reference import attention_reference, modded_attention
from torch_flashsys import flash_attention
from torch_flashsys.attention._extras import CAUSAL

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


_run = triton_run


# Kernel compilation bounds the GPU run (every head dim, dtype and flag set is its own kernel): the
# property tests are split per dtype / feature so pytest-xdist compiles them in parallel, and
# float32 per head-dim group too, fewer examples for the larger head dims: an IEEE float32 dot
# runs as unrolled FMA loops, so each new d 256 float32 kernel set compiles for about a minute
# (H100 box, triton 3.6: 3 examples took 224 s, the critical path of the whole GPU run).
EXAMPLES = {
    torch.float32: {(16, 32): 4, (64, 80): 3, (128,): 2, (256,): 1},
    torch.float16: {(16, 32, 64, 80, 128, 256): 10},
    torch.bfloat16: {(16, 32, 64, 80, 128, 256): 10},
}
SPLITS = [(dtype, dims) for dtype, groups in EXAMPLES.items() for dims in groups]


@pytest.mark.parametrize(("dtype", "head_dims"), SPLITS)
def test_triton_matches_float64_on_cuda(dtype, head_dims):
    # float32 is held to the float32 tolerance: the kernels' dots are IEEE unless TF32 is allowed.
    @settings(max_examples=EXAMPLES[dtype][head_dims])
    @given(case=cases(max_seq=300, head_dims=head_dims, max_batch=3))
    def check(case):
        check_against_reference(case, dtype, _run(case), device="cuda")

    check()


@pytest.mark.parametrize("head_dim", [32, 128])
def test_float32_follows_pytorch_tf32_setting_at_call_time(head_dim):
    """IEEE dots by default; TF32 once the user allows it (legacy or new API), read per call."""
    case = Case(1, 2, 1, 1, 1, head_dim, False, None, False, False, seed=3)  # the shape that
    check_against_reference(case, torch.float32, _run(case), device="cuda")  # once failed
    case = Case(2, 2, 1, 200, 200, head_dim, True, None, False, False, seed=4)
    q, k, v = case.make(torch.float32, "cuda", requires_grad=False)
    ref, _ = attention_reference(q, k, v, is_causal=True)
    errors = {}
    for setting in ("highest", "high", "highest"):
        torch.set_float32_matmul_precision(setting)
        try:
            errors.setdefault(setting, []).append(max_err(_run(case)(q, k, v)[0], ref))
        finally:
            torch.set_float32_matmul_precision("highest")
    ieee, tf32 = max(errors["highest"]), errors["high"][0]
    assert ieee < 2e-5, f"IEEE float32 error {ieee:.3g}"
    assert tf32 > 10 * ieee, f"allowing TF32 changed nothing ({tf32:.3g} vs {ieee:.3g})"
    assert tf32 < ATOL_TF32, f"TF32 error {tf32:.3g}"


@pytest.mark.parametrize("hopper", [False, True])
def test_repeat_calls_take_the_launch_cache_and_agree(hopper):
    """Repeat calls launch from the launch caches (the portable kernels', or the Hopper
    kernels' plan tables where that path runs) and agree bitwise (dQ up to the order of its
    atomic sums where the fused Hopper backward runs)."""
    from torch_flashsys.attention import _sm90, _triton_bwd, _triton_fwd

    case = Case(2, 2, 2, 333, 333, 64, True, None, False, True, seed=8)
    results = []
    with mock.patch.object(_sm90, "ENABLED", hopper and _sm90.ENABLED):
        for _ in range(3):
            q, k, v = case.make(torch.bfloat16, "cuda")
            hits = (_triton_fwd._launch_fwd.hits, _triton_bwd._launch_dkdv.hits)
            plans = (len(_sm90._PLANS), len(_sm90._BWD_PLANS), len(_sm90._FUSED_PLANS))
            out = flash_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(torch.ones_like(out))
            results.append((out, q.grad, k.grad, v.grad))
        dout = torch.ones_like(out)
        forward = _sm90.forward_takes(q, k, v, 0.125, CAUSAL)
        fused = _sm90.fused_takes(q, k, v, dout, 0.125, CAUSAL)
        backward = not fused and _sm90.backward_takes(q, k, v, dout, 0.125, CAUSAL)
    # The last call made no new plan for a key the first call made (Hopper kernels), or
    # launched from the portable kernels' caches.
    if forward:
        assert len(_sm90._PLANS) == plans[0]
    else:
        assert _triton_fwd._launch_fwd.hits > hits[0]
    if fused:
        assert len(_sm90._FUSED_PLANS) == plans[2]
    elif backward:
        assert len(_sm90._BWD_PLANS) == plans[1]
    else:
        assert _triton_bwd._launch_dkdv.hits > hits[1]
    for later in results[1:]:
        for i, (a, b) in enumerate(zip(results[0], later, strict=True)):
            if fused and i == 1:  # dQ: float32 atomic sums in varying order, then rounded
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
            else:
                assert torch.equal(a, b)
    check_against_reference(case, torch.bfloat16, _run(case), device="cuda")


@pytest.mark.parametrize("seq", [4096, 16384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_sequences(seq, dtype):
    case = Case(1, 1, 1, seq, seq, 64, True, None, False, False, seed=seq)
    check_against_reference(case, dtype, _run(case), device="cuda", grads=seq <= 4096)


def test_batch_heads_beyond_grid_limit_and_2_31_elements():
    """B*H = 2**17 + 1 > 65535 programs per grid axis; q has > 2**31 elements (64-bit offsets)."""
    batch, seq, dim = 2**17 + 1, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(batch, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    )
    assert q.numel() > 2**31
    for t in (q, k, v):
        t.requires_grad_()
    out = flash_attention(q, k, v, is_causal=True)
    out.backward(torch.ones_like(out))
    for idx in (0, batch // 2, batch - 1):  # spot-check heads, incl. ones past the 2**31 offset
        sl = slice(idx, idx + 1)
        qs, ks, vs = (t.detach()[sl].double().requires_grad_() for t in (q, k, v))
        ref, _ = attention_reference(qs, ks, vs, is_causal=True)
        ref.backward(torch.ones_like(ref))
        assert max_err(out[sl], ref) < 2e-2
        assert max_err(q.grad[sl], qs.grad) < 5e-2 * (1 + qs.grad.abs().max().item())
        assert max_err(v.grad[sl], vs.grad) < 5e-2 * (1 + vs.grad.abs().max().item())


def test_deterministic_backward_on_cuda():
    """Under ``torch.use_deterministic_algorithms(True)`` two backward passes give the same bits
    (a causal GQA problem, which takes the fused Hopper backward, with atomic dQ sums, where
    determinism is not asked for)."""
    case = Case(2, 2, 4, 1000, 1000, 64, True, None, False, True, seed=5)
    grads = []
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        for _ in range(2):
            q, k, v = case.make(torch.bfloat16, "cuda")
            out = flash_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(torch.ones_like(out))
            grads.append([t.grad for t in (q, k, v)])
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_cuda_graph_capture():
    case = Case(2, 2, 1, 256, 256, 64, True, None, False, False, seed=9)
    q, k, v = case.make(torch.float16, "cuda")
    flash_attention(q, k, v, is_causal=True).sum().backward()  # warm up: autotune, compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention(q, k, v, is_causal=True)
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), is_causal=True)
    assert max_err(out, ref) < 5e-3


FEATURE_SETS = [("mask",), ("dropout",), ("window",), ("softcap", "alibi"), None, None]


@pytest.mark.parametrize("only", FEATURE_SETS, ids=lambda f: "+".join(f) if f else "random")
@settings(max_examples=3)
@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_triton_features_match_float64_on_cuda(only, data, dtype):
    """Masks, dropout (the GPU's Philox against PyTorch's replica), windows, softcap, ALiBi; each
    feature alone and random combinations (``None``: a random subset)."""
    case = data.draw(feature_cases(max_seq=300, head_dims=(32, 64, 128), only=only))
    check_features(case, dtype, "triton", device="cuda")


@pytest.mark.parametrize("only", FEATURE_SETS[:4], ids=lambda f: "+".join(f))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_features_at_head_dim_256_match_float64_on_cuda(only, dtype):
    """Head dim 256 takes the sm90 tile table's largest tiles (forward 128 x 64, 8 warps); a
    kernel with a feature takes the table's tile only where the shared-memory estimate passes,
    else a smaller one: each feature compiles, launches and matches float64 there. float32 with
    TF32 allowed (the table's tile when it fits, as for 16 bits)."""
    torch.set_float32_matmul_precision("high")
    try:

        @settings(max_examples=2)
        @given(case=feature_cases(max_seq=300, head_dims=(256,), only=only))
        def check(case):
            atol = ATOL_TF32 if dtype == torch.float32 else None
            check_features(case, dtype, "triton", device="cuda", atol=atol)

        check()
    finally:
        torch.set_float32_matmul_precision("highest")


def test_key_padding_and_window_long_sequence_on_cuda():
    case = FeatureCase(2, 2, 2, 1500, 1500, 64, True, "key_padding", (200, -1), None, "heads",
                       0.1, seed=21)  # fmt: skip
    check_features(case, torch.bfloat16, "triton", device="cuda")


# float16 at 1e6: PyTorch's own float16 baseline (the tolerance rule's yardstick) overflows.
@pytest.mark.parametrize(
    ("softcap", "dtype"),
    [(1e4, torch.float32), (1e4, torch.float16), (1e4, torch.bfloat16), (1e6, torch.float32),
     (1e6, torch.bfloat16)],
)  # fmt: skip
def test_large_softcap_on_cuda(softcap, dtype):
    """A softcap far above the scores: the kernels' tanh (forward, dQ and dK/dV) must not cancel."""
    case = FeatureCase(2, 2, 2, 300, 333, 64, True, "none", None, softcap, "heads", 0.0, seed=24)
    check_features(case, dtype, "triton", device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_penalty_on_cuda(dtype):
    """Double backward through the Triton backend (its create_graph path) in every dtype."""
    case = FeatureCase(2, 2, 2, 150, 170, 64, True, "key_padding", None, 20.0, "heads", 0.1, 25)
    q, k, v, out, lse, ref_kw = run_features(case, dtype, "triton", device="cuda")
    compare((out, lse, (q, k, v)), lambda *t: modded_attention(*t, **ref_kw), (q, k, v), dtype,
            case.seed)  # fmt: skip


@settings(max_examples=8)
@given(case=packed_cases(max_len=300, head_dims=(64, 128)),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))  # fmt: skip
# d 128 with dropout took the plain kernel's swept tile: 240 KiB of shared memory (the H100 has 227)
@example(case={"lens_q": [0, 37, 5], "lens_k": [0, 64, 5], "kv_heads": 1, "group": 1,
               "dims": (128, 128),
               "causal": False, "window": None, "softcap": None, "alibi": False,
               "dropout_p": 0.25, "seed": 0}, dtype=torch.bfloat16)  # fmt: skip
def test_packed_batches_match_per_sequence_float64_on_cuda(case, dtype):
    check_packed(case, dtype, "triton", device="cuda")


def test_packed_batch_with_max_seqlen_checks_on_the_device():
    """With max_seqlen given, cu_seqlens are checked on the GPU (no host synchronization)."""
    lens = [300, 17, 0, 129]
    q = torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 317, 317, 446], device="cuda", dtype=torch.int32)
    out = flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300,
                          max_seqlen_k=300, is_causal=True)  # fmt: skip
    ref = flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, is_causal=True)
    assert torch.equal(out, ref)


_INDEX_DTYPES = (
    "import sys, torch; from torch_flashsys import flash_attention\n"
    "lens, grads = [300, 17, 129], []\n"
    "q = torch.randn(sum(lens), 4, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
    "for name in sys.argv[1:]:\n"
    "    cu = torch.tensor([0, 300, 317, 446], device='cuda', dtype=getattr(torch, name))\n"
    "    out = flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300,\n"
    "                          max_seqlen_k=300, is_causal=True)\n"
    "    q.grad = None\n"
    "    out.float().square().sum().backward()\n"
    "    grads.append((out.detach(), q.grad))\n"
    "(o1, g1), (o2, g2) = grads\n"
    "torch.cuda.synchronize()\n"
    "assert torch.equal(o1, o2) and torch.equal(g1, g2), 'results differ between index dtypes'\n"
)


@pytest.mark.parametrize("order", [("int64", "int32"), ("int32", "int64")])
def test_cu_seqlens_dtype_is_part_of_the_launch_key(order):
    """The same shapes with int64 then int32 cu_seqlens (nested tensors give int64 offsets): the
    second call must not reuse the first's compiled kernel, which reads the index width it was
    compiled for (an illegal memory access or wrong sequences). In a subprocess: a bad read can
    leave the CUDA context unusable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _INDEX_DTYPES, *order], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("when", ["new tensor", "updated in place"])
def test_cache_seqlens_below_seq_q_fails_on_the_device(when):
    """On CUDA, cache_seqlens < seq_q is caught by a device-side check (no synchronization):
    the process fails at the next synchronization instead of returning rows of zeros. The check
    runs once per version of the tensor (every layer of a step passes the same one): an in-place
    update is checked again."""
    update = "    lens[1] = 2\n" if when == "updated in place" else ""
    first = "[40, 2]" if not update else "[40, 30]"
    code = (
        "import torch; from torch_flashsys import flash_attention\n"
        "q = torch.randn(2, 4, 3, 64, device='cuda', dtype=torch.bfloat16)\n"
        "k = torch.randn(2, 4, 64, 64, device='cuda', dtype=torch.bfloat16)\n"
        f"lens = torch.tensor({first}, device='cuda', dtype=torch.int32)\n"
        "with torch.no_grad():\n"
        "    flash_attention(q, k, k, cache_seqlens=lens, is_causal=True)\n"
        "    torch.cuda.synchronize()\n"
        f"{update}"
        "    flash_attention(q, k, k, cache_seqlens=lens, is_causal=True)\n"
        "torch.cuda.synchronize()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert proc.returncode != 0, "cache_seqlens below seq_q was accepted on CUDA"
    assert "assert" in proc.stderr, proc.stderr[-2000:]


@settings(max_examples=8)
@given(case=decode_cases(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_split_kv_decode_matches_float64_on_cuda(case, dtype):
    check_decode(case, dtype, "triton", device="cuda")


@pytest.mark.parametrize("head_dim", [20, 264])
def test_auto_runs_other_head_dims_on_the_torch_path_on_cuda(head_dim):
    """A head dim the kernels do not take: "auto" warns and matches SDPA (its math fallback)."""
    q, k, v = (torch.randn(2, 3, 77, head_dim, device="cuda", requires_grad=True) for _ in range(3))
    with pytest.warns(UserWarning, match=f"head dims {head_dim}"):
        out = flash_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, atol=ATOL_TF32, rtol=1e-3)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL_TF32, rtol=1e-3)
