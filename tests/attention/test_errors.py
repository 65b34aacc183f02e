"""Bad input raises a clear error that names the argument; unsupported features never fall back."""

from __future__ import annotations

import pytest
import torch

from torch_flashsys import flash_attention
from torch_flashsys.attention import _checks


def _qkv(**shapes):
    q = torch.randn(shapes.get("q", (2, 4, 8, 16)))
    k = torch.randn(shapes.get("k", (2, 4, 8, 16)))
    v = torch.randn(shapes.get("v", (2, 4, 8, 16)))
    return q, k, v


def _call(q=None, k=None, v=None, **kwargs):
    dq, dk, dv = _qkv()
    return flash_attention(
        dq if q is None else q, dk if k is None else k, dv if v is None else v, **kwargs
    )


BAD_INPUTS = [
    # (description, call, expected exception, message fragment)
    ("rank 1", lambda: _call(q=torch.randn(16)), ValueError, "at least 2 dimensions"),
    (
        "leading dims differ",
        lambda: _call(
            q=torch.randn(3, 2, 4, 8, 16),
            k=torch.randn(2, 2, 4, 8, 16),
            v=torch.randn(2, 2, 4, 8, 16),
        ),
        ValueError,
        r"same batch dimensions .* got \(3, 2\) and \(2, 2\)",
    ),
    (
        "rank mismatch",
        lambda: _call(k=torch.randn(4, 8, 16)),
        ValueError,
        "same number of dimensions",
    ),
    ("head-dim mismatch", lambda: _call(k=torch.randn(2, 4, 8, 32)), ValueError, "same head dim"),
    (
        "value seq differs",
        lambda: _call(v=torch.randn(2, 4, 7, 24)),
        ValueError,
        "same shape except the head dim",
    ),
    (
        "k/v length mismatch",
        lambda: _call(v=torch.randn(2, 4, 7, 16)),
        ValueError,
        "sequence lengths 8 and 7",
    ),
    (
        "batch mismatch",
        lambda: _call(k=torch.randn(1, 4, 8, 16), v=torch.randn(1, 4, 8, 16)),
        ValueError,
        r"same batch dimensions \(all but the last three\), got \(2,\) and \(1,\)",
    ),
    (
        "heads differ without enable_gqa",
        lambda: _call(k=torch.randn(2, 2, 8, 16), v=torch.randn(2, 2, 8, 16)),
        ValueError,
        "enable_gqa=True",
    ),
    (
        "heads not divisible",
        lambda: _call(k=torch.randn(2, 3, 8, 16), v=torch.randn(2, 3, 8, 16), enable_gqa=True),
        ValueError,
        "multiple of the key/value heads",
    ),
    (
        "integer dtype",
        lambda: _call(q=torch.ones(2, 4, 8, 16, dtype=torch.int64)),
        TypeError,
        "query must be float16, bfloat16, float32 or float64, got torch.int64",
    ),
    (
        "float64 on the Triton backend",
        lambda: _call(
            *(torch.randn(2, 4, 8, 16, dtype=torch.float64) for _ in range(3)), backend="triton"
        ),
        TypeError,
        "backend='triton' supports float16, bfloat16 and float32, got torch.float64",
    ),
    ("dtype mismatch", lambda: _call(k=torch.randn(2, 4, 8, 16).half()), TypeError, "same dtype"),
    ("not a tensor", lambda: _call(q=[[1.0]]), TypeError, "query must be a torch.Tensor, got list"),
    ("unknown backend", lambda: _call(backend="cuda"), ValueError, "backend must be one of"),
    (
        "attn_mask not broadcastable",
        lambda: _call(attn_mask=torch.ones(7, 8, dtype=torch.bool)),
        ValueError,
        r"attn_mask of shape \(7, 8\) does not broadcast to \(2, 4, 8, 8\)",
    ),
    (
        "attn_mask dtype",
        lambda: _call(attn_mask=torch.ones(8, 8, dtype=torch.int32)),
        TypeError,
        "attn_mask must be a bool mask .* got dtype torch.int32",
    ),
    ("attn_mask type", lambda: _call(attn_mask=[[True]]), TypeError, "attn_mask must be a torch"),
    (
        "attn_mask on another device",
        lambda: _call(attn_mask=torch.ones(8, 8, dtype=torch.bool, device="meta")),
        ValueError,
        "attn_mask must be on cpu",
    ),
    (
        "attn_mask that needs a gradient",
        lambda: _call(attn_mask=torch.zeros(8, 8, requires_grad=True)),
        NotImplementedError,
        "gradient with respect to attn_mask is not supported",
    ),
    ("dropout bool", lambda: _call(dropout_p=True), ValueError, "dropout_p must be"),
    ("window one int", lambda: _call(window_size=3), ValueError, "window_size must be"),
    (
        "window -2",
        lambda: _call(window_size=(-2, 0)),
        ValueError,
        r"window_size must be .* got \(-2, 0\)",
    ),
    ("window floats", lambda: _call(window_size=(1.5, 0)), ValueError, "pair of ints"),
    (
        "softcap negative",
        lambda: _call(softcap=-1.0),
        ValueError,
        "softcap must be None \\(off\\) or a finite float > 0",
    ),
    ("softcap inf", lambda: _call(softcap=float("inf")), ValueError, "softcap must be"),
    ("softcap zero", lambda: _call(softcap=0.0), ValueError, r"softcap must be None \(off\) or"),
    (
        "alibi shape",
        lambda: _call(alibi_slopes=torch.ones(3)),
        ValueError,
        r"alibi_slopes must have shape \(heads,\) = \(4,\)",
    ),
    (
        "alibi batch",
        lambda: _call(alibi_slopes=torch.ones(3, 4)),
        ValueError,
        r"\(batch, heads\) = \(2, 4\)",
    ),
    (
        "alibi dtype",
        lambda: _call(alibi_slopes=torch.ones(4, dtype=torch.int64)),
        TypeError,
        "alibi_slopes must be a float tensor",
    ),
    (
        "alibi list",
        lambda: _call(alibi_slopes=[1.0] * 4),
        TypeError,
        "alibi_slopes must be a float tensor, got list",
    ),
    ("dropout range", lambda: _call(dropout_p=1.5), ValueError, "dropout_p must be"),
    ("scale type", lambda: _call(scale="0.1"), TypeError, "scale must be"),
    ("scale nan", lambda: _call(scale=float("nan")), ValueError, "scale must be finite"),
    ("is_causal type", lambda: _call(is_causal=1), TypeError, "is_causal must be a bool"),
]


