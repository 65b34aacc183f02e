"""Right-padded causal masks (what a Hugging Face model passes SDPA for right-padded batches) run
as mask-free causal problems, one per sequence (``_padding``): recognized exactly, equal to the
masked attention in float64 (outputs, lse and gradients), every other mask left to the mask path,
and a mask changed in place never answered from the kept result."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention.cases import assert_close, padded_mask
from tests.reference import modded_attention
from torch_flashsys import flash_attention
from torch_flashsys.attention import _dispatch, _padding
from torch_flashsys.attention._backend import triton_can_run_on

needs_interpreter = pytest.mark.skipif(
    not triton_can_run_on(torch.device("cpu")),
    reason="Triton kernels cannot run on CPU here (no triton or TRITON_INTERPRET unset)",
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def inputs(batch, heads, kv_heads, seq, dim, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, seq, dim, generator=gen).to(dtype)
    return q, k, v


@pytest.fixture
def kept_on_cpu():
    """CPU masks' answers kept as CUDA masks' are (on CPUs they are looked at every call), so
    that the keeping is tested here."""
    with mock.patch.object(_padding, "KEPT_DEVICES", frozenset({"cuda", "cpu"})):
        yield


@pytest.fixture
def per_sequence():
    """Counts the calls that took the per-sequence route."""
    with mock.patch.object(
        _dispatch, "_run_right_padded", wraps=_dispatch._run_right_padded
    ) as spy:
        yield spy


def _check(q, k, v, mask, is_causal, backend, dtype, seed):
    """flash_attention(mask) against the float64 masked reference, out, lse, dq, dk, dv: float64
    to 1e-9, other dtypes by the tests' rule (PyTorch's own error in the dtype as baseline)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=group > 1,
                               backend=backend, return_lse=True)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=dtype)
    ours = (out, *torch.autograd.grad(out, (q, k, v), dout))
    refs, bases = [], []
    for wide in (True, False):
        qr, kr, vr = (t.detach().to(torch.float64 if wide else dtype).requires_grad_()
                      for t in (q, k, v))  # fmt: skip
        o, ref_lse = modded_attention(qr, kr, vr, attn_mask=mask, is_causal=is_causal)
        grads = torch.autograd.grad(o, (qr, kr, vr), dout.to(o.dtype))
        (refs if wide else bases).extend([o, *grads])
        if wide:
            torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    for name, mine, ref, base in zip(("out", "dq", "dk", "dv"), ours, refs, bases, strict=True):
        if dtype == torch.float64:
            torch.testing.assert_close(mine, ref, atol=1e-9, rtol=1e-9, msg=name)
        else:
            assert_close(name, mine, base, ref, dtype)


