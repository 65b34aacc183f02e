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
    plan_tile,
    problem_dims,
    program_scalars,
    program_setup,
    segment,
    softmax_finish,
    softmax_lse,
    softmax_step,
    store_rows,
    tile_ptrs,
    tune_len,
)

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
    acc, l_i, m_i, q, k_ptrs, v_ptrs, strides, offs_m, offs_p, offs_n, dmasks, row_ok, lo, hi,
    seq_k, mods, window, mask, drop,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, MAY_EMPTY: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    FOLD_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key tiles [lo, hi) into (acc, l_i, m_i). MASKED tiles may cross the window / causal
    diagonal or the end of keys. Bundles: strides (K, V rows), dmasks (head dims of K, V), mods
    (:func:`mod_scores`), window (left, right), mask (:func:`mask_tile`), drop
    (:func:`dropout_keep`); the flags as the kernel's."""
    stride_kn, stride_vn = strides
    mask_d, mask_dv = dmasks
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_rows(k_ptrs, cols, seq_k, mask_d, MASKED, EVEN_D)
        mvals = mask_tile(  # issued before the dot, so the load overlaps it
            mask, offs_m, cols, row_ok, cols < seq_k, MASK_KIND, MASK_ROWS, False
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if FOLD_SCALE:  # raw scores: the scale is applied in the exponent's FMA (softmax_step)
            s = qk
        else:
            s, _t = mod_scores(
                qk, offs_p[:, None], cols[None, :], mods, mvals, SOFTCAP, ALIBI, MASK_KIND == 2
            )  # fmt: skip
        if MASKED:  # positions: offs_p (= offs_m, or shifted to the end of a KV cache)
            keep = keep_scores(offs_p[:, None], cols[None, :], seq_k, window, HAS_LEFT, HAS_RIGHT)
            s = tl.where(keep, s, float("-inf"))
        if MASK_KIND == 1:
            s = tl.where(mvals, s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, mods[0], FOLD_SCALE, MAY_EMPTY)
        if DROPOUT:  # dropped after the normalizer: softmax first, then dropout (as SDPA)
            keep_r = dropout_keep(drop, offs_m, start_n, BLOCK_N, False)
            p = tl.where(keep_r, p, 0.0)
        v = load_rows(v_ptrs, cols, seq_k, mask_dv, MASKED, EVEN_DV)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)  # P in V's dtype
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
    check_blocks(HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    EVEN_DV: tl.constexpr = BLOCK_DV == HEAD_DIM_V
    # Setup: this program's query tile; causal: longest (most key tiles) first.
    bh, b, h, start_m, q_start, seq_q, k_start, seq_k = program_setup(
        CuQ, CuK, seq_q, seq_k, n_heads, BLOCK_M, False, HAS_RIGHT, VARLEN
    )
    hk = h // group  # shared key/value head (GQA); group == 1 otherwise
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
    rows = q_start + offs_m.to(tl.int64)  # 64-bit offsets: a (b, l, h, d) layout can pass 2**31
    q = load_rows(
        tile_ptrs(Q, b, h, stride_qb, stride_qh, rows, stride_qm, offs_d),
        offs_m, seq_q, mask_d, True, EVEN_D,
    )  # fmt: skip
    slope, mask_base = head_scalars(
        Alibi, Mask, b, h, stride_ab, stride_ah, stride_mb, stride_mh, ALIBI
    )
    seed, stride_mn = program_scalars(Seed, stride_mn, DROPOUT, MASK_CONTIG)
    mask = (mask_base, stride_mm, stride_mn)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = key_tile_range(
        start_m + shift, seq_k, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    if VARLEN:  # a query tile past this sequence's end: no key tiles, every store masked
        lo, mid_lo, mid_hi, hi = empty_if(start_m >= seq_q, lo, mid_lo, mid_hi, hi)
    cols = k_start + offs_n.to(tl.int64)
    k_base = tile_ptrs(K, b, hk, stride_kb, stride_kh, cols, stride_kn, offs_d)
    v_base = tile_ptrs(V, b, hk, stride_vb, stride_vh, cols, stride_vn, offs_dv)
    mods = (qk_scale, sm_scale, softcap, slope)
    drop = (seed, bh.to(tl.int32), threshold, inv_keep)
    # Loop: masked window edge, unmasked middle, masked diagonal / end (segment 0 is empty
    # without a left window).
    for seg in tl.static_range(3):
        seg_lo, seg_hi = segment(seg, lo, mid_lo, mid_hi, hi)
        if seg != 0 or HAS_LEFT:
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, q,
                k_base + seg_lo.to(tl.int64) * stride_kn, v_base + seg_lo.to(tl.int64) * stride_vn,
                (stride_kn, stride_vn), offs_m, offs_p, offs_n, (mask_d, mask_dv), row_ok,
                seg_lo, seg_hi, seq_k, mods, (left, right), mask, drop,
                seg != 1, HAS_LEFT, HAS_RIGHT, MASK_KIND, MASK_ROWS, SOFTCAP, ALIBI, DROPOUT,
                MAY_EMPTY, EVEN_D, EVEN_DV, PRECISION, FOLD_SCALE, BLOCK_N,
            )  # fmt: skip
    # Epilogue: normalize, store O and the logsumexp.
    if DROPOUT:
        acc = acc * inv_keep  # kept probabilities are scaled by 1 / (1 - dropout_p)
    out = softmax_finish(acc, l_i, MAY_EMPTY)  # a row with no key: out 0, lse -inf
    store_rows(tile_ptrs(O, b, h, stride_ob, stride_oh, rows, stride_om, offs_dv), out, row_ok,
               mask_dv, EVEN_DV)  # fmt: skip
    lse = softmax_lse(m_i, l_i)
    tl.store(LSE + b * stride_lb + h * stride_lh + rows, lse, mask=row_ok)


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
    n_heads = q.shape[1]
    batch, seq_q, seq_k, lse_strides = problem_dims(q, k, ex)
    ints = (*batch_strides(q, ex), *batch_strides(k, ex), *batch_strides(v, ex),
            *batch_strides(out, ex), *lse_strides, *runtime[:6],
            n_heads, n_heads // k.shape[1], seq_q, seq_k, tune_len(seq_q, seq_k))  # fmt: skip
    constexprs = kernel_constexprs(q.shape[3], v.shape[3], precision, flags._asdict())
    constexprs["FOLD_SCALE"] = fold_scale(flags, pos_scale)
    constexprs.update(plan_tile("fwd", q, constexprs, flags, max(seq_q, seq_k), FWD_SHAPES,
                                _fwd_footprint))  # fmt: skip
    grid = lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]) * batch * n_heads,)
    return Plan(grid, ints, constexprs)
