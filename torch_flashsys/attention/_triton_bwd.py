"""FlashAttention-2 backward in Triton (FA2 Algorithm 2, eqs. 13-19), deterministic: no atomics.

Two launches. The dQ kernel runs over query tiles: it first computes ``D = rowsum(dO * O)`` for its
rows (the FA2 "preprocess", fused here: it needs the same dO tile), stores D, and accumulates dQ.
The dK/dV kernel then runs over key tiles, reading D; it loops over the query heads of a GQA group,
so the group sum needs no atomics. Probabilities are recomputed from the saved logsumexp,
``P = exp(S - LSE)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_flashsys.attention._launch import LaunchCache, dot_precision
from torch_flashsys.attention._triton_common import (
    LOG2E,
    keep_scores,
    load_rows,
    make_autotune,
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


def _dkdv_footprint(block_m: int, block_n: int, block_d: int, stages: int) -> int:
    return block_d * (2 * block_n + stages * 2 * block_m)  # resident K, V; pipelined Q, dO


def _dq_footprint(block_m: int, block_n: int, block_d: int, stages: int) -> int:
    return block_d * (3 * block_m + stages * 2 * block_n)  # resident Q, dO (O once); pipelined K, V


# For one query tile i:  D_i = rowsum(dO_i * O_i) - dLSE_i  (stored for the dK/dV kernel);
# over key tiles j:  P = exp(Q_i K_j^T * scale - LSE_i);  dP = dO_i V_j^T;  dS = P * (dP - D_i);
# dQ_i = scale * sum_j dS K_j
@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, mask_d,
    lo, hi, seq_k, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_rows(k_ptrs, cols, seq_k, mask_d, MASKED, EVEN_D)
        v = load_rows(v_ptrs, cols, seq_k, mask_d, MASKED, EVEN_D)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.math.exp2(qk - lse2[:, None])
        if MASKED:
            p = tl.where(keep_scores(offs_m[:, None], cols[None, :], seq_k, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit(do_not_specialize=["seq_q", "seq_k", "tune_len"])
def _attn_bwd_dq(
    Q, K, V, O, DO, LSE, DLSE, Delta, DQ,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    n_heads, group, seq_q, seq_k, tune_len, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DLSE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    n_m_tiles = tl.cdiv(seq_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m_tiles
    tile_m = pid % n_m_tiles
    if CAUSAL:
        tile_m = n_m_tiles - 1 - tile_m  # longest first
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    hk = h // group
    start_m = tile_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seq_q
    mask_d = offs_d < HEAD_DIM
    rows = offs_m.to(tl.int64)
    q = load_rows(
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
        offs_m, seq_q, mask_d, True, EVEN_D,
    )  # fmt: skip
    do = load_rows(
        DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :],
        offs_m, seq_q, mask_d, True, EVEN_D,
    )  # fmt: skip
    o = load_rows(
        O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :],
        offs_m, seq_q, mask_d, True, EVEN_D,
    )  # fmt: skip
    row_ptrs = bh.to(tl.int64) * seq_q + rows
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:  # gradient flowing into the returned lse: dS gains + dLSE * P
        delta -= tl.load(DLSE + row_ptrs, mask=mask_m, other=0.0)
    tl.store(Delta + row_ptrs, delta, mask=mask_m)
    lse2 = tl.load(LSE + row_ptrs, mask=mask_m, other=0.0) * _LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        n_full = tl.minimum((start_m + 1) // BLOCK_N, seq_k // BLOCK_N)
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
    else:
        n_full = seq_k // BLOCK_N
        hi = seq_k
    cols = offs_n.to(tl.int64)
    k_ptrs = K + b * stride_kb + hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + b * stride_vb + hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :]
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, mask_d,
        0, n_full * BLOCK_N, seq_k, qk_scale, CAUSAL, False, EVEN_D, PRECISION, BLOCK_N,
    )  # fmt: skip
    lo = n_full * BLOCK_N
    k_ptrs += lo.to(tl.int64) * stride_kn
    v_ptrs += lo.to(tl.int64) * stride_vn
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, mask_d,
        lo, hi, seq_k, qk_scale, CAUSAL, True, EVEN_D, PRECISION, BLOCK_N,
    )  # fmt: skip

    dq *= sm_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm + offs_d[None, :]
    if EVEN_D:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=mask_m[:, None])
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# For one key tile j, over query tiles i:  P = exp(Q_i K_j^T * scale - LSE_i);  dV_j += P^T dO_i;
# dP = dO_i V_j^T;  dS = P * (dP - D_i);  dK_j += scale * dS^T Q_i      (P^T, dS^T computed directly)
@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
    offs_n, offs_m0, mask_d, lo, hi, seq_q, seq_k, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        q = load_rows(q_ptrs, offs_m, seq_q, mask_d, MASKED, EVEN_D)
        do = load_rows(do_ptrs, offs_m, seq_q, mask_d, MASKED, EVEN_D)
        if MASKED:
            lse = tl.load(lse_ptrs, mask=offs_m < seq_q, other=0.0)
            delta = tl.load(delta_ptrs, mask=offs_m < seq_q, other=0.0)
        else:
            lse = tl.load(lse_ptrs)
            delta = tl.load(delta_ptrs)
        qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(qkT - lse[None, :] * _LOG2E)
        if MASKED:
            keep = keep_scores(offs_m[None, :], offs_n[:, None], seq_k, CAUSAL)
            pT = tl.where(keep & (offs_m < seq_q)[None, :], pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit(do_not_specialize=["seq_q", "seq_k", "tune_len"])
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, Delta, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    n_heads, n_kv_heads, group, seq_q, seq_k, tune_len, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    n_n_tiles = tl.cdiv(seq_k, BLOCK_N)
    pid = tl.program_id(0)
    bhk = pid // n_n_tiles
    start_n = (pid % n_n_tiles) * BLOCK_N
    b = (bhk // n_kv_heads).to(tl.int64)
    hk = (bhk % n_kv_heads).to(tl.int64)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    cols = offs_n.to(tl.int64)
    k = load_rows(
        K + b * stride_kb + hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :],
        offs_n, seq_k, mask_d, True, EVEN_D,
    )  # fmt: skip
    v = load_rows(
        V + b * stride_vb + hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :],
        offs_n, seq_k, mask_d, True, EVEN_D,
    )  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query tiles: [lo, mid) cross the causal diagonal (masked), [mid, full) need no mask,
    # [max(mid, full), seq_q) is the ragged last tile (masked). Keys past seq_k are not masked in
    # the unmasked segment: they only touch rows of dK/dV that are never stored.
    full = (seq_q // BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # earlier queries see none of these keys: skipped
        mid = tl.maximum(lo, tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, full))
    else:
        lo = start_n * 0
        mid = lo
    tail = tl.maximum(mid, full)
    for g in range(0, group):
        h = hk * group + g  # the query heads that share this key/value head
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * n_heads + h) * seq_q
        for seg in tl.static_range(3):
            if seg == 0:
                seg_lo = lo
                seg_hi = mid
            elif seg == 1:
                seg_lo = mid
                seg_hi = tail
            else:
                seg_lo = tail
                seg_hi = seq_q
            rows = (seg_lo + offs_m0).to(tl.int64)
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v,
                q_base + rows[:, None] * stride_qm + offs_d[None, :],
                do_base + rows[:, None] * stride_dom + offs_d[None, :],
                LSE + row_base + rows, Delta + row_base + rows, stride_qm, stride_dom,
                offs_n, offs_m0, mask_d, seg_lo, seg_hi, seq_q, seq_k, qk_scale,
                CAUSAL, seg != 1, EVEN_D, PRECISION, BLOCK_M,
            )  # fmt: skip

    dk *= sm_scale
    mask_n = (offs_n < seq_k)[:, None]
    dk_ptrs = DK + b * stride_dkb + hk * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + hk * stride_dvh + cols[:, None] * stride_dvn + offs_d[None, :]
    if EVEN_D:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=mask_n)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask_n)
    else:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=mask_n & mask_d[None, :])
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask_n & mask_d[None, :])


_attn_bwd_dq_tuned = make_autotune(_attn_bwd_dq, DQ_SHAPES, _dq_footprint)
_attn_bwd_dkdv_tuned = make_autotune(_attn_bwd_dkdv, DKDV_SHAPES, _dkdv_footprint)
_launch_dq = LaunchCache(_attn_bwd_dq_tuned, n_tensors=9)
_launch_dkdv = LaunchCache(_attn_bwd_dkdv_tuned, n_tensors=8)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the two backward kernels on 4-D views; ``lse``/``dlse`` are contiguous (B, H, L).

    The last dimension of every 4-D tensor must be contiguous (stride 1).
    """
    batch, n_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_k = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty_like(lse)
    precision = dot_precision(q.dtype)
    qs, ks, vs, os_, dos = q.stride(), k.stride(), v.stride(), out.stride(), dout.stride()
    dqs, dks, dvs = dq.stride(), dk.stride(), dv.stride()
    group = n_heads // n_kv_heads
    qk_scale = scale * LOG2E
    tl_len = tune_len(seq_q, seq_k)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim),
                  "CAUSAL": is_causal, "PRECISION": precision}  # fmt: skip
    key = (q.shape, qs, k.shape, ks, vs, os_, dos, q.dtype, is_causal, precision)
    _launch_dq(
        (key, dlse is None),
        lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * n_heads,),
        (q, k, v, out, dout, lse, lse if dlse is None else dlse, delta, dq,
         qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2],
         dos[0], dos[1], dos[2], dqs[0], dqs[1], dqs[2],
         n_heads, group, seq_q, seq_k, tl_len, qk_scale, scale),
        {**constexprs, "HAS_DLSE": dlse is not None},
    )  # fmt: skip
    _launch_dkdv(
        key,
        lambda meta: (triton.cdiv(seq_k, meta["BLOCK_N"]) * batch * n_kv_heads,),
        (q, k, v, dout, lse, delta, dk, dv,
         qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], dos[0], dos[1], dos[2],
         dks[0], dks[1], dks[2], dvs[0], dvs[1], dvs[2],
         n_heads, n_kv_heads, group, seq_q, seq_k, tl_len, qk_scale, scale),
        constexprs,
    )  # fmt: skip
    return dq, dk, dv