@pytest.mark.parametrize("how", ["per_sequence", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.sampled_from([(2, 2), (4, 2)]),
    seq=st.integers(1, 40),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
)
def test_right_padded_causal_masks_run_without_the_mask(how, backend, batch, heads, seq, data,
                                                        seed):  # fmt: skip
    """The mask as a Hugging Face model builds it (causal AND key padding, is_causal False), or
    the key padding alone with is_causal=True: both are a causal problem on each sequence's first
    n_b keys, run one call per sequence or as one packed problem (``how``; a GPU chooses by
    length). Padded query rows see all n_b keys (their rows of the mask say so)."""
    lengths = data.draw(st.lists(st.integers(1, seq), min_size=batch, max_size=batch))
    form = data.draw(st.sampled_from(["hf", "padding and is_causal"]))
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v = inputs(batch, heads[0], heads[1], seq, 16, seed, dtype)
    mask = padded_mask(lengths, seq)
    is_causal = form != "hf"
    if is_causal:  # the padding alone, every row
        mask = torch.arange(seq)[None, None, None, :] < torch.tensor(lengths)[:, None, None, None]
        mask = mask.expand(batch, 1, seq, seq)
    routed = mock.patch.object(_dispatch, "_run_right_padded", wraps=_dispatch._run_right_padded)
    with routed as spy, mock.patch.object(_dispatch, "route", lambda q: how):
        _check(q, k, v, mask, is_causal, backend, dtype, seed)
    assert spy.call_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_packed_route_follows_the_padded_length(backend):
    """The packed layout is kept for the last lengths (a model's layers share it): the same key
    lengths padded to another length are another layout (query rows per sequence)."""
    dtype = torch.float32 if backend == "triton" else torch.float64
    for seed, seq in enumerate((8, 10, 8)):
        q, k, v = inputs(2, 2, 2, seq, 16, seed, dtype)
        with mock.patch.object(_dispatch, "route", lambda q: "packed"):
            _check(q, k, v, padded_mask([3, 5], seq), False, backend, dtype, seed)


def _not_right_padded(seq: int) -> dict[str, tuple[torch.Tensor, bool]]:
    """Masks the per-sequence route must leave to the mask path: (mask, is_causal)."""
    hf = padded_mask([seq, seq - 2], seq)
    flipped = hf.clone()
    flipped[1, 0, 3, 1] = False  # one key hidden from one row
    left = hf.flip(-1).flip(-2)  # left padding: the padded rows see no key
    empty = padded_mask([seq, 1], seq).clone()
    empty[1, 0, :, 0] = False  # a sequence with no key
    return {
        "one bit": (flipped, False),
        "left padding": (left.contiguous(), False),
        "no keys": (empty, False),
        "padding without is_causal": (hf[:, :, -1:].expand(2, 1, seq, seq), False),
        "per head": (hf.expand(2, 2, seq, seq), False),
        "float": (torch.zeros(2, 1, seq, seq).masked_fill(~hf, float("-inf")), False),
    }


@pytest.mark.parametrize("name", list(_not_right_padded(8)))
def test_other_masks_take_the_mask_path(name, per_sequence):
    mask, is_causal = _not_right_padded(8)[name]
    q, k, v = inputs(2, 2, 2, 8, 16, 7, torch.float64)
    _check(q, k, v, mask, is_causal, "torch", torch.float64, 7)
    assert per_sequence.call_count == 0, name


def test_a_mask_changed_in_place_is_looked_at_again(per_sequence, kept_on_cpu):
    """The lengths are kept per mask object; an in-place change (its version counter) or another
    object is looked at again, so a stale answer never decides the route."""
    seq = 12
    q, k, v = inputs(2, 2, 2, seq, 16, 3, torch.float64)
    mask = padded_mask([seq, 7], seq)
    with mock.patch.object(_padding, "_lengths", wraps=_padding._lengths) as looked:
        flash_attention(q, k, v, attn_mask=mask)
        flash_attention(q, k, v, attn_mask=mask)  # a model's next layer: the same mask object
        assert looked.call_count == 1 and per_sequence.call_count == 2
        mask[1, 0, 9, 2] = False  # no longer right-padded causal
        out = flash_attention(q, k, v, attn_mask=mask)
        assert looked.call_count == 2 and per_sequence.call_count == 2
    ref, _ = modded_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_cpu_masks_are_looked_at_on_every_call(per_sequence):
    """A write PyTorch does not count (through ``.data``, a NumPy alias, a kernel of another
    library) leaves a mask's version counter as it was: a CPU mask is looked at on every call
    (no synchronization to save), so a buffer refilled that way is never answered from a kept
    result."""
    seq = 12
    q, k, v = inputs(2, 2, 2, seq, 16, 5, torch.float64)
    mask = padded_mask([seq, 7], seq)
    for lengths in ([seq, 7], [5, seq], [3, 9]):  # refilled in place, its version unchanged
        mask.data.copy_(padded_mask(lengths, seq))
        out = flash_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out, modded_attention(q, k, v, attn_mask=mask)[0],
                                   atol=1e-10, rtol=1e-10)  # fmt: skip
    mask.data[1, 0, 9, 2] = False  # no longer right-padded causal: the mask path
    out = flash_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, modded_attention(q, k, v, attn_mask=mask)[0], atol=1e-10,
                               rtol=1e-10)  # fmt: skip
    assert per_sequence.call_count == 3


def test_padded_masks_switch_is_read_at_import():
    """``TORCH_FLASHSYS_PADDED_MASKS=0`` (read at import) leaves every mask to the mask path."""
    import os
    import subprocess
    import sys

    code = ("from torch_flashsys.attention import _padding; import torch; "
            "print(_padding.ENABLED, _padding.key_lengths(torch.ones(1, 1, 4, 4, dtype=torch.bool)"
            ".tril(), 1, 4, 4, False))")  # fmt: skip
    for value, expected in (("0", "False None"), ("1", "True [4]")):
        env = {**os.environ, "TORCH_FLASHSYS_PADDED_MASKS": value}
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.split("\n")[-2]  # fmt: skip
        assert got == expected, (value, got)


@settings(max_examples=10, deadline=None)
@given(seq=st.integers(2, 30), data=st.data())
def test_masks_are_checked_in_blocks_of_rows(seq, data):
    """The check walks the mask in blocks of rows (bounded temporaries): a right-padded mask is
    found whatever the block size, and one changed bit anywhere is not."""
    lengths = data.draw(st.lists(st.integers(1, seq), min_size=1, max_size=3))
    mask = padded_mask(lengths, seq)[:, 0]
    block = data.draw(st.integers(1, seq))
    with mock.patch.object(_padding, "BLOCK_ELEMENTS", block * len(lengths) * seq):
        assert _padding._lengths(mask, False) == lengths
        b, i, j = (data.draw(st.integers(0, n - 1)) for n in (len(lengths), seq, seq))
        mask[b, i, j] = ~mask[b, i, j]
        assert _padding._lengths(mask, False) == plainly_right_padded(mask)


