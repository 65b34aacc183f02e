"""replace_attention on real torch Transformers, and sdpa_override's routing and restoration."""

from __future__ import annotations

import copy
import threading
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.attention.cases import assert_close, padded_mask
from tests.reference import attention_reference
from torch_flashsys.attention import FlashAttention, _dropin
from torch_flashsys.attention import module as attention_module
from torch_flashsys.attention._backend import triton_can_run_on
from torch_flashsys.attention._dropin import (
    disable_sdpa_override,
    enable_sdpa_override,
    replace_attention,
    sdpa_override,
)
from torch_flashsys.models import build_model

ORIGINAL_SDPA = F.scaled_dot_product_attention


@pytest.fixture
def flash_calls():
    """Counts flash_attention calls of FlashAttention modules and of the SDPA override (each looks
    flash_attention up in its own module at call time)."""
    spy = mock.MagicMock(wraps=_dropin.flash_attention)
    patch_module = mock.patch.object(attention_module, "flash_attention", spy)
    with patch_module, mock.patch.object(_dropin, "flash_attention", spy):
        yield spy


@pytest.fixture(autouse=True)
def _sdpa_restored():
    yield
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA, "a test left SDPA patched"


# ---------------------------------------------------------------------------------------------
# replace_attention


def _encoder(batch_first: bool = True, layers: int = 2) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        32, 2, dim_feedforward=64, dropout=0.0, batch_first=batch_first
    )
    # enable_nested_tensor stays at its default (True) where torch allows it: batch_first.
    return nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=batch_first)


