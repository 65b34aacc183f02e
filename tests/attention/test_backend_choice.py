"""What backend="auto" picks: the Triton kernels on CUDA only; the PyTorch tiled path for CPU tensors
whatever the environment (the Triton interpreter is slow and its bfloat16 dot is wrong, so it runs
only when asked for with backend="triton")."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from tests.attention.cases import Case, assert_close, cases, check_against_reference
from tests.reference import attention_reference, naive_attention
from torch_flashsys import FlashAttention, _env, flash_attention, replace_attention, sdpa_override
from torch_flashsys.attention import _backend, _ops
from torch_flashsys.attention._backend import resolve_backend, triton_installed

ENVIRONMENTS = ["1", "0", None]  # TRITON_INTERPRET set, set to 0, unset


def _set_interpret(monkeypatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)


@pytest.fixture
def triton_calls():
    """A spy on the Triton path: every flash_attention call that reaches the kernels goes here."""
    with mock.patch.object(_ops, "triton_attention", wraps=_ops.triton_attention) as spy:
        yield spy


@pytest.mark.parametrize("interpret", ENVIRONMENTS)
def test_auto_runs_cpu_tensors_on_the_torch_path_whatever_the_environment(
    monkeypatch, triton_calls, interpret
):
    _set_interpret(monkeypatch, interpret)
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    case = Case(2, 2, 1, 33, 33, 32, True, None, False, False, seed=3)
    q, k, v = case.make(torch.float32)
    out = flash_attention(q, k, v, is_causal=True)
    out.sum().backward()
    assert triton_calls.call_count == 0
    named = flash_attention(*(t.detach() for t in (q, k, v)), is_causal=True, backend="torch")
    assert torch.equal(out, named)


@pytest.mark.parametrize("interpret", ENVIRONMENTS)
def test_dropins_with_the_default_backend_take_the_torch_path_on_cpu(
    monkeypatch, triton_calls, interpret
):
    _set_interpret(monkeypatch, interpret)
    x = torch.randn(2, 9, 32)
    with sdpa_override():
        q = x.view(2, 9, 2, 16).transpose(1, 2)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    mha = torch.nn.MultiheadAttention(32, 2, batch_first=True)
    model = torch.nn.Sequential(mha)
    assert replace_attention(model) == ["0"]
    model[0](x, x, x, need_weights=False)
    FlashAttention(32, 2)(x)
    assert triton_calls.call_count == 0


def test_auto_leaves_cuda_tensors_to_the_torch_path_under_the_interpreter(monkeypatch):
    """With TRITON_INTERPRET=1 even CUDA tensors would go through the (slow) interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expected = "triton" if triton_installed() else "torch"
    assert resolve_backend("auto", torch.device("cuda")) == expected


@settings(max_examples=6)
@given(case=cases(max_seq=70))
def test_bfloat16_under_the_interpreter_setting_matches_float64(case):
    """Issue 24: "auto" picked the interpreter, whose bf16 dot is wrong (error ~8e8)."""

    def run(q, k, v):
        return flash_attention(
            q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=case.gqa,
            return_lse=True,
        )  # fmt: skip

    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        check_against_reference(case, torch.bfloat16, run)


def test_bfloat16_autocast_on_cpu_matches_float64(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = Case(2, 2, 1, 70, 70, 64, True, None, False, False, seed=5)
    q, k, v = case.make(torch.float32, requires_grad=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flash_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    ref, _ = attention_reference(*(t.double() for t in low), is_causal=True)
    assert_close("out", out, naive_attention(*low, is_causal=True), ref, torch.bfloat16)


def test_explicit_triton_with_bfloat16_under_the_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError) as info:
        flash_attention(q, q, q, backend="triton")
    msg = str(info.value)
    assert msg.startswith("flash_attention: ")
    assert "torch.bfloat16" in msg and "backend='torch'" in msg and "TRITON_INTERPRET" in msg


@pytest.mark.parametrize("interpret", ENVIRONMENTS)
def test_environment_report_says_what_auto_picks_for_cpu_tensors(monkeypatch, interpret):
    _set_interpret(monkeypatch, interpret)
    info = _env.collect()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    picks = info["backend='auto' picks"]
    assert picks.startswith(f"{resolve_backend('auto', torch.device(device))} for {device}")
    assert ("torch for cpu" in picks) and ("triton for cpu" not in picks)
    if interpret == "1" and triton_installed():
        assert "backend='triton'" in info["triton kernels can run"]


@pytest.mark.gpu
def test_auto_runs_cuda_tensors_on_the_kernels_unless_interpreting(monkeypatch, triton_calls):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    flash_attention(q, q, q, is_causal=True)
    assert triton_calls.call_count == 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    flash_attention(q, q, q, is_causal=True)
    assert triton_calls.call_count == 1  # the torch path


@pytest.mark.parametrize(
    ("dq", "dv", "expected"),
    [
        (64, 64, "triton"),
        (80, 48, "triton"),
        (20, 20, "torch"),
        (64, 300, "torch"),
        (8, 8, "torch"),
    ],
)
def test_auto_takes_the_torch_path_for_head_dims_the_kernels_do_not_take(dq, dv, expected):
    """As SDPA falls back to its math kernel: "auto" on a device where the kernels run (stood in for
    here) takes the tiled PyTorch path for other head dims, with a warning; backend="triton" is
    not rerouted (check_triton refuses it with the supported range)."""
    q, v = torch.randn(1, 2, 8, dq), torch.randn(1, 2, 8, dv)
    with mock.patch.object(_backend, "resolve_backend", lambda backend, device: "triton"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _backend.choose_backend("auto", q, q, v) == expected
        assert _backend.choose_backend("triton", q, q, v) == "triton"
    messages = [str(w.message) for w in caught]
    if expected == "torch":
        assert len(messages) == 1 and f"head dims {dq} (query/key) and {dv} (value)" in messages[0]
    else:
        assert messages == []


@pytest.mark.parametrize(
    ("name", "value", "attribute", "expected"),
    [
        ("TORCH_FLASHSYS_SM90_BWD", "yes", "_BWD_MODE", ""),
        ("TORCH_FLASHSYS_SM90_BWD", "fused", "_BWD_MODE", "fused"),
        ("TORCH_FLASHSYS_SM90", "on", "_MODE", ""),
        ("TORCH_FLASHSYS_SM90", "0", "_MODE", "0"),
    ],
)
def test_hopper_switches_warn_on_an_unknown_value_and_keep_the_default(
    name, value, attribute, expected
):
    """An unknown value of a Hopper switch warns and counts as unset (``SM90_BWD=yes`` silently
    turned both Hopper backwards off before, as ``=0`` does)."""
    pytest.importorskip("triton")
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    import torch_flashsys.attention._sm90 as s\n"
        f"print(repr(getattr(s, {attribute!r})), sum({name!r} in str(w.message) for w in seen))"
    )
    env = {**os.environ, name: value, "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    mode, warned = run.stdout.split()
    assert mode == repr(expected)
    assert int(warned) == (expected != value)
