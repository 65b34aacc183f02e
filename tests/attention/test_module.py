"""FlashAttention (nn.Module): MHA weight compatibility, outputs and grads vs a float64 MHA, GQA,
the MHA call form inside nn.TransformerEncoderLayer, and its errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.attention.cases import assert_close
from tests.reference import attention_reference, naive_attention
from torch_flashsys.attention import FlashAttention


def _mha(
    embed_dim, num_heads, *, bias=True, batch_first=True, seed=0, **kw
) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=batch_first, **kw)
    if bias:  # MHA initialises biases to zero; make them count
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    return mha


def _causal_mask(seq: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return nn.Transformer.generate_square_subsequent_mask(seq, dtype=dtype)


@pytest.mark.parametrize("bias", [True, False])
def test_parameters_have_mha_names_shapes_and_init(bias):
    mha = nn.MultiheadAttention(48, 3, bias=bias, batch_first=True)
    fa = FlashAttention(48, 3, bias=bias)
    mha_sd, fa_sd = mha.state_dict(), fa.state_dict()
    assert list(fa_sd) == list(mha_sd)
    assert all(
        fa_sd[k].shape == mha_sd[k].shape and fa_sd[k].dtype == mha_sd[k].dtype for k in fa_sd
    )
    if bias:  # MHA's init: zero biases, xavier-uniform fused projection
        assert fa.in_proj_bias.count_nonzero() == 0 and fa.out_proj.bias.count_nonzero() == 0
    bound = (6 / (48 + 3 * 48)) ** 0.5
    assert fa.in_proj_weight.abs().max() <= bound
    fa.load_state_dict(mha_sd)  # strict
    for k in fa_sd:
        assert torch.equal(fa.state_dict()[k], mha_sd[k])
    mha.load_state_dict(fa.state_dict())  # and back


@pytest.mark.parametrize("causal", ["none", "module", "is_causal", "float_mask", "bool_mask"])
@settings(max_examples=4)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    seq=st.integers(1, 23),
    heads_dim=st.sampled_from([(1, 16), (2, 16), (3, 24), (4, 8)]),
    bias=st.booleans(),
    batch_first=st.booleans(),
    unbatched=st.booleans(),
)
def test_matches_float64_mha(seed, batch, seq, heads_dim, bias, batch_first, unbatched, causal):
    heads, head_dim = heads_dim
    embed = heads * head_dim
    mha = _mha(embed, heads, bias=bias, batch_first=batch_first, seed=seed)
    fa = FlashAttention.from_mha(mha, causal=causal == "module", backend="torch")
    assert fa.batch_first == batch_first
    mha64 = copy.deepcopy(mha).double()
    gen = torch.Generator().manual_seed(seed)
    shape = (
        (seq, embed) if unbatched else (batch, seq, embed) if batch_first else (seq, batch, embed)
    )
    x = torch.randn(shape, generator=gen)
    dout = torch.randn(shape, generator=gen)

    kw: dict = {"need_weights": False}
    if causal != "none":
        kw["attn_mask"] = _causal_mask(seq, torch.bool if causal == "bool_mask" else torch.float32)
        kw["is_causal"] = causal in ("is_causal", "float_mask")  # bool_mask: detected from the mask
    fa_kw = dict(kw)
    if causal == "module":
        fa_kw = {"need_weights": False}
    if causal == "is_causal":
        fa_kw = {"need_weights": False, "is_causal": True}  # the hint alone, no mask

    def run(module, x, call_kw, form="mha"):
        x = x.detach().clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        if form == "mha":
            out, weights = module(x, x, x, **call_kw)
            assert weights is None
        else:
            out = module(x)
        (out * dout.to(out.dtype)).sum().backward()
        grads = [x.grad] + [p.grad for p in module.parameters()]
        return out.detach(), grads

    mask64 = {**kw}
    if "attn_mask" in kw and kw["attn_mask"].is_floating_point():
        mask64["attn_mask"] = kw["attn_mask"].double()
    ref, ref_grads = run(mha64, x.double(), mask64)
    base, base_grads = run(mha, x, kw)  # PyTorch's own float32 error
    forms = ["mha", "module"] if causal in ("none", "module") else ["mha"]
    for form in forms:
        out, grads = run(fa, x, fa_kw, form)
        assert out.shape == shape and out.dtype == torch.float32
        # contiguous wherever MHA's output is (seq-first: code may .view() it)
        assert out.is_contiguous() or not base.is_contiguous(), (form, out.stride())
        assert_close(f"{form} out", out, base, ref, torch.float32)
        for i, (g, b, r) in enumerate(zip(grads, base_grads, ref_grads, strict=True)):
            assert_close(f"{form} grad {i}", g, b, r, torch.float32)


def test_triton_backend_through_interpreter_matches_mha():
    mha = _mha(32, 2, seed=1)
    fa = FlashAttention.from_mha(mha, causal=True, backend="triton")  # interpreted on CPU
    x = torch.randn(2, 19, 32, requires_grad=True)
    mask = _causal_mask(19, torch.float32)
    ref = copy.deepcopy(mha).double()(x.double(), x.double(), x.double(), attn_mask=mask.double())[
        0
    ]
    base = mha(x, x, x, attn_mask=mask, need_weights=False)[0]
    out = fa(x)
    assert_close("out", out, base, ref, torch.float32)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@settings(max_examples=6)
@given(
    seed=st.integers(0, 2**31 - 1),
    seq=st.integers(1, 17),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([2, 3]),
    causal=st.booleans(),
)
def test_gqa_matches_float64_reference(seed, seq, kv_heads, group, causal):
    heads, head_dim = kv_heads * group, 16
    embed = heads * head_dim
    torch.manual_seed(seed)
    fa = FlashAttention(
        embed, heads, num_kv_heads=kv_heads, causal=causal, batch_first=True, backend="torch"
    )
    proj_rows = (heads + 2 * kv_heads) * head_dim
    assert fa.in_proj_weight.shape == (proj_rows, embed) and fa.in_proj_bias.shape == (proj_rows,)
    with torch.no_grad():
        fa.in_proj_bias.normal_()
    x = torch.randn(2, seq, embed, generator=torch.Generator().manual_seed(seed))

    def reference(attend, x, w, b, wo, bo):
        qkv = x @ w.T + b
        q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), -1)
        q, k, v = (t.unflatten(-1, (-1, head_dim)).transpose(1, 2) for t in (q, k, v))
        return attend(q, k, v, is_causal=causal).transpose(1, 2).flatten(2) @ wo.T + bo

    params = [fa.in_proj_weight, fa.in_proj_bias, fa.out_proj.weight, fa.out_proj.bias]
    float64 = lambda *a, **kw: attention_reference(*a, **kw)[0]
    ref = reference(float64, x.double(), *(p.detach().double() for p in params))
    base = reference(naive_attention, x, *(p.detach() for p in params))  # PyTorch's fp32 error
    assert_close("gqa out", fa(x), base, ref, torch.float32)


def test_inside_transformer_encoder_layer_train_and_eval():
    """Same outputs as MHA in a real layer (train, eval, eval under no_grad: MHA's fused fast
    path), causal or not, and the same training trajectory."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
    ours = copy.deepcopy(layer)
    ours.self_attn = FlashAttention.from_mha(layer.self_attn, backend="torch")
    ref64 = copy.deepcopy(layer).double()
    x = torch.randn(3, 11, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(11)
    for training in (True, False):
        for m in (layer, ours, ref64):
            m.train(training)
        for kw in ({}, {"src_mask": mask, "is_causal": True}):
            ref = ref64(
                x.double(), **{k: (v.double() if k == "src_mask" else v) for k, v in kw.items()}
            )
            with torch.no_grad():
                assert_close(
                    f"train={training} {kw.keys()}",
                    ours(x, **kw),
                    layer(x, **kw),
                    ref,
                    torch.float32,
                )
    # Training: a few SGD steps in lockstep with the float64 MHA layer.
    ours.train(), ref64.train()
    opt, opt64 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref64))
    target = torch.randn(3, 11, 32)
    for _ in range(5):
        for m, o, dt in ((ours, opt, torch.float32), (ref64, opt64, torch.float64)):
            o.zero_grad()
            loss = (m(x.to(dt), src_mask=mask.to(dt), is_causal=True) - target.to(dt)).pow(2).mean()
            loss.backward()
            o.step()
    for (name, p), p64 in zip(ours.named_parameters(), ref64.parameters(), strict=True):
        torch.testing.assert_close(p.double(), p64, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"need_weights": False, "key_padding_mask": torch.zeros(2, 4, dtype=torch.bool)},
            ValueError,
            r"key_padding_mask must be \(batch, seq\) = \(2, 5\)",
        ),
        (
            {"need_weights": False, "attn_mask": torch.zeros(3, 5, 5)},
            ValueError,
            r"\(batch \* num_heads, seq, seq\) = \(4, 5, 5\)",
        ),
        ({"need_weights": False, "attn_mask": torch.zeros(5, 4)}, ValueError, "attn_mask must be"),
    ],
)
def test_call_errors(kwargs, error, match):
    fa = FlashAttention(32, 2, batch_first=True, backend="torch")
    x = torch.randn(2, 5, 32)
    with pytest.raises(error, match=match):
        fa(x, x, x, **kwargs)


