"""FlashAttention forward for Hopper (sm90) in Gluon: warp-specialized, TMA loads, async wgmma.

One program owns ``2 * BLOCK_M`` query rows of one (batch, head) and runs three partitions:

- a **load** warp issues TMA copies: both query halves once, then key and value tiles into a ring
  of ``STAGES`` shared-memory buffers, each guarded by a ready barrier (TMA byte count) and an
  empty barrier (both consumers release it);
- two **consumer** warpgroups, each owning ``BLOCK_M`` (64) query rows, run the FA2 loop on the
  tensor cores: ``S = Q K^T`` (both operands in shared memory), the online softmax in base 2 with
  the scale inside the exponent, ``O += P V`` (P from registers). The two warpgroups run the same
  loop on different rows, so while one computes its softmax the other's wgmma keeps the tensor
  cores busy (the warp scheduler interleaves them, FA3's inter-warpgroup overlap).

The descriptors are 4-D ``(batch, heads, seq, head_dim)`` over the tensors' own strides, so any
layout whose strides are 16-byte multiples works without a copy, and rows past a sequence's end
read as zeros (TMA bounds) rather than the next head's rows. Causal programs are launched
heaviest first with heads varying fastest (better tail balance).

Written against Triton 3.6's Gluon; :mod:`._gluon` guards the import.
"""

from __future__ import annotations