@pytest.mark.parametrize("batch_first", [True, False])
def test_replace_attention_on_transformer_encoder(batch_first, flash_calls):
    original = _encoder(batch_first)
    ours = copy.deepcopy(original)
    names = replace_attention(ours, backend="torch")
    assert names == ["layers.0.self_attn", "layers.1.self_attn"]
    assert all(isinstance(layer.self_attn, FlashAttention) for layer in ours.layers)
    ref64 = copy.deepcopy(original).double()
    x = torch.randn((3, 9, 32) if batch_first else (9, 3, 32))
    mask = nn.Transformer.generate_square_subsequent_mask(9)
    for training in (True, False):
        for m in (original, ours, ref64):
            m.train(training)
        for kw in ({}, {"mask": mask, "is_causal": True}, {"mask": mask}):
            kw64 = {k: v.double() if k == "mask" else v for k, v in kw.items()}
            ref = ref64(x.double(), **kw64)
            calls = flash_calls.call_count
            # no_grad in eval: the original takes torch's fused fast path; ours must not.
            with torch.no_grad():
                out = ours(x, **kw)
            assert flash_calls.call_count == calls + 2  # one per layer
            assert_close(f"{training=} {list(kw)}", out, original(x, **kw), ref, torch.float32)

    # It trains: SGD steps in lockstep with the float64 original.
    ours.train(), ref64.train()
    target = torch.randn(x.shape)
    for model, dtype in ((ours, torch.float32), (ref64, torch.float64)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            out = model(x.to(dtype), mask=mask.to(dtype), is_causal=True)
            (out - target.to(dtype)).pow(2).mean().backward()
            opt.step()
    for (name, p), p64 in zip(ours.named_parameters(), ref64.parameters(), strict=True):
        torch.testing.assert_close(p.double(), p64, atol=1e-5, rtol=1e-4, msg=name)


def test_replaced_encoder_takes_padding_masks_instead_of_nesting():
    """A padded batch through the swapped encoder equals the original encoder (float64 MHA)."""
    model = _encoder().eval()
    ours = copy.deepcopy(model)
    replace_attention(ours, backend="torch")
    assert ours.use_nested_tensor is False
    x = torch.randn(2, 5, 32)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    ref64 = copy.deepcopy(model).double()
    ref64.use_nested_tensor = False  # compare every row, padded ones included
    with torch.no_grad():
        out = ours(x, src_key_padding_mask=pad)
        base = model(x, src_key_padding_mask=pad)
        ref = ref64(x.double(), src_key_padding_mask=pad)
    # the original's nested-tensor path zeroes padded rows; compare the real ones there
    keep = ~pad[..., None]
    assert_close("padded encoder", out * keep, base * keep, ref * keep, torch.float32)


def test_replace_attention_on_full_transformer_keeps_cross_attention():
    torch.manual_seed(0)
    model = nn.Transformer(
        32, 2, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=48, dropout=0.0,
        batch_first=True,
    )  # fmt: skip
    ours = copy.deepcopy(model)
    names = replace_attention(ours, backend="torch")
    assert names == [
        "encoder.layers.0.self_attn",
        "decoder.layers.0.self_attn",
        "decoder.layers.1.self_attn",
    ]
    assert all(isinstance(d.multihead_attn, nn.MultiheadAttention) for d in ours.decoder.layers)
    src, tgt = torch.randn(2, 7, 32), torch.randn(2, 6, 32)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(6)
    ref = copy.deepcopy(model).double()(src.double(), tgt.double(), tgt_mask=tgt_mask.double())
    out = ours(src, tgt, tgt_mask=tgt_mask)
    assert_close("transformer", out, model(src, tgt, tgt_mask=tgt_mask), ref, torch.float32)


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.MultiheadAttention(32, 2, batch_first=True)
        self.a, self.b = shared, shared  # one module registered twice
        self.dropped = nn.MultiheadAttention(32, 2, dropout=0.1, batch_first=True)
        self.kdim = nn.MultiheadAttention(32, 2, kdim=16, vdim=16, batch_first=True)
        self.blocks = nn.ModuleList([nn.Sequential(nn.MultiheadAttention(32, 4))])


def test_replace_attention_skips_filters_and_shares():
    model = _Custom().eval()
    with pytest.warns(UserWarning, match=r"kdim \(kdim/vdim"):
        names = replace_attention(model, backend="torch")
    assert names == ["a", "b", "dropped", "blocks.0.0"]
    assert model.a is model.b and isinstance(model.a, FlashAttention)
    assert not model.a.training and model.blocks[0][0].batch_first is False
    assert isinstance(model.dropped, FlashAttention) and model.dropped.dropout == 0.1

    model = _Custom()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names = replace_attention(model, should_replace=lambda name, mha: name.startswith("blocks"))
    assert names == ["blocks.0.0"] and isinstance(model.a, nn.MultiheadAttention)


def _train_in_lockstep(models_and_opts, x, mask, steps=3):
    for _ in range(steps):
        for model, opt in models_and_opts:
            opt.zero_grad()
            model(x, src_mask=mask, is_causal=True).pow(2).mean().backward()
            opt.step()


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    ],
    ids=["sgd", "adamw"],
)
def test_replace_attention_after_building_the_optimizer(make_opt):
    """Issue 24 row 1: the optimizer is built first (the natural order when retrofitting); the
    swapped attention must keep training, exactly as the unswapped model (float64)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 2, dim_feedforward=48, dropout=0.0).double()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.self_attn.out_proj.bias.requires_grad_(False)  # kept frozen by the swap
    hook_calls = []
    model.self_attn.in_proj_weight.register_hook(lambda g: hook_calls.append(g.shape))
    before = dict(model.named_parameters())
    initial = {name: p.detach().clone() for name, p in before.items()}
    opt, opt_ref = make_opt(model.parameters()), make_opt(ref.parameters())

    assert replace_attention(model, backend="torch") == ["self_attn"]
    assert isinstance(model.self_attn, FlashAttention)
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    assert all(after[name] is before[name] for name in after), "new Parameter objects"
    assert not model.self_attn.out_proj.bias.requires_grad

    x = torch.randn(7, 3, 32, dtype=torch.float64)  # (seq, batch, embed): batch_first=False
    mask = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    _train_in_lockstep([(model, opt), (ref, opt_ref)], x, mask)
    assert len(hook_calls) == 3
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, atol=1e-10, rtol=1e-10, msg=name)
    assert not torch.equal(model.self_attn.in_proj_weight, initial["self_attn.in_proj_weight"])
    assert torch.equal(model.self_attn.out_proj.bias, initial["self_attn.out_proj.bias"])
    torch.testing.assert_close(model(x), ref(x), atol=1e-10, rtol=1e-10)


class _Tied(nn.Module):
    """Two distinct MHAs sharing their input projection (tied parameters)."""

    def __init__(self):
        super().__init__()
        self.a = nn.MultiheadAttention(32, 2, batch_first=True, dtype=torch.float64)
        self.b = nn.MultiheadAttention(32, 2, batch_first=True, dtype=torch.float64)
        self.b.in_proj_weight = self.a.in_proj_weight

    def forward(self, x):
        x = x + self.a(x, x, x, need_weights=False)[0]
        return x + self.b(x, x, x, need_weights=False)[0]


def test_replace_attention_keeps_tied_parameters():
    torch.manual_seed(0)
    model = _Tied()
    ref = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    assert replace_attention(model, backend="torch") == ["a", "b"]
    assert model.a.in_proj_weight is model.b.in_proj_weight
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    for _ in range(3):
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, atol=1e-10, rtol=1e-10, msg=name)


def test_replace_attention_skips_parametrized_mha():
    model = nn.Sequential(nn.MultiheadAttention(32, 2))
    torch.nn.utils.parametrizations.weight_norm(model[0], "in_proj_weight")
    with pytest.warns(UserWarning, match=r"0 \(.*parametrize"):
        assert replace_attention(model, backend="torch") == []
    assert isinstance(model[0], nn.MultiheadAttention)


def test_replace_attention_errors():
    with pytest.raises(TypeError, match=r"FlashAttention\.from_mha"):
        replace_attention(nn.MultiheadAttention(32, 2))
    with pytest.raises(TypeError, match=r"must be an nn\.Module"):
        replace_attention("model")  # type: ignore[arg-type]
    assert replace_attention(nn.Linear(2, 2)) == []


# ---------------------------------------------------------------------------------------------
# sdpa_override


@st.composite
def _supported_call(draw):
    rank3 = draw(st.booleans())
    batch, kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    group = 1 if rank3 else draw(st.sampled_from([1, 2]))
    seq_q, seq_k, dim = (
        draw(st.integers(1, 20)),
        draw(st.integers(1, 20)),
        draw(st.sampled_from([8, 16, 40])),
    )
    q_shape = (batch, seq_q, dim) if rank3 else (batch, kv_heads * group, seq_q, dim)
    kv_shape = (batch, seq_k, dim) if rank3 else (batch, kv_heads, seq_k, dim)
    kwargs = {"is_causal": draw(st.booleans())}
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.05, 1.0))
    if group > 1:
        kwargs["enable_gqa"] = True
    return q_shape, kv_shape, kwargs, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=10)
@given(call=_supported_call(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_sdpa_override_routes_supported_calls(call, dtype):
    q_shape, kv_shape, kwargs, seed = call
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(kv_shape, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    with mock.patch.object(_dropin, "flash_attention", wraps=_dropin.flash_attention) as spy:
        with sdpa_override(backend="torch"):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        assert spy.call_count == 1
    base = ORIGINAL_SDPA(q, k, v, **kwargs)
    ref, _ = attention_reference(q, k, v, is_causal=kwargs["is_causal"], scale=kwargs.get("scale"))
    assert out.shape == base.shape and out.dtype == dtype
    assert_close("routed", out, base, ref, dtype)
    out.float().sum().backward()
    assert q.grad is not None and k.grad.shape == k.shape


@pytest.mark.skipif(
    not triton_can_run_on(torch.device("cpu")),
    reason="Triton kernels cannot run on CPU here (no triton or TRITON_INTERPRET unset)",
)
def test_sdpa_override_positional_arguments_and_triton_backend(flash_calls):
    q = torch.randn(1, 2, 9, 16)
    with sdpa_override(backend="triton"):  # the kernels through the interpreter
        out = F.scaled_dot_product_attention(q, q, q, None, 0.0, True)
    assert flash_calls.call_count == 1
    torch.testing.assert_close(out, ORIGINAL_SDPA(q, q, q, is_causal=True), atol=2e-5, rtol=0)


def _unsupported_calls():
    g = torch.Generator().manual_seed(0)
    r = lambda *s, dtype=torch.float32: torch.randn(*s, generator=g).to(dtype)
    q = r(2, 2, 6, 16)
    return [
        ("mask that needs a gradient", (q, q, q), {"attn_mask": r(6, 6).requires_grad_()}),
        ("broadcast batch", (q, r(1, 2, 6, 16), r(1, 2, 6, 16)), {}),
        ("heads 1 vs 2 broadcast", (r(1, 1, 6, 16), r(1, 2, 6, 16), r(1, 2, 6, 16)), {}),
        ("3-D broadcast batch", (r(2, 6, 16), r(1, 6, 16), r(1, 6, 16)), {}),
        # backend="triton" (below): head dim 12 is outside the kernels' range (and without the
        # interpreter, CPU tensors are too): either way SDPA must answer.
        ("head dim 12 on the Triton backend", (r(1, 1, 6, 12),) * 3, {}),
    ]


@pytest.mark.parametrize(("name", "args", "kwargs"), _unsupported_calls())
def test_sdpa_override_sends_unsupported_calls_to_the_original(name, args, kwargs, flash_calls):
    expected = ORIGINAL_SDPA(*args, **kwargs)
    backend = "triton" if "Triton" in name else "torch"
    with sdpa_override(backend=backend):
        out = F.scaled_dot_product_attention(*args, **kwargs)
    assert flash_calls.call_count == 0, name
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_sdpa_override_routes_dropout_and_leaves_unknown_kwargs(flash_calls):
    q = torch.randn(1, 1, 6, 16)
    with sdpa_override(backend="torch"):
        assert F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).shape == q.shape
        assert flash_calls.call_count == 1
        with pytest.raises(TypeError):  # the original's own error for an unknown argument
            F.scaled_dot_product_attention(q, q, q, not_an_argument=1)
    assert flash_calls.call_count == 1


def _masked_calls():
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)
    q = r(2, 2, 6, 16)
    pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    pad[1, ..., 4:] = False
    return [
        ("float mask", (q, q, q), {"attn_mask": r(6, 6)}),
        ("bool mask", (q, q, q), {"attn_mask": torch.ones(6, 6, dtype=torch.bool).tril()}),
        ("key padding", (q, r(2, 2, 7, 16), r(2, 2, 7, 16)), {"attn_mask": pad}),
        ("per-head float mask", (q, q, q), {"attn_mask": r(2, 2, 6, 6), "scale": 0.3}),
        ("3-D with mask", (r(3, 6, 16),) * 3, {"attn_mask": r(3, 6, 6) > 0}),
        ("float64", (q.double(),) * 3, {"is_causal": True}),
        ("5-D", (r(1, 2, 2, 6, 16),) * 3, {}),
        ("2-D", (r(6, 16),) * 3, {}),
        ("value head dim differs", (q, q, r(2, 2, 6, 8)), {}),
        ("no keys", (q, r(2, 2, 0, 16), r(2, 2, 0, 16)), {}),
    ]


@pytest.mark.parametrize(("name", "args", "kwargs"), _masked_calls())
def test_sdpa_override_routes_masked_and_other_calls(name, args, kwargs, flash_calls):
    expected = ORIGINAL_SDPA(*args, **kwargs)
    with sdpa_override(backend="torch"):
        out = F.scaled_dot_product_attention(*args, **kwargs)
    assert flash_calls.call_count == 1, name
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@settings(max_examples=8, deadline=None)
@given(
    dtypes=st.sampled_from([("f", "f", "b"), ("f", "b", "b"), ("b", "f", "f"), ("f", "f", "f")]),
    causal=st.booleans(),
    masked=st.booleans(),
    group=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sdpa_override_routes_mixed_dtypes_under_autocast(dtypes, causal, masked, group, seed):
    """Under ``torch.autocast`` SDPA casts query, key and value to the autocast dtype first, so
    calls whose inputs differ in dtype are valid there: a Hugging Face Llama's query and key leave
    the rotary embedding in float32 (its cos/sin follow the float32 embeddings) while value is
    bfloat16. The override must route them (it checked the uncast inputs and sent every such call
    back to SDPA, silently) and give what SDPA gives under autocast."""
    gen = torch.Generator().manual_seed(seed)
    kinds = {"f": torch.float32, "b": torch.bfloat16}
    shapes = ((2, 2 * group, 7, 16), (2, 2, 7, 16), (2, 2, 7, 16))
    q, k, v = (torch.randn(s, generator=gen).to(kinds[t]).requires_grad_()
               for s, t in zip(shapes, dtypes, strict=True))  # fmt: skip
    kwargs = {"is_causal": causal and not masked, "enable_gqa": group > 1}
    if masked:
        kwargs["attn_mask"] = torch.rand(2, 1, 7, 7, generator=gen) > 0.3
        kwargs["attn_mask"][..., 0] = True  # every row sees a key
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ORIGINAL_SDPA(q, k, v, **kwargs)
        spy = mock.MagicMock(wraps=_dropin.flash_attention)
        with mock.patch.object(_dropin, "flash_attention", spy), sdpa_override(backend="torch"):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert spy.call_count == 1, f"not routed: {dtypes}"
    assert out.dtype == expected.dtype == torch.bfloat16
    with sdpa_kernel([SDPBackend.MATH]):  # float64, on the inputs autocast rounds to bfloat16
        ref = ORIGINAL_SDPA(*(t.detach().bfloat16().double() for t in (q, k, v)), **kwargs)
    assert_close("autocast", out, expected, ref, torch.bfloat16)
    out.float().sum().backward()
    assert q.grad.dtype == q.dtype and v.grad.dtype == v.dtype


def _mask_calls(seq: int, device: str = "cpu", dtype=torch.float32):
    """(name, kwargs, routed with backend="auto" where masks are left to SDPA) of masked calls
    on (2, 4, seq, 32) inputs."""
    g = torch.Generator().manual_seed(seq)
    padded = padded_mask([seq, seq // 2], seq)
    other = torch.rand(2, 1, seq, seq, generator=g) > 0.4
    other[..., 0] = True
    return [
        ("right-padded causal", {"attn_mask": padded.to(device)}, True),
        ("random bool", {"attn_mask": other.to(device)}, False),
        ("float", {"attn_mask": torch.randn(seq, seq, generator=g).to(device, dtype)}, False),
        ("mask and is_causal", {"attn_mask": other.to(device), "is_causal": True}, True),
        ("no mask, causal", {"is_causal": True}, True),
    ]


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("index", range(len(_mask_calls(12))))
def test_sdpa_override_leaves_masks_to_sdpa_where_it_is_faster(backend, index):
    """On a GPU (here: the CPU standing in for it), with backend="auto", a call with a mask and
    without is_causal stays on SDPA (its masked kernels beat the mask path) unless the mask is a
    right-padded causal mask that runs one call per sequence; an explicit backend routes every
    supported call; either way the result is SDPA's."""
    seq = 12
    name, kwargs, routed = _mask_calls(seq)[index]
    q, k, v = (torch.randn(2, 4, seq, 32) for _ in range(3))
    spy = mock.MagicMock(wraps=_dropin.flash_attention)
    left = mock.patch.object(_dropin, "MASKS_LEFT_TO_SDPA_ON", frozenset({"cpu"}))
    with left, mock.patch.object(_dropin, "flash_attention", spy), sdpa_override(backend=backend):
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert spy.call_count == (1 if routed or backend != "auto" else 0), name
    if "is_causal" in kwargs and "attn_mask" in kwargs:
        kwargs = {"attn_mask": kwargs["attn_mask"] & torch.ones(seq, seq, dtype=torch.bool).tril()}
    torch.testing.assert_close(out, ORIGINAL_SDPA(q, k, v, **kwargs), atol=2e-5, rtol=1e-5)


