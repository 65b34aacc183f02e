"""FlashAttention-2 forward in Triton (FA2 Algorithm 1), plain pointer arithmetic.

Tensors arrive as 4-D views ``(batch, heads, seq, head_dim)`` whose last dimension is contiguous
(the wrapper copies the rare input that is not); key/value may have fewer heads than query (GQA:
query head ``h`` reads key/value head ``h // group``). The score modifications of ``_extras``
(position window / causal, masks, soft-capping, ALiBi, dropout) are switched by constexpr flags:
a disabled feature compiles to nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_flashsys.attention._extras import Extras
from torch_flashsys.attention._launch import LaunchCache, Plan, dot_precision, remember
from torch_flashsys.attention._tensors import empty_like_layout
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
    seq_bounds,
    tune_len,
)

_LN2 = tl.constexpr(0.6931471805599453)  # ln(2): turns the base-2 logsumexp into a natural one

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class: the fallback where the tile table
# (_kernel_config) has no entry is the first that fits; TORCH_FLASHSYS_AUTOTUNE=1 tunes over them.
FWD_SHAPES = {  # from benchmarks/tune_attention.py on an H100 (docs/benchmarks.md)
    64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 4, 4)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    256: [(64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
}


def _fwd_footprint(block_m: int, block_n: int, block_d: int, stages: int) -> int:
    return block_d * (block_m + stages * 2 * block_n)  # Q tile + pipelined K and V tiles


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_p, offs_n, mask_d, mask_dv,
    row_ok,
    lo, hi, seq_k, qk_scale, sm_scale, left, right, softcap, slope, mask_base,
    stride_mm, stride_mn, seed, bh, threshold,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MAY_EMPTY: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, FOLD_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Key tiles [lo, hi). MASKED tiles may cross the window / causal diagonal or the end of keys.
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_rows(k_ptrs, cols, seq_k, mask_d, MASKED, EVEN_D)
        mvals = 0.0
        if MASK_KIND != 0:  # issued before the dot, so the load overlaps it
            col_ok = cols < seq_k
            if MASK_ROWS:
                ptrs = mask_base + offs_m[:, None] * stride_mm + cols[None, :] * stride_mn
                mvals = load_mask(ptrs, row_ok[:, None] & col_ok[None, :], MASK_KIND)
            else:  # a key-padding mask: one vector per key tile
                mvals = load_mask(mask_base + cols * stride_mn, col_ok, MASK_KIND)[None, :]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if FOLD_SCALE:  # raw scores: the scale is applied in the exponent's FMA below
            s = qk
        else:
            s, _t = mod_scores(
                qk, offs_p[:, None], cols[None, :], sm_scale, qk_scale, softcap, slope, mvals,
                SOFTCAP, ALIBI, MASK_KIND == 2,
            )  # fmt: skip
        if MASKED:  # positions: offs_p (= offs_m, or shifted to the end of a KV cache)
            keep = keep_scores(
                offs_p[:, None], cols[None, :], seq_k, left, right, HAS_LEFT, HAS_RIGHT
            )
            s = tl.where(keep, s, float("-inf"))
        if MASK_KIND == 1:
            s = tl.where(mvals, s, float("-inf"))
        # Online softmax (base 2). m_use is 0 for a row that has seen no allowed key yet.
        if FOLD_SCALE:  # qk_scale > 0: max(qk) * qk_scale is the max of the scaled scores
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if MAY_EMPTY:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        if FOLD_SCALE:
            p = tl.math.exp2(s * qk_scale - m_use[:, None])  # one FMA per score
        else:
            p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:  # dropped after the normalizer: softmax first, then dropout (as SDPA)
            keep_r = dropout_keep(seed, offs_m, start_n, bh, threshold, BLOCK_N, False)
            p = tl.where(keep_r, p, 0.0)
        v = load_rows(v_ptrs, cols, seq_k, mask_dv, MASKED, EVEN_DV)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)  # P in V's dtype
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


# S = mods(Q K^T * scale);  O = dropout(softmax(S)) V;  LSE = logsumexp(S, dim=-1)
# (one query tile per program)
@triton.jit(
    do_not_specialize=[
        "seq_q", "seq_k", "tune_len", "left", "right", "threshold",
        "stride_mn", "stride_ab", "stride_ah",
        "stride_lb", "stride_lh",
    ]
)  # fmt: skip
def _attn_fwd(
    Q, K, V, O, LSE, Mask, Alibi, Seed, CuQ, CuK, SeqUsed,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_ab, stride_ah,
    n_heads, group, seq_q, seq_k, tune_len, qk_scale, sm_scale,
    left, right, softcap, threshold, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
    MASK_CONTIG: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MAY_EMPTY: tl.constexpr,
    VARLEN: tl.constexpr, SEQUSED: tl.constexpr, PRECISION: tl.constexpr,
    FOLD_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_D >= HEAD_DIM and BLOCK_DV >= HEAD_DIM_V)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)  # tl.dot's minimum tile
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    EVEN_DV: tl.constexpr = BLOCK_DV == HEAD_DIM_V
    # 1-D grid (no 65535 limit on batch*heads): consecutive programs share a head, so K/V stay in L2.
    # Packed (VARLEN): b is the sequence, seq_q/seq_k the longest; each program reads its own.
    n_m_tiles = tl.cdiv(seq_q, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m_tiles
    tile_m = pid % n_m_tiles
    if HAS_RIGHT:
        tile_m = n_m_tiles - 1 - tile_m  # longest (most key tiles) first: better tail balance
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    hk = h // group  # shared key/value head (GQA); group == 1 otherwise
    start_m = tile_m * BLOCK_M
    q_start, seq_q = seq_bounds(CuQ, b, seq_q, VARLEN)
    k_start, seq_k = seq_bounds(CuK, b, seq_k, VARLEN)
    shift = seq_k * 0  # query row i sits at position i + shift
    if SEQUSED:  # a KV cache: seq_k valid keys of this sequence; queries are its last positions
        seq_k = tl.load(SeqUsed + b)
        shift = seq_k - seq_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_p = offs_m + shift
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM  # head dims that are not a power of two are padded to BLOCK_D
    offs_dv = tl.arange(0, BLOCK_DV)  # value head dim (may differ from the query/key one)
    mask_dv = offs_dv < HEAD_DIM_V
    row_ok = offs_m < seq_q
    rows = offs_m.to(tl.int64)  # 64-bit offsets: a (b, l, h, d) layout can pass 2**31 elements
    q = load_rows(
        Q + b * stride_qb + h * stride_qh + (q_start + rows)[:, None] * stride_qm + offs_d[None, :],
        offs_m, seq_q, mask_d, True, EVEN_D,
    )  # fmt: skip
    slope = 0.0
    if ALIBI:
        slope = tl.load(Alibi + b * stride_ab + h * stride_ah)
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)
    mask_base = Mask + b * stride_mb + h * stride_mh
    if MASK_CONTIG:  # a constant: Triton sees contiguous keys and vectorizes the loads
        stride_mn = 1

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = key_tile_range(
        start_m + shift, seq_k, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
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
    for seg in tl.static_range(3):  # masked window edge, unmasked middle, masked diagonal / end
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
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, q,
                k_base + seg_lo.to(tl.int64) * stride_kn, v_base + seg_lo.to(tl.int64) * stride_vn,
                stride_kn, stride_vn, offs_m, offs_p, offs_n, mask_d, mask_dv, row_ok, seg_lo, seg_hi, seq_k,
                qk_scale, sm_scale, left, right, softcap, slope, mask_base, stride_mm, stride_mn,
                seed, bh32, threshold,
                seg != 1, HAS_LEFT, HAS_RIGHT, MASK_KIND, MASK_ROWS, SOFTCAP, ALIBI, DROPOUT,
                MAY_EMPTY, EVEN_D, EVEN_DV, PRECISION, FOLD_SCALE, BLOCK_N,
            )  # fmt: skip

    l_safe = l_i
    if MAY_EMPTY:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row that attends nothing: out 0, lse -inf
    if DROPOUT:
        acc = acc * inv_keep  # kept probabilities are scaled by 1 / (1 - dropout_p)
    acc = acc / l_safe[:, None]
    o_ptrs = (
        O + b * stride_ob + h * stride_oh + (q_start + rows)[:, None] * stride_om + offs_dv[None, :]
    )
    if EVEN_DV:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & mask_dv[None, :])
    lse = (m_i + tl.math.log2(l_i)) * _LN2
    tl.store(LSE + b * stride_lb + h * stride_lh + q_start + rows, lse, mask=row_ok)


_attn_fwd_tuned = make_autotune(_attn_fwd, FWD_SHAPES, _fwd_footprint)
_launch_fwd = LaunchCache(_attn_fwd_tuned, n_tensors=11)
_PLANS: dict[tuple, Plan] = {}  # shapes, strides, flags, scalars -> what they determine


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ex: Extras
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on 4-D views; returns ``out`` (q's shape and layout, v's head dim)
    and fp32 ``lse`` (B, H, L) ((1, H, total) for a packed batch).

    The last dimension of q, k and v must be contiguous (stride 1). Everything the launch key
    determines (strides, lengths, grid, constexprs) is computed on the key's first call only.
    """
    out = empty_like_layout(q, v.shape[-1])  # q's layout, e.g. a (B, L, H, E)-transposed view
    shape = q.shape
    lse = q.new_empty((shape[0], shape[1], shape[2]), dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    precision = dot_precision(q.dtype)
    tensors, runtime, flags = kernel_extras(ex, q)
    key = (shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(), q.dtype,
           precision, flags, tuple([t.dtype for t in tensors]), problem_dims(q, k, ex), runtime, scale > 0)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, v, out, ex, runtime, flags, precision, scale > 0)
        remember(_PLANS, key, plan)
    _launch_fwd(
        plan,
        plan.grid,
        (q, k, v, out, lse, *tensors, *plan.ints, scale * LOG2E, scale, *runtime[6:]),
        plan.constexprs,
    )
    return out, lse


