"""FlashAttention-2 forward in Triton (FA2 Algorithm 1), plain pointer arithmetic, any strides.

Tensors arrive as 4-D views ``(batch, heads, seq, head_dim)`` with arbitrary strides; key/value may
have fewer heads than query (GQA: query head ``h`` reads key/value head ``h // group``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_flashsys.attention._triton_utils import LOG2E, make_configs, smem_pruner

_LN2 = tl.constexpr(0.6931471805599453)  # ln(2): turns the base-2 logsumexp into a natural one

_FWD_SHAPES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3),
               (64, 32, 4, 2)]  # fmt: skip


def _fwd_footprint(block_m: int, block_n: int, block_d: int, stages: int) -> int:
    return block_d * (block_m + stages * 2 * block_n)  # Q tile + pipelined K and V tiles


# S = Q K^T * scale;  O = softmax(S) V;  LSE = logsumexp(S, dim=-1)  (one query tile per program)
@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, kT_ptrs, v_ptrs, stride_kn, stride_vn,
    offs_m, offs_n, mask_d, lo, hi, seq_k, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Key tiles [lo, hi). MASKED tiles may cross the causal diagonal or the end of the keys.
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if MASKED:
            kT = tl.load(kT_ptrs, mask=mask_d[:, None] & (cols[None, :] < seq_k), other=0.0)
        else:
            kT = tl.load(kT_ptrs, mask=mask_d[:, None], other=0.0)
        qk = tl.dot(q, kT) * qk_scale  # base-2 scaled scores, fp32
        if MASKED:
            valid = cols[None, :] < seq_k
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])  # top-left aligned
            qk = tl.where(valid, qk, float("-inf"))
        # Online softmax: every row has seen key 0 by now, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=(cols[:, None] < seq_k) & mask_d[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)  # P in V's dtype, accumulate in fp32
        m_i = m_new
        kT_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.autotune(
    configs=make_configs(_FWD_SHAPES),
    key=["HEAD_DIM", "CAUSAL"],  # tensor dtypes are part of the autotune key automatically
    prune_configs_by={"early_config_prune": smem_pruner(_fwd_footprint)},
)
@triton.jit(do_not_specialize=["seq_q", "seq_k"])  # lengths of 1 would become constexpr
def _attn_fwd(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    n_heads, group, seq_q, seq_k, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)  # tl.dot's minimum tile
    # 1-D grid (no 65535 limit on batch*heads): consecutive programs share a head, so K/V stay in L2.
    n_m_tiles = tl.cdiv(seq_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m_tiles
    tile_m = pid % n_m_tiles
    if CAUSAL:
        tile_m = n_m_tiles - 1 - tile_m  # longest (most key tiles) first: better tail balance
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    hk = h // group  # shared key/value head (GQA); group == 1 otherwise
    start_m = tile_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seq_q
    mask_d = offs_d < HEAD_DIM  # head dims that are not a power of two are padded to BLOCK_D
    rows = offs_m.to(tl.int64)  # 64-bit offsets: a (b, l, h, d) layout can pass 2**31 elements

    q_ptrs = (
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        n_full = tl.minimum(
            (start_m + 1) // BLOCK_N, seq_k // BLOCK_N
        )  # tiles left of the diagonal
        hi = tl.minimum(seq_k, start_m + BLOCK_M)  # later keys are masked for every row: skipped
    else:
        n_full = seq_k // BLOCK_N
        hi = seq_k
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    cols = offs_n.to(tl.int64)
    kT_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
    v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, kT_ptrs, v_ptrs, stride_kn, stride_vn,
        offs_m, offs_n, mask_d, 0, n_full * BLOCK_N, seq_k, qk_scale,
        CAUSAL, False, BLOCK_N,
    )  # fmt: skip
    lo = n_full * BLOCK_N
    kT_ptrs += lo.to(tl.int64) * stride_kn
    v_ptrs += lo.to(tl.int64) * stride_vn
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, kT_ptrs, v_ptrs, stride_kn, stride_vn,
        offs_m, offs_n, mask_d, lo, hi, seq_k, qk_scale,
        CAUSAL, True, BLOCK_N,
    )  # fmt: skip

    acc = acc / l_i[:, None]
    o_ptrs = (
        O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    lse = (m_i + tl.math.log2(l_i)) * _LN2
    tl.store(LSE + bh.to(tl.int64) * seq_q + rows, lse, mask=mask_m)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on 4-D views; returns ``out`` (like q) and fp32 ``lse`` (B, H, L)."""
    batch, n_heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    out = torch.empty_like(q)  # keeps q's layout, e.g. a (B, L, H, E)-transposed view
    lse = torch.empty((batch, n_heads, seq_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    grid = lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * n_heads,)
    _attn_fwd[grid](
        q, k, v, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        n_heads, n_heads // k.shape[1], seq_q, seq_k, scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=is_causal,
    )  # fmt: skip
    return out, lse
