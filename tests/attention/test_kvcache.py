"""KV-cache decoding: flash_attention(q, k_cache, v_cache, cache_seqlens=...) against an explicit
float64 reference (queries at the end of each sequence's valid keys), both backends (the Triton
split-KV kernel through the interpreter), the KVCache object and FlashAttention's kv_cache."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.attention.cases import assert_close
from torch_flashsys import FlashAttention, flash_attention
from torch_flashsys.attention import KVCache
from torch_flashsys.attention._backend import triton_can_run_on

needs_interpreter = pytest.mark.skipif(
    not triton_can_run_on(torch.device("cpu")),
    reason="Triton kernels cannot run on CPU here (no triton or TRITON_INTERPRET unset)",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def decode_reference(q, k, v, lens, *, causal, window=None, softcap=None, alibi=None, mask=None):
    """Per sequence b: keys [0, lens[b]); query i sits at position lens[b] - seq_q + i."""
    batch, heads, seq_q, dim = q.shape
    group = heads // k.shape[1]
    outs, lses = [], []
    for b in range(batch):
        n = int(lens[b])
        kk = k[b, :, :n].repeat_interleave(group, 0)
        vv = v[b, :, :n].repeat_interleave(group, 0)
        s = (q[b] @ kk.transpose(-1, -2)) / math.sqrt(dim)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = (n - seq_q + torch.arange(seq_q))[:, None]
        j = torch.arange(n)[None, :]
        if alibi is not None:  # (heads,) or (batch, heads) slopes
            slopes = alibi if alibi.dim() == 1 else alibi[b]
            s = s - slopes.view(-1, 1, 1).to(s.dtype) * (pos - j).abs().to(s.dtype)
        allowed = torch.ones(seq_q, n, dtype=torch.bool)
        if causal:
            allowed &= j <= pos
        if window is not None and window[0] >= 0:
            allowed &= j >= pos - window[0]
        if window is not None and window[1] >= 0:
            allowed &= j <= pos + window[1]
        if mask is not None:
            allowed = allowed & mask[b, :, :, :n]
        s = s.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0)[..., None])
        outs.append(p.to(v.dtype) @ vv)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@st.composite
def decode_cases(draw):
    kv_heads, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    batch = draw(st.integers(1, 3))
    seq_q = draw(st.integers(1, 12))
    capacity = draw(st.integers(seq_q, 150))
    return {
        "batch": batch, "kv_heads": kv_heads, "group": group, "seq_q": seq_q,
        "capacity": capacity, "dim": draw(st.sampled_from([16, 32])),
        "lens": draw(st.lists(st.integers(seq_q, capacity), min_size=batch, max_size=batch)),
        "causal": draw(st.booleans()),
        "window": draw(st.sampled_from([None, (20, -1), (5, 0)])),
        "softcap": draw(st.sampled_from([None, 5.0])),
        "alibi": draw(st.sampled_from([None, "heads", "batch_heads"])),  # the slopes' shape
        "seed": draw(st.integers(0, 2**31 - 1)),
        # q, k, v each: (B, H, S, D) memory, (B, S, H, D) viewed as it, or a strided last dim
        # (a K cache kept as (B, H, D, S), passed transposed)
        "layouts": draw(st.lists(st.sampled_from(LAYOUTS), min_size=3, max_size=3)),
    }  # fmt: skip


LAYOUTS = ("bhsd", "bshd", "last_strided")


def in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in the memory layout ``layout`` (a LAYOUTS name)."""
    if layout == "bshd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "last_strided":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


