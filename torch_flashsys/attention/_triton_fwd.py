"""FlashAttention-2 forward in Triton (FA2 Algorithm 1), plain pointer arithmetic.

Tensors arrive as 4-D views ``(batch, heads, seq, head_dim)`` whose last dimension is contiguous
(the wrapper copies the rare input that is not); key/value may have fewer heads than query (GQA:
query head ``h`` reads key/value head ``h // group``).
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

_LN2 = tl.constexpr(0.6931471805599453)  # ln(2): turns the base-2 logsumexp into a natural one

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class; the first entry is the default.
FWD_SHAPES = {  # from benchmarks/tune_attention.py on an H100 (docs/benchmarks.md)
    64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 4, 4)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    256: [(64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
}


def _fwd_footprint(block_m: int, block_n: int, block_d: int, stages: int) -> int:
    return block_d * (block_m + stages * 2 * block_n)  # Q tile + pipelined K and V tiles


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, mask_d,
    lo, hi, seq_k, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Key tiles [lo, hi). MASKED tiles may cross the causal diagonal or the end of the keys.
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_rows(k_ptrs, cols, seq_k, mask_d, MASKED, EVEN_D)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # base-2 scores, fp32
        if MASKED:
            keep = keep_scores(offs_m[:, None], cols[None, :], seq_k, CAUSAL)
            qk = tl.where(keep, qk, float("-inf"))
        # Online softmax: every row has seen key 0 by now, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_rows(v_ptrs, cols, seq_k, mask_d, MASKED, EVEN_D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)  # P in V's dtype
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


# S = Q K^T * scale;  O = softmax(S) V;  LSE = logsumexp(S, dim=-1)   (one query tile per program)
@triton.jit(do_not_specialize=["seq_q", "seq_k", "tune_len"])  # lengths of 1 would be constexpr
def _attn_fwd(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    n_heads, group, seq_q, seq_k, tune_len, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)  # tl.dot's minimum tile
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
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
    mask_d = offs_d < HEAD_DIM  # head dims that are not a power of two are padded to BLOCK_D
    rows = offs_m.to(tl.int64)  # 64-bit offsets: a (b, l, h, d) layout can pass 2**31 elements
    q = load_rows(
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
        offs_m, seq_q, mask_d, True, EVEN_D,
    )  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        # key tiles wholly left of the diagonal need no mask; later keys are masked for every row
        n_full = tl.minimum((start_m + 1) // BLOCK_N, seq_k // BLOCK_N)
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
    else:
        n_full = seq_k // BLOCK_N
        hi = seq_k
    cols = offs_n.to(tl.int64)
    k_ptrs = K + b * stride_kb + hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + b * stride_vb + hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :]
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, mask_d,
        0, n_full * BLOCK_N, seq_k, qk_scale, CAUSAL, False, EVEN_D, PRECISION, BLOCK_N,
    )  # fmt: skip
    lo = n_full * BLOCK_N
    k_ptrs += lo.to(tl.int64) * stride_kn
    v_ptrs += lo.to(tl.int64) * stride_vn
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, mask_d,
        lo, hi, seq_k, qk_scale, CAUSAL, True, EVEN_D, PRECISION, BLOCK_N,
    )  # fmt: skip

    acc = acc / l_i[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :]
    if EVEN_D:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=(offs_m < seq_q)[:, None])
    else:
        tl.store(
            o_ptrs, acc.to(O.dtype.element_ty), mask=(offs_m < seq_q)[:, None] & mask_d[None, :]
        )
    lse = (m_i + tl.math.log2(l_i)) * _LN2
    tl.store(LSE + bh.to(tl.int64) * seq_q + rows, lse, mask=offs_m < seq_q)


_attn_fwd_tuned = make_autotune(_attn_fwd, FWD_SHAPES, _fwd_footprint)
_launch_fwd = LaunchCache(_attn_fwd_tuned, n_tensors=5)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on 4-D views; returns ``out`` (like q) and fp32 ``lse`` (B, H, L).

    The last dimension of q, k and v must be contiguous (stride 1).
    """
    batch, n_heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    out = torch.empty_like(q)  # keeps q's layout, e.g. a (B, L, H, E)-transposed view
    lse = torch.empty((batch, n_heads, seq_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    precision = dot_precision(q.dtype)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    key = (q.shape, qs, k.shape, ks, vs, os_, q.dtype, is_causal, precision)
    _launch_fwd(
        key,
        lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * n_heads,),
        (q, k, v, out, lse, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
         os_[0], os_[1], os_[2], n_heads, n_heads // k.shape[1], seq_q, seq_k,
         tune_len(seq_q, seq_k), scale * LOG2E),
        {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim),
         "CAUSAL": is_causal, "PRECISION": precision},
    )  # fmt: skip
    return out, lse
