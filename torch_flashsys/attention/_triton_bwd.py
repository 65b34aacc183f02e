"""FlashAttention-2 backward in Triton (FA2 Algorithm 2, eqs. 13-19), deterministic: no atomics.

Two launches. The dQ kernel runs over query tiles: it first computes ``D = rowsum(dO * O)`` for its
rows (the FA2 "preprocess", fused here: it needs the same dO tile), stores D, and accumulates dQ.
The dK/dV kernel then runs over key tiles, reading D; it loops over the query heads of a GQA group,
so the group sum needs no atomics. Probabilities are recomputed from the saved logsumexp,
``P = exp(S - LSE)``, with the forward's score modifications (``_triton_common.mod_scores``) and the
same dropout random numbers (regenerated, never stored).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_flashsys.attention._extras import Extras
from torch_flashsys.attention._launch import LaunchCache, Plan, dot_precision, remember
from torch_flashsys.attention._triton_common import (
    LOG2E,
    batch_strides,
    dropout_keep,
    empty_if,
    keep_scores,
    kernel_extras,
    key_tile_range,
    load_mask,
    load_rows,
    make_autotune,
    mod_scores,
    next_pow2,
    plan_tile,
    problem_dims,
    query_tile_range,
    seq_bounds,
    tune_len,
)

_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): LSE is stored in natural log, kernels use exp2

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class; the first entry is the default.
# dK/dV: few query rows per step against a resident key tile; dQ: the transpose of that.
DKDV_SHAPES = {  # from benchmarks/tune_attention.py on an H100 (docs/benchmarks.md)
    64: [(64, 64, 4, 3), (32, 128, 4, 5), (32, 128, 4, 3)],
    128: [(32, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3)],
    256: [(32, 64, 4, 2), (16, 64, 4, 2), (32, 128, 8, 2)],
}
DQ_SHAPES = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 8, 3)],
    128: [(128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3)],
    256: [(64, 32, 4, 2), (64, 16, 4, 2), (128, 32, 8, 2)],
}
_SPECIALIZE_NOT = [
    "seq_q", "seq_k", "tune_len", "left", "right", "threshold",
    "stride_mn", "stride_ab", "stride_ah",
    "stride_lb", "stride_lh",
]  # fmt: skip


def _dkdv_footprint(block_m: int, block_n: int, block_d: int, stages: int) -> int:
    return block_d * (2 * block_n + stages * 2 * block_m)  # resident K, V; pipelined Q, dO


def _dq_footprint(block_m: int, block_n: int, block_d: int, stages: int) -> int:
    return block_d * (3 * block_m + stages * 2 * block_n)  # resident Q, dO (O once); pipelined K, V


# For one query tile i:  D_i = rowsum(dO_i * O_i) - dLSE_i  (stored for the dK/dV kernel);
# over key tiles j:  P = exp(S_ij - LSE_i);  dP = dropout(dO_i V_j^T);  dS = P * (dP - D_i)
# (times 1 - tanh^2 under softcap);  dQ_i = scale * sum_j dS K_j
@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, mask_d, mask_dv,
    row_ok,
    lo, hi, seq_k, qk_scale, sm_scale, left, right, softcap, slope, mask_base,
    stride_mm, stride_mn, seed, bh, threshold, inv_keep,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_rows(k_ptrs, cols, seq_k, mask_d, MASKED, EVEN_D)
        v = load_rows(v_ptrs, cols, seq_k, mask_dv, MASKED, EVEN_DV)
        mvals = 0.0
        if MASK_KIND != 0:  # issued before the dot, so the load overlaps it
            col_ok = cols < seq_k
            if MASK_ROWS:
                ptrs = mask_base + offs_m[:, None] * stride_mm + cols[None, :] * stride_mn
                mvals = load_mask(ptrs, row_ok[:, None] & col_ok[None, :], MASK_KIND)
            else:
                mvals = load_mask(mask_base + cols * stride_mn, col_ok, MASK_KIND)[None, :]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s, dcap = mod_scores(
            qk, offs_m[:, None], cols[None, :], sm_scale, qk_scale, softcap, slope, mvals,
            SOFTCAP, ALIBI, MASK_KIND == 2,
        )  # fmt: skip
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            keep = keep_scores(
                offs_m[:, None], cols[None, :], seq_k, left, right, HAS_LEFT, HAS_RIGHT
            )
            p = tl.where(keep, p, 0.0)
        if MASK_KIND == 1:
            p = tl.where(mvals, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:
            keep_r = dropout_keep(seed, offs_m, start_n, bh, threshold, BLOCK_N, False)
            dp = tl.where(keep_r, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * dcap  # 1 - tanh^2
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit(do_not_specialize=_SPECIALIZE_NOT)
def _attn_bwd_dq(
    Q, K, V, O, DO, LSE, DLSE, Delta, DQ, Mask, Alibi, Seed, CuQ, CuK, SeqUsed,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah,
    n_heads, group, seq_q, seq_k, tune_len, qk_scale, sm_scale,
    left, right, softcap, threshold, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
    MASK_CONTIG: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MAY_EMPTY: tl.constexpr,
    VARLEN: tl.constexpr, SEQUSED: tl.constexpr, HAS_DLSE: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(not SEQUSED)  # KV-cache decoding is forward only
    tl.static_assert(BLOCK_D >= HEAD_DIM and BLOCK_DV >= HEAD_DIM_V)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    EVEN_DV: tl.constexpr = BLOCK_DV == HEAD_DIM_V
    n_m_tiles = tl.cdiv(seq_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m_tiles
    tile_m = pid % n_m_tiles
    if HAS_RIGHT:
        tile_m = n_m_tiles - 1 - tile_m  # longest first
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    hk = h // group
    start_m = tile_m * BLOCK_M
    q_start, seq_q = seq_bounds(CuQ, b, seq_q, VARLEN)
    k_start, seq_k = seq_bounds(CuK, b, seq_k, VARLEN)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_q
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    rows = offs_m.to(tl.int64)
    q = load_rows(
        Q + b * stride_qb + h * stride_qh + (q_start + rows)[:, None] * stride_qm + offs_d[None, :],
        offs_m, seq_q, mask_d, True, EVEN_D,
    )  # fmt: skip
    do = load_rows(
        DO + b * stride_dob + h * stride_doh + (q_start + rows)[:, None] * stride_dom
        + offs_dv[None, :],
        offs_m, seq_q, mask_dv, True, EVEN_DV,
    )  # fmt: skip
    o = load_rows(
        O + b * stride_ob + h * stride_oh + (q_start + rows)[:, None] * stride_om + offs_dv[None, :],
        offs_m, seq_q, mask_dv, True, EVEN_DV,
    )  # fmt: skip
    row_ptrs = b * stride_lb + h * stride_lh + q_start + rows  # LSE, dLSE and D: one layout
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:  # gradient flowing into the returned lse: dS gains + dLSE * P
        delta -= tl.load(DLSE + row_ptrs, mask=row_ok, other=0.0)
    tl.store(Delta + row_ptrs, delta, mask=row_ok)
    lse2 = tl.load(LSE + row_ptrs, mask=row_ok, other=0.0) * _LOG2E
    if MAY_EMPTY:  # a row that attended nothing (lse -inf): +inf makes its P zero
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    slope = 0.0
    if ALIBI:
        slope = tl.load(Alibi + b * stride_ab + h * stride_ah)
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)
    mask_base = Mask + b * stride_mb + h * stride_mh
    if MASK_CONTIG:  # a constant: Triton sees contiguous keys and vectorizes the loads
        stride_mn = 1
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = key_tile_range(
        start_m, seq_k, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    if VARLEN:  # a query tile past this sequence's end: no key tiles, every store masked
        lo, mid_lo, mid_hi, hi = empty_if(start_m >= seq_q, lo, mid_lo, mid_hi, hi)
    cols = offs_n.to(tl.int64)
    k_base = (
        K + b * stride_kb + hk * stride_kh + (k_start + cols)[:, None] * stride_kn + offs_d[None, :]
    )
    v_base = (
        V
        + b * stride_vb
        + hk * stride_vh
        + (k_start + cols)[:, None] * stride_vn
        + offs_dv[None, :]
    )
    bh32 = bh.to(tl.int32)
    for seg in tl.static_range(3):
        if seg == 0:
            seg_lo = lo
            seg_hi = mid_lo
        elif seg == 1:
            seg_lo = mid_lo
            seg_hi = mid_hi
        else:
            seg_lo = mid_hi
            seg_hi = hi
        if seg != 0 or HAS_LEFT:
            dq = _attn_bwd_dq_inner(
                dq, q, do, lse2, delta,
                k_base + seg_lo.to(tl.int64) * stride_kn, v_base + seg_lo.to(tl.int64) * stride_vn,
                stride_kn, stride_vn, offs_m, offs_n, mask_d, mask_dv, row_ok, seg_lo, seg_hi,
                seq_k, qk_scale, sm_scale, left, right, softcap, slope, mask_base, stride_mm,
                stride_mn, seed, bh32, threshold, inv_keep,
                seg != 1, HAS_LEFT, HAS_RIGHT, MASK_KIND, MASK_ROWS, SOFTCAP, ALIBI, DROPOUT,
                EVEN_D, EVEN_DV, PRECISION, BLOCK_N,
            )  # fmt: skip

    dq *= sm_scale
    dq_ptrs = (
        DQ
        + b * stride_dqb
        + h * stride_dqh
        + (q_start + rows)[:, None] * stride_dqm
        + offs_d[None, :]
    )
    if EVEN_D:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])


# For one key tile j, over query tiles i:  P = exp(S_ij - LSE_i);  dV_j += dropout(P)^T dO_i;
# dP = dropout(dO_i V_j^T);  dS = P * (dP - D_i) (* (1 - tanh^2));  dK_j += scale * dS^T Q_i
# (P^T, dS^T computed directly)
@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
    offs_n, offs_m0, mask_d, mask_dv, key_ok, lo, hi, seq_q, seq_k, qk_scale, sm_scale,
    left, right, softcap, slope, mask_base, mask_keys, stride_mm, stride_mn,
    seed, bh, threshold, inv_keep, start_n,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MAY_EMPTY: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        q = load_rows(q_ptrs, offs_m, seq_q, mask_d, MASKED, EVEN_D)
        do = load_rows(do_ptrs, offs_m, seq_q, mask_dv, MASKED, EVEN_DV)
        if MASKED:
            lse = tl.load(lse_ptrs, mask=offs_m < seq_q, other=0.0)
            delta = tl.load(delta_ptrs, mask=offs_m < seq_q, other=0.0)
        else:
            lse = tl.load(lse_ptrs)
            delta = tl.load(delta_ptrs)
        lse2 = lse * _LOG2E
        if MAY_EMPTY:
            lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        mvals = 0.0
        if MASK_KIND != 0:  # issued before the dot, so the load overlaps it
            if MASK_ROWS:
                ptrs = mask_base + offs_m[None, :] * stride_mm + offs_n[:, None] * stride_mn
                mvals = load_mask(ptrs, key_ok[:, None] & (offs_m < seq_q)[None, :], MASK_KIND)
            else:
                mvals = mask_keys  # a key-padding mask: loaded once per key tile
        qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        sT, dcapT = mod_scores(
            qkT, offs_m[None, :], offs_n[:, None], sm_scale, qk_scale, softcap, slope, mvals,
            SOFTCAP, ALIBI, MASK_KIND == 2,
        )  # fmt: skip
        pT = tl.math.exp2(sT - lse2[None, :])
        if MASKED:
            keep = keep_scores(
                offs_m[None, :], offs_n[:, None], seq_k, left, right, HAS_LEFT, HAS_RIGHT
            )
            pT = tl.where(keep & (offs_m < seq_q)[None, :], pT, 0.0)
        if MASK_KIND == 1:
            pT = tl.where(mvals, pT, 0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if DROPOUT:
            keep_r = dropout_keep(seed, offs_m, start_n, bh, threshold, BLOCK_N, True)
            dv = tl.dot(tl.where(keep_r, pT * inv_keep, 0.0).to(do.dtype), do, dv,
                        input_precision=PRECISION)  # fmt: skip
            dpT = tl.where(keep_r, dpT * inv_keep, 0.0)
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * dcapT  # 1 - tanh^2
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit(do_not_specialize=_SPECIALIZE_NOT)
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, Delta, DK, DV, Mask, Alibi, Seed, CuQ, CuK, SeqUsed,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah,
    n_heads, n_kv_heads, group, seq_q, seq_k, tune_len, qk_scale, sm_scale,
    left, right, softcap, threshold, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
    MASK_CONTIG: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MAY_EMPTY: tl.constexpr,
    VARLEN: tl.constexpr, SEQUSED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(not SEQUSED)  # KV-cache decoding is forward only
    tl.static_assert(BLOCK_D >= HEAD_DIM and BLOCK_DV >= HEAD_DIM_V)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    EVEN_DV: tl.constexpr = BLOCK_DV == HEAD_DIM_V
    n_n_tiles = tl.cdiv(seq_k, BLOCK_N)
    pid = tl.program_id(0)
    bhk = pid // n_n_tiles
    start_n = (pid % n_n_tiles) * BLOCK_N
    b = (bhk // n_kv_heads).to(tl.int64)
    hk = (bhk % n_kv_heads).to(tl.int64)
    q_start, seq_q = seq_bounds(CuQ, b, seq_q, VARLEN)
    k_start, seq_k = seq_bounds(CuK, b, seq_k, VARLEN)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    key_ok = offs_n < seq_k
    cols = offs_n.to(tl.int64)
    k = load_rows(
        K + b * stride_kb + hk * stride_kh + (k_start + cols)[:, None] * stride_kn + offs_d[None, :],
        offs_n, seq_k, mask_d, True, EVEN_D,
    )  # fmt: skip
    v = load_rows(
        V + b * stride_vb + hk * stride_vh + (k_start + cols)[:, None] * stride_vn + offs_dv[None, :],
        offs_n, seq_k, mask_dv, True, EVEN_DV,
    )  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)
    if MASK_CONTIG:  # a constant: Triton sees contiguous keys and vectorizes the loads
        stride_mn = 1

    # Query tiles: [lo, mid_lo) and [mid_hi, hi) cross a window edge, the causal diagonal or the
    # ragged end (masked); [mid_lo, mid_hi) need no position mask. Keys past seq_k are not masked
    # in the middle: they only touch rows of dK/dV that are never stored.
    lo, mid_lo, mid_hi, hi = query_tile_range(
        start_n, seq_q, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    if VARLEN:  # a key tile past this sequence's end: no query tiles, every store masked
        lo, mid_lo, mid_hi, hi = empty_if(start_n >= seq_k, lo, mid_lo, mid_hi, hi)
    for g in range(0, group):
        h = hk * group + g  # the query heads that share this key/value head
        q_base = Q + b * stride_qb + h * stride_qh + q_start * stride_qm
        do_base = DO + b * stride_dob + h * stride_doh + q_start * stride_dom
        row_base = b * stride_lb + h * stride_lh + q_start
        slope = 0.0
        if ALIBI:
            slope = tl.load(Alibi + b * stride_ab + h * stride_ah)
        mask_base = Mask + b * stride_mb + h * stride_mh
        mask_keys = key_ok[:, None]
        if MASK_KIND != 0 and not MASK_ROWS:
            mask_keys = load_mask(mask_base + offs_n * stride_mn, key_ok, MASK_KIND)[:, None]
        bh32 = (b * n_heads + h).to(tl.int32)
        for seg in tl.static_range(3):
            if seg == 0:
                seg_lo = lo
                seg_hi = mid_lo
            elif seg == 1:
                seg_lo = mid_lo
                seg_hi = mid_hi
            else:
                seg_lo = mid_hi
                seg_hi = hi
            rows = (seg_lo + offs_m0).to(tl.int64)
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v,
                q_base + rows[:, None] * stride_qm + offs_d[None, :],
                do_base + rows[:, None] * stride_dom + offs_dv[None, :],
                LSE + row_base + rows, Delta + row_base + rows, stride_qm, stride_dom,
                offs_n, offs_m0, mask_d, mask_dv, key_ok, seg_lo, seg_hi, seq_q, seq_k, qk_scale,
                sm_scale,
                left, right, softcap, slope, mask_base, mask_keys, stride_mm, stride_mn,
                seed, bh32, threshold, inv_keep, start_n,
                seg != 1, HAS_LEFT, HAS_RIGHT, MASK_KIND, MASK_ROWS, SOFTCAP, ALIBI, DROPOUT,
                MAY_EMPTY, EVEN_D, EVEN_DV, PRECISION, BLOCK_M, BLOCK_N,
            )  # fmt: skip

    dk *= sm_scale
    dk_ptrs = (
        DK
        + b * stride_dkb
        + hk * stride_dkh
        + (k_start + cols)[:, None] * stride_dkn
        + offs_d[None, :]
    )
    dv_ptrs = (
        DV
        + b * stride_dvb
        + hk * stride_dvh
        + (k_start + cols)[:, None] * stride_dvn
        + offs_dv[None, :]
    )
    if EVEN_D:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    else:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_ok[:, None] & mask_d[None, :])
    if EVEN_DV:
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])
    else:
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None] & mask_dv[None, :])


_attn_bwd_dq_tuned = make_autotune(_attn_bwd_dq, DQ_SHAPES, _dq_footprint)
_attn_bwd_dkdv_tuned = make_autotune(_attn_bwd_dkdv, DKDV_SHAPES, _dkdv_footprint)
_launch_dq = LaunchCache(_attn_bwd_dq_tuned, n_tensors=15)
_launch_dkdv = LaunchCache(_attn_bwd_dkdv_tuned, n_tensors=14)


_PLANS: dict[tuple, tuple[Plan, Plan]] = {}  # shapes, strides, flags, scalars -> (dQ, dK/dV)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    scale: float,
    ex: Extras,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the two backward kernels on 4-D views; ``lse``/``dlse`` are contiguous (B, H, L)
    ((1, H, total) for a packed batch).

    The last dimension of every 4-D tensor must be contiguous (stride 1). Everything the launch
    key determines (strides, lengths, grids, constexprs) is computed on the key's first call only.
    """
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    if ex.varlen:
        dk.zero_()  # keys of no sequence (none in a well-formed packed batch) get no gradient
        dv.zero_()
    delta = torch.empty_like(lse)
    precision = dot_precision(q.dtype)
    tensors, runtime, flags = kernel_extras(ex, q)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(),
           dout.stride(), q.dtype, precision, flags, tuple([t.dtype for t in tensors]), problem_dims(q, k, ex),
           runtime, dlse is None)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(
            dout, q, k, v, out, dq, dk, dv, dlse is not None, ex, runtime, flags, precision
        )
        remember(_PLANS, key, plan)
    plan_dq, plan_dkdv = plan
    tail = (scale * LOG2E, scale, *runtime[6:])
    _launch_dq(
        plan_dq,
        plan_dq.grid,
        (q, k, v, out, dout, lse, lse if dlse is None else dlse, delta, dq, *tensors,
         *plan_dq.ints, *tail),
        plan_dq.constexprs,
    )  # fmt: skip
    _launch_dkdv(
        plan_dkdv,
        plan_dkdv.grid,
        (q, k, v, dout, lse, delta, dk, dv, *tensors, *plan_dkdv.ints, *tail),
        plan_dkdv.constexprs,
    )
    return dq, dk, dv