def check_decode(c, dtype, backend, device="cpu"):
    g = torch.Generator().manual_seed(c["seed"])
    heads = c["kv_heads"] * c["group"]
    q = torch.randn(c["batch"], heads, c["seq_q"], c["dim"], generator=g)
    k = torch.randn(c["batch"], c["kv_heads"], c["capacity"], c["dim"], generator=g)
    v = torch.randn(c["batch"], c["kv_heads"], c["capacity"], c["dim"], generator=g)
    shape = {"heads": (heads,), "batch_heads": (c["batch"], heads)}.get(c["alibi"])
    alibi = None if shape is None else torch.rand(shape, generator=g)
    lens = torch.tensor(c["lens"], dtype=torch.int32)
    kw = {"causal": c["causal"], "window": c["window"], "softcap": c["softcap"], "alibi": alibi}
    inputs = [in_layout(t.to(device=device, dtype=dtype), layout)
              for t, layout in zip((q, k, v), c["layouts"], strict=True)]  # fmt: skip
    with torch.no_grad():
        out, lse = flash_attention(
            *inputs,
            cache_seqlens=lens.to(device), is_causal=c["causal"], window_size=c["window"],
            softcap=c["softcap"], alibi_slopes=None if alibi is None else alibi.to(device),
            enable_gqa=c["group"] > 1, backend=backend, return_lse=True,
        )  # fmt: skip
    ref, ref_lse = decode_reference(*(t.to(dtype).double() for t in (q, k, v)), lens, **kw)
    base, _ = decode_reference(*(t.to(dtype) for t in (q, k, v)), lens, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert out.stride() == torch.empty_like(inputs[0]).stride()  # the query's memory layout
    assert_close("out", out.cpu(), base, ref, dtype)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.cpu().isfinite(), finite)
    if finite.any():
        assert (lse.cpu()[finite].double() - ref_lse[finite]).abs().max() < 1e-3


