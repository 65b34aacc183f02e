"""The reference LM: the three attention choices agree with a float64 model, layers, sizes, errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention.cases import assert_close
from torch_flashsys.attention._backend import triton_can_run_on
from torch_flashsys.attention._checks import triton_head_dim_ok
from torch_flashsys.models import (
    ATTENTION_CHOICES,
    MODEL_SIZES,
    ModelConfig,
    TransformerLM,
    build_model,
)
from torch_flashsys.models._layers import RMSNorm, RotaryEmbedding, naive_causal_attention

VOCAB = 50
CPU = torch.device("cpu")


def _run(model: TransformerLM, tokens: torch.Tensor, dout: torch.Tensor):
    """(logits, {name: grad}) for loss = sum(logits * dout)."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    (logits * dout.to(logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad.detach() for n, p in model.named_parameters()}


@settings(max_examples=4)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 2),
    seq=st.integers(1, 19),
    # "triton" on CPU: the kernels through the interpreter (TRITON_INTERPRET=1, set by conftest)
    flash_backend=st.sampled_from(["torch", "triton"] if triton_can_run_on(CPU) else ["torch"]),
)
def test_attention_choices_match_float64(seed, batch, seq, flash_backend):
    torch.manual_seed(seed)
    model = build_model("tiny", context_length=24, vocab_size=VOCAB, attention="naive")
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    dout = torch.randn(batch, seq, VOCAB, generator=gen)

    ref_logits, ref_grads = _run(copy.deepcopy(model).double(), tokens, dout)
    model.set_attention("sdpa")
    base_logits, base_grads = _run(model, tokens, dout)  # PyTorch's own float32 error
    for attention in ATTENTION_CHOICES:
        model.set_attention(attention, flash_backend=flash_backend)
        assert model.attention == attention
        logits, grads = _run(model, tokens, dout)
        assert logits.shape == (batch, seq, VOCAB) and logits.dtype == torch.float32
        assert_close(f"{attention} logits", logits, base_logits, ref_logits, torch.float32)
        for name, grad in grads.items():
            assert_close(
                f"{attention} d{name}", grad, base_grads[name], ref_grads[name], torch.float32
            )