def fold_scale(flags, pos_scale: bool) -> bool:
    """Whether the forward applies the softmax scale inside the exponent (one FMA per score):
    no score modification (softcap, ALiBi, float mask) and a positive scale, so that
    ``max(qk) * scale`` is the maximum of the scaled scores."""
    return pos_scale and not (flags.SOFTCAP or flags.ALIBI or flags.MASK_KIND == 2)


def _plan(q, k, v, out, ex: Extras, runtime: tuple, flags, precision: str, pos_scale: bool) -> Plan:
    n_heads, head_dim, dim_v = q.shape[1], q.shape[3], v.shape[3]
    batch, seq_q, seq_k, lse_strides = problem_dims(q, k, ex)
    ints = (*batch_strides(q, ex), *batch_strides(k, ex), *batch_strides(v, ex),
            *batch_strides(out, ex), *lse_strides, *runtime[:6],
            n_heads, n_heads // k.shape[1], seq_q, seq_k, tune_len(seq_q, seq_k))  # fmt: skip
    block_d, block_dv = next_pow2(head_dim), next_pow2(dim_v)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "HEAD_DIM_V": dim_v,
                  "BLOCK_DV": block_dv, **flags._asdict(), "PRECISION": precision,
                  "FOLD_SCALE": fold_scale(flags, pos_scale),
                  **plan_tile("fwd", q, max(head_dim, dim_v), max(block_d, block_dv), precision,
                              flags, max(seq_q, seq_k), FWD_SHAPES, _fwd_footprint)}  # fmt: skip
    grid = lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * n_heads,)
    return Plan(grid, ints, constexprs)