@given(case=decode_cases(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_torch_backend_decode_matches_float64(case, dtype):
    check_decode(case, dtype, "torch")


@needs_interpreter
@given(case=decode_cases(), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_triton_split_kv_decode_matches_float64(case, dtype):
    check_decode(case, dtype, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_with_a_mask_or_many_queries_takes_the_prefill_kernel(backend):
    """A mask (or more than 128 rows per key/value head) is not the split-KV kernel's: the same
    answer through the prefill kernel's cache mode."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 70, 16, generator=g)
    k, v = torch.randn(2, 1, 90, 16, generator=g), torch.randn(2, 1, 90, 16, generator=g)
    lens = torch.tensor([75, 90], dtype=torch.int32)
    mask = torch.rand(2, 1, 70, 90, generator=g) > 0.2
    with torch.no_grad():
        out = flash_attention(q, k, v, attn_mask=mask, cache_seqlens=lens, is_causal=True,
                              enable_gqa=True, backend=backend)  # fmt: skip
        many = flash_attention(q, k, v, cache_seqlens=lens, is_causal=True, enable_gqa=True,
                               backend=backend)  # fmt: skip
    ref, _ = decode_reference(q.double(), k.double(), v.double(), lens, causal=True, mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    ref, _ = decode_reference(q.double(), k.double(), v.double(), lens, causal=True)
    torch.testing.assert_close(many.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_seqlens_below_seq_q_raises(backend):
    """The queries are the last seq_q positions of each sequence's keys: fewer valid keys than
    queries is an error naming cache_seqlens (not rows that silently attend nothing)."""
    q, k = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 8, 16)
    for lens in ([5, 2], [0, 8]):
        with pytest.raises(ValueError, match=r"flash_attention: cache_seqlens .* \[3, 8\]"):
            flash_attention(q, k, k, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                            backend=backend)  # fmt: skip


def test_cache_seqlens_errors():
    q, k = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 8, 16)
    with pytest.raises(
        TypeError, match=r"cache_seqlens must be an int32 .* shape \(batch,\) = \(2,\)"
    ):
        flash_attention(q, k, k, cache_seqlens=torch.tensor([3, 4, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must lie in \[seq_q, capacity\] = \[1, 8\]"):
        flash_attention(q, k, k, cache_seqlens=torch.tensor([3, 9], dtype=torch.int32))
    for needs_grad in range(3):  # query, key or value: the kernels have no backward
        qkv = [t.clone().requires_grad_(i == needs_grad) for i, t in enumerate((q, k, k))]
        for backend in ("torch", "triton") if triton_can_run_on(q.device) else ("torch",):
            with pytest.raises(ValueError, match="forward only"):
                flash_attention(*qkv, cache_seqlens=torch.tensor([3, 4]), backend=backend)
    with pytest.raises(ValueError, match="4-D"):
        flash_attention(q[0], k[0], k[0], cache_seqlens=torch.tensor([3]))


def test_kv_cache_append_and_errors():
    cache = KVCache(2, 3, 10, 8, head_dim_v=4)
    k1, v1 = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 4)
    cache.append(k1, v1)
    k2, v2 = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 4)
    cache.append(k2, v2)
    assert cache.length == 6 and cache.seqlens.tolist() == [6, 6]
    assert torch.equal(cache.key[:, :, :6], torch.cat([k1, k2], 2))
    assert torch.equal(cache.value[:, :, :6], torch.cat([v1, v2], 2))
    with pytest.raises(ValueError, match="exceed the capacity 10"):
        cache.append(torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 4))
    with pytest.raises(ValueError, match=r"\(batch, kv_heads, n, head_dim\)"):
        cache.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 4))
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        KVCache(1, 1, 0, 8)
    cache.reset()
    assert cache.length == 0 and cache.seqlens.tolist() == [0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_flash_attention_module_generates_with_a_cache(backend, batch_first):
    """Prompt then one position at a time through kv_cache equals the full causal forward."""
    torch.manual_seed(0)
    attn = FlashAttention(
        64, 4, num_kv_heads=2, causal=True, batch_first=batch_first, backend=backend
    ).eval()
    x = torch.randn(2, 12, 64)
    if not batch_first:  # (seq, batch, embed_dim): positions along dim 0
        x = x.transpose(0, 1).contiguous()
    at = (lambda a, b: x[:, a:b]) if batch_first else (lambda a, b: x[a:b])
    with torch.no_grad():
        full = attn(x)
        cache = attn.new_cache(2, 16)
        steps = [attn(at(0, 5), kv_cache=cache)]
        steps += [attn(at(t, t + 1), kv_cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1 if batch_first else 0), full, atol=2e-5,
                               rtol=1e-5)  # fmt: skip
    assert cache.length == 12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True])  # split-KV kernel / prefill kernel's cache mode
def test_strided_cache_seqlens_give_the_contiguous_result(backend, masked):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, 4, 16, generator=g)
    k, v = torch.randn(3, 2, 40, 16, generator=g), torch.randn(3, 2, 40, 16, generator=g)
    lens = torch.tensor([7, 40, 22], dtype=torch.int32)
    strided = torch.stack([lens, torch.zeros_like(lens)], 1).flatten()[::2]  # lens[::2]-like view
    mask = torch.rand(3, 1, 4, 40, generator=g) > 0.2 if masked else None
    kw = {"attn_mask": mask, "is_causal": True, "backend": backend}
    with torch.no_grad():
        outs = [flash_attention(q, k, v, cache_seqlens=t, **kw) for t in (lens, strided)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_a_compiled_cached_call_off_the_split_kernel_reads_the_cache_lengths(backend, masked):
    """Under torch.compile a cached call the split-KV kernel does not take (a mask, or more than
    128 rows per key/value head) reaches the kernels through the custom ops, which must carry
    ``cache_seqlens``: they dropped it, and every key up to the capacity was attended (silently
    wrong, 2.25 off here)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 70, 16, generator=g)
    k, v = torch.randn(1, 1, 90, 16, generator=g), torch.randn(1, 1, 90, 16, generator=g)
    lens = torch.tensor([75], dtype=torch.int32)
    mask = torch.rand(1, 1, 70, 90, generator=g) > 0.2 if masked else None

    def f(q, k, v, lens):
        return flash_attention(q, k, v, attn_mask=mask, cache_seqlens=lens, is_causal=True,
                               enable_gqa=True, backend=backend)  # fmt: skip

    torch.compiler.reset()
    with torch.no_grad():
        out = torch.compile(f, backend="aot_eager")(q, k, v, lens)
    ref, _ = decode_reference(q.double(), k.double(), v.double(), lens, causal=True, mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
