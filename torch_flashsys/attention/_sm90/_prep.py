"""The fused Hopper backward's preprocessing, a plain Triton kernel (it runs anywhere, the
interpreter included): ``D = rowsum(dO * O) - dLSE`` for every query row, and the float32 dQ
buffer zeroed for the backward's sums (TMA reductions or atomics, added in no fixed order), and
with ``HAS_SEM`` zeroed int32 counters, one per (batch, head, row block): the deterministic
backward's ordered sums, or the fused kernels' in-kernel dQ conversion (off by default)."""

from __future__ import annotations

import triton
import triton.language as tl


# Not specialized: the lengths, the row counts' strides (a multiple of 16 or not with the length:
# a new build at every such change) and the head count. O's and dO's strides stay specialized:
# with head dims of 64 and 128 they are multiples of 16 (vectorized loads).
@triton.jit(do_not_specialize=["seq_q", "stride_lb", "stride_lh", "n_heads"])
def attn_bwd_prep(
    Out, DO, DLSE, Delta, DQ, SEM, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, n_heads, seq_q, HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_SEM: tl.constexpr = False, COPIES: tl.constexpr = 1,
    DIM: tl.constexpr = 0,
):  # fmt: skip
    """Program (row block, b * n_heads + h). ``DQ`` is (COPIES x B, H, seq_q, HEAD_DIM),
    contiguous; ``SEM`` (int32, ``HAS_SEM``) is (COPIES x B, H, row blocks), contiguous. ``DIM``:
    O's and dO's head dim where it is narrower than HEAD_DIM (the fused kernel's; 0: the same),
    their columns past it read as zeros."""
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    ok = rows < seq_q
    inside = ok[:, None] & (cols < DIM)[None, :] if DIM else ok[:, None]
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + cols[None, :],
                mask=inside, other=0.0)  # fmt: skip
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom
                 + cols[None, :], mask=inside, other=0.0)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    l_off = b * stride_lb + h * stride_lh + rows
    if HAS_DLSE:
        delta -= tl.load(DLSE + l_off, mask=ok, other=0.0)
    tl.store(Delta + l_off, delta, mask=ok)
    for c in tl.static_range(COPIES):
        row = c * tl.num_programs(1) + bh
        dq = DQ + row.to(tl.int64) * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
        tl.store(dq, tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), mask=ok[:, None])
        if HAS_SEM:
            tl.store(SEM + row * tl.num_programs(0) + tl.program_id(0), 0)


@triton.jit(do_not_specialize=["seq_q", "n_heads"])
def attn_bwd_dq_sum(
    ACC, DQ, stride_qb, stride_qh, stride_qm, n_heads, seq_q, COPIES: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """dQ = the sum of the deterministic backward's ``COPIES`` float32 dQ copies (``ACC``:
    (COPIES x B, H, seq_q, HEAD_DIM), contiguous), added in copy order, in DQ's dtype and
    layout. Program (row block, b * n_heads + h)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    ok = (rows < seq_q)[:, None]
    offs = rows[:, None] * HEAD_DIM + cols[None, :]
    dq = tl.load(ACC + bh.to(tl.int64) * seq_q * HEAD_DIM + offs, mask=ok, other=0.0)
    for c in tl.static_range(1, COPIES):
        row = c * tl.num_programs(1) + bh
        dq += tl.load(ACC + row.to(tl.int64) * seq_q * HEAD_DIM + offs, mask=ok, other=0.0)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    out = DQ + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + cols[None, :]
    tl.store(out, dq.to(DQ.dtype.element_ty), mask=ok)