_MHA_CALLS = {
    "no mask": lambda b, h, seq, gen: {},
    "key_padding_mask": lambda b, h, seq, gen: {"key_padding_mask": _padding(b, seq)},
    "float attn_mask": lambda b, h, seq, gen: {"attn_mask": torch.randn(seq, seq, generator=gen)},
    "3-D bool attn_mask + padding": lambda b, h, seq, gen: {
        "attn_mask": _bool_mask_keeping_key_0(b * h, seq, gen),
        "key_padding_mask": _padding(b, seq),
    },
    "causal mask + is_causal": lambda b, h, seq, gen: {
        "attn_mask": _causal_mask(seq, torch.float32),
        "is_causal": True,
    },
}


def _padding(batch, seq):
    pad = torch.zeros(batch, seq, dtype=torch.bool)
    pad[0, seq - 2 :] = True
    return pad


def _bool_mask_keeping_key_0(n, seq, gen):
    mask = torch.rand(n, seq, seq, generator=gen) > 0.6
    mask[..., 0] = False  # every query keeps key 0 (MHA returns NaN for empty rows)
    return mask


@pytest.mark.parametrize("call", list(_MHA_CALLS))
@pytest.mark.parametrize("batch_first", [None, False, True])  # None: both constructors' default
def test_mha_state_dict_recipe_matches_mha(batch_first, call):
    """Issue 24 row 10, docs/migration.md's recipe: ``FlashAttention(E, H)`` with an
    ``nn.MultiheadAttention(E, H)`` state dict is the same layer, layout default included."""
    kw = {} if batch_first is None else {"batch_first": batch_first}
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(32, 4, dtype=torch.float64, **kw)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # MHA initialises biases to zero; make them count
        mha.in_proj_bias.normal_(generator=gen)
        mha.out_proj.bias.normal_(generator=gen)
    fa = FlashAttention(32, 4, backend="torch", dtype=torch.float64, **kw)
    fa.load_state_dict(mha.state_dict())
    batch, seq = 3, 6
    shape = (batch, seq, 32) if mha.batch_first else (seq, batch, 32)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    masks = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in _MHA_CALLS[call](batch, 4, seq, gen).items()
    }
    expected = mha(x, x, x, need_weights=False, **masks)[0]
    out, weights = fa(x, x, x, need_weights=False, **masks)
    assert weights is None
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
    if not masks:
        torch.testing.assert_close(fa(x), expected, atol=1e-12, rtol=1e-10)
    assert fa.batch_first == mha.batch_first