def plainly_right_padded(mask: torch.Tensor) -> list[int] | None:
    """The lengths of a (batch, L, L) right-padded causal mask, or None, by building each
    sequence's mask from its last row's count and comparing."""
    lengths = [int(row[-1].sum()) for row in mask]
    if min(lengths) < 1 or not torch.equal(mask, padded_mask(lengths, mask.shape[-1])[:, 0]):
        return None
    return lengths


def test_alternating_masks_are_each_looked_at_once(per_sequence, kept_on_cpu):
    """A model whose layers alternate masks (full and sliding-window layers) passes a few mask
    objects in turn: each is looked at once, whether right-padded or not."""
    seq = 12
    q, k, v = inputs(2, 2, 2, seq, 16, 13, torch.float64)
    padded = padded_mask([seq, 8], seq)
    window = padded & (torch.arange(seq)[None, :] > torch.arange(seq)[:, None] - 4)
    with mock.patch.object(_padding, "_lengths", wraps=_padding._lengths) as looked:
        for _ in range(3):
            for mask in (padded, window):
                out = flash_attention(q, k, v, attn_mask=mask)
                ref, _ = modded_attention(q, k, v, attn_mask=mask)
                torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert looked.call_count == 2 and per_sequence.call_count == 3


def test_masks_made_under_inference_mode(per_sequence):
    """Inference tensors have no version counter: such a mask is looked at on every call (never
    kept), and the route still runs."""
    with torch.inference_mode():
        q, k, v = inputs(2, 2, 2, 9, 16, 11, torch.float64)
        mask = padded_mask([9, 4], 9)
        outs = [flash_attention(q, k, v, attn_mask=mask) for _ in range(2)]
        mask[1, 0, 7, 1] = False  # changed in place: the next call follows it
        changed = flash_attention(q, k, v, attn_mask=mask)
    assert per_sequence.call_count == 2
    for out in outs:
        torch.testing.assert_close(
            out, modded_attention(q, k, v, attn_mask=padded_mask([9, 4], 9))[0]
        )
    torch.testing.assert_close(changed, modded_attention(q, k, v, attn_mask=mask)[0])


@pytest.mark.parametrize("how", ["per_sequence", "packed"])
def test_double_backward_through_both_routes(how, per_sequence):
    """create_graph=True: the gradients are differentiable (per sequence: the mask's
    differentiable backward; packed: the packed problem's), and their own gradients are the
    masked attention's."""
    seq, lengths = 10, [10, 6]
    mask = padded_mask(lengths, seq)
    q, k, v = (t.requires_grad_() for t in inputs(2, 2, 2, seq, 8, 5, torch.float64))
    w = torch.randn(2, 2, seq, 8, dtype=torch.float64)

    def second_order(attend):
        out = attend(q, k, v)
        dq, dk = torch.autograd.grad((out * w).sum(), (q, k), create_graph=True)
        return torch.autograd.grad((dq * dq).sum() + (dk * w).sum(), (q, k, v))

    with mock.patch.object(_dispatch, "route", lambda q: how):
        ours = second_order(lambda *t: flash_attention(*t, attn_mask=mask))
    assert per_sequence.call_count == 1
    refs = second_order(lambda *t: modded_attention(*t, attn_mask=mask)[0])
    for mine, ref in zip(ours, refs, strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-9, rtol=1e-9)


@pytest.mark.gpu
@settings(max_examples=12, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.sampled_from([(4, 4), (8, 2)]),
    dim=st.sampled_from([64, 128]),
    seq=st.integers(_padding.MIN_SEQ_CUDA, 2600),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
)
def test_right_padded_masks_on_cuda_bfloat16(batch, heads, dim, seq, data, seed):
    """bfloat16 on the GPU, one call per sequence (the Hopper kernels where they take its
    problem) or packed (the portable kernels), against the float64 masked reference by the
    tests' rule; sequences as short as one key."""
    lengths = data.draw(st.lists(st.integers(1, seq), min_size=batch, max_size=batch))
    how = data.draw(st.sampled_from(["per_sequence", "packed"]))
    q, k, v = (t.cuda() for t in inputs(batch, heads[0], heads[1], seq, dim, seed, torch.bfloat16))
    mask = padded_mask(lengths, seq).cuda()
    routed = mock.patch.object(_dispatch, "_run_right_padded", wraps=_dispatch._run_right_padded)
    with routed as spy, mock.patch.object(_dispatch, "route", lambda q: how):
        _check(q, k, v, mask, False, "auto", torch.bfloat16, seed)
    assert spy.call_count == 1