def test_grouped_query_attention_choices_match_float64_and_full_heads():
    """num_kv_heads < num_heads: the three attention choices agree with a float64 model, and with
    the multi-head model whose key/value heads are the grouped ones repeated (same function)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, d_ff=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      vocab_size=VOCAB, context_length=24, attention="naive")  # fmt: skip
    model = TransformerLM(cfg)
    assert model.layers[0].attn.qkv_proj.out_features == (4 + 2 * 2) * 16
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=gen)
    dout = torch.randn(2, 17, VOCAB, generator=gen)
    ref_logits, ref_grads = _run(copy.deepcopy(model).double(), tokens, dout)
    model.set_attention("sdpa")
    base_logits, base_grads = _run(model, tokens, dout)
    for attention in ATTENTION_CHOICES:
        model.set_attention(attention, flash_backend="torch")
        logits, grads = _run(model, tokens, dout)
        assert_close(f"{attention} logits", logits, base_logits, ref_logits, torch.float32)
        for name, grad in grads.items():
            assert_close(f"{attention} d{name}", grad, base_grads[name], ref_grads[name],
                         torch.float32)  # fmt: skip
    full = TransformerLM(dataclasses.replace(cfg, num_kv_heads=None, attention="sdpa")).double()
    state = {}  # the same weights, each key/value head repeated for its two query heads
    for name, w in model.double().state_dict().items():
        if name.endswith("qkv_proj.weight"):
            q, k, v = w.view(4 + 2 * 2, 16, 64).split([4, 2, 2])
            w = torch.cat([q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)]).view(-1, 64)
        state[name] = w
    full.load_state_dict(state)
    model.set_attention("sdpa")
    torch.testing.assert_close(model(tokens), full(tokens))


@settings(max_examples=5)
@given(seed=st.integers(0, 2**31 - 1), seq=st.integers(1, 12))
def test_naive_attention_is_causal_softmax_attention(seed, seq):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, seq, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(naive_causal_attention(q, k, v), ref)


def test_causality_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    for attention in ATTENTION_CHOICES:
        model = build_model("tiny", context_length=16, vocab_size=VOCAB, attention=attention)
        model.set_attention(attention, flash_backend="torch")
        a = torch.randint(0, VOCAB, (2, 16))
        b = a.clone()
        b[:, 9:] = torch.randint(0, VOCAB, (2, 7))
        torch.testing.assert_close(model(a)[:, :9], model(b)[:, :9])


@settings(max_examples=5)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(0, 20), n=st.integers(0, 20))
def test_rope_scores_depend_only_on_relative_position(seed, m, n):
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(16, context_length=48).double()
    q, k = (torch.randn(16, generator=gen, dtype=torch.float64) for _ in range(2))

    def score(pos_q: int, pos_k: int) -> torch.Tensor:
        seq_q, seq_k = torch.zeros(1, 1, 48, 16).double(), torch.zeros(1, 1, 48, 16).double()
        seq_q[..., pos_q, :], seq_k[..., pos_k, :] = q, k
        return rope(seq_q)[..., pos_q, :] @ rope(seq_k)[..., pos_k, :].transpose(-1, -2)

    # The tables are float32 (rounding ~6e-8 relative), hence float32-level tolerances.
    tol = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(score(m, n), score(m + 7, n + 7), **tol)
    if m == n:  # no rotation between equal positions: the plain dot product
        torch.testing.assert_close(score(m, n).squeeze(), q @ k, **tol)
    if m != n:  # and it does rotate otherwise
        assert not torch.allclose(score(m, n), score(m, m), **tol)


def test_rmsnorm_matches_torch():
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=gen))
    x = torch.randn(3, 5, 32, generator=gen)
    ref = torch.nn.functional.rms_norm(x.double(), (32,), norm.weight.double(), eps=1e-5)
    torch.testing.assert_close(norm(x), ref.float())


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_sizes(size):
    model = build_model(size, context_length=128, device="meta")
    cfg, dims = model.config, MODEL_SIZES[size]
    assert (cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.num_heads) == (
        dims["d_model"],
        dims["d_ff"],
        dims["num_layers"],
        dims["num_heads"],
    )
    assert cfg.kv_heads == dims.get("num_kv_heads", dims["num_heads"])
    assert cfg.vocab_size == 10_000 and len(model.layers) == cfg.num_layers
    assert triton_head_dim_ok(cfg.head_dim), f"{size}: head dim {cfg.head_dim} not Triton-ready"
    d, f, layers, v = cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.vocab_size
    kv_width = cfg.kv_heads * cfg.head_dim  # keys' (and values') projection width
    per_layer = 2 * d * d + 2 * d * kv_width + 3 * d * f + 2 * d
    assert model.num_parameters() == layers * per_layer + 2 * v * d + d


def test_state_dict_is_shared_by_attention_choices():
    torch.manual_seed(0)
    a = build_model("tiny", context_length=8, vocab_size=VOCAB, attention="flash")
    b = build_model("tiny", context_length=8, vocab_size=VOCAB, attention="naive")
    b.load_state_dict(a.state_dict())
    assert not any("rope" in k for k in a.state_dict())  # RoPE tables are not parameters


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (
            lambda: ModelConfig(d_model=60, d_ff=8, num_layers=1, num_heads=8),
            ValueError,
            "multiple",
        ),
        (lambda: ModelConfig(d_model=24, d_ff=8, num_layers=1, num_heads=8), ValueError, "even"),
        (
            lambda: ModelConfig(d_model=64, d_ff=8, num_layers=1, num_heads=4, num_kv_heads=3),
            ValueError,
            "num_kv_heads must be a positive int dividing num_heads",
        ),
        (lambda: ModelConfig(d_model=0, d_ff=8, num_layers=1, num_heads=1), ValueError, "d_model"),
        (lambda: build_model("tiny", attention="fast"), ValueError, "attention must be one of"),
        (lambda: build_model("huge"), ValueError, "size must be one of"),
        (lambda: TransformerLM({"d_model": 8}), TypeError, "ModelConfig"),
        (lambda: build_model("tiny").set_attention("x"), ValueError, "set_attention"),
    ],
)
def test_constructor_errors(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_forward_errors():
    model = build_model("tiny", context_length=8, vocab_size=VOCAB, attention="sdpa")
    with pytest.raises(ValueError, match="2-D"):
        model(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds context_length 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_attention_choices_agree(dtype):
    torch.manual_seed(0)
    model = build_model("tiny", context_length=256, vocab_size=VOCAB, device="cuda")
    tokens = torch.randint(0, VOCAB, (4, 256), device="cuda")
    ref = copy.deepcopy(model).double()
    ref.set_attention("naive")
    ref_logits = ref(tokens)
    model = model.to(dtype)
    outs = {}
    for attention in ATTENTION_CHOICES:  # naive also exercises the NVTX ranges
        model.set_attention(attention)
        outs[attention] = model(tokens)
    for attention in ("naive", "flash"):
        assert_close(attention, outs[attention], outs["sdpa"], ref_logits, dtype)


@pytest.mark.parametrize("kv_heads", [None, 2])
@pytest.mark.parametrize("attention", ["flash", "sdpa", "naive"])
def test_cached_generation_equals_uncached_token_for_token(attention, kv_heads):
    """generate() with per-layer KV caches (flash: read in place through cache_seqlens) gives the
    same greedy tokens as re-running the whole sequence each step, and so does sampling with the
    same generator."""
    torch.manual_seed(0)
    model = build_model("tiny", context_length=64, vocab_size=50, attention=attention,
                        dtype=torch.float64, num_kv_heads=kv_heads)  # fmt: skip
    assert model.new_caches(1)[0].key.shape[1] == (kv_heads or 4)
    model.set_attention(attention, flash_backend="torch")
    prompt = torch.randint(0, 50, (3, 7))
    cached = model.generate(prompt, 25)
    uncached = model.generate(prompt, 25, use_cache=False)
    assert cached.shape == (3, 32) and torch.equal(cached[:, :7], prompt)
    assert torch.equal(cached, uncached)
    sampled = [
        model.generate(
            prompt,
            10,
            use_cache=c,
            temperature=0.8,
            top_k=5,
            generator=torch.Generator().manual_seed(3),
        )
        for c in (True, False)
    ]
    assert torch.equal(sampled[0], sampled[1])


def test_generate_errors():
    model = build_model("tiny", context_length=16, vocab_size=20, attention="naive")
    with pytest.raises(ValueError, match="exceed context_length 16"):
        model.generate(torch.zeros(1, 10, dtype=torch.long), 7)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), -1)


# ---------------------------------------------- long-context options: position ids, checkpointing,
# chunked loss (float64, against the plain model)


def _f64_model(**overrides) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("tiny", context_length=32, vocab_size=50, attention="sdpa")
    return TransformerLM(dataclasses.replace(cfg, **overrides)).double()


def _grads(model: TransformerLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@given(seed=st.integers(0, 2**31 - 1), seq=st.integers(2, 32), batch=st.integers(1, 3))
@settings(max_examples=5, deadline=None)
def test_position_ids_select_the_rotary_positions(seed, seq, batch):
    """arange positions change nothing; any subset of positions rotates exactly as those rows of
    the full sequence (what a context-parallel shard needs)."""
    model = _f64_model()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (batch, seq), generator=g)
    full = model(tokens)
    torch.testing.assert_close(model(tokens, position_ids=torch.arange(seq)), full, rtol=0, atol=0)
    per_row = torch.arange(seq).expand(batch, seq)
    torch.testing.assert_close(model(tokens, position_ids=per_row), full, rtol=0, atol=0)
    x = torch.randn(batch, 4, seq, 8, generator=g, dtype=torch.float64)
    picks = torch.randperm(seq, generator=g)[: max(1, seq // 2)]
    rows = torch.stack([picks.roll(i) for i in range(batch)])  # a different subset order per row
    rope = RotaryEmbedding(8, 32)
    want = torch.stack([rope(x)[b, :, rows[b]] for b in range(batch)])
    got = rope(torch.stack([x[b, :, rows[b]] for b in range(batch)]), positions=rows)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(rope(x[:, :, picks], positions=picks), rope(x)[:, :, picks])


def test_position_ids_shape_error():
    model = _f64_model()
    with pytest.raises(ValueError, match="position_ids must be"):
        model(torch.zeros(1, 8, dtype=torch.long), position_ids=torch.arange(7))


@given(seed=st.integers(0, 2**31 - 1), chunk=st.sampled_from([None, 1, 3, 7, 64]))
@settings(max_examples=6, deadline=None)
def test_chunked_loss_and_checkpointing_match_plain_training(seed, chunk):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (2, 12), generator=g)
    targets = torch.randint(0, 50, (2, 12), generator=g)
    targets[0, :3] = -100  # ignored positions count in neither the sum nor the mean
    plain = _f64_model()
    want = torch.nn.functional.cross_entropy(plain(tokens).flatten(0, 1), targets.flatten())
    want.backward()
    for ckpt in (False, True):
        model = _f64_model(activation_checkpointing=ckpt)
        got = model.loss(tokens, targets, chunk_size=chunk)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for name, grad in _grads(plain).items():
            torch.testing.assert_close(
                _grads(model)[name], grad, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}"
            )
    summed = plain.loss(tokens, targets, chunk_size=chunk, reduction="sum")
    torch.testing.assert_close(summed, want * (targets != -100).sum(), rtol=1e-12, atol=1e-12)


def test_checkpointing_stores_fewer_activations():
    """Saved tensors of the autograd graph: per-block checkpointing keeps only block inputs."""

    def saved_bytes(model: TransformerLM) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.loss(torch.zeros(1, 32, dtype=torch.long), torch.zeros(1, 32, dtype=torch.long))
        return total

    assert saved_bytes(_f64_model(activation_checkpointing=True)) < 0.5 * saved_bytes(_f64_model())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reduction": "none"}, "reduction must be"),
        ({"chunk_size": 0}, "chunk_size must be"),
        ({"targets": torch.zeros(1, 7, dtype=torch.long)}, "targets must have the shape"),
    ],
)
def test_loss_errors(kwargs, match):
    model = _f64_model()
    args = {"targets": torch.zeros(1, 8, dtype=torch.long), **kwargs}
    with pytest.raises(ValueError, match=match):
        model.loss(torch.zeros(1, 8, dtype=torch.long), **args)


def test_activation_checkpointing_must_be_bool():
    with pytest.raises(TypeError, match="activation_checkpointing must be a bool"):
        ModelConfig.from_size("tiny", activation_checkpointing="yes")