def test_need_weights_true_returns_none_and_warns_once(monkeypatch):
    """Issue 25 row 2b: MHA's default call ``out, _ = attn(x, x, x)`` works, with one warning per
    process that the weights are not computed."""
    import torch_flashsys.attention.module as module

    monkeypatch.setattr(module, "_WARNED", set(), raising=False)
    mha = _mha(32, 2, batch_first=False, seed=4).double()
    fa = FlashAttention.from_mha(copy.deepcopy(mha), backend="torch")
    x = torch.randn(5, 2, 32, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # need_weights=False: silent, and does not use up the once
        fa(x, x, x, need_weights=False)
    with pytest.warns(UserWarning) as record:
        result = fa(x, x, x)
    assert [str(w.message) for w in record] == [
        "FlashAttention: need_weights=True, but attention weights are not computed by the fused "
        "kernel; returning (output, None). Pass need_weights=False to silence this warning."
    ]
    assert record[0].filename == __file__  # points at the caller
    assert isinstance(result, tuple) and len(result) == 2 and result[1] is None
    torch.testing.assert_close(result[0], mha(x, x, x)[0], atol=1e-12, rtol=1e-10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning, any module
        assert fa(x, x, x, need_weights=True, average_attn_weights=False)[1] is None
        other = FlashAttention(32, 2, backend="torch", dtype=torch.float64)
        assert other(x, x, x)[1] is None


def test_other_errors():
    fa = FlashAttention(32, 2, batch_first=True, backend="torch")
    x = torch.randn(2, 5, 32)
    with pytest.raises(NotImplementedError, match="self-attention only"):
        fa(x, x.clone(), x.clone(), need_weights=False)
    with pytest.raises(ValueError, match=r"embed_dim=32, got shape \(2, 5, 31\)"):
        fa(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match="got shape"):
        fa(torch.randn(1, 2, 5, 32))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((30, 4), {}, ValueError, "multiple of num_heads"),
        ((32, 4), {"num_kv_heads": 3}, ValueError, "multiple of num_kv_heads"),
        ((32, 0), {}, ValueError, "num_heads must be a positive int"),
        ((32, 4), {"num_kv_heads": 0}, ValueError, "num_kv_heads"),
        ((32, 4), {"backend": "cuda"}, ValueError, "backend must be one of"),
    ],
)
def test_constructor_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        FlashAttention(*args, **kwargs)