def test_sdpa_override_leaves_padded_masks_with_dropout_to_sdpa():
    """With dropout a right-padded mask takes flash_attention's mask path (the per-sequence
    calls have no dropout), so such a call stays on SDPA where masks are left to it."""
    q = torch.randn(2, 4, 12, 32)
    spy = mock.MagicMock(wraps=_dropin.flash_attention)
    left = mock.patch.object(_dropin, "MASKS_LEFT_TO_SDPA_ON", frozenset({"cpu"}))
    with left, mock.patch.object(_dropin, "flash_attention", spy), sdpa_override():
        F.scaled_dot_product_attention(q, q, q, attn_mask=padded_mask([12, 5], 12),
                                       dropout_p=0.3)  # fmt: skip
        assert spy.call_count == 0
        F.scaled_dot_product_attention(q, q, q, attn_mask=padded_mask([12, 5], 12))
        assert spy.call_count == 1


# (head dim of q and k, of v, dtype, backend, routed where the Hopper kernels run)
_HEAD_DIM_CALLS = [
    (64, 64, torch.bfloat16, "auto", True), (128, 128, torch.float16, "auto", True),
    (96, 96, torch.bfloat16, "auto", False), (80, 80, torch.float16, "auto", False),
    (256, 256, torch.bfloat16, "auto", False), (32, 32, torch.bfloat16, "auto", False),
    (64, 128, torch.bfloat16, "auto", False), (96, 96, torch.float32, "auto", True),
    (96, 96, torch.bfloat16, "torch", True),
]  # fmt: skip


