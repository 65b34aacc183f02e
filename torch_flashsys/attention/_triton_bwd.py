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
from torch import Tensor

import torch_flashsys.attention._precompile as _precompile
import torch_flashsys.attention._sm90 as _sm90
from torch_flashsys.attention._extras import CAUSAL, PLAIN, Extras
from torch_flashsys.attention._kernel_config import dim_class, fits, tile_meta
from torch_flashsys.attention._kernel_config import sm_count as _sm_count
from torch_flashsys.attention._launch import (
    LaunchCache,
    Plan,
    compile_together,
    dot_precision,
    remember,
)
from torch_flashsys.attention._triton_common import (
    AUTOTUNE,
    LOG2E,
    batch_strides,
    check_blocks,
    dropout_keep,
    empty_if,
    head_scalars,
    keep_scores,
    kernel_constexprs,
    kernel_extras,
    key_tile_range,
    load_rows,
    make_autotune,
    mask_tile,
    mod_scores,
    next_pow2,
    plan_tile,
    problem_dims,
    program_scalars,
    program_setup,
    query_tile_range,
    segment,
    store_rows,
    tile_ptrs,
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
# Few query rows over many keys (cross-attention: latents, a short decoder over a long input):
# the dK/dV kernel's programs would each loop over a handful of query tiles. Where one program
# can hold every query row of its head (KV_GRADS_TILES' rows: 256 at head dims <= 64, 128 up to
# 128), one query head per key head, no dropout, mask or window, at least KV_GRADS_MIN_KEYS
# keys per query row and enough heads to fill the GPU (batch x heads >= KV_GRADS_MIN_FILL x its
# SMs: one program per head), the dQ kernel computes each key tile's dK and dV too (KV_GRADS)
# and the dK/dV kernel does not run. H100, 2026-11-27 (``gpu_checks/cross_shapes.py``, GPU
# time of a fwd+bwd): 0.65-0.89x cuDNN's where the two kernels took 1.00-1.27x it; with 16
# heads in all (2 x 8) 2-3x slower than the two kernels. Tiles per (head-dim class, query rows):
# (BLOCK_M, BLOCK_N, warps, stages); 16-bit inputs (float32 takes the two kernels).
KV_GRADS_MAX_Q = 256
KV_GRADS_MIN_KEYS = 4
KV_GRADS_MIN_FILL = 0.75
KV_GRADS_TILES = {
    (64, 64): (64, 64, 4, 3), (64, 128): (128, 64, 8, 3), (64, 256): (256, 64, 8, 3),
    (128, 64): (64, 64, 4, 3), (128, 128): (128, 32, 8, 3),
}  # fmt: skip
_KV_GRADS_INTERPRETER_N = 16  # the interpreter's key tile (its query tile covers the rows)
# Head dims (the larger of query/key's and value's) from which the dK/dV kernel runs SPLIT: two
# programs per key tile, one accumulating dK and one dV, so each holds one (BLOCK_N, head dim)
# float32 accumulator instead of two (S is computed by both, each loads Q and dO). H100
# (``tune_attention.py --kernels dkdv,dkdv_split``, each kernel alone, the same bits): head dim
# 256 0.51-0.64x the unsplit kernel's time (its best tile 32 x 128 x 8 warps x 3 stages, where
# the unsplit kernel's 128-key tiles spill); head dim 128 1.17-1.8x, so from 129.
DKDV_SPLIT_MIN_DIM = 129


def dkdv_split(head_dim: int, dim_v: int) -> bool:
    """Whether the dK/dV kernel runs SPLIT for these head dims (``DKDV_SPLIT_MIN_DIM``)."""
    return max(head_dim, dim_v) >= DKDV_SPLIT_MIN_DIM


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
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, strides, offs_m, offs_n, dmasks, row_ok, lo, hi,
    seq_k, mods, window, mask, drop, kv_out,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, MAY_EMPTY: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr, KV_GRADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key tiles [lo, hi) into dq; the bundles as in ``_attn_fwd_inner``. ``KV_GRADS`` (every
    query row of the head in this program, no dropout): each key tile's dK and dV too, stored
    at ``kv_out``'s (dK pointers, dV pointers, their row strides)."""
    stride_kn, stride_vn = strides
    mask_d, mask_dv = dmasks
    dk_ptrs, dv_ptrs, stride_dkn, stride_dvn = kv_out
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_rows(k_ptrs, cols, seq_k, mask_d, MASKED, EVEN_D)
        v = load_rows(v_ptrs, cols, seq_k, mask_dv, MASKED, EVEN_DV)
        mvals = mask_tile(  # issued before the dot, so the load overlaps it
            mask, offs_m, cols, row_ok, cols < seq_k, MASK_KIND, MASK_ROWS, False
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s, dcap = mod_scores(
            qk, offs_m[:, None], cols[None, :], mods, mvals, SOFTCAP, ALIBI, MASK_KIND == 2
        )  # fmt: skip
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            keep = keep_scores(offs_m[:, None], cols[None, :], seq_k, window, HAS_LEFT, HAS_RIGHT)
            p = tl.where(keep, p, 0.0)
        if MASK_KIND == 1:
            p = tl.where(mvals, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:
            keep_r = dropout_keep(drop, offs_m, start_n, BLOCK_N, False)
            dp = tl.where(keep_r, dp * drop[3], 0.0)  # drop[3]: 1 / keep probability
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * dcap  # 1 - tanh^2
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        if KV_GRADS:  # this key tile's whole dV = P^T dO and dK = scale * dS^T Q
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION) * mods[1]
            store_rows(dk_ptrs, dk, cols < seq_k, mask_d, EVEN_D)
            store_rows(dv_ptrs, dv, cols < seq_k, mask_dv, EVEN_DV)
            dk_ptrs += BLOCK_N * stride_dkn
            dv_ptrs += BLOCK_N * stride_dvn
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit(do_not_specialize=_SPECIALIZE_NOT)
def _attn_bwd_dq(
    Q, K, V, O, DO, LSE, DLSE, Delta, DQ, DK, DV, Mask, Alibi, Seed, CuQ, CuK, SeqUsed,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah,
    n_heads, group, seq_q, seq_k, tune_len, qk_scale, sm_scale,
    left, right, softcap, threshold, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
    MASK_CONTIG: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MAY_EMPTY: tl.constexpr,
    VARLEN: tl.constexpr, SEQUSED: tl.constexpr, HAS_DLSE: tl.constexpr,
    PRECISION: tl.constexpr, KV_GRADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(not SEQUSED)  # KV-cache decoding is forward only
    # KV_GRADS: one program holds every query row of its head (the caller's rule: seq_q <=
    # BLOCK_M, one query head per key head), so each key tile's dK and dV are whole here
    tl.static_assert(not (KV_GRADS and (DROPOUT or VARLEN or HAS_LEFT or HAS_RIGHT)))
    check_blocks(HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    EVEN_DV: tl.constexpr = BLOCK_DV == HEAD_DIM_V
    # Setup: this program's query tile (causal: longest first), its Q, dO, D and LSE rows.
    bh, b, h, start_m, q_start, seq_q, k_start, seq_k = program_setup(
        CuQ, CuK, seq_q, seq_k, n_heads, BLOCK_M, False, HAS_RIGHT, VARLEN
    )
    hk = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_q
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    rows = q_start + offs_m.to(tl.int64)
    q = load_rows(tile_ptrs(Q, b, h, stride_qb, stride_qh, rows, stride_qm, offs_d),
                  offs_m, seq_q, mask_d, True, EVEN_D)  # fmt: skip
    do = load_rows(tile_ptrs(DO, b, h, stride_dob, stride_doh, rows, stride_dom, offs_dv),
                   offs_m, seq_q, mask_dv, True, EVEN_DV)  # fmt: skip
    o = load_rows(tile_ptrs(O, b, h, stride_ob, stride_oh, rows, stride_om, offs_dv),
                  offs_m, seq_q, mask_dv, True, EVEN_DV)  # fmt: skip
    row_ptrs = b * stride_lb + h * stride_lh + rows  # LSE, dLSE and D: one layout
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:  # gradient flowing into the returned lse: dS gains + dLSE * P
        delta -= tl.load(DLSE + row_ptrs, mask=row_ok, other=0.0)
    tl.store(Delta + row_ptrs, delta, mask=row_ok)
    lse2 = tl.load(LSE + row_ptrs, mask=row_ok, other=0.0) * _LOG2E
    if MAY_EMPTY:  # a row that attended nothing (lse -inf): +inf makes its P zero
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    slope, mask_base = head_scalars(
        Alibi, Mask, b, h, stride_ab, stride_ah, stride_mb, stride_mh, ALIBI
    )
    seed, stride_mn = program_scalars(Seed, stride_mn, DROPOUT, MASK_CONTIG)
    mask = (mask_base, stride_mm, stride_mn)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = key_tile_range(
        start_m, seq_k, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    if VARLEN:  # a query tile past this sequence's end: no key tiles, every store masked
        lo, mid_lo, mid_hi, hi = empty_if(start_m >= seq_q, lo, mid_lo, mid_hi, hi)
    cols = k_start + offs_n.to(tl.int64)
    k_base = tile_ptrs(K, b, hk, stride_kb, stride_kh, cols, stride_kn, offs_d)
    v_base = tile_ptrs(V, b, hk, stride_vb, stride_vh, cols, stride_vn, offs_dv)
    mods = (qk_scale, sm_scale, softcap, slope)
    drop = (seed, bh.to(tl.int32), threshold, inv_keep)
    dk_base = tile_ptrs(DK, b, hk, stride_dkb, stride_dkh, cols, stride_dkn, offs_d)
    dv_base = tile_ptrs(DV, b, hk, stride_dvb, stride_dvh, cols, stride_dvn, offs_dv)
    # Loop: the key tiles in three segments (as the forward).
    for seg in tl.static_range(3):
        seg_lo, seg_hi = segment(seg, lo, mid_lo, mid_hi, hi)
        if seg != 0 or HAS_LEFT:
            dq = _attn_bwd_dq_inner(
                dq, q, do, lse2, delta,
                k_base + seg_lo.to(tl.int64) * stride_kn, v_base + seg_lo.to(tl.int64) * stride_vn,
                (stride_kn, stride_vn), offs_m, offs_n, (mask_d, mask_dv), row_ok, seg_lo, seg_hi,
                seq_k, mods, (left, right), mask, drop,
                (dk_base + seg_lo.to(tl.int64) * stride_dkn,
                 dv_base + seg_lo.to(tl.int64) * stride_dvn, stride_dkn, stride_dvn),
                seg != 1, HAS_LEFT, HAS_RIGHT, MASK_KIND, MASK_ROWS, SOFTCAP, ALIBI, DROPOUT,
                MAY_EMPTY, EVEN_D, EVEN_DV, PRECISION, KV_GRADS, BLOCK_N,
            )  # fmt: skip
    # Epilogue: dQ = scale * sum_j dS K_j.
    dq *= sm_scale
    store_rows(tile_ptrs(DQ, b, h, stride_dqb, stride_dqh, rows, stride_dqm, offs_d), dq, row_ok,
               mask_d, EVEN_D)  # fmt: skip


# For one key tile j, over query tiles i:  P = exp(S_ij - LSE_i);  dV_j += dropout(P)^T dO_i;
# dP = dropout(dO_i V_j^T);  dS = P * (dP - D_i) (* (1 - tanh^2));  dK_j += scale * dS^T Q_i
# (P^T, dS^T computed directly)
@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, strides, offs_n, offs_m0, dmasks,
    key_ok, lo, hi, seq_q, seq_k, mods, window, mask, mask_keys, drop, start_n,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, MAY_EMPTY: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr, PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Query tiles [lo, hi) into (dk, dv); strides are Q's and dO's row strides, mask_keys a
    key-padding mask loaded once per key tile; the other bundles as in ``_attn_bwd_dq_inner``.
    PARTS: 3 both, 1 dK only, 2 dV only (``v`` unused)."""
    stride_qm, stride_dom = strides
    mask_d, mask_dv = dmasks
    inv_keep = drop[3]  # 1 / keep probability
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
        mvals = mask_keys  # a key-padding mask: loaded once per key tile
        if MASK_ROWS:  # issued before the dot, so the load overlaps it
            mvals = mask_tile(
                mask, offs_m, offs_n, offs_m < seq_q, key_ok, MASK_KIND, MASK_ROWS, True
            )  # fmt: skip
        qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        sT, dcapT = mod_scores(
            qkT, offs_m[None, :], offs_n[:, None], mods, mvals, SOFTCAP, ALIBI, MASK_KIND == 2
        )  # fmt: skip
        pT = tl.math.exp2(sT - lse2[None, :])
        if MASKED:
            keep = keep_scores(offs_m[None, :], offs_n[:, None], seq_k, window, HAS_LEFT, HAS_RIGHT)
            pT = tl.where(keep & (offs_m < seq_q)[None, :], pT, 0.0)
        if MASK_KIND == 1:
            pT = tl.where(mvals, pT, 0.0)
        if PARTS != 2:
            dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if DROPOUT:
            keep_r = dropout_keep(drop, offs_m, start_n, BLOCK_N, True)
            if PARTS != 1:
                dv = tl.dot(tl.where(keep_r, pT * inv_keep, 0.0).to(do.dtype), do, dv,
                            input_precision=PRECISION)  # fmt: skip
            if PARTS != 2:
                dpT = tl.where(keep_r, dpT * inv_keep, 0.0)
        elif PARTS != 1:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        if PARTS != 2:
            dsT = pT * (dpT - delta[None, :])
            if SOFTCAP:
                dsT = dsT * dcapT  # 1 - tanh^2
            dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_heads(
    dk, dv, k, v, head, strides, scalars, tile,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
    MASK_ROWS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    MAY_EMPTY: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The query heads that share key/value head ``hk``, each in three segments of query tiles,
    into (dk, dv) (``PARTS`` as in :func:`_attn_bwd_dkdv_inner`)."""
    Q, DO, LSE, Delta, Mask, Alibi, b, hk, group, n_heads, q_start, seq_q, seq_k = head
    (stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom, stride_lb, stride_lh,
     stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah) = strides  # fmt: skip
    qk_scale, sm_scale, left, right, softcap, seed, threshold, inv_keep = scalars
    (offs_n, offs_m0, offs_d, offs_dv, mask_d, mask_dv, key_ok, start_n,
     lo, mid_lo, mid_hi, hi) = tile  # fmt: skip
    for g in range(0, group):
        h = hk * group + g
        q_base = Q + b * stride_qb + h * stride_qh + q_start * stride_qm
        do_base = DO + b * stride_dob + h * stride_doh + q_start * stride_dom
        row_base = b * stride_lb + h * stride_lh + q_start
        slope, mask_base = head_scalars(
            Alibi, Mask, b, h, stride_ab, stride_ah, stride_mb, stride_mh, ALIBI
        )
        mask = (mask_base, stride_mm, stride_mn)
        mask_keys = key_ok[:, None]
        if not MASK_ROWS:
            mask_keys = mask_tile(mask, offs_m0, offs_n, offs_m0 < seq_q, key_ok, MASK_KIND, False,
                                  True)  # fmt: skip
        mods = (qk_scale, sm_scale, softcap, slope)
        drop = (seed, (b * n_heads + h).to(tl.int32), threshold, inv_keep)
        for seg in tl.static_range(3):
            seg_lo, seg_hi = segment(seg, lo, mid_lo, mid_hi, hi)
            rows = (seg_lo + offs_m0).to(tl.int64)
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v,
                q_base + rows[:, None] * stride_qm + offs_d[None, :],
                do_base + rows[:, None] * stride_dom + offs_dv[None, :],
                LSE + row_base + rows, Delta + row_base + rows, (stride_qm, stride_dom),
                offs_n, offs_m0, (mask_d, mask_dv), key_ok, seg_lo, seg_hi, seq_q, seq_k, mods,
                (left, right), mask, mask_keys, drop, start_n,
                seg != 1, HAS_LEFT, HAS_RIGHT, MASK_KIND, MASK_ROWS, SOFTCAP, ALIBI, DROPOUT,
                MAY_EMPTY, EVEN_D, EVEN_DV, PRECISION, PARTS, BLOCK_M, BLOCK_N,
            )  # fmt: skip
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
    VARLEN: tl.constexpr, SEQUSED: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(not SEQUSED)  # KV-cache decoding is forward only
    check_blocks(HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    EVEN_DV: tl.constexpr = BLOCK_DV == HEAD_DIM_V
    # Setup: this program's key tile of one key/value head; its K and V stay resident. SPLIT:
    # two programs per key tile (heads counted twice, adjacent), one computing dK, the other dV,
    # each holding one accumulator instead of two (wide head dims: fewer registers per program).
    _bhk, b, hk, start_n, q_start, seq_q, k_start, seq_k = program_setup(
        CuQ, CuK, seq_q, seq_k, n_kv_heads * (2 if SPLIT else 1), BLOCK_N, True, False, VARLEN
    )
    if SPLIT:
        part = hk % 2
        hk = hk // 2
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    key_ok = offs_n < seq_k
    cols = k_start + offs_n.to(tl.int64)
    k = load_rows(tile_ptrs(K, b, hk, stride_kb, stride_kh, cols, stride_kn, offs_d),
                  offs_n, seq_k, mask_d, True, EVEN_D)  # fmt: skip
    if not SPLIT:
        v = load_rows(tile_ptrs(V, b, hk, stride_vb, stride_vh, cols, stride_vn, offs_dv),
                      offs_n, seq_k, mask_dv, True, EVEN_DV)  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    seed, stride_mn = program_scalars(Seed, stride_mn, DROPOUT, MASK_CONTIG)
    # Query tiles: [lo, mid_lo) and [mid_hi, hi) cross a window edge, the causal diagonal or the
    # ragged end (masked); [mid_lo, mid_hi) need no position mask. Keys past seq_k are not masked
    # in the middle: they only touch rows of dK/dV that are never stored.
    lo, mid_lo, mid_hi, hi = query_tile_range(
        start_n, seq_q, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    if VARLEN:  # a key tile past this sequence's end: no query tiles, every store masked
        lo, mid_lo, mid_hi, hi = empty_if(start_n >= seq_k, lo, mid_lo, mid_hi, hi)
    head = (Q, DO, LSE, Delta, Mask, Alibi, b, hk, group, n_heads, q_start, seq_q, seq_k)
    strides = (stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom, stride_lb,
               stride_lh, stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah)  # fmt: skip
    scalars = (qk_scale, sm_scale, left, right, softcap, seed, threshold, inv_keep)
    tile = (offs_n, offs_m0, offs_d, offs_dv, mask_d, mask_dv, key_ok, start_n,
            lo, mid_lo, mid_hi, hi)  # fmt: skip
    if not SPLIT:
        dk, dv = _attn_bwd_dkdv_heads(
            dk, dv, k, v, head, strides, scalars, tile, HAS_LEFT, HAS_RIGHT, MASK_KIND,
            MASK_ROWS, SOFTCAP, ALIBI, DROPOUT, MAY_EMPTY, EVEN_D, EVEN_DV, PRECISION, 3,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip
        # Epilogue: dK = scale * sum dS^T Q, dV.
        dk *= sm_scale
        dk_ptrs = tile_ptrs(DK, b, hk, stride_dkb, stride_dkh, cols, stride_dkn, offs_d)
        dv_ptrs = tile_ptrs(DV, b, hk, stride_dvb, stride_dvh, cols, stride_dvn, offs_dv)
        store_rows(dk_ptrs, dk, key_ok, mask_d, EVEN_D)
        store_rows(dv_ptrs, dv, key_ok, mask_dv, EVEN_DV)
    elif part == 0:  # SPLIT's dK program
        v = load_rows(tile_ptrs(V, b, hk, stride_vb, stride_vh, cols, stride_vn, offs_dv),
                      offs_n, seq_k, mask_dv, True, EVEN_DV)  # fmt: skip
        dk, dv = _attn_bwd_dkdv_heads(
            dk, dv, k, v, head, strides, scalars, tile, HAS_LEFT, HAS_RIGHT, MASK_KIND,
            MASK_ROWS, SOFTCAP, ALIBI, DROPOUT, MAY_EMPTY, EVEN_D, EVEN_DV, PRECISION, 1,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip
        dk *= sm_scale
        dk_ptrs = tile_ptrs(DK, b, hk, stride_dkb, stride_dkh, cols, stride_dkn, offs_d)
        store_rows(dk_ptrs, dk, key_ok, mask_d, EVEN_D)
    else:  # SPLIT's dV program (V unused)
        dk, dv = _attn_bwd_dkdv_heads(
            dk, dv, k, k, head, strides, scalars, tile, HAS_LEFT, HAS_RIGHT, MASK_KIND,
            MASK_ROWS, SOFTCAP, ALIBI, DROPOUT, MAY_EMPTY, EVEN_D, EVEN_DV, PRECISION, 2,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip
        dv_ptrs = tile_ptrs(DV, b, hk, stride_dvb, stride_dvh, cols, stride_dvn, offs_dv)
        store_rows(dv_ptrs, dv, key_ok, mask_dv, EVEN_DV)


_attn_bwd_dq_tuned = make_autotune(_attn_bwd_dq, DQ_SHAPES, _dq_footprint)
_attn_bwd_dkdv_tuned = make_autotune(_attn_bwd_dkdv, DKDV_SHAPES, _dkdv_footprint)
_launch_dq = LaunchCache(_attn_bwd_dq_tuned, n_tensors=17)
_launch_dkdv = LaunchCache(_attn_bwd_dkdv_tuned, n_tensors=14)


_PLANS: dict[tuple, tuple[Plan, Plan]] = {}  # shapes, strides, flags, scalars -> (dQ, dK/dV)


def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
    scale: float, ex: Extras,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Launch the two backward kernels on 4-D views; ``lse``/``dlse`` are contiguous (B, H, L)
    ((1, H, total) for a packed batch).

    The last dimension of every 4-D tensor must be contiguous (stride 1). Everything the launch
    key determines (strides, lengths, grids, constexprs) is computed on the key's first call only.
    """
    kept = _sm90.kept_backward(dout, q, k, v, out, lse, dlse, scale, ex) if q.numel() else None
    if kept is not None:  # Hopper: the fused kernel, a key that ran before (no rules' work)
        return _sm90.backward(dout, q, k, v, out, lse, dlse, scale, ex is CAUSAL, kept=kept)
    if q.numel() and _sm90.fused_takes(q, k, v, dout, scale, ex):  # Hopper: the fused kernel
        planned = _sm90.planned
        grads = _sm90.backward(dout, q, k, v, out, lse, dlse, scale, ex is CAUSAL)
        if _sm90.planned != planned:  # a new launch key: maybe a new kind of problem
            _precompile_builds(dout, q, k, v, out, lse, dlse, scale, ex)
        return grads
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    if ex.varlen:
        dk.zero_()  # keys of no sequence (none in a well-formed packed batch) get no gradient
        dv.zero_()
    delta = torch.empty_like(lse)
    first, launches = backward_launches(dout, q, k, v, out, lse, dlse, scale, ex, dq, dk, dv, delta)
    hopper = len(launches) == 2 and _sm90.backward_takes(q, k, v, dout, scale, ex)
    if hopper:  # dK/dV on the Hopper kernel, after the dQ kernel has stored D
        launches = launches[:1]
    if first and q.is_cuda:  # a new key: compile both kernels at once (if not compiled yet)
        with torch.cuda.device(q.device):
            compile_together([(c, plan.grid, args, plan.constexprs) for c, plan, args in launches])
    for cache, plan, args in launches:
        cache(plan, plan.grid, args, plan.constexprs)
    if hopper:
        _sm90.backward_dkdv(q, k, v, dout, lse, delta, dk, dv, scale, ex is CAUSAL)
    if first and q.is_cuda:
        _precompile_builds(dout, q, k, v, out, lse, dlse, scale, ex)
    return dq, dk, dv


def _precompile_builds(dout, q, k, v, out, lse, dlse, scale, ex) -> None:
    """After a new launch key: on the first one of its kind of problem, queue the backward builds
    its other lengths take for the background (``_precompile``)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    kind = "causal" if ex is CAUSAL else "plain" if ex is PLAIN else kernel_extras(ex, q)[2]
    family = ("backward", q.dtype, q.shape[-1], v.shape[-1], q.shape[1] // k.shape[1], kind,
              dlse is None, deterministic, dot_precision(q.dtype), q.get_device())  # fmt: skip
    if _precompile.first(family):
        _precompile.submit(backward_builds(dout, q, k, v, out, lse, dlse, scale, ex,
                                           deterministic))  # fmt: skip


def backward_builds(dout, q, k, v, out, lse, dlse, scale, ex, deterministic: bool) -> list:
    """Every build the backward of this kind of problem compiles at some length
    (``_sm90.rule_lengths``), as background compile jobs with stand-in arguments: the portable
    kernels' tiles where the portable backward runs, and the Hopper fused backward's builds where
    it does."""
    fused = False
    tiles: dict[str, tuple] = {}
    precision = dot_precision(q.dtype)
    tensors, runtime, flags = kernel_extras(ex, q)
    for n in _sm90.rule_lengths():
        if _sm90.fused_rule(_sm90.with_length(q, n), _sm90.with_length(k, n), ex, deterministic):
            fused = True
            continue
        plans = _plan(dout, q, k, v, out, q, k, v, dlse is not None, ex, runtime, flags,
                      precision, tile_len=n)  # fmt: skip
        tiles.setdefault(repr([p.constexprs for p in plans if p is not None]), plans)
    index, mock = q.get_device(), _precompile.stand_in
    tail = (scale * LOG2E, scale, *runtime[6:])
    rows = lse if dlse is None else dlse
    jobs = []
    for plan_dq, plan_dkdv in tiles.values():
        dq_args = (q, k, v, out, dout, lse, rows, lse, q, k, v, *tensors, *plan_dq.ints, *tail)
        jobs.append(_precompile.Job(_launch_dq.kernel, tuple(map(mock, dq_args)),
                                    plan_dq.constexprs, index))  # fmt: skip
        if plan_dkdv is not None:
            dkdv_args = (q, k, v, dout, lse, lse, k, v, *tensors, *plan_dkdv.ints, *tail)
            jobs.append(_precompile.Job(_launch_dkdv.kernel, tuple(map(mock, dkdv_args)),
                                        plan_dkdv.constexprs, index))  # fmt: skip
    if fused and _sm90.fused_fits(q, k, v, dout, scale, ex):
        jobs += _sm90.fused_builds(q, k, v, dout, out, lse, dlse, scale, ex is CAUSAL,
                                   deterministic)  # fmt: skip
    return jobs


def backward_launches(dout, q, k, v, out, lse, dlse, scale, ex, dq, dk, dv, delta):
    """``(new key?, [(launch cache, plan, args)])``: the dQ and dK/dV launches of a backward,
    their plan made on the key's first call."""
    precision = dot_precision(q.dtype)
    tensors, runtime, flags = kernel_extras(ex, q)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(),
           dout.stride(), q.dtype, precision, flags, tuple([t.dtype for t in tensors]), problem_dims(q, k, ex),
           runtime, dlse is None)  # fmt: skip
    plan = _PLANS.get(key)
    first = plan is None
    if first:
        plan = _plan(
            dout, q, k, v, out, dq, dk, dv, dlse is not None, ex, runtime, flags, precision
        )
        remember(_PLANS, key, plan)
    plan_dq, plan_dkdv = plan
    tail = (scale * LOG2E, scale, *runtime[6:])
    dq_args = (q, k, v, out, dout, lse, lse if dlse is None else dlse, delta, dq, dk, dv,
               *tensors, *plan_dq.ints, *tail)  # fmt: skip
    if plan_dkdv is None:  # the dQ kernel computes dK and dV too
        return first, [(_launch_dq, plan_dq, dq_args)]
    dkdv_args = (q, k, v, dout, lse, delta, dk, dv, *tensors, *plan_dkdv.ints, *tail)
    return first, [(_launch_dq, plan_dq, dq_args), (_launch_dkdv, plan_dkdv, dkdv_args)]


def kv_grads_tile(q: Tensor, v: Tensor, ex: Extras, n_heads: int, n_kv_heads: int, seq_q: int,
                  seq_k: int) -> tuple[int, int, int, int] | None:  # fmt: skip
    """The dQ kernel's tile when it also computes dK and dV (KV_GRADS: see KV_GRADS_MAX_Q),
    else None: a plain problem (no mask, dropout, window or causal mask), one query head per key
    head, 16-bit inputs, at most KV_GRADS_MAX_Q query rows (and a tile that holds them), at
    least KV_GRADS_MIN_KEYS keys per row, batch x heads >= KV_GRADS_MIN_FILL x the SMs, the
    tile's shared memory estimate within the GPU's; never under the opt-in autotuner (whose
    tiles may not cover the rows)."""
    if ex is not PLAIN or n_heads != n_kv_heads or q.element_size() != 2 or AUTOTUNE:
        return None
    if not 0 < seq_q <= KV_GRADS_MAX_Q or seq_k < KV_GRADS_MIN_KEYS * seq_q:
        return None
    rows = max(64, next_pow2(seq_q))
    if not q.is_cuda:  # the interpreter: the rows in one tile, a small key tile
        return (rows, _KV_GRADS_INTERPRETER_N, 4, 1)
    index = q.get_device()
    if q.shape[0] * n_heads < KV_GRADS_MIN_FILL * _sm_count(index):
        return None
    tile = KV_GRADS_TILES.get((dim_class(max(q.shape[-1], v.shape[-1])), rows))
    if tile is None:
        return None
    # The tiles were measured on an H100; a GPU with less shared memory per block takes the two
    # kernels where the estimate (as pick_tile's, a quarter spare) does not fit.
    block_d = max(next_pow2(q.shape[-1]), next_pow2(v.shape[-1]))
    return tile if fits(tile, block_d, q.element_size(), _dq_footprint, index) else None


def _plan(dout, q, k, v, out, dq, dk, dv, has_dlse, ex, runtime, flags, precision,
          tile_len: int | None = None):  # fmt: skip
    """The dQ and dK/dV plans of a new launch key (``tile_len``: the length whose tile to take,
    else the problem's own); the dK/dV plan None where the dQ kernel computes dK and dV
    (:func:`kv_grads_tile`)."""
    n_heads, head_dim, n_kv_heads, dim_v = q.shape[1], q.shape[3], k.shape[1], v.shape[3]
    batch, seq_q, seq_k, lse_strides = problem_dims(q, k, ex)
    qs, ks, vs, os_, dos, dqs, dks, dvs = (
        batch_strides(t, ex) for t in (q, k, v, out, dout, dq, dk, dv)
    )
    group = n_heads // n_kv_heads
    tl_len = tune_len(seq_q, seq_k)
    constexprs = kernel_constexprs(head_dim, dim_v, precision, flags._asdict())
    tile = (q, constexprs, flags, tile_len or max(seq_q, seq_k))
    dq_ints = (*qs, *ks, *vs, *os_, *dos, *dqs, *dks, *dvs, *lse_strides, *runtime[:6],
               n_heads, group, seq_q, seq_k, tl_len)  # fmt: skip
    dkdv_ints = (*qs, *ks, *vs, *dos, *dks, *dvs, *lse_strides, *runtime[:6],
                 n_heads, n_kv_heads, group, seq_q, seq_k, tl_len)  # fmt: skip
    kv_tile = kv_grads_tile(q, v, ex, n_heads, n_kv_heads, seq_q, seq_k)
    dq_tile = tile_meta(kv_tile) if kv_tile else plan_tile("dq", *tile, DQ_SHAPES, _dq_footprint)
    plan_dq = Plan(
        lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * n_heads,),
        dq_ints,
        {**constexprs, "HAS_DLSE": has_dlse, "KV_GRADS": kv_tile is not None, **dq_tile},
    )
    if kv_tile:
        return plan_dq, None
    split = dkdv_split(head_dim, dim_v)
    parts = 2 if split else 1
    return (
        plan_dq,
        Plan(
            lambda meta: (triton.cdiv(seq_k, meta["BLOCK_N"]) * batch * n_kv_heads * parts,),
            dkdv_ints,
            {
                **constexprs,
                "SPLIT": split,
                **plan_tile("dkdv", *tile, DKDV_SHAPES, _dkdv_footprint),
            },
        ),
    )