@pytest.mark.parametrize(
    "call, exc, match", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_raises_clear_error(call, exc, match):
    with pytest.raises(exc, match=match) as info:
        call()
    assert str(info.value).startswith("flash_attention: ")


def test_unsupported_head_dim_for_triton(monkeypatch):
    monkeypatch.setattr(_checks, "triton_installed", lambda: True)
    monkeypatch.setattr(_checks, "interpreter_active", lambda: True)
    for head_dim in (8, 20, 264):
        q = torch.randn(1, 1, 4, head_dim)
        with pytest.raises(
            ValueError, match=f"supports head dims 16..256, multiples of 8, got {head_dim}"
        ):
            flash_attention(q, q, q, backend="triton")
    q = torch.randn(1, 1, 4, 32)
    with pytest.raises(ValueError, match=r"got 20 \(value\)"):
        flash_attention(q, q, torch.randn(1, 1, 4, 20), backend="triton")


def test_cpu_tensors_for_triton_without_interpreter(monkeypatch):
    monkeypatch.setattr(_checks, "interpreter_active", lambda: False)
    monkeypatch.setattr(_checks, "triton_installed", lambda: True)
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(
        RuntimeError, match="backend='triton' needs CUDA tensors, got tensors on cpu"
    ):
        flash_attention(q, q, q, backend="triton")


def test_tensors_on_different_devices():
    q = torch.randn(1, 1, 4, 16)
    k = torch.randn(1, 1, 4, 16, device="meta")
    with pytest.raises(ValueError, match="same device"):
        flash_attention(q, k, k, backend="torch")
