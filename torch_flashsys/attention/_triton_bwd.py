"""FlashAttention-2 backward in Triton (FA2 Algorithm 2, eqs. 13-19), deterministic: no atomics.

Three launches: a preprocess kernel for ``D = rowsum(dO * O)``, a kernel over key tiles that
produces dK and dV (looping over the query heads of a GQA group, so the group sum needs no atomics),
and a kernel over query tiles that produces dQ. Probabilities are recomputed from the saved
logsumexp, ``P = exp(S - LSE)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_flashsys.attention._triton_utils import LOG2E, make_configs, smem_pruner

_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): LSE is stored in natural log, kernels use exp2


# dK/dV: few query rows per step against a resident key tile; dQ: the transpose of that.
_DKDV_SHAPES = [(32, 128, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 3),
                (16, 64, 4, 2)]  # fmt: skip
_DQ_SHAPES = [(128, 32, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3),
              (64, 16, 4, 2)]  # fmt: skip


def _dkdv_footprint(block_m: int, block_n: int, block_d: int, stages: int) -> int:
    return block_d * (2 * block_n + stages * 2 * block_m)  # resident K, V; pipelined Q, dO


def _dq_footprint(block_m: int, block_n: int, block_d: int, stages: int) -> int:
    return block_d * (2 * block_m + stages * 2 * block_n)  # resident Q, dO; pipelined K, V


# D_i = sum_d dO[i, d] * O[i, d] - dLSE_i   (dLSE: gradient flowing into the returned lse, if any)
@triton.jit(do_not_specialize=["seq_q"])
def _attn_bwd_preprocess(
    O, DO, DLSE, Delta,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_db, stride_dh, stride_dm, stride_dd,
    n_heads, seq_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
):  # fmt: skip
    n_m_tiles = tl.cdiv(seq_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m_tiles
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    offs_m = (pid % n_m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m.to(tl.int64)
    mask = (offs_m < seq_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(
        O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :] * stride_od,
        mask=mask, other=0.0,
    ).to(tl.float32)  # fmt: skip
    do = tl.load(
        DO + b * stride_db + h * stride_dh + rows[:, None] * stride_dm + offs_d[None, :] * stride_dd,
        mask=mask, other=0.0,
    ).to(tl.float32)  # fmt: skip
    delta = tl.sum(o * do, axis=1)
    row_ptrs = bh.to(tl.int64) * seq_q + rows
    if HAS_DLSE:
        delta -= tl.load(DLSE + row_ptrs, mask=offs_m < seq_q, other=0.0)
    tl.store(Delta + row_ptrs, delta, mask=offs_m < seq_q)


# For one key tile j, over query tiles i:  P = exp(Q_i K_j^T * scale - LSE_i);  dV_j += P^T dO_i;
# dP = dO_i V_j^T;  dS = P * (dP - D_i);  dK_j += scale * dS^T Q_i      (P^T, dS^T computed directly)
@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
    offs_n, offs_m0, mask_d, lo, hi, seq_q, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        if MASKED:
            mask_m = offs_m < seq_q
            q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            lse = tl.load(lse_ptrs, mask=mask_m, other=0.0)
            delta = tl.load(delta_ptrs, mask=mask_m, other=0.0)
        else:
            q = tl.load(q_ptrs, mask=mask_d[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=mask_d[None, :], other=0.0)
            lse = tl.load(lse_ptrs)
            delta = tl.load(delta_ptrs)
        qkT = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M), base-2 scaled
        pT = tl.math.exp2(qkT - lse[None, :] * _LOG2E)
        if MASKED:
            valid = mask_m[None, :]
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(valid, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.autotune(
    configs=make_configs(_DKDV_SHAPES),
    key=["HEAD_DIM", "CAUSAL"],
    prune_configs_by={"early_config_prune": smem_pruner(_dkdv_footprint)},
)
@triton.jit(do_not_specialize=["seq_q", "seq_k"])
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, Delta, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_heads, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
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
    mask_nd = (offs_n < seq_k)[:, None] & mask_d[None, :]
    cols = offs_n.to(tl.int64)
    k = tl.load(
        K + b * stride_kb + hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=mask_nd, other=0.0,
    )  # fmt: skip
    v = tl.load(
        V + b * stride_vb + hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
        mask=mask_nd, other=0.0,
    )  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query tiles: [lo, mid) cross the causal diagonal (masked), [mid, full) need no mask,
    # [max(mid, full), seq_q) is the ragged last tile (masked). Keys past seq_k need no mask here:
    # they only touch rows of dK/dV that are never stored.
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
            q_ptrs = q_base + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd
            do_ptrs = do_base + rows[:, None] * stride_dom + offs_d[None, :] * stride_dod
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_base + rows, Delta + row_base + rows,
                stride_qm, stride_dom, offs_n, offs_m0, mask_d, seg_lo, seg_hi, seq_q, qk_scale,
                CAUSAL, seg != 1, BLOCK_M,
            )  # fmt: skip

    dk *= sm_scale
    tl.store(
        DK + b * stride_dkb + hk * stride_dkh + cols[:, None] * stride_dkn
        + offs_d[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty), mask=mask_nd,
    )  # fmt: skip
    tl.store(
        DV + b * stride_dvb + hk * stride_dvh + cols[:, None] * stride_dvn
        + offs_d[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty), mask=mask_nd,
    )  # fmt: skip


# For one query tile i, over key tiles j:  P = exp(Q_i K_j^T * scale - LSE_i);  dP = dO_i V_j^T;
# dS = P * (dP - D_i);  dQ_i += scale * dS K_j
@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse2, delta, kT_ptrs, vT_ptrs, stride_kn, stride_vn,
    offs_m, offs_n, mask_d, lo, hi, seq_k, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if MASKED:
            mask_kd = mask_d[:, None] & (cols[None, :] < seq_k)
            kT = tl.load(kT_ptrs, mask=mask_kd, other=0.0)
            vT = tl.load(vT_ptrs, mask=mask_kd, other=0.0)
        else:
            kT = tl.load(kT_ptrs, mask=mask_d[:, None], other=0.0)
            vT = tl.load(vT_ptrs, mask=mask_d[:, None], other=0.0)
        qk = tl.dot(q, kT) * qk_scale
        p = tl.math.exp2(qk - lse2[:, None])
        if MASKED:
            valid = cols[None, :] < seq_k
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
        kT_ptrs += BLOCK_N * stride_kn
        vT_ptrs += BLOCK_N * stride_vn
    return dq


@triton.autotune(
    configs=make_configs(_DQ_SHAPES),
    key=["HEAD_DIM", "CAUSAL"],
    prune_configs_by={"early_config_prune": smem_pruner(_dq_footprint)},
)
@triton.jit(do_not_specialize=["seq_q", "seq_k"])
def _attn_bwd_dq(
    Q, K, V, DO, LSE, Delta, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    n_heads, group, seq_q, seq_k, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
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
    mask_md = mask_m[:, None] & mask_d[None, :]
    rows = offs_m.to(tl.int64)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=mask_md, other=0.0,
    )  # fmt: skip
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom
        + offs_d[None, :] * stride_dod,
        mask=mask_md, other=0.0,
    )  # fmt: skip
    row_ptrs = bh.to(tl.int64) * seq_q + rows
    lse2 = tl.load(LSE + row_ptrs, mask=mask_m, other=0.0) * _LOG2E
    delta = tl.load(Delta + row_ptrs, mask=mask_m, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        n_full = tl.minimum((start_m + 1) // BLOCK_N, seq_k // BLOCK_N)
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
    else:
        n_full = seq_k // BLOCK_N
        hi = seq_k
    cols = offs_n.to(tl.int64)
    kT_ptrs = (
        K + b * stride_kb + hk * stride_kh + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
    )
    vT_ptrs = (
        V + b * stride_vb + hk * stride_vh + cols[None, :] * stride_vn + offs_d[:, None] * stride_vd
    )
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, kT_ptrs, vT_ptrs, stride_kn, stride_vn,
        offs_m, offs_n, mask_d, 0, n_full * BLOCK_N, seq_k, qk_scale,
        CAUSAL, False, BLOCK_N,
    )  # fmt: skip
    lo = n_full * BLOCK_N
    kT_ptrs += lo.to(tl.int64) * stride_kn
    vT_ptrs += lo.to(tl.int64) * stride_vn
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, kT_ptrs, vT_ptrs, stride_kn, stride_vn,
        offs_m, offs_n, mask_d, lo, hi, seq_k, qk_scale,
        CAUSAL, True, BLOCK_N,
    )  # fmt: skip

    dq *= sm_scale
    tl.store(
        DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm
        + offs_d[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty), mask=mask_md,
    )  # fmt: skip


_PREPROCESS_BLOCK_M = 64  # rows per program for D = rowsum(dO * O): a memory-bound reduction


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
    """Launch the three backward kernels on 4-D views; ``lse``/``dlse`` are contiguous (B, H, L)."""
    batch, n_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_k = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    block_d = triton.next_power_of_2(head_dim)
    delta = torch.empty_like(lse)
    _attn_bwd_preprocess[(triton.cdiv(seq_q, _PREPROCESS_BLOCK_M) * batch * n_heads,)](
        out, dout, dlse if dlse is not None else lse, delta,
        *out.stride(), *dout.stride(), n_heads, seq_q,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=_PREPROCESS_BLOCK_M,
        HAS_DLSE=dlse is not None,
    )  # fmt: skip
    group = n_heads // n_kv_heads
    qk_scale = scale * LOG2E
    grid_kv = lambda meta: (triton.cdiv(seq_k, meta["BLOCK_N"]) * batch * n_kv_heads,)
    _attn_bwd_dkdv[grid_kv](
        q, k, v, dout, lse, delta, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        n_heads, n_kv_heads, group, seq_q, seq_k, qk_scale, scale,
        HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=is_causal,
    )  # fmt: skip
    grid_q = lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * n_heads,)
    _attn_bwd_dq[grid_q](
        q, k, v, dout, lse, delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
        n_heads, group, seq_q, seq_k, qk_scale, scale,
        HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=is_causal,
    )  # fmt: skip
    return dq, dk, dv