@pytest.mark.parametrize(
    ("mha_kwargs", "match"),
    [
        ({"kdim": 16, "vdim": 16}, "kdim/vdim"),
        ({"add_bias_kv": True}, "add_bias_kv"),
        ({"add_zero_attn": True}, "add_zero_attn"),
    ],
)
def test_from_mha_rejects_what_it_cannot_reproduce(mha_kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlashAttention.from_mha(nn.MultiheadAttention(32, 2, **mha_kwargs))
    with pytest.raises(TypeError, match=r"nn\.MultiheadAttention"):
        FlashAttention.from_mha(nn.Linear(2, 2))


def _mha_masks(batch, heads, seq, kind, gen):
    """MHA-convention masks (bool: True = not allowed; float: added) of one kind."""
    pad = torch.zeros(batch, seq, dtype=torch.bool)
    pad[0, seq - 2 :] = True
    if kind == "key_padding":
        return {"key_padding_mask": pad}
    if kind == "float 2-D":
        return {"attn_mask": torch.randn(seq, seq, generator=gen)}
    if kind == "bool 3-D + padding":
        am = torch.rand(batch * heads, seq, seq, generator=gen) > 0.7
        am[..., 0] = False  # every query keeps key 0 (MHA returns NaN for empty rows)
        return {"attn_mask": am, "key_padding_mask": pad}
    am = torch.randn(seq, seq, generator=gen)  # float attn_mask with a bool padding mask
    return {"attn_mask": am, "key_padding_mask": pad}


@pytest.mark.parametrize("kind", ["key_padding", "float 2-D", "bool 3-D + padding", "mixed"])
def test_masks_follow_multihead_attention(kind):
    """key_padding_mask / attn_mask in MHA's conventions give MHA's output (float64 MHA as the
    reference), forward and backward."""
    gen = torch.Generator().manual_seed(5)
    mha = _mha(32, 2, seed=3).eval()
    fa = FlashAttention.from_mha(mha, backend="torch").eval()
    x = torch.randn(3, 7, 32, generator=gen)
    masks = _mha_masks(3, 2, 7, kind, gen)
    ref64 = copy.deepcopy(mha).double()
    x64 = x.double().requires_grad_()
    masks64 = {k: (v.double() if v.is_floating_point() else v) for k, v in masks.items()}
    ref = ref64(x64, x64, x64, need_weights=False, **masks64)[0]
    base = mha(x, x, x, need_weights=False, **masks)[0]
    xf = x.clone().requires_grad_()
    out = fa(xf, xf, xf, need_weights=False, **masks)[0]
    assert_close(f"{kind} out", out, base, ref, torch.float32)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    ref.backward(g.double())
    torch.testing.assert_close(xf.grad.double(), x64.grad, atol=1e-5, rtol=1e-4)


def test_dropout_in_training_mode_only():
    mha = nn.MultiheadAttention(32, 2, dropout=0.3, batch_first=True)
    fa = FlashAttention.from_mha(mha, backend="torch")
    assert fa.dropout == 0.3 and "dropout=0.3" in repr(fa)
    x = torch.randn(2, 9, 32)
    fa.eval()
    no_drop = FlashAttention.from_mha(mha, backend="torch").eval()
    no_drop.dropout = 0.0
    torch.testing.assert_close(fa(x), no_drop(x), atol=0, rtol=0)  # eval: no dropout
    fa.train()
    torch.manual_seed(7)
    a = fa(x)
    torch.manual_seed(7)
    b = fa(x)
    torch.testing.assert_close(a, b, atol=0, rtol=0)  # torch.manual_seed reproduces it
    assert not torch.allclose(a, no_drop(x))  # and it is dropout, not a no-op
    with pytest.raises(ValueError, match="dropout must be a float in"):
        FlashAttention(32, 2, dropout=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_matches_mha(dtype):
    mha = _mha(128, 2, seed=0).cuda()  # head dim 64
    ref = copy.deepcopy(mha).double()
    fa = FlashAttention.from_mha(copy.deepcopy(mha).to(dtype), causal=True)
    x = torch.randn(4, 300, 128, device="cuda")
    mask = _causal_mask(300, torch.float32).cuda()
    out64 = ref(x.double(), x.double(), x.double(), attn_mask=mask.double(), need_weights=False)[0]
    base = mha.to(dtype)(*(x.to(dtype),) * 3, attn_mask=mask.to(dtype), need_weights=False)[0]
    assert_close("out", fa(x.to(dtype)), base, out64, dtype)
