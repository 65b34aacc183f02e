"""Split-KV ("flash-decoding") forward for a few new queries against a long KV cache.

A decode step has 1-16 query positions per sequence: one program per query tile (the prefill
kernel's grid) would leave almost the whole GPU idle while one program streams the whole cache.
Here a program takes one (sequence, key/value head, key chunk): its rows are every query position
of every query head sharing that key/value head (GQA packed into the tile, so K and V are read
once per key/value head), and it writes a partial output and logsumexp for its chunk. A second
kernel combines the chunks of a row by their logsumexps:
``lse = log(sum_c exp(lse_c))``, ``out = sum_c exp(lse_c - lse) * out_c``.

Queries are the last ``seq_q`` positions of each sequence's ``cache_seqlens[b]`` valid keys
(bottom-right aligned); masks and dropout are not handled here (the prefill kernel's cache mode
takes those calls).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from torch_flashsys.attention._extras import Extras
from torch_flashsys.attention._launch import LaunchCache, Plan, dot_precision, remember
from torch_flashsys.attention._tensors import empty_like_layout
from torch_flashsys.attention._triton_common import (
    LOG2E,
    check_blocks,
    keep_scores,
    kernel_constexprs,
    load_rows,
    mod_scores,
    next_pow2,
    softmax_finish,
    softmax_lse,
    softmax_step,
    store_rows,
)

# Keys per step of a chunk, the launch's warps/stages and the programs per SM the chunks aim for
# (benchmarks/tune_decode.py sweeps these on the device).
CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2}
_MAX_ROWS = 128  # query rows (query heads per key/value head x query positions) per program


def decode_supported(q: torch.Tensor, k: torch.Tensor, ex: Extras) -> bool:
    """Whether the split-KV kernel takes this call (else the prefill kernel's cache mode)."""
    group = q.shape[1] // k.shape[1]
    return (
        ex.seqused_k is not None
        and ex.mask is None
        and not ex.dropout_p
        and group * q.shape[2] <= _MAX_ROWS
    )


# Per (sequence b, key/value head hk, chunk c): rows r = (g, i) for the query heads h = hk*group+g
# and query positions i; S = mods(Q K^T * scale) over keys of chunk c;  O_c = softmax(S) V,
# LSE_c = logsumexp(S)   (rows with no key in the chunk: O_c = 0, LSE_c = -inf)
@triton.jit(do_not_specialize=["seq_q", "chunk", "left", "right"])
def _attn_decode_split(
    Q, K, V, SeqUsed, Alibi, OP, LP,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ab, stride_ah,
    n_heads, n_kv_heads, group, seq_q, chunk, n_chunks, qk_scale, sm_scale, left, right, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    check_blocks(HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    EVEN_DV: tl.constexpr = BLOCK_DV == HEAD_DIM_V
    bhk = tl.program_id(0)
    c = tl.program_id(1)
    b = (bhk // n_kv_heads).to(tl.int64)
    hk = (bhk % n_kv_heads).to(tl.int64)
    seq_k = tl.load(SeqUsed + b)
    shift = seq_k - seq_q  # query row i sits at key position i + shift

    r = tl.arange(0, BLOCK_M)
    g = r // seq_q
    i = r % seq_q
    row_ok = r < group * seq_q
    h = hk * group + g.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    q = load_rows(
        Q + b * stride_qb + h[:, None] * stride_qh + i.to(tl.int64)[:, None] * stride_qm
        + offs_d[None, :],
        r, group * seq_q, mask_d, True, EVEN_D,
    )  # fmt: skip
    slope = 0.0
    if ALIBI:
        slope = tl.load(Alibi + b * stride_ab + h * stride_ah, mask=row_ok, other=0.0)[:, None]
    pos = i + shift

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, seq_k)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        rows_k = cols.to(tl.int64)
        k = load_rows(
            K + b * stride_kb + hk * stride_kh + rows_k[:, None] * stride_kn + offs_d[None, :],
            cols, hi, mask_d, True, EVEN_D,
        )  # fmt: skip
        v = load_rows(
            V + b * stride_vb + hk * stride_vh + rows_k[:, None] * stride_vn + offs_dv[None, :],
            cols, hi, mask_dv, True, EVEN_DV,
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s, _t = mod_scores(
            qk, pos[:, None], cols[None, :], (qk_scale, sm_scale, softcap, slope), qk,
            SOFTCAP, ALIBI, False,
        )  # fmt: skip
        keep = keep_scores(pos[:, None], cols[None, :], hi, (left, right), HAS_LEFT, HAS_RIGHT)
        s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale, False, True)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)

    # Epilogue: -inf where the chunk held no allowed key. Partial results: OP (B, H, seq_q,
    # n_chunks, BLOCK_DV) float32 (padded: every column written), LP (B, H, seq_q, n_chunks).
    out = softmax_finish(acc, l_i, True)
    lse = softmax_lse(m_i, l_i)
    row = ((b * n_heads + h) * seq_q + i) * n_chunks + c
    store_rows(OP + row[:, None] * BLOCK_DV + offs_dv[None, :], out, row_ok, mask_dv, True)
    tl.store(LP + row, lse, mask=row_ok)


# out = sum_c exp(LSE_c - LSE) O_c with LSE = logsumexp_c(LSE_c)   (one row per program)
@triton.jit
def _attn_decode_combine(
    OP, LP, O, LSE, stride_ob, stride_oh, stride_om, n_heads, seq_q, n_chunks,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # (b * n_heads + h) * seq_q + i
    i = row % seq_q
    bh = row // seq_q
    b = bh // n_heads
    h = bh % n_heads
    offs_c = tl.arange(0, BLOCK_C)
    offs_dv = tl.arange(0, BLOCK_DV)
    lse_c = tl.load(LP + row * n_chunks + offs_c, mask=offs_c < n_chunks, other=float("-inf"))
    m = tl.max(lse_c, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_c - m_use)
    total = tl.sum(w, 0)
    o_c = tl.load(
        OP + (row * n_chunks + offs_c)[:, None] * BLOCK_DV + offs_dv[None, :],
        mask=(offs_c < n_chunks)[:, None], other=0.0,
    )  # fmt: skip
    out = tl.sum(o_c * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    o_ptrs = O + b * stride_ob + h * stride_oh + i * stride_om + offs_dv
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)
    tl.store(LSE + row, m_use + tl.log(total))  # -inf for a row no chunk had a key for


_launch_split = LaunchCache(_attn_decode_split, n_tensors=7)
_launch_combine = LaunchCache(_attn_decode_combine, n_tensors=4)


@functools.cache
def _sm_count(device_index: int) -> int:
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(props["multiprocessor_count"])
    except Exception:  # the interpreter, or an unknown driver
        return 8


def decode_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ex: Extras
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, seq_q, D) against a cache k/v (B, Hk, capacity, D[v]) with ``ex.seqused_k`` valid
    keys each: ``(out (B, H, seq_q, Dv), lse (B, H, seq_q) float32)``. 4-D views, last dim
    contiguous. Everything the shapes, strides and flags determine is computed once per key (a
    decode step runs once per layer and token: its host time is the step's floor)."""
    batch, n_heads, seq_q, _ = q.shape
    out = empty_like_layout(q, v.shape[-1])  # the query's memory layout, last dim contiguous
    lse = torch.empty((batch, n_heads, seq_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    alibi = ex.alibi
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype,
           ex.seqused_k.dtype, None if alibi is None else (alibi.stride(), alibi.dtype),
           ex.left, ex.right, ex.softcap, scale, dot_precision(q.dtype), q.device)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, v, out, scale, ex)
        remember(_PLANS, key, plan)
    split, combine, n_chunks, block_dv = plan
    part_o = torch.empty((batch, n_heads, seq_q, n_chunks, block_dv), device=q.device,
                         dtype=torch.float32)  # fmt: skip
    part_l = torch.empty((batch, n_heads, seq_q, n_chunks), device=q.device, dtype=torch.float32)
    tensors = (q, k, v, ex.seqused_k, lse if alibi is None else alibi, part_o, part_l)
    _launch_split(split, split.grid, (*tensors, *split.ints), split.constexprs)
    combine_args = (part_o, part_l, out, lse, *combine.ints)
    _launch_combine(combine, combine.grid, combine_args, combine.constexprs)
    return out, lse


_PLANS: dict[tuple, tuple[Plan, Plan, int, int]] = {}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _plan(q, k, v, out, scale: float, ex: Extras) -> tuple[Plan, Plan, int, int]:
    """(split launch plan, combine launch plan, key chunks per sequence, padded value dim)."""
    batch, n_heads, seq_q, head_dim = q.shape
    n_kv_heads, capacity, dim_v = k.shape[1], k.shape[2], v.shape[-1]
    group = n_heads // n_kv_heads
    # Enough chunks to give every SM about two programs, no chunk shorter than one key tile.
    block_n = CONFIG["BLOCK_N"]
    sms = _sm_count(q.device.index or 0) if q.is_cuda else 8
    programs = CONFIG["programs_per_sm"] * sms
    n_chunks = max(1, min(_cdiv(programs, batch * n_kv_heads), _cdiv(capacity, block_n)))
    chunk = _cdiv(_cdiv(capacity, n_chunks), block_n) * block_n
    n_chunks = _cdiv(capacity, chunk)
    block_dv = next_pow2(dim_v)
    stride_ab, stride_ah = ex.alibi.stride() if ex.alibi is not None else (0, 0)
    split_ints = (
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], stride_ab, stride_ah,
        n_heads, n_kv_heads, group, seq_q, chunk, n_chunks, scale * LOG2E, scale,
        ex.left, ex.right, ex.softcap,
    )  # fmt: skip
    flags = {"HAS_LEFT": ex.left >= 0, "HAS_RIGHT": ex.right >= 0, "SOFTCAP": ex.softcap > 0,
             "ALIBI": ex.alibi is not None}  # fmt: skip
    split_meta = {
        **kernel_constexprs(head_dim, dim_v, dot_precision(q.dtype), flags),
        "BLOCK_M": max(16, next_pow2(group * seq_q)), "BLOCK_N": block_n,
        "num_warps": CONFIG["num_warps"], "num_stages": CONFIG["num_stages"],
    }  # fmt: skip
    split_grid = (batch * n_kv_heads, n_chunks)
    # out is allocated in q's layout: its strides follow from q's shape and strides (the key)
    out_strides = out.stride()[:3]
    combine_meta = {"HEAD_DIM_V": dim_v, "BLOCK_DV": block_dv, "BLOCK_C": next_pow2(n_chunks),
                    "num_warps": 4}  # fmt: skip
    combine_grid = (batch * n_heads * seq_q,)
    return (
        Plan(lambda meta: split_grid, split_ints, split_meta),
        Plan(lambda meta: combine_grid, (*out_strides, n_heads, seq_q, n_chunks), combine_meta),
        n_chunks,
        block_dv,
    )
