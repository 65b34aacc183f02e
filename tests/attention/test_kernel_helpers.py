"""The kernels' shared ``@triton.jit`` helpers on their own, against float64: run on CUDA, or on
CPU through the Triton interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from torch_flashsys.attention._backend import triton_can_run_on  # noqa: E402
from torch_flashsys.attention._triton_common import (  # noqa: E402
    _tanh_and_slope,
    key_tile_range,
    query_tile_range,
    softmax_finish,
    softmax_lse,
    softmax_step,
    store_rows,
)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_can_run_on(torch.device("cpu"))),
    reason="needs CUDA or the Triton interpreter",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _tanh_kernel(X, T, G, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t, g = _tanh_and_slope(tl.load(X + offs, mask=offs < n, other=0.0))
    tl.store(T + offs, t, mask=offs < n)
    tl.store(G + offs, g, mask=offs < n)


def test_softcap_tanh_and_its_slope_are_precise_at_every_magnitude():
    """softcap's tanh and ``1 - tanh^2``: tiny arguments (a softcap far above the scores) must
    not cancel, saturated ones keep the slope's relative precision."""
    mags = torch.logspace(-9, 1.3, 4000, dtype=torch.float64)  # |x| from 1e-9 to 20
    x = torch.cat([mags, -mags]).float().to(DEVICE)
    t, g = torch.empty_like(x), torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, t, g, x.numel(), BLOCK=1024)
    x64 = x.double().cpu()
    t_ref, g_ref = torch.tanh(x64), torch.cosh(x64).pow(-2)
    t_rel = ((t.double().cpu() - t_ref).abs() / t_ref.abs()).max().item()
    g_rel = ((g.double().cpu() - g_ref).abs() / g_ref).max().item()
    assert t_rel < 1e-6, f"tanh: relative error {t_rel:.3g}"  # float32 rounding: 6e-8 each
    # a saturated x's slope inherits the rounding of 2 |x| log2(e) (|x| = 20: ~4e-6)
    assert g_rel < 1e-5, f"1 - tanh^2: relative error {g_rel:.3g}"


@triton.jit
def _ranges_kernel(
    Starts, Out, seq, left, right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KEYS: tl.constexpr, N: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, N)
    start = tl.load(Starts + i)  # the helpers work elementwise: N tiles at once
    if KEYS:
        lo, mid_lo, mid_hi, hi = key_tile_range(
            start, seq, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
        )
    else:
        lo, mid_lo, mid_hi, hi = query_tile_range(
            start, seq, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
        )
    tl.store(Out + 4 * i, lo)
    tl.store(Out + 4 * i + 1, mid_lo)
    tl.store(Out + 4 * i + 2, mid_hi)
    tl.store(Out + 4 * i + 3, hi)


@given(
    keys=st.booleans(),
    shift=st.integers(-40, 40),
    seq=st.integers(1, 200),
    left=st.integers(-1, 70),
    right=st.integers(-1, 70),
    bm=st.sampled_from([16, 32]),
    bn=st.sampled_from([16, 64]),
)
@example(keys=True, shift=2, seq=100, left=0, right=-1, bm=16, bn=16)  # a row's edge on a tile
@example(keys=False, shift=0, seq=100, left=-1, right=1, bm=16, bn=16)
def test_tile_ranges_cover_every_allowed_pair_and_their_middle_needs_no_mask(
    keys, shift, seq, left, right, bm, bn
):
    """key_tile_range (a query tile's keys; positions may be shifted, as in a KV cache) and
    query_tile_range (a key tile's queries), for every tile: [lo, hi) holds every partner some
    member of the tile may attend (or be attended by), [mid_lo, mid_hi) only partners every
    member attends, and the segments the kernels loop over start on tile boundaries."""
    own, other = (bm, bn) if keys else (bn, bm)
    starts = torch.arange(16, dtype=torch.int32) * own + (shift if keys else 0)
    out = torch.empty(16, 4, dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(1,)](starts.to(DEVICE), out, seq, left, right, left >= 0, right >= 0, bm, bn,
                         keys, 16)  # fmt: skip

    def allowed(i, j):  # query position i, key j
        return (left < 0 or j >= i - left) and (right < 0 or j <= i + right)

    pair = (lambda m, p: allowed(m, p)) if keys else (lambda m, p: allowed(p, m))
    for start, (lo, mid_lo, mid_hi, hi) in zip(starts.tolist(), out.tolist(), strict=True):
        members = range(start, start + own)
        assert mid_lo <= mid_hi <= hi <= seq
        assert lo <= mid_lo or lo >= hi  # lo past hi: nothing to do, every loop empty
        assert lo % other == 0
        assert mid_lo == mid_hi or mid_lo % other == 0
        assert mid_hi == hi or mid_hi % other == 0
        for p in range(seq):
            if any(pair(m, p) for m in members):
                assert lo <= p < hi, (start, p, lo, hi)
        for p in range(mid_lo, mid_hi):
            assert all(pair(m, p) for m in members), (start, p, mid_lo, mid_hi)


@triton.jit
def _softmax_kernel(S, V, Out, Lse, n_cols, qk_scale, FOLD_SCALE: tl.constexpr,
                    ROWS: tl.constexpr, COLS: tl.constexpr, D: tl.constexpr):  # fmt: skip
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    d = tl.arange(0, D)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    for start in range(0, n_cols, COLS):
        s = tl.load(S + rows[:, None] * n_cols + start + cols[None, :])
        v = tl.load(V + (start + cols)[:, None] * D + d[None, :])
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale, FOLD_SCALE, True)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    store_rows(Out + rows[:, None] * D + d[None, :], softmax_finish(acc, l_i, True), rows < ROWS, d,
               True)  # fmt: skip
    tl.store(Lse + rows, softmax_lse(m_i, l_i))


@pytest.mark.parametrize("fold", [False, True])
def test_online_softmax_step_matches_softmax_with_empty_rows(fold):
    """softmax_step over column tiles, then softmax_finish and softmax_lse: softmax(s) @ v and the logsumexp
    (natural log) of base-2 scores, against float64; a row of -inf gives 0 and -inf."""
    rows, n_cols, d, scale = 16, 64, 16, 0.7 if fold else 1.0
    s = torch.randn(rows, n_cols, dtype=torch.float64) * 4
    s[3] = float("-inf")  # a row with no allowed key
    s[5, :40] = float("-inf")  # a row whose first tiles are all masked
    v = torch.randn(n_cols, d, dtype=torch.float64)
    out = torch.empty(rows, d, device=DEVICE)
    lse = torch.empty(rows, device=DEVICE)
    _softmax_kernel[(1,)](s.float().to(DEVICE), v.float().to(DEVICE), out, lse, n_cols, scale,
                          fold, rows, 16, d)  # fmt: skip
    z = s * scale * math.log(2.0)  # base-2 scores in natural units
    ref_lse = torch.logsumexp(z, 1)
    ref_out = torch.softmax(z, 1).nan_to_num(0.0) @ v
    assert torch.equal(lse.cpu()[3], torch.tensor(float("-inf")))
    keep = torch.arange(rows) != 3
    torch.testing.assert_close(lse.cpu().double()[keep], ref_lse[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=1e-4, atol=1e-5)