def _plan(dout, q, k, v, out, dq, dk, dv, has_dlse, ex, runtime, flags, precision):
    n_heads, head_dim, n_kv_heads, dim_v = q.shape[1], q.shape[3], k.shape[1], v.shape[3]
    batch, seq_q, seq_k, lse_strides = problem_dims(q, k, ex)
    qs, ks, vs, os_, dos, dqs, dks, dvs = (
        batch_strides(t, ex) for t in (q, k, v, out, dout, dq, dk, dv)
    )
    group = n_heads // n_kv_heads
    tl_len = tune_len(seq_q, seq_k)
    block_d, block_dv = next_pow2(head_dim), next_pow2(dim_v)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "HEAD_DIM_V": dim_v,
                  "BLOCK_DV": block_dv, **flags._asdict(), "PRECISION": precision}  # fmt: skip
    tile = (q, max(head_dim, dim_v), max(block_d, block_dv), precision, flags, max(seq_q, seq_k))
    dq_ints = (*qs, *ks, *vs, *os_, *dos, *dqs, *lse_strides, *runtime[:6],
               n_heads, group, seq_q, seq_k, tl_len)  # fmt: skip
    dkdv_ints = (*qs, *ks, *vs, *dos, *dks, *dvs, *lse_strides, *runtime[:6],
                 n_heads, n_kv_heads, group, seq_q, seq_k, tl_len)  # fmt: skip
    return (
        Plan(
            lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * n_heads,),
            dq_ints,
            {
                **constexprs,
                "HAS_DLSE": has_dlse,
                **plan_tile("dq", *tile, DQ_SHAPES, _dq_footprint),
            },
        ),
        Plan(
            lambda meta: (triton.cdiv(seq_k, meta["BLOCK_N"]) * batch * n_kv_heads,),
            dkdv_ints,
            {**constexprs, **plan_tile("dkdv", *tile, DKDV_SHAPES, _dkdv_footprint)},
        ),
    )