from torch_flashsys.attention._sm90._gluon import (
    AVAILABLE,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

if AVAILABLE:
    LN2 = gl.constexpr(0.6931471805599453)  # ln(2): the kernels work in base 2, lse is natural

    @gluon.jit
    def _attend_tiles(
        acc, l_i, m_i, q, k_smem, v_smem, k_ready, v_ready, kv_empty, lo, hi, r0, seq_k,
        qk_scale, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
    ):  # fmt: skip
        """Key tiles [lo, hi) into (acc, l_i, m_i) for this warpgroup's rows r0.. ; MASKED tiles
        may cross the causal diagonal or the end of the keys."""
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[3]
        HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
        BLOCK_M: gl.constexpr = q.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        for j in range(lo, hi):
            st = j % STAGES
            ph = (j // STAGES) & 1
            k = k_smem.index(st).reshape([BLOCK_N, HEAD_DIM])
            v = v_smem.index(st).reshape([BLOCK_N, HEAD_DIM])
            mbarrier.wait(k_ready.index(st), ph)
            s = warpgroup_mma(q, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s, _, _ = warpgroup_mma_wait(0, deps=(s, q, k))
            if MASKED:
                cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                keep = (cols < seq_k)[None, :]
                if CAUSAL:  # top-left aligned: row i attends keys j <= i
                    rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                    keep = keep & (cols[None, :] <= rows[:, None])
                s = gl.where(keep, s, float("-inf"))
            # Online softmax, base 2, scale in the exponent's FMA (qk_scale = scale * log2(e) > 0,
            # so max(s) * qk_scale is the max of the scaled scores).
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            pa = gl.convert_layout(p.to(q.dtype), p_layout)
            mbarrier.wait(v_ready.index(st), ph)
            acc = warpgroup_mma(pa, v, acc, is_async=True)
            acc, _ = warpgroup_mma_wait(0, deps=(acc, v))
            mbarrier.arrive(kv_empty.index(st), count=1)  # both warpgroups release the stage
        return acc, l_i, m_i

    @gluon.jit
    def _consume(descs, bufs, bars, pos, out, CAUSAL: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup WG: query rows [m0 + WG * BLOCK_M, + BLOCK_M) over every key tile,
        then O (q's dtype) and the natural logsumexp."""
        q_desc, k_desc, v_desc = descs
        q_smem, k_smem, v_smem = bufs
        q_bars, k_ready, v_ready, kv_empty = bars
        b, h, hk, m0, n_kv, seq_q, seq_k, qk_scale = pos
        O, LSE, stride_ob, stride_oh, stride_om, stride_lb, stride_lh = out
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        r0 = m0 + WG * BLOCK_M
        # Key tiles every row of this warpgroup sees whole (no position or length mask).
        if CAUSAL:
            n_full = gl.minimum(r0 + 1, seq_k) // BLOCK_N
        else:
            n_full = seq_k // BLOCK_N
        n_full = gl.minimum(n_full, n_kv)
        q = q_smem.index(WG).reshape([BLOCK_M, HEAD_DIM])
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        mbarrier.wait(q_bars.index(WG), 0)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_smem, v_smem, k_ready, v_ready, kv_empty, 0, n_full, r0, seq_k,
            qk_scale, CAUSAL, False,
        )  # fmt: skip
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_smem, v_smem, k_ready, v_ready, kv_empty, n_full, n_kv, r0,
            seq_k, qk_scale, CAUSAL, True,
        )  # fmt: skip
        # Epilogue: O = acc / l in O's dtype, lse = (m + log2 l) ln 2; rows past seq_q unstored.
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        o_tile = acc / l_o[:, None]
        rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_base = O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
        o_ptrs = o_base + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
        gl.store(o_ptrs, o_tile.to(O.dtype.element_ty), mask=(rows < seq_q)[:, None])
        rows_s = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        lse = (m_i + gl.log2(l_i)) * LN2
        l_base = LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        gl.store(l_base + rows_s, lse, mask=rows_s < seq_q)

    @gluon.jit
    def _consumer0(descs, bufs, bars, pos, out, CAUSAL: gl.constexpr):
        _consume(descs, bufs, bars, pos, out, CAUSAL, 0)

    @gluon.jit
    def _consumer1(descs, bufs, bars, pos, out, CAUSAL: gl.constexpr):
        _consume(descs, bufs, bars, pos, out, CAUSAL, 1)

    @gluon.jit
    def _load(descs, bufs, bars, pos, out, CAUSAL: gl.constexpr):
        """Load warp: both query halves, then the key/value ring."""
        q_desc, k_desc, v_desc = descs
        q_smem, k_smem, v_smem = bufs
        q_bars, k_ready, v_ready, kv_empty = bars
        b, h, hk, m0, n_kv, seq_q, seq_k, qk_scale = pos
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        for i in gl.static_range(2):
            mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc, [b, h, m0 + i * BLOCK_M, 0], q_bars.index(i), q_smem.index(i)
            )
        for j in range(n_kv):
            st = j % STAGES
            ph = (j // STAGES) & 1
            mbarrier.wait(kv_empty.index(st), ph ^ 1)  # a fresh barrier passes parity 1
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(st), k_smem.index(st)
            )
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(st), v_smem.index(st)
            )

    # O = softmax(Q K^T * scale) V;  LSE = logsumexp(Q K^T * scale, dim=-1)
    # (2 * BLOCK_M query rows of one (batch, head) per program)
    @gluon.jit
    def attn_fwd_sm90(
        q_desc, k_desc, v_desc, O, LSE, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
        n_heads, group, seq_q, seq_k, qk_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        gl.static_assert(BLOCK_M == 64, "one warpgroup of 64 rows per consumer")
        gl.static_assert(BLOCK_N == 2 * BLOCK_M, "both consumers see the same key tiles")
        n_tiles = gl.cdiv(seq_q, 2 * BLOCK_M)
        pid = gl.program_id(0)
        if CAUSAL:  # heaviest query tiles first, heads varying fastest
            n_bh = gl.num_programs(0) // n_tiles
            bh = pid % n_bh
            tile = n_tiles - 1 - pid // n_bh
        else:  # consecutive programs share a head: its K and V stay in L2
            bh = pid // n_tiles
            tile = pid % n_tiles
        b = bh // n_heads
        h = bh % n_heads
        hk = h // group  # GQA: the shared key/value head
        m0 = tile * (2 * BLOCK_M)
        hi = seq_k
        if CAUSAL:
            hi = gl.minimum(seq_k, m0 + 2 * BLOCK_M)
        n_kv = gl.cdiv(hi, BLOCK_N)
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warpgroup
        descs = (q_desc, k_desc, v_desc)
        bufs = (q_smem, k_smem, v_smem)
        bars = (q_bars, k_ready, v_ready, kv_empty)
        pos = (b, h, hk, m0, n_kv, seq_q, seq_k, qk_scale)
        out = (O, LSE, stride_ob, stride_oh, stride_om, stride_lb, stride_lh)
        gl.warp_specialize(
            [
                (_consumer0, (descs, bufs, bars, pos, out, CAUSAL)),
                (_consumer1, (descs, bufs, bars, pos, out, CAUSAL)),
                (_load, (descs, bufs, bars, pos, out, CAUSAL)),
            ],
            [4, 1],
            [240, 24],
        )