@pytest.mark.parametrize(("d", "dv", "dtype", "backend", "routed"), _HEAD_DIM_CALLS)
@pytest.mark.parametrize("hopper", [True, False])
def test_sdpa_override_leaves_head_dims_the_hopper_kernels_lack_to_sdpa(d, dv, dtype, backend,
                                                                       routed, hopper):  # fmt: skip
    """Where the Hopper kernels run (here the CPU standing in for an sm90 GPU), with
    backend="auto", a 16-bit call whose head dims are not 64 or 128 for query, key and value
    alike stays on SDPA (the portable kernels took 1.35-3.6x its fwd+bwd time there on an H100);
    float32 calls, an explicit backend and every call on other devices are routed; the result
    is SDPA's either way."""
    gen = torch.Generator().manual_seed(d + dv)
    q, k = (torch.randn(2, 4, 12, d, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(2, 4, 12, dv, generator=gen).to(dtype)
    spy = mock.MagicMock(wraps=_dropin.flash_attention)
    with (mock.patch.object(_dropin, "_on_hopper", return_value=hopper),
          mock.patch.object(_dropin, "flash_attention", spy), sdpa_override(backend=backend)):  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert spy.call_count == int(routed or not hopper)
    ref = ORIGINAL_SDPA(q.float(), k.float(), v.float(), is_causal=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_the_override_knows_the_hopper_kernels_head_dims():
    """The override's list of the Hopper kernels' head dims is the kernels' own, and a tensor
    off CUDA is never on a Hopper GPU."""
    from torch_flashsys.attention import _sm90

    assert set(_sm90.STAGES) == _dropin.HOPPER_HEAD_DIMS
    assert not _dropin._on_hopper(torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sdpa_override_on_cuda_leaves_head_dims_the_hopper_kernels_lack_to_sdpa():
    """On the GPU, bf16: on an sm90 GPU with the Hopper path on, head dims 96 and 256 stay on
    SDPA and 64 and 128 run on flash_attention (elsewhere all four do; with backend="triton"
    all four everywhere); outputs and gradients match SDPA's to bf16 rounding."""
    hopper = _dropin._on_hopper(torch.zeros(1, device="cuda"))
    for d in (64, 96, 128, 256):
        for backend in ("auto", "triton"):
            q, k, v = (torch.randn(2, 4, 600, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))  # fmt: skip
            spy = mock.MagicMock(wraps=_dropin.flash_attention)
            with mock.patch.object(_dropin, "flash_attention", spy), sdpa_override(backend=backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            routed = backend == "triton" or not hopper or d in (64, 128)
            assert spy.call_count == int(routed), (d, backend, hopper)
            grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
            ref = ORIGINAL_SDPA(q, k, v, is_causal=True)
            ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
            for ours, theirs in zip((out, *grads), (ref, *ref_grads), strict=True):
                scale = theirs.float().abs().max().item()
                err = (ours.float() - theirs.float()).abs().max().item()
                assert err <= 2e-2 * max(1.0, scale), (d, backend, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seq", [700, 1024])
def test_sdpa_override_on_cuda_leaves_masks_to_sdpa_but_padded_batches(seq):
    """On the GPU, bf16: a right-padded causal mask from 1024 tokens runs on flash_attention,
    shorter ones and other masks stay on SDPA; outputs match SDPA's to bf16 rounding."""
    q, k, v = (torch.randn(2, 4, seq, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name, kwargs, routed in _mask_calls(seq, "cuda", torch.bfloat16):
        spy = mock.MagicMock(wraps=_dropin.flash_attention)
        with mock.patch.object(_dropin, "flash_attention", spy), sdpa_override():
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        mask_only = "attn_mask" in kwargs and not kwargs.get("is_causal")
        assert spy.call_count == int(routed and (seq >= 1024 or not mask_only)), (name, seq)
        if "is_causal" in kwargs and "attn_mask" in kwargs:
            both = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
            kwargs = {"attn_mask": kwargs["attn_mask"] & both}
        torch.testing.assert_close(out, ORIGINAL_SDPA(q, k, v, **kwargs), atol=2e-2, rtol=2e-2)


def test_sdpa_override_mask_and_is_causal_compose(flash_calls):
    """Both apply, as SDPA's CPU kernel does (its math path refuses the pair)."""
    q = torch.randn(1, 1, 6, 16)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[:, 1] = False
    both = mask & torch.ones(6, 6, dtype=torch.bool).tril()
    with sdpa_override(backend="torch"):
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
    assert flash_calls.call_count == 1
    torch.testing.assert_close(out, ORIGINAL_SDPA(q, q, q, attn_mask=both), atol=2e-5, rtol=1e-5)


def test_sdpa_override_restores_after_exception_and_nesting():
    with pytest.raises(RuntimeError, match="boom"), sdpa_override(backend="torch"):
        assert F.scaled_dot_product_attention is not ORIGINAL_SDPA
        raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    with sdpa_override(backend="torch"):
        outer = F.scaled_dot_product_attention
        with sdpa_override(backend="torch"):
            assert F.scaled_dot_product_attention is not outer
        assert F.scaled_dot_product_attention is outer
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA

    @sdpa_override(backend="torch")
    def decorated():
        return F.scaled_dot_product_attention

    assert decorated() is not ORIGINAL_SDPA
    with pytest.raises(ValueError, match="sdpa_override: backend must be one of"):
        sdpa_override(backend="cuda").__enter__()
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_sdpa_override_blocks_exited_out_of_order_restore_sdpa():
    """Two threads' blocks overlap without nesting (A enters, B enters, A exits, B exits): once
    both have exited SDPA is torch's own again (B used to put back the router A installed, and
    every later SDPA call in the process stayed routed)."""
    entered, a_left, b_may_leave = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with sdpa_override(backend="torch"):
            entered.wait()
        a_left.set()

    def thread_b():
        with sdpa_override(backend="torch"):
            entered.set()
            b_may_leave.wait()
            seen["routed_after_a_left"] = F.scaled_dot_product_attention is not ORIGINAL_SDPA

    a = threading.Thread(target=thread_a)
    a.start()
    try:
        while F.scaled_dot_product_attention is ORIGINAL_SDPA:  # A's block is open
            time.sleep(0.001)
        b = threading.Thread(target=thread_b)
        b.start()
        assert a_left.wait(10)
        b_may_leave.set()
        a.join(10)
        b.join(10)
        assert seen == {"routed_after_a_left": True}  # B's block still routes
        assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    finally:
        entered.set()
        b_may_leave.set()
        disable_sdpa_override()  # (the other tests' SDPA, should this one fail)


def test_enable_disable_sdpa_override(flash_calls):
    q = torch.randn(1, 1, 5, 16)
    try:
        enable_sdpa_override(backend="torch")
        enable_sdpa_override(backend="torch")  # again: still one level to undo
        F.scaled_dot_product_attention(q, q, q)
        assert flash_calls.call_count == 1
    finally:
        disable_sdpa_override()
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    disable_sdpa_override()  # not enabled: no-op
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    with pytest.raises(ValueError, match="enable_sdpa_override: backend"):
        enable_sdpa_override(backend="nope")
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


@pytest.fixture
def routed_backend():
    """state() -> None when F.scaled_dot_product_attention is torch's own, else the backend the
    installed override passes to flash_attention (replaced by a stub for speed)."""
    q = torch.randn(1, 1, 4, 16)
    with mock.patch.object(_dropin, "flash_attention", return_value=q) as stub:

        def state():
            if F.scaled_dot_product_attention is ORIGINAL_SDPA:
                return None
            calls = stub.call_count
            F.scaled_dot_product_attention(q, q, q)
            assert stub.call_count == calls + 1, "patched, but not routed to flash_attention"
            return stub.call_args.kwargs["backend"]

        yield state


def test_enable_inside_sdpa_override_then_disable(routed_backend):
    """Issue 24 row 9: exiting the block restores the state at its entry (off), and disable
    restores torch's function."""
    try:
        with sdpa_override(backend="torch"):
            enable_sdpa_override(backend="auto")
            assert routed_backend() == "auto"
        assert routed_backend() is None
        disable_sdpa_override()
        assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    finally:
        F.scaled_dot_product_attention = ORIGINAL_SDPA


@pytest.mark.parametrize(
    "steps",
    [
        # (action, expected state afterwards); "with:<backend>" enters a block, "exit" leaves
        # the innermost one
        [("enable:torch", "torch"), ("with:auto", "auto"), ("exit", "torch"), ("disable", None)],
        [("with:torch", "torch"), ("enable:auto", "auto"), ("exit", None), ("disable", None)],
        [("enable:torch", "torch"), ("enable:auto", "auto"), ("disable", None)],
        [("disable", None), ("disable", None), ("enable:torch", "torch"), ("disable", None)],
        [("enable:torch", "torch"), ("with:auto", "auto"), ("disable", None), ("exit", "torch")],
        [("with:torch", "torch"), ("disable", None), ("enable:auto", "auto"), ("exit", None)],
        [("with:torch", "torch"), ("with:auto", "auto"), ("disable", None), ("exit", "torch")],
        [("with:torch", "torch"), ("with:auto", "auto"), ("exit", "torch"), ("exit", None)],
    ],
    ids=lambda steps: " ".join(action for action, _ in steps),
)
def test_sdpa_override_switches_and_blocks_compose(steps, routed_backend):
    """enable/disable are one global switch (like torch.set_grad_enabled); a block restores on
    exit the state at its entry (like torch.no_grad()), whatever was switched inside it."""
    blocks = []
    try:
        for action, expected in steps:
            kind, _, backend = action.partition(":")
            if kind == "enable":
                enable_sdpa_override(backend=backend)
            elif kind == "disable":
                disable_sdpa_override()
            elif kind == "with":
                blocks.append(sdpa_override(backend=backend))
                blocks[-1].__enter__()
            else:
                blocks.pop().__exit__(None, None, None)
            assert routed_backend() == expected, action
    finally:
        while blocks:
            blocks.pop().__exit__(None, None, None)
        disable_sdpa_override()
        F.scaled_dot_product_attention = ORIGINAL_SDPA


def test_sdpa_override_reaches_models_that_call_sdpa(flash_calls):
    """Unmodified code that calls F.scaled_dot_product_attention: the LM's "sdpa" attention and
    nn.MultiheadAttention's own (slow-path) implementation."""
    torch.manual_seed(0)
    model = build_model("tiny", context_length=12, vocab_size=40, attention="sdpa")
    tokens = torch.randint(0, 40, (2, 12))
    mha = nn.MultiheadAttention(32, 2, batch_first=True)
    x = torch.randn(2, 7, 32)
    expected, expected_mha = model(tokens), mha(x, x, x, need_weights=False)[0]
    with sdpa_override(backend="torch"):
        logits = model(tokens)
        assert flash_calls.call_count == len(model.layers)
        out_mha = mha(x, x, x, need_weights=False)[0]
        assert flash_calls.call_count == len(model.layers) + 1
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_mha, expected_mha, atol=1e-5, rtol=1e-5)
