"""FlashAttention dK/dV for Hopper (sm90) in Gluon: warp-specialized, TMA loads, async wgmma.

The dK/dV half of the backward (the portable dQ kernel runs first and stores ``D = rowsum(dO * O)``
(minus dLSE), which this kernel reads). One program per key tile of ``2 * BLOCK_N`` keys of one
(batch, key/value head), heaviest causal tiles first (key tile 0 is seen by every query). Three
partitions:

- a **load** warp: the program's K and V tiles once (two halves each), then for every query head
  of the GQA group and every query tile that sees these keys, the tile's Q and dO into a ring of
  ``STAGES`` shared-memory buffers (ready barrier: TMA byte count; empty barrier: both consumers);
- two **consumer** warpgroups, each owning ``BLOCK_N`` (64) keys of the tile and accumulating
  their dK and dV in registers over the query tiles:
  ``S^T = K Q^T``, ``dP^T = V dO^T`` (both operands in shared memory), ``P^T = exp2(S^T * scale
  * log2 e - LSE * log2 e)``, ``dS^T = P^T (dP^T - D)``, ``dV += P^T dO``, ``dK += dS^T Q`` (P^T and
  dS^T from registers). With ``PIPELINE`` the dV/dK products of one query tile stay in flight while
  the next tile's ``S^T``/``dP^T`` are issued (FA3's intra-warpgroup overlap).

The fused kernels add dQ (five products, S and dP computed once): ``attn_bwd_sm90`` (head dim 64)
with a third warpgroup that computes dQ from the consumers' dS^T tiles, ``attn_bwd_split_sm90``
(head dim 128, whose dK and dV fill the consumers' registers) with the consumers computing half of
dQ's columns each; both add their float32 dQ tiles by TMA bulk reductions (in no fixed order;
``attn_bwd_sm90`` with ``DETERMINISTIC`` in a fixed one, paced by a sync warp: ``_fused_dq``,
``_fused_sync``).

The dK/dV kernel is deterministic: every dK/dV row is summed by one program in a fixed order, no
atomics. Query rows past ``seq_q`` read as zeros (TMA bounds) and their LSE as +inf, so their P is
0; keys past ``seq_k`` only touch dK/dV rows that are never stored.

Written against Triton 3.6's Gluon; :mod:`._gluon` guards the import.
"""

from __future__ import annotations

from torch_flashsys.attention._sm90._gluon import (
    AVAILABLE,
    clock64,
    fence_async_shared,
    gl,
    gluon,
    lap,
    mbarrier,
    schedule_fence,
    store_probes,
    thread_barrier,
    tma,
    tma_load,
    tma_reduce_add,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_INTEGER_ARGS = [
    "stride_lb",
    "stride_lh",
    "stride_kb",
    "stride_kh",
    "stride_kn",
    "stride_vb",
    "stride_vh",
    "stride_vn",
    "n_bhk",
    "n_kv_heads",
    "group",
    "seq_q",
    "seq_k",
    "stride_ob",
    "stride_oh",
    "stride_on",
]

if AVAILABLE:
    LOG2E = gl.constexpr(1.4426950408889634)

    # ORDER bits (the host's names for them: _sm90.KEYS_FIRST, _sm90.LIGHTEST_FIRST, same values)
    KEYS_FIRST = gl.constexpr(1)  # one head's key tiles after another
    LIGHTEST_FIRST = gl.constexpr(2)  # the key tiles in descending order
    CHUNKED = gl.constexpr(4)  # chunks of heads in turn, each chunk's heaviest key tiles first
    CHUNK_SHIFT = gl.constexpr(8)  # with CHUNKED, ORDER >> CHUNK_SHIFT: programs per chunk

    @gluon.jit
    def _program_tile(n_bhk, n_kv_heads, seq_q, BLOCK_M: gl.constexpr, BLOCK_N2: gl.constexpr,
                      CAUSAL: gl.constexpr, ORDER: gl.constexpr = 0):  # fmt: skip
        """This program's (b, hk, n0, first query tile, query tiles). ``ORDER`` 0: key tiles in
        order (causal: tile 0 is the heaviest), heads varying fastest, so that the heaviest causal
        tiles of every head start first. Bit ``KEYS_FIRST``: one head's key tiles after another
        instead, so that its Q, dO and dQ sums stay in L2 (the fused kernel without a causal mask,
        where every tile is equally heavy: 8% faster at 4 x 16 x 4096, d 64; causal, it lost the
        longest-first order: 19% slower at GQA 4 x 32/8 x 2048). Bit ``LIGHTEST_FIRST``: the key
        tiles in descending order (the deterministic causal backward: a query tile's dQ sums are
        added from its last key tile down, so a tile's predecessors must have started before
        it). Bit ``CHUNKED`` (causal): chunks of ``ORDER >> CHUNK_SHIFT`` programs' worth of
        heads (at least one head) in turn, each chunk heads first, so that the heaviest tiles of
        a chunk start first and the grid ends on light ones, while the heads in flight, about a
        chunk's, keep their Q, dO and dQ sums in L2 (with about one wave of programs a chunk:
        1-26% faster than the better of the two orders above from 1024 to 8192 tokens, H100,
        ``benchmarks/sm90_bwd.py --variants``)."""
        pid = gl.program_id(0)
        n_kb = gl.num_programs(0) // n_bhk
        if (ORDER & CHUNKED) != 0:
            chunk = gl.minimum(gl.maximum((ORDER >> CHUNK_SHIFT) // n_kb, 1), n_bhk)
            first = (pid // (chunk * n_kb)) * chunk
            heads = gl.minimum(n_bhk - first, chunk)  # the last chunk may be short
            r = pid - first * n_kb
            bhk = first + r % heads
            nb = r // heads
        elif (ORDER & KEYS_FIRST) != 0:  # a head's key tiles one after another (Q, dO, dQ in L2)
            bhk = pid // n_kb
            nb = pid % n_kb
        else:
            bhk = pid % n_bhk
            nb = pid // n_bhk
        if (ORDER & LIGHTEST_FIRST) != 0:
            nb = n_kb - 1 - nb
        n0 = nb * BLOCK_N2
        n_m = gl.cdiv(seq_q, BLOCK_M)
        m_lo = 0
        if CAUSAL:  # top-left aligned: query row i sees keys j <= i
            m_lo = gl.minimum(n0 // BLOCK_M, n_m)
        return bhk // n_kv_heads, bhk % n_kv_heads, n0, m_lo, n_m

    @gluon.jit
    def _probs(s_t, lse2, n0w, m0, qk_scale, CAUSAL: gl.constexpr):
        """``P^T`` of one (keys x queries) tile; causal tiles that cross the diagonal are masked
        (``m0 < n0w + BLOCK_N``: some query of the tile precedes some key)."""
        BLOCK_N: gl.constexpr = s_t.type.shape[0]
        BLOCK_M: gl.constexpr = s_t.type.shape[1]
        s_layout: gl.constexpr = s_t.type.layout
        p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
        if CAUSAL:
            if m0 < n0w + BLOCK_N:
                keys = n0w + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
                rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
                p_t = gl.where(keys[:, None] <= rows[None, :], p_t, 0.0)
        return p_t

    @gluon.jit
    def _row_stats(LSE, Delta, l_off, m0, seq_q, layout: gl.constexpr, BLOCK_M: gl.constexpr):
        """LSE (base 2) and D of query rows m0.. in ``layout``; rows past seq_q get LSE +inf
        (P = 0)."""
        rows = m0 + gl.arange(0, BLOCK_M, layout=layout)
        ok = rows < seq_q
        lse = gl.load(LSE + l_off + rows, mask=ok, other=float("inf"))
        delta = gl.load(Delta + l_off + rows, mask=ok, other=0.0)
        return lse * LOG2E, delta

    @gluon.jit
    def _masked_probs(s_t, lse2, n0w, m0, seq_k, qk_scale, CAUSAL: gl.constexpr):
        """``P^T`` of the fused kernels' (keys n0w.. x queries m0..) tile: 0 where key >
        min(row, seq_k - 1), i.e. after the causal diagonal and for keys past the end (zeros
        there: exp(0 - LSE) can overflow 16 bits, and dQ's inf * 0 is NaN). One compare per
        element on every step: behind a runtime ``if`` the compiler turned the masks into selects
        that every step paid anyway."""
        BLOCK_N: gl.constexpr = s_t.type.shape[0]
        BLOCK_M: gl.constexpr = s_t.type.shape[1]
        s_layout: gl.constexpr = s_t.type.layout
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        keys = n0w + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        if CAUSAL:
            last = gl.minimum(m0 + gl.arange(0, BLOCK_M, layout=col_layout), seq_k - 1)
        else:
            last = gl.full([BLOCK_M], seq_k - 1, gl.int32, col_layout)
        return gl.where(keys[:, None] <= last[None, :], gl.exp2(s_t * qk_scale - lse2[None, :]),
                        0.0)  # fmt: skip

    @gluon.jit
    def _publish(buf, value, ready):
        """Store a warpgroup's ``value`` into shared memory ``buf`` for the async proxy (wgmma,
        TMA) and another partition, then one arrival on ``ready``."""
        buf.store(value)
        fence_async_shared()  # every thread's stores, before the async proxy reads them
        thread_barrier()  # ... all of this warpgroup's, before one thread arrives
        mbarrier.arrive(ready, count=1)

    @gluon.jit
    def _bulk_wait(x, PENDING: gl.constexpr):
        """Wait until all but ``PENDING`` (0 to 3) of this thread's TMA store and reduction groups
        are complete in global memory (``tma.store_wait`` waits only until their shared-memory
        sources are read). ``x``: any scalar (keeps the wait in place)."""
        gl.static_assert(PENDING >= 0 and PENDING <= 3, "0 to 3 groups pending")
        if PENDING == 0:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n mov.u32 $0, $1;", "=r,r",
                                      [x], dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
        elif PENDING == 1:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 1;\n mov.u32 $0, $1;", "=r,r",
                                      [x], dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
        elif PENDING == 2:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 2;\n mov.u32 $0, $1;", "=r,r",
                                      [x], dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
        else:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 3;\n mov.u32 $0, $1;", "=r,r",
                                      [x], dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip

    # dQ converted inside the fused kernels (CONVERT): the warpgroups that add dQ tell a converter
    # warp (ring ``landed``) when a step's bulk reductions have landed in global memory; it counts
    # the query tile's int32 counter up (zeroed by the preprocessing kernel) and, when it counts
    # last, reads the tile's float32 sums back (TMA, into a staging tile), converts them and stores
    # them into dQ. The math warps only wait for their own reductions, three steps late. Off by
    # default (``_sm90.FUSED_CONVERT``): slower, measured (docs/benchmarks.md).
    @gluon.jit
    def _count_issue(counter):
        """Lane 0: a release addition of one to the int32 at ``counter`` (GPU scope), ordering the
        landed reductions this warp was told of (an mbarrier wait) before it; returns the count
        before it in lane 0 (0 elsewhere), read a few steps later (:func:`_count_read`) so that
        the atomics' round trips overlap."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t;\n"
            "mov.u32 t, %laneid; setp.eq.u32 p, t, 0; mov.u32 $0, 0;\n"
            "@p atom.release.gpu.global.add.u32 $0, [$1], 1; }",
            "=r,l", [counter.to(gl.int64, bitcast=True)], dtype=gl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip

    @gluon.jit
    def _count_read(x):
        """Lane 0's count (:func:`_count_issue`) in every lane."""
        return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", [x],
                                         dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def _acquire_for_tma(x):
        """After reading the last count of a tile: an acquire fence at GPU scope (the counts
        were release additions: every addition into the tile happens before what follows) and
        a proxy fence, so that the TMA load that follows (the async proxy) sees the sums.
        ``x``: any scalar (keeps the fences in place)."""
        return gl.inline_asm_elementwise(
            "bar.warp.sync -1;\n fence.acq_rel.gpu;\n fence.proxy.async.global;\n"
            "mov.u32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _opaque(x):
        """``x`` (an int32 scalar), through a move the compiler cannot see through or hoist."""
        return gl.inline_asm_elementwise("mov.u32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                         is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def _contributions(m0, seq_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N2: gl.constexpr):  # fmt: skip
        """How many key tiles (programs) add into query tile ``m0``'s dQ: all of them, or
        causal those up to the one that holds its last row's diagonal."""
        n_kb = gl.cdiv(seq_k, BLOCK_N2)
        need = n_kb
        if CAUSAL:
            need = gl.minimum((m0 + BLOCK_M - 1) // BLOCK_N2, n_kb - 1) + 1
        return need

    @gluon.jit
    def _landed(step, convs, LAG: gl.constexpr = 3):
        """A warpgroup that adds dQ, after issuing step ``step``'s reduction: the reductions of
        ``LAG`` steps before have landed (waited for here, so late that the math rarely waits:
        a bulk reduction into L2 takes several steps to complete under load), so say so on the
        converter's ring (once the converter has taken the ring slot's last use)."""
        conv_landed, conv_free = convs[0], convs[1]
        NCONV: gl.constexpr = conv_landed.type.shape[0]
        _bulk_wait(step, LAG)
        thread_barrier()
        if step >= LAG:
            done = step - LAG
            mbarrier.wait(conv_free.index(done % NCONV), ((done // NCONV) & 1) ^ 1)
            mbarrier.arrive(conv_landed.index(done % NCONV), count=1)

    @gluon.jit
    def _landed_tail(n_steps, convs, LAG: gl.constexpr = 3):
        """After the last step: every reduction landed; say so for the last ``LAG`` steps (as
        :func:`_landed`)."""
        conv_landed, conv_free = convs[0], convs[1]
        NCONV: gl.constexpr = conv_landed.type.shape[0]
        _bulk_wait(n_steps, 0)
        thread_barrier()
        for done in range(gl.maximum(n_steps - LAG, 0), n_steps):
            mbarrier.wait(conv_free.index(done % NCONV), ((done // NCONV) & 1) ^ 1)
            mbarrier.arrive(conv_landed.index(done % NCONV), count=1)

    @gluon.jit
    def _conv_rings(NCONV: gl.constexpr, ADDERS: gl.constexpr, dq_desc):
        """The converter's rings (``landed``: ADDERS arrivals, the warpgroups that add dQ;
        ``free``: the converter's), its TMA barrier and its float32 staging tile."""
        conv_landed = gl.allocate_shared_memory(gl.int64, [NCONV, 1], mbarrier.MBarrierLayout())
        conv_free = gl.allocate_shared_memory(gl.int64, [NCONV, 1], mbarrier.MBarrierLayout())
        conv_loaded = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NCONV):
            mbarrier.init(conv_landed.index(i), count=ADDERS)
            mbarrier.init(conv_free.index(i), count=1)
        mbarrier.init(conv_loaded, count=1)
        staging = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout)
        return conv_landed, conv_free, conv_loaded, staging

    @gluon.jit
    def _dq_converter(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                      ORDER: gl.constexpr, SEM, cvt, convs, CONVERT: gl.constexpr = 1):  # fmt: skip
        """The converter warp (CONVERT; measurement-only probes, wrong dQ: 2, it counts and
        converts nothing; 3, nothing at all, and the warpgroups that add dQ do not wait; 4, it
        counts but converts nothing): per step of its program, once the step's dQ sums have
        landed (``landed``), it counts the query tile's counter up; the warp that counts last
        for a tile (its ``need``-th contribution: :func:`_contributions`) loads its float32
        sums by TMA into the staging tile (a column block at a time: one at head dim 64, two
        at 128), converts them to dQ's dtype and stores them (rows past seq_q not stored)."""
        q_desc, k_desc = descs[0], descs[1]
        n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale = sched
        dq_desc = dqs[4]
        conv_landed, conv_free, conv_loaded, staging = convs
        DQO, stride_ob, stride_oh, stride_on = cvt
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N2: gl.constexpr = 2 * k_desc.block_type.shape[2]
        COLS: gl.constexpr = dq_desc.block_type.shape[3]
        ROWS: gl.constexpr = 8  # staging rows x columns converted at a time (8 floats a lane;
        CHUNK: gl.constexpr = 32  # 8 rows: a swizzle period, 32 floats: 128 bytes)
        gl.static_assert(COLS % CHUNK == 0, "column blocks of 32 floats")
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])
        b, hk, n0, m_lo, n_m = _program_tile(n_bhk, n_kv_heads, seq_q, BLOCK_M, BLOCK_N2,
                                             CAUSAL, ORDER)  # fmt: skip
        n_steps = group * (n_m - m_lo)
        bh0 = (b * n_kv_heads + hk) * group  # the group's first query head
        base = DQO + b.to(gl.int64) * stride_ob + (hk * group).to(gl.int64) * stride_oh
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
        tile = staging.reshape([BLOCK_M, COLS])
        HALVES: gl.constexpr = HEAD_DIM // COLS
        loads = n_steps * 0
        conv = (
            SEM,
            bh0,
            m_lo,
            n_m,
            seq_q,
            seq_k,
            b,
            hk,
            group,
            base,
            stride_oh,
            stride_on,
            dq_desc,
            conv_landed,
            conv_free,
            conv_loaded,
            staging,
            tile,
            rows,
            cols,
        )
        # Each step's count is read four steps after its atomic (the unrolled slots keep
        # each pending count in its own register: a move of it would wait for the atomic).
        c0 = n_steps * 0
        c1 = c0
        c2 = c0
        c3 = c0
        for at in range(0, (n_steps + 4) * (CONVERT != 3), 4):  # (3: a probe, no converter)
            c0, f0 = _count_slot(at, c0, n_steps, conv, CAUSAL, BLOCK_N2, CONVERT)
            c1, f1 = _count_slot(at + 1, c1, n_steps, conv, CAUSAL, BLOCK_N2, CONVERT)
            c2, f2 = _count_slot(at + 2, c2, n_steps, conv, CAUSAL, BLOCK_N2, CONVERT)
            c3, f3 = _count_slot(at + 3, c3, n_steps, conv, CAUSAL, BLOCK_N2, CONVERT)
            last = f0 | (f1 << 1) | (f2 << 2) | (f3 << 3)  # of steps at - 4 .. at - 1
            for j in range(4):  # (a loop: the conversion's code once)
                if ((last >> j) & 1) != 0:
                    loads = _convert_tile(at + j - 4, loads, conv, layout, HALVES)

    @gluon.jit
    def _count_slot(step, pending, n_steps, conv, CAUSAL: gl.constexpr,
                    BLOCK_N2: gl.constexpr, CONVERT: gl.constexpr = 1):  # fmt: skip
        """One step of the converter: whether step ``step - 4`` counted last (``pending``: its
        count, issued at this slot four steps ago), then step ``step``'s landed sums counted
        (the atomic issued, its count returned unread)."""
        (SEM, bh0, m_lo, n_m, seq_q, seq_k, b, hk, group, base, stride_oh, stride_on, dq_desc,
         conv_landed, conv_free, conv_loaded, staging, tile, rows, cols) = conv  # fmt: skip
        NCONV: gl.constexpr = conv_landed.type.shape[0]
        BLOCK_M: gl.constexpr = tile.type.shape[0]
        done = step - 4
        last = step * 0
        if (done >= 0) & (done < n_steps) & (CONVERT == 1):
            m0 = (m_lo + done % (n_m - m_lo)) * BLOCK_M
            need = _contributions(m0, seq_k, CAUSAL, BLOCK_M, BLOCK_N2)
            last = (_count_read(pending) == need - 1).to(gl.int32)
        count = step * 0
        if step < n_steps:
            slot = step % NCONV
            mbarrier.wait(conv_landed.index(slot), (step // NCONV) & 1)
            g = step // (n_m - m_lo)
            m0 = (m_lo + step % (n_m - m_lo)) * BLOCK_M
            if (CONVERT == 1) or (CONVERT == 4):
                count = _count_issue(SEM + (bh0 + g).to(gl.int64) * n_m + m0 // BLOCK_M)
            mbarrier.arrive(conv_free.index(slot), count=1)
        return count, last

    @gluon.jit
    def _convert_tile(step, loads, conv, layout: gl.constexpr, HALVES: gl.constexpr):
        """Convert step ``step``'s query tile (its last count was this warp's): the float32 sums
        by TMA into the staging tile (HALVES column blocks in turn), converted and stored into
        dQ (rows past seq_q not stored); returns the TMA loads made so far."""
        (SEM, bh0, m_lo, n_m, seq_q, seq_k, b, hk, group, base, stride_oh, stride_on, dq_desc,
         conv_landed, conv_free, conv_loaded, staging, tile, rows, cols) = conv  # fmt: skip
        BLOCK_M: gl.constexpr = tile.type.shape[0]
        COLS: gl.constexpr = tile.type.shape[1]
        ROWS: gl.constexpr = rows.type.shape[0]
        CHUNK: gl.constexpr = cols.type.shape[0]
        g = step // (n_m - m_lo)
        m0 = _acquire_for_tma((m_lo + step % (n_m - m_lo)) * BLOCK_M)
        dst = base + g.to(gl.int64) * stride_oh
        for half in range(HALVES):  # (a loop: registers are few)
            fence_async_shared()  # the last conversion's reads before the TMA write
            mbarrier.expect(conv_loaded, dq_desc.block_type.nbytes)
            tma_load(dq_desc, [b, hk * group + g, m0, half * COLS], conv_loaded, staging)
            mbarrier.wait(conv_loaded, loads & 1)
            loads += 1
            # (Offsets from values the compiler cannot see through: offsets that do not depend
            # on the loops would be hoisted out of them, every one of them live.)
            row0 = _opaque(m0)
            col0 = _opaque(half * COLS)
            for r in gl.static_range(BLOCK_M // ROWS):
                at = row0 + r * ROWS + rows
                row_out = dst + (at.to(gl.int64) * stride_on)[:, None]
                for c in gl.static_range(COLS // CHUNK):
                    sums = tile.slice(r * ROWS, ROWS, dim=0).slice(c * CHUNK, CHUNK, dim=1)
                    out = row_out + (col0 + c * CHUNK + cols)[None, :]
                    gl.store(out, sums.load(layout).to(base.dtype.element_ty),
                             mask=(at < seq_q)[:, None])  # fmt: skip
        return loads

    @gluon.jit
    def _wait_turn(lock, turn):
        """Spin until the int32 at ``lock`` reads ``turn`` (relaxed GPU-scope loads); each lane
        polls, no barrier per round. (No acquire: what the wait orders is a TMA reduction, an
        async-proxy operation that acquire semantics do not cover, issued only after the sync
        warp's ``turn_ok`` arrival that follows this loop; the reduction it follows was
        complete in global memory before its counter went up.)"""
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 v;\n"
            "WAIT_TURN: ld.relaxed.gpu.global.b32 v, [$1];\n"
            "setp.ne.s32 p, v, $2;\n"
            "@p bra WAIT_TURN;\n"
            "mov.u32 $0, v; }",
            "=r,l,r", [lock.to(gl.int64, bitcast=True), turn], dtype=gl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip

    @gluon.jit
    def _step_lock(sem_base, step, m_lo, n_m, BLOCK_M: gl.constexpr):
        """The counter of the (query head of the group, query tile) that step ``step`` of a
        program adds into. (Recomputed from the step: a pointer carried across iterations in a
        variable assigned from another carried variable was not carried by Triton 3.6's
        front end, and the kernel waited forever.)"""
        g = step // (n_m - m_lo)
        return sem_base + g * n_m + m_lo + step % (n_m - m_lo)

    @gluon.jit
    def _count_up(lock):
        """Add one to the int32 at ``lock`` (a release reduction at GPU scope, no value back) from
        lane 0 (a one-warp partition's call: one addition)."""
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t;\n"
            "mov.u32 t, %laneid; setp.eq.u32 p, t, 0;\n"
            "@p red.release.gpu.global.add.s32 [$1], 1;\n"
            "mov.u32 $0, 0; }",
            "=r,l", [lock.to(gl.int64, bitcast=True)], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _ordered_setup(n0, b, hk, n_bhk, n_kv_heads, group, seq_k, n_m, SEM,
                       CHAINS: gl.constexpr, BLOCK_N2: gl.constexpr):  # fmt: skip
        """The ordered dQ sums of this program's key tile: ``(nb, last key tile, its dQ copy's
        batch row, its counters' base)``."""
        nb = n0 // BLOCK_N2
        nb_end = gl.cdiv(seq_k, BLOCK_N2) - 1
        dq_b = (nb % CHAINS) * (n_bhk // n_kv_heads) + b
        return nb, nb_end, dq_b, SEM + (dq_b * n_kv_heads + hk).to(gl.int64) * group * n_m

    @gluon.jit
    def _sync_rings(LANDED_ARRIVALS: gl.constexpr):
        """The ordered dQ sums' two rings of four mbarriers (``turn_ok``: one arrival, the sync
        warp's; ``landed``: LANDED_ARRIVALS, the warpgroups that add dQ)."""
        turn_ok = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        landed = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(4):
            mbarrier.init(turn_ok.index(i), count=1)
            mbarrier.init(landed.index(i), count=LANDED_ARRIVALS)
        return turn_ok, landed

    @gluon.jit
    def _turn(m0, nb, nb_end, CAUSAL: gl.constexpr, CHAINS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N2: gl.constexpr):  # fmt: skip
        """The count key tile ``nb`` waits for before adding into query tile ``m0``'s dQ (its
        copy's tiles before it in the sums' order: causal, those above it that see the query
        tile; else those below it)."""
        turn = nb // CHAINS
        if CAUSAL:
            turn = (gl.minimum((m0 + BLOCK_M - 1) // BLOCK_N2, nb_end) - nb) // CHAINS
        return turn

    @gluon.jit
    def _store_dkdv(dk, dv, n0w, b, hk, seq_k, sm_scale, outs):
        """Epilogue of a consumer: dK = scale * sum dS^T Q and dV of keys n0w.., stored straight
        from registers (once per program); rows past seq_k are not stored."""
        LSE, Delta, stride_lb, stride_lh, DK, sdk_b, sdk_h, sdk_n, DV, sdv_b, sdv_h, sdv_n = outs
        BLOCK_N: gl.constexpr = dk.type.shape[0]
        HEAD_DIM: gl.constexpr = dk.type.shape[1]
        acc_layout: gl.constexpr = dk.type.layout
        rows = n0w + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        ok = (rows < seq_k)[:, None]
        dk_base = DK + b.to(gl.int64) * sdk_b + hk.to(gl.int64) * sdk_h
        dv_base = DV + b.to(gl.int64) * sdv_b + hk.to(gl.int64) * sdv_h
        rows64 = rows.to(gl.int64)[:, None]
        gl.store(dk_base + rows64 * sdk_n + cols[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
                 mask=ok)  # fmt: skip
        gl.store(dv_base + rows64 * sdv_n + cols[None, :], dv.to(DV.dtype.element_ty), mask=ok)

    @gluon.jit
    def _consume(descs, bufs, bars, sched, outs, CAUSAL: gl.constexpr, PIPELINE: gl.constexpr,
                 WG: gl.constexpr):  # fmt: skip
        """Consumer warpgroup WG: keys [n0 + WG * BLOCK_N, + BLOCK_N) of this program's tile."""
        q_desc, k_desc, v_desc, do_desc = descs
        q_smem, k_smem, v_smem, do_smem = bufs
        kv_ready, ready, empty = bars
        n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale = sched
        LSE, Delta, stride_lb, stride_lh, DK, sdk_b, sdk_h, sdk_n, DV, sdv_b, sdv_h, sdv_n = outs
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        STAGES: gl.constexpr = q_smem.type.shape[0]
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        b, hk, n0, m_lo, n_m = _program_tile(n_bhk, n_kv_heads, seq_q, BLOCK_M, 2 * BLOCK_N,
                                             CAUSAL)  # fmt: skip
        n0w = n0 + WG * BLOCK_N
        k = k_smem.index(WG).reshape([BLOCK_N, HEAD_DIM])
        v = v_smem.index(WG).reshape([BLOCK_N, HEAD_DIM])
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        mbarrier.wait(kv_ready, 0)
        n_steps = group * (n_m - m_lo)
        if PIPELINE:
            # Step 0's S^T and dP^T are issued before the loop, and every step issues the next
            # step's pair before it waits for its own dV/dK products (the last step re-issues
            # its own pair, drained after the loop, so the loop-carried values keep one type).
            if n_steps > 0:
                mbarrier.wait(ready.index(0), 0)
            q = q_smem.index(0).reshape([BLOCK_M, HEAD_DIM])
            do = do_smem.index(0).reshape([BLOCK_M, HEAD_DIM])
            s_t = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        for step in range(n_steps):
            g = step // (n_m - m_lo)
            m0 = (m_lo + step % (n_m - m_lo)) * BLOCK_M
            h = hk * group + g
            l_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
            lse2, delta = _row_stats(LSE, Delta, l_off, m0, seq_q, col_layout, BLOCK_M)
            st = step % STAGES
            q = q_smem.index(st).reshape([BLOCK_M, HEAD_DIM])
            do = do_smem.index(st).reshape([BLOCK_M, HEAD_DIM])
            if not PIPELINE:
                mbarrier.wait(ready.index(st), (step // STAGES) & 1)
                s_t = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                dp_t = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_w = warpgroup_mma_wait(1, deps=(s_t, k, q))[0]
            p_t = _probs(s_w, lse2, n0w, m0, qk_scale, CAUSAL)
            dp_w = warpgroup_mma_wait(0, deps=(dp_t, v, do))[0]
            ds_t = p_t * (dp_w - delta[None, :])
            pa = gl.convert_layout(p_t.to(dtype), a_layout)
            dsa = gl.convert_layout(ds_t.to(dtype), a_layout)
            dv = warpgroup_mma(pa, do, dv, is_async=True)
            dk = warpgroup_mma(dsa, q, dk, is_async=True)
            if PIPELINE:
                more = step + 1 < n_steps
                nt = gl.where(more, (step + 1) % STAGES, st)
                if more:
                    mbarrier.wait(ready.index(nt), ((step + 1) // STAGES) & 1)
                q_next = q_smem.index(nt).reshape([BLOCK_M, HEAD_DIM])
                do_next = do_smem.index(nt).reshape([BLOCK_M, HEAD_DIM])
                s_t = warpgroup_mma(k, q_next.permute((1, 0)), zero_s, use_acc=False,
                                    is_async=True)  # fmt: skip
                dp_t = warpgroup_mma(v, do_next.permute((1, 0)), zero_s, use_acc=False,
                                     is_async=True)  # fmt: skip
                dv, dk = warpgroup_mma_wait(2, deps=(dv, dk, pa, dsa, q, do))[:2]
            else:
                dv, dk = warpgroup_mma_wait(0, deps=(dv, dk, pa, dsa, q, do))[:2]
            mbarrier.arrive(empty.index(st), count=1)  # both warpgroups release a stage
        if PIPELINE:
            warpgroup_mma_wait(0, deps=(s_t, dp_t))
        _store_dkdv(dk, dv, n0w, b, hk, seq_k, sm_scale, outs)

    @gluon.jit
    def _consumer0(descs, bufs, bars, sched, outs, CAUSAL: gl.constexpr, PIPELINE: gl.constexpr):
        _consume(descs, bufs, bars, sched, outs, CAUSAL, PIPELINE, 0)

    @gluon.jit
    def _consumer1(descs, bufs, bars, sched, outs, CAUSAL: gl.constexpr, PIPELINE: gl.constexpr):
        _consume(descs, bufs, bars, sched, outs, CAUSAL, PIPELINE, 1)

    @gluon.jit
    def _load(descs, bufs, bars, sched, outs, CAUSAL: gl.constexpr, PIPELINE: gl.constexpr,
              ORDER: gl.constexpr = 0, STATS: gl.constexpr = False,
              stats=None):  # fmt: skip
        """Load warp: K and V (two halves each) once, then Q and dO per step into the ring.
        ``STATS`` (the fused kernel): each step's LSE (times log2 e; +inf past seq_q) and D rows
        too, into ``stats`` beside Q and dO: loaded before the stage is free, stored after, the
        warp's second arrival on ``ready``. (The consumers had loaded them themselves, 32
        masked scalar loads a thread a step with their 64-bit address arithmetic: 8-10% of the
        kernel's time, docs/benchmarks.md.)"""
        q_desc, k_desc, v_desc, do_desc = descs
        q_smem, k_smem, v_smem, do_smem = bufs
        kv_ready, ready, empty = bars
        n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale = sched
        LSE, Delta, stride_lb, stride_lh = outs[0], outs[1], outs[2], outs[3]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        STAGES: gl.constexpr = q_smem.type.shape[0]
        row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        b, hk, n0, m_lo, n_m = _program_tile(n_bhk, n_kv_heads, seq_q, BLOCK_M, 2 * BLOCK_N,
                                             CAUSAL, ORDER)  # fmt: skip
        mbarrier.expect(kv_ready, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for i in gl.static_range(2):
            tma_load(k_desc, [b, hk, n0 + i * BLOCK_N, 0], kv_ready, k_smem.index(i))
            tma_load(v_desc, [b, hk, n0 + i * BLOCK_N, 0], kv_ready, v_smem.index(i))
        n_steps = group * (n_m - m_lo)
        l_b = b.to(gl.int64) * stride_lb
        for step in range(n_steps):
            g = step // (n_m - m_lo)
            m0 = (m_lo + step % (n_m - m_lo)) * BLOCK_M
            st = step % STAGES
            if STATS:
                l_off = l_b + (hk * group + g).to(gl.int64) * stride_lh
                lse2, delta = _row_stats(LSE, Delta, l_off, m0, seq_q, row_layout, BLOCK_M)
            mbarrier.wait(empty.index(st), ((step // STAGES) & 1) ^ 1)  # fresh: parity 1 passes
            mbarrier.expect(ready.index(st), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma_load(q_desc, [b, hk * group + g, m0, 0], ready.index(st), q_smem.index(st))
            tma_load(do_desc, [b, hk * group + g, m0, 0], ready.index(st), do_smem.index(st))
            if STATS:
                stats.index(2 * st).store(lse2)
                stats.index(2 * st + 1).store(delta)
                thread_barrier()  # every lane's stores before one lane arrives
                mbarrier.arrive(ready.index(st), count=1)

    # dV_j = sum_i P_ij^T dO_i;  dK_j = scale * sum_i dS_ij^T Q_i  (over every query head of the
    # GQA group), P = exp(S - LSE), dS = P (dP - D), dP = dO V^T.
    @gluon.jit(do_not_specialize=_INTEGER_ARGS)
    def attn_bwd_dkdv_sm90(
        q_desc, k_desc, v_desc, do_desc, LSE, Delta, stride_lb, stride_lh, DK, stride_kb,
        stride_kh, stride_kn, DV, stride_vb, stride_vh, stride_vn, n_bhk, n_kv_heads, group,
        seq_q, seq_k, qk_scale, sm_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
        PIPELINE: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        gl.static_assert(BLOCK_N == 64, "one warpgroup of 64 keys per consumer")
        gl.static_assert(BLOCK_M == BLOCK_N, "one descriptor block for queries and keys")
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(
            dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout
        )
        k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        descs = (q_desc, k_desc, v_desc, do_desc)
        bufs = (q_smem, k_smem, v_smem, do_smem)
        bars = (kv_ready, ready, empty)
        sched = (n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale)
        outs = (LSE, Delta, stride_lb, stride_lh, DK, stride_kb, stride_kh, stride_kn, DV,
                stride_vb, stride_vh, stride_vn)  # fmt: skip
        gl.warp_specialize(
            [
                (_consumer0, (descs, bufs, bars, sched, outs, CAUSAL, PIPELINE)),
                (_consumer1, (descs, bufs, bars, sched, outs, CAUSAL, PIPELINE)),
                (_load, (descs, bufs, bars, sched, outs, CAUSAL, PIPELINE)),
            ],
            [4, 1],
            [240, 24],
        )

    # The fused backward: dQ as well, so S and dP are computed once (five matrix products).
    @gluon.jit
    def _fused_consume(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                       KV_RS: gl.constexpr, DK_RS: gl.constexpr, PROBE: gl.constexpr,
                       ORDER: gl.constexpr, PIN_WAIT: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        """Consumer warpgroup WG of the fused kernel: as :func:`_consume` (serial), and each
        step's dS^T goes to shared memory, where the dQ warpgroup reads it. Each step's LSE and
        D rows come from shared memory, put there by the load warp with Q and dO (8-10% off the
        kernel against loading them here), and P is masked by one unconditional compare per
        element (the compiler had turned runtime ``if``s around the causal and past-the-end
        masks into selects that every step paid twice; docs/benchmarks.md). ``KV_RS``: this
        warpgroup's K and V tiles are held in registers as the A operands of S^T and dP^T (else
        read from shared memory by every product); ``DK_RS``: dS^T is the dK product's A
        operand from registers (else from its shared-memory copy). ``PROBE == 3``: cycles per
        phase of a step, summed, into Delta (measurement only, ``sm90_bwd.py --timeline``).
        ``PIN_WAIT``: a :func:`schedule_fence` before the wait for dP^T, which ptxas otherwise
        hoists above the exponentials of P^T (Triton 3.6), so that they do not overlap it."""
        q_desc, k_desc, v_desc, do_desc = descs
        q_smem, k_smem, v_smem, do_smem = bufs
        kv_ready, ready, empty = bars
        n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale = sched
        LSE, Delta, stride_lb, stride_lh, DK, sdk_b, sdk_h, sdk_n, DV, sdv_b, sdv_h, sdv_n = outs
        ds_smem, ds_ready, ds_empty, DQ, dq_desc, dq_smem, stats = dqs
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        STAGES: gl.constexpr = q_smem.type.shape[0]
        NBUF: gl.constexpr = ds_ready.type.shape[0]
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        b, hk, n0, m_lo, n_m = _program_tile(n_bhk, n_kv_heads, seq_q, BLOCK_M, 2 * BLOCK_N,
                                             CAUSAL, ORDER)  # fmt: skip
        n0w = n0 + WG * BLOCK_N
        k = k_smem.index(WG).reshape([BLOCK_N, HEAD_DIM])
        v = v_smem.index(WG).reshape([BLOCK_N, HEAD_DIM])
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        mbarrier.wait(kv_ready, 0)
        if KV_RS:
            kv_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout,
                                                          k_width=2)  # fmt: skip
            ka = k.load(kv_layout)
            va = v.load(kv_layout)
        n_steps = group * (n_m - m_lo)
        if PROBE == 3:  # cycles per phase, summed over the steps
            c0 = n_steps.to(gl.int64) * 0
            c1 = c0
            c2 = c0
            c3 = c0
            c4 = c0
            c5 = c0
            c6 = c0
            t = clock64(n_steps)
        for step in range(n_steps):
            m0 = (m_lo + step % (n_m - m_lo)) * BLOCK_M
            st = step % STAGES
            q = q_smem.index(st).reshape([BLOCK_M, HEAD_DIM])
            do = do_smem.index(st).reshape([BLOCK_M, HEAD_DIM])
            mbarrier.wait(ready.index(st), (step // STAGES) & 1)
            lse2 = stats.index(2 * st).load(col_layout)  # (LSE * log2 e)
            delta = stats.index(2 * st + 1).load(col_layout)
            if PROBE == 3:
                c0, t = lap(c0, t, step)
            if KV_RS:
                s_t = warpgroup_mma(ka, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                dp_t = warpgroup_mma(va, do.permute((1, 0)), zero_s, use_acc=False,
                                     is_async=True)  # fmt: skip
                s_w = warpgroup_mma_wait(1, deps=(s_t, ka, q))[0]
            else:
                s_t = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                dp_t = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False,
                                     is_async=True)  # fmt: skip
                s_w = warpgroup_mma_wait(1, deps=(s_t, k, q))[0]
            if PROBE == 3:
                c1, t = lap(c1, t, step)
            p_t = _masked_probs(s_w, lse2, n0w, m0, seq_k, qk_scale, CAUSAL)
            pa = gl.convert_layout(p_t.to(dtype), a_layout)
            if PROBE == 3:
                c2, t = lap(c2, t, step)
            if PIN_WAIT:
                schedule_fence(step)
            if KV_RS:
                dp_w = warpgroup_mma_wait(0, deps=(dp_t, va, do))[0]
            else:
                dp_w = warpgroup_mma_wait(0, deps=(dp_t, v, do))[0]
            dv = warpgroup_mma(pa, do, dv, is_async=True)
            ds_t = (p_t * (dp_w - delta[None, :])).to(dtype)
            if PROBE == 3:
                c3, t = lap(c3, t, step)
            # Hand dS^T over: the buffer is free once the dQ warpgroup's product read it.
            buf = step % NBUF
            ds_buf = ds_smem.index(2 * buf + WG)
            mbarrier.wait(ds_empty.index(buf), ((step // NBUF) & 1) ^ 1)  # fresh: parity 1 passes
            if PROBE == 3:
                c4, t = lap(c4, t, step)
            _publish(ds_buf, ds_t, ds_ready.index(buf))
            if PROBE == 3:
                c5, t = lap(c5, t, step)
            if DK_RS:
                dsa = gl.convert_layout(ds_t, a_layout)
                dk = warpgroup_mma(dsa, q, dk, is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=(dv, dk, pa, dsa, q, do))[:2]
            else:
                dk = warpgroup_mma(ds_buf, q, dk, is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=(dv, dk, pa, ds_buf, q, do))[:2]
            mbarrier.arrive(empty.index(st), count=1)  # both warpgroups release a stage
            if PROBE == 3:
                c6, t = lap(c6, t, step)
        _store_dkdv(dk, dv, n0w, b, hk, seq_k, sm_scale, outs)
        if PROBE == 3:  # cycles per phase, summed over steps, into Delta (wrong gradients)
            base = Delta + gl.program_id(0).to(gl.int64) * 48 + WG * 16
            store_probes(base, (c0, c1, c2, c3, c4, c5, c6, n_steps))

    @gluon.jit
    def _fused_consumer0(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                         KV_RS: gl.constexpr, DK_RS: gl.constexpr, PROBE: gl.constexpr,
                         ORDER: gl.constexpr, PIN_WAIT: gl.constexpr):  # fmt: skip
        _fused_consume(
            descs, bufs, bars, sched, outs, dqs, CAUSAL, KV_RS, DK_RS, PROBE, ORDER, PIN_WAIT, 0
        )

    @gluon.jit
    def _fused_consumer1(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                         KV_RS: gl.constexpr, DK_RS: gl.constexpr, PROBE: gl.constexpr,
                         ORDER: gl.constexpr, PIN_WAIT: gl.constexpr):  # fmt: skip
        _fused_consume(
            descs, bufs, bars, sched, outs, dqs, CAUSAL, KV_RS, DK_RS, PROBE, ORDER, PIN_WAIT, 1
        )

    @gluon.jit
    def _fused_load(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                    ORDER: gl.constexpr):  # fmt: skip
        _load(descs, bufs, bars, sched, outs, CAUSAL, False, ORDER, True, dqs[6])

    @gluon.jit
    def _fused_dq(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                  PROBE: gl.constexpr, DQ_TMA: gl.constexpr, ORDER: gl.constexpr, SEM,
                  DETERMINISTIC: gl.constexpr, CHAINS: gl.constexpr, SIGNAL_LAG: gl.constexpr,
                  syncs, convs, CONVERT: gl.constexpr):  # fmt: skip
        """The dQ warpgroup: per step, dQ_i += scale * dS_i K over the program's 2 x BLOCK_N keys
        (both consumers' dS^T tiles from shared memory, K as loaded), added into the float32
        dQ buffer, so the consumers never wait on the reduction: with atomics from registers,
        or (``DQ_TMA``) stored to one of two shared-memory tiles and added by a TMA bulk
        reduction, which runs while the next step's product is computed.

        ``CONVERT`` (with ``DQ_TMA``, not ``DETERMINISTIC``; off by default, docs/attention.md):
        each step's reductions are waited for three steps later and the converter warp told
        (:func:`_landed`, ``convs``).

        ``DETERMINISTIC`` (with ``DQ_TMA``): the key tiles add into a query tile's dQ in a fixed
        order, so that the sums are bitwise reproducible (FA3's deterministic backward). ``SEM``
        holds one int32 counter per (dQ copy x batch, query head, query tile), zeroed by the
        preprocessing kernel; key tile ``nb`` adds into a query tile only when its counter reads
        the tile's turn, and the counter counts up once the addition has landed in global memory
        (not only once its shared-memory tile was read). The sync warp (:func:`_fused_sync`)
        does the polling and the counting; this warpgroup waits on its ``turn_ok`` ring before
        each reduction and, ``SIGNAL_LAG`` (0 to 3) steps later (after that many further
        reductions are issued, so it never waits for its own reductions to land), arrives on
        ``landed``. The turn: causal, from the last key tile that sees the query tile down
        (``nb_last - nb``: with the lightest tiles started first, ``ORDER`` LIGHTEST_FIRST, a
        tile reaches a query tile two steps after the key tile above it); without a causal mask,
        ``nb`` (key tile 0 first). A tile's predecessors have smaller program ids, so they are
        running or done (the hardware starts programs in id order), and the waits point one
        way (to higher key tiles, causal; else lower), so none is circular. ``CHAINS`` (1, 2,
        4): key tile ``nb`` adds into dQ copy ``nb % CHAINS`` (``DQ``, ``SEM``: CHAINS x batch
        rows), each copy in its own order, summed in copy order after the kernel: a tile's
        predecessor is CHAINS key tiles away, 2 x CHAINS steps ahead (causal), more than a
        reduction's round trip."""
        q_desc, k_desc, v_desc, do_desc = descs
        q_smem, k_smem, v_smem, do_smem = bufs
        kv_ready, ready, empty = bars
        n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale = sched
        ds_smem, ds_ready, ds_empty, DQ, dq_desc, dq_smem, stats = dqs
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        NBUF: gl.constexpr = ds_ready.type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        b, hk, n0, m_lo, n_m = _program_tile(n_bhk, n_kv_heads, seq_q, BLOCK_M, 2 * BLOCK_N,
                                             CAUSAL, ORDER)  # fmt: skip
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        offs = rows[:, None] * HEAD_DIM + cols[None, :]  # the buffer is (B, H, seq_q, HEAD_DIM)
        zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
        k0 = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM])
        k1 = k_smem.index(1).reshape([BLOCK_N, HEAD_DIM])
        mbarrier.wait(kv_ready, 0)
        n_steps = group * (n_m - m_lo)
        dq_b = b  # the dQ copy's batch row
        if DETERMINISTIC:
            gl.static_assert(DQ_TMA, "the ordered dQ sums are TMA reductions")
            # A tile's predecessors in the sums' order must start first, or the kernel can wait
            # forever: causal (from the last key tile down) the lightest first, else key order.
            gl.static_assert(((ORDER & LIGHTEST_FIRST) != 0) == CAUSAL,
                             "ordered dQ sums: LIGHTEST_FIRST exactly when causal")  # fmt: skip
            turn_ok, landed = syncs
            NSYNC: gl.constexpr = turn_ok.type.shape[0]
            dq_b = _ordered_setup(n0, b, hk, n_bhk, n_kv_heads, group, seq_k, n_m, SEM, CHAINS,
                                  2 * BLOCK_N)[2]  # fmt: skip
        if CONVERT:
            gl.static_assert(DQ_TMA and not DETERMINISTIC, "dQ converted from TMA sums")
        if PROBE == 3:
            c0 = n_steps.to(gl.int64) * 0
            c1 = c0
            c2 = c0
            c3 = c0
            c4 = c0
            c5 = c0
            t = clock64(n_steps)
        for step in range(n_steps):
            g = step // (n_m - m_lo)
            m0 = (m_lo + step % (n_m - m_lo)) * BLOCK_M
            buf = step % NBUF
            ds0 = ds_smem.index(2 * buf).permute((1, 0))
            ds1 = ds_smem.index(2 * buf + 1).permute((1, 0))
            mbarrier.wait(ds_ready.index(buf), (step // NBUF) & 1)
            if PROBE == 3:
                c0, t = lap(c0, t, step)
            if PROBE == 2:  # measurement only: no dQ work at all
                mbarrier.arrive(ds_empty.index(buf), count=1)
            else:
                dq = warpgroup_mma(ds0, k0, zero, use_acc=False, is_async=True)
                dq = warpgroup_mma(ds1, k1, dq, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq, ds0, ds1, k0, k1))[0]
                mbarrier.arrive(ds_empty.index(buf), count=1)
                if PROBE == 3:
                    c1, t = lap(c1, t, step)
                if DQ_TMA:
                    # Tile step % 2 is free once the reduction issued two steps ago read it.
                    tile = dq_smem.index(step % 2)
                    tma.store_wait(1)
                    thread_barrier()
                    if PROBE == 3:
                        c2, t = lap(c2, t, step)
                    tile.reshape([BLOCK_M, HEAD_DIM]).store(dq * sm_scale)
                    fence_async_shared()
                    thread_barrier()
                    if DETERMINISTIC:
                        if PROBE == 3:
                            c3, t = lap(c3, t, step)
                        # the sync warp saw this tile's turn come
                        mbarrier.wait(turn_ok.index(step % NSYNC), (step // NSYNC) & 1)
                        if PROBE == 3:
                            c4, t = lap(c4, t, step)
                    tma_reduce_add(dq_desc, [dq_b, hk * group + g, m0, 0], tile)  # rows past
                    # seq_q fall outside the descriptor and are dropped
                    if DETERMINISTIC:
                        # The sums of SIGNAL_LAG steps before landed: the sync warp counts up.
                        _bulk_wait(step, SIGNAL_LAG)
                        thread_barrier()
                        if step >= SIGNAL_LAG:
                            done = step - SIGNAL_LAG
                            mbarrier.arrive(landed.index(done % NSYNC), count=1)
                        if PROBE == 3:
                            c5, t = lap(c5, t, step)
                    if CONVERT and CONVERT != 3:  # earlier sums landed: the converter counts
                        _landed(step, convs)
                    if PROBE == 3:
                        c3, t = lap(c3, t, step)
                else:
                    # Rows of HEAD_DIM floats from a multiple of HEAD_DIM: vectorized atomics.
                    row0 = ((b * n_kv_heads + hk) * group + g).to(gl.int64) * seq_q + m0
                    base = DQ + row0 * HEAD_DIM
                    ok = (m0 + rows < seq_q)[:, None]
                    if PROBE == 1:  # measurement only: the product, no sums
                        ok = ok & (dq == 12345.0)
                    gl.atomic_add(base + offs, dq * sm_scale, mask=ok, sem="relaxed")
        if DQ_TMA:
            tma.store_wait(0)  # shared memory stays allocated until the last reduction read it
        if DETERMINISTIC and SIGNAL_LAG > 0:  # the last steps' sums landed
            _bulk_wait(n_steps, 0)
            thread_barrier()
            for done in range(gl.maximum(n_steps - SIGNAL_LAG, 0), n_steps):
                mbarrier.arrive(landed.index(done % NSYNC), count=1)
        if CONVERT and CONVERT != 3:  # the last steps' sums landed
            _landed_tail(n_steps, convs)
        if PROBE == 3:
            Delta = outs[1]
            base = Delta + gl.program_id(0).to(gl.int64) * 48 + 32
            store_probes(base, (c0, c1, c2, c3, c4, c5))
            gl.store(base + 7, n_steps.to(gl.float32))

    @gluon.jit
    def _fused_sync(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                    ORDER: gl.constexpr, SEM, CHAINS: gl.constexpr, SIGNAL_LAG: gl.constexpr,
                    syncs):  # fmt: skip
        """The ordered dQ sums' sync warp (DETERMINISTIC): per step, it polls the counter of the
        query tile the step adds into until the key tile's turn comes, says so to the dQ
        warpgroup (``turn_ok``, a ring of mbarriers), and once the dQ warpgroup says that step's
        sums landed (``landed``, SIGNAL_LAG steps later) counts the counter up. The global
        memory round trips stay off the dQ warpgroup (whose barriers would wait for them);
        this warp runs ahead by the ring's depth."""
        q_desc, k_desc = descs[0], descs[1]
        n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale = sched
        turn_ok, landed = syncs
        NSYNC: gl.constexpr = turn_ok.type.shape[0]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N2: gl.constexpr = 2 * k_desc.block_type.shape[2]
        b, hk, n0, m_lo, n_m = _program_tile(n_bhk, n_kv_heads, seq_q, BLOCK_M, BLOCK_N2,
                                             CAUSAL, ORDER)  # fmt: skip
        nb, nb_end, dq_b, sem_base = _ordered_setup(n0, b, hk, n_bhk, n_kv_heads, group, seq_k,
                                                    n_m, SEM, CHAINS, BLOCK_N2)  # fmt: skip
        n_steps = group * (n_m - m_lo)
        for step in range(n_steps):
            m0 = (m_lo + step % (n_m - m_lo)) * BLOCK_M
            _wait_turn(_step_lock(sem_base, step, m_lo, n_m, BLOCK_M),
                       _turn(m0, nb, nb_end, CAUSAL, CHAINS, BLOCK_M, BLOCK_N2))  # fmt: skip
            mbarrier.arrive(turn_ok.index(step % NSYNC), count=1)
            if step >= SIGNAL_LAG:
                done = step - SIGNAL_LAG
                mbarrier.wait(landed.index(done % NSYNC), (done // NSYNC) & 1)
                _count_up(_step_lock(sem_base, done, m_lo, n_m, BLOCK_M))
        for done in range(gl.maximum(n_steps - SIGNAL_LAG, 0), n_steps):
            mbarrier.wait(landed.index(done % NSYNC), (done // NSYNC) & 1)
            _count_up(_step_lock(sem_base, done, m_lo, n_m, BLOCK_M))

    # dQ = scale * sum_j dS_ij K_j; dK, dV as the dK/dV kernel. dQ is summed in float32 by TMA
    # bulk reductions (DQ_TMA) or atomics (not reproducible bit for bit: the order of the
    # additions varies).
    @gluon.jit(do_not_specialize=_INTEGER_ARGS)
    def attn_bwd_sm90(
        q_desc, k_desc, v_desc, do_desc, LSE, Delta, stride_lb, stride_lh, DK, stride_kb,
        stride_kh, stride_kn, DV, stride_vb, stride_vh, stride_vn, DQ, dq_desc, SEM, DQO,
        stride_ob, stride_oh, stride_on, n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale,
        sm_scale, CAUSAL: gl.constexpr,
        STAGES: gl.constexpr, DS_LAYOUT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        DQ_REGS: gl.constexpr, NBUF: gl.constexpr = 2, KV_RS: gl.constexpr = False,
        DK_RS: gl.constexpr = False, PROBE: gl.constexpr = 0, DQ_TMA: gl.constexpr = False,
        ORDER: gl.constexpr = 0, DETERMINISTIC: gl.constexpr = False, CHAINS: gl.constexpr = 1,
        SIGNAL_LAG: gl.constexpr = 0, PIN_WAIT: gl.constexpr = False,
        CONVERT: gl.constexpr = False, NCONV: gl.constexpr = 8, CONVERT_REGS: gl.constexpr = 24,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        gl.static_assert(BLOCK_N == 64, "one warpgroup of 64 keys per consumer")
        gl.static_assert(BLOCK_M == BLOCK_N, "one descriptor block for queries and keys")
        dtype: gl.constexpr = q_desc.dtype
        cvt = (DQO, stride_ob, stride_oh, stride_on)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(
            dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout
        )
        k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NBUF, BLOCK_N, BLOCK_M], DS_LAYOUT)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=2)  # the TMA loads' bytes and the stats' stores
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(NBUF):
            mbarrier.init(ds_ready.index(i), count=2)  # both consumers' halves stored
            mbarrier.init(ds_empty.index(i), count=1)  # the dQ warpgroup's product read them
        descs = (q_desc, k_desc, v_desc, do_desc)
        bufs = (q_smem, k_smem, v_smem, do_smem)
        bars = (kv_ready, ready, empty)
        sched = (n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale)
        outs = (LSE, Delta, stride_lb, stride_lh, DK, stride_kb, stride_kh, stride_kn, DV,
                stride_vb, stride_vh, stride_vn)  # fmt: skip
        if DQ_TMA:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape,
                                                dq_desc.layout)  # fmt: skip
        else:
            dq_smem = ds_smem  # (unused)
        stats = gl.allocate_shared_memory(  # each stage's LSE * log2 e and D rows
            gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        dqs = (ds_smem, ds_ready, ds_empty, DQ, dq_desc, dq_smem, stats)
        # fmt: off
        # (The two consumers' argument tuples are written out: a tuple held in a variable loses
        # its constexpr members.)
        if DETERMINISTIC:  # the sync warp's rings: turn come, sums landed (4 > SIGNAL_LAG)
            gl.static_assert(SIGNAL_LAG < 4, "the rings hold 4 steps")
            syncs = _sync_rings(1)  # (the dQ warpgroup adds dQ)
            gl.warp_specialize(
                [
                    (_fused_consumer0, (descs, bufs, bars, sched, outs, dqs, CAUSAL, KV_RS,
                                        DK_RS, PROBE, ORDER, PIN_WAIT)),
                    (_fused_consumer1, (descs, bufs, bars, sched, outs, dqs, CAUSAL, KV_RS,
                                        DK_RS, PROBE, ORDER, PIN_WAIT)),
                    (_fused_dq, (descs, bufs, bars, sched, outs, dqs, CAUSAL, PROBE, DQ_TMA,
                                 ORDER, SEM, DETERMINISTIC, CHAINS, SIGNAL_LAG, syncs, None,
                                 False)),
                    (_fused_load, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER)),
                    (_fused_sync, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                   CHAINS, SIGNAL_LAG, syncs)),
                ],
                [4, 4, 1, 1],
                [CONSUMER_REGS, DQ_REGS, 40, 24],
            )
        elif CONVERT:  # the converter warp's rings: the dQ warpgroup's sums landed
            convs = _conv_rings(NCONV, 1, dq_desc)
            gl.warp_specialize(
                [
                    (_fused_consumer0, (descs, bufs, bars, sched, outs, dqs, CAUSAL, KV_RS,
                                        DK_RS, PROBE, ORDER, PIN_WAIT)),
                    (_fused_consumer1, (descs, bufs, bars, sched, outs, dqs, CAUSAL, KV_RS,
                                        DK_RS, PROBE, ORDER, PIN_WAIT)),
                    (_fused_dq, (descs, bufs, bars, sched, outs, dqs, CAUSAL, PROBE, DQ_TMA,
                                 ORDER, SEM, DETERMINISTIC, CHAINS, SIGNAL_LAG, None, convs,
                                 CONVERT)),
                    (_fused_load, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER)),
                    (_dq_converter, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                     cvt, convs, CONVERT)),
                ],
                [4, 4, 1, 1],
                [CONSUMER_REGS, DQ_REGS, 40, CONVERT_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (_fused_consumer0, (descs, bufs, bars, sched, outs, dqs, CAUSAL, KV_RS,
                                        DK_RS, PROBE, ORDER, PIN_WAIT)),
                    (_fused_consumer1, (descs, bufs, bars, sched, outs, dqs, CAUSAL, KV_RS,
                                        DK_RS, PROBE, ORDER, PIN_WAIT)),
                    (_fused_dq, (descs, bufs, bars, sched, outs, dqs, CAUSAL, PROBE, DQ_TMA,
                                 ORDER, SEM, DETERMINISTIC, CHAINS, SIGNAL_LAG, None, None,
                                 False)),
                    (_fused_load, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER)),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, DQ_REGS, 40],  # (the load warp: 24 without the stats)
            )
        # fmt: on

    # The head-dim-128 fused backward. The consumers' dK and dV (64 keys x 128 floats each) leave
    # no registers for a dQ warpgroup, so the consumers compute dQ themselves (FA3's layout):
    # each step both store their dS^T tile to shared memory, wait for the other's, and
    # consumer WG computes dQ's columns [WG * 64, + 64) over the program's 128 keys, which it
    # stores to shared memory and adds into the float32 dQ buffer by a TMA bulk reduction.
    @gluon.jit
    def _split_consume(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                       ORDER: gl.constexpr, WG: gl.constexpr, SEM, DETERMINISTIC: gl.constexpr,
                       CHAINS: gl.constexpr, SIGNAL_LAG: gl.constexpr, syncs,
                       PIN_WAIT: gl.constexpr, convs, CONVERT: gl.constexpr,
                       PROBE: gl.constexpr):  # fmt: skip
        """Consumer warpgroup WG of the head-dim-128 fused kernel: keys [n0 + WG * BLOCK_N,
        + BLOCK_N) for dK and dV (as :func:`_fused_consume`), dQ columns [WG * HALF, + HALF).
        ``DETERMINISTIC``: its dQ reductions in the sums' fixed order, as :func:`_fused_dq`'s
        (the sync warp's ``turn_ok`` before each, ``landed`` from both consumers).
        ``PIN_WAIT``: as :func:`_fused_consume`'s. ``CONVERT``: as :func:`_fused_dq`'s (the
        converter waits for both consumers). ``PROBE`` (measurement only, wrong dQ; not with
        either): 1, no wait for the other consumer's dS^T; 2, no dQ reductions; 3, no dQ work."""
        q_desc, k_desc, v_desc, do_desc = descs
        q_smem, k_smem, v_smem, do_smem = bufs
        kv_ready, ready, empty = bars
        n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale = sched
        ds_smem, ds_ready, ds_empty, DQ, dq_desc, dq_smem, stats = dqs
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        HALF: gl.constexpr = dq_desc.block_type.shape[3]
        STAGES: gl.constexpr = q_smem.type.shape[0]
        NBUF: gl.constexpr = ds_ready.type.shape[0]
        DQ_BUFS: gl.constexpr = dq_smem.type.shape[0] // 2
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        b, hk, n0, m_lo, n_m = _program_tile(n_bhk, n_kv_heads, seq_q, BLOCK_M, 2 * BLOCK_N,
                                             CAUSAL, ORDER)  # fmt: skip
        n0w = n0 + WG * BLOCK_N
        k = k_smem.index(WG).reshape([BLOCK_N, HEAD_DIM])
        v = v_smem.index(WG).reshape([BLOCK_N, HEAD_DIM])
        k0 = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).slice(WG * HALF, HALF, dim=1)
        k1 = k_smem.index(1).reshape([BLOCK_N, HEAD_DIM]).slice(WG * HALF, HALF, dim=1)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        mbarrier.wait(kv_ready, 0)
        n_steps = group * (n_m - m_lo)
        dq_b = b  # the dQ copy's batch row
        if DETERMINISTIC:
            gl.static_assert(((ORDER & LIGHTEST_FIRST) != 0) == CAUSAL,
                             "ordered dQ sums: LIGHTEST_FIRST exactly when causal")  # fmt: skip
            turn_ok, landed = syncs
            NSYNC: gl.constexpr = turn_ok.type.shape[0]
            dq_b = _ordered_setup(n0, b, hk, n_bhk, n_kv_heads, group, seq_k, n_m, SEM, CHAINS,
                                  2 * BLOCK_N)[2]  # fmt: skip
        if CONVERT:
            gl.static_assert(not DETERMINISTIC, "dQ converted from unordered sums")
        gl.static_assert(
            PROBE == 0 or not (DETERMINISTIC or CONVERT),
            "probes skip waits the ordered sums and the converter count on",
        )
        for step in range(n_steps):
            g = step // (n_m - m_lo)
            m0 = (m_lo + step % (n_m - m_lo)) * BLOCK_M
            st = step % STAGES
            q = q_smem.index(st).reshape([BLOCK_M, HEAD_DIM])
            do = do_smem.index(st).reshape([BLOCK_M, HEAD_DIM])
            mbarrier.wait(ready.index(st), (step // STAGES) & 1)
            s_t = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s_w = warpgroup_mma_wait(1, deps=(s_t, k, q))[0]
            # (the rows' LSE and D read where they are used: registers are short)
            lse2 = stats.index(2 * st).load(col_layout)  # (LSE * log2 e)
            p_t = _masked_probs(s_w, lse2, n0w, m0, seq_k, qk_scale, CAUSAL)
            pa = gl.convert_layout(p_t.to(dtype), a_layout)
            if PIN_WAIT:
                schedule_fence(step)
            dp_w = warpgroup_mma_wait(0, deps=(dp_t, v, do))[0]
            dv = warpgroup_mma(pa, do, dv, is_async=True)
            delta = stats.index(2 * st + 1).load(col_layout)
            ds_t = (p_t * (dp_w - delta[None, :])).to(dtype)
            buf = step % NBUF
            ds_buf = ds_smem.index(2 * buf + WG)
            mbarrier.wait(ds_empty.index(buf), ((step // NBUF) & 1) ^ 1)  # fresh: parity 1 passes
            _publish(ds_buf, ds_t, ds_ready.index(buf))
            dk = warpgroup_mma(ds_buf, q, dk, is_async=True)
            if PROBE == 3:  # (measurement only, wrong dQ: no dQ work at all)
                dv, dk = warpgroup_mma_wait(0, deps=(dv, dk, pa, ds_buf, q, do))[:2]
                mbarrier.arrive(ds_empty.index(buf), count=1)
                mbarrier.arrive(empty.index(st), count=1)
            else:
                # dQ[:, WG * HALF:][rows of this step] = dS K over both consumers' keys.
                if PROBE != 1:  # (PROBE 1, measurement only, wrong dQ: no wait for the other)
                    mbarrier.wait(ds_ready.index(buf), (step // NBUF) & 1)
                ds0 = ds_smem.index(2 * buf).permute((1, 0))
                ds1 = ds_smem.index(2 * buf + 1).permute((1, 0))
                dq = warpgroup_mma(ds0, k0, gl.zeros([BLOCK_M, HALF], gl.float32, dq_layout),
                                   use_acc=False, is_async=True)  # fmt: skip
                dq = warpgroup_mma(ds1, k1, dq, is_async=True)
                dv, dk, dq = warpgroup_mma_wait(
                    0, deps=(dv, dk, dq, pa, ds_buf, q, do, ds0, ds1, k0, k1)
                )[:3]  # fmt: skip
                mbarrier.arrive(ds_empty.index(buf), count=1)  # this consumer read both halves
                mbarrier.arrive(empty.index(st), count=1)  # both consumers release a stage
                tile = dq_smem.index(WG * DQ_BUFS + step % DQ_BUFS)
                tma.store_wait(DQ_BUFS - 1)  # the reduction that last read this tile is done
                thread_barrier()
                tile.reshape([BLOCK_M, HALF]).store(dq * sm_scale)
                fence_async_shared()
                thread_barrier()
                if DETERMINISTIC:  # the sync warp saw this tile's turn come
                    mbarrier.wait(turn_ok.index(step % NSYNC), (step // NSYNC) & 1)
                if PROBE != 2:  # (PROBE 2, measurement only, wrong dQ: no reductions)
                    tma_reduce_add(dq_desc, [dq_b, hk * group + g, m0, WG * HALF], tile)
                # (rows past seq_q fall outside the descriptor and are dropped)
            if DETERMINISTIC:  # the sums of SIGNAL_LAG steps before landed
                _bulk_wait(step, SIGNAL_LAG)
                thread_barrier()
                if step >= SIGNAL_LAG:
                    done = step - SIGNAL_LAG
                    mbarrier.arrive(landed.index(done % NSYNC), count=1)
            if CONVERT and CONVERT != 3:  # earlier sums landed: the converter counts them
                _landed(step, convs)
        tma.store_wait(0)  # shared memory stays allocated until the last reduction read it
        if DETERMINISTIC and SIGNAL_LAG > 0:  # the last steps' sums landed
            _bulk_wait(n_steps, 0)
            thread_barrier()
            for done in range(gl.maximum(n_steps - SIGNAL_LAG, 0), n_steps):
                mbarrier.arrive(landed.index(done % NSYNC), count=1)
        if CONVERT and CONVERT != 3:  # the last steps' sums landed
            _landed_tail(n_steps, convs)
        _store_dkdv(dk, dv, n0w, b, hk, seq_k, sm_scale, outs)

    @gluon.jit
    def _split_consumer0(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                         ORDER: gl.constexpr, SEM, DETERMINISTIC: gl.constexpr,
                         CHAINS: gl.constexpr, SIGNAL_LAG: gl.constexpr, syncs,
                         PIN_WAIT: gl.constexpr, convs, CONVERT: gl.constexpr,
                         PROBE: gl.constexpr):  # fmt: skip
        _split_consume(descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, 0, SEM, DETERMINISTIC,
                       CHAINS, SIGNAL_LAG, syncs, PIN_WAIT, convs, CONVERT, PROBE)  # fmt: skip

    @gluon.jit
    def _split_consumer1(descs, bufs, bars, sched, outs, dqs, CAUSAL: gl.constexpr,
                         ORDER: gl.constexpr, SEM, DETERMINISTIC: gl.constexpr,
                         CHAINS: gl.constexpr, SIGNAL_LAG: gl.constexpr, syncs,
                         PIN_WAIT: gl.constexpr, convs, CONVERT: gl.constexpr,
                         PROBE: gl.constexpr):  # fmt: skip
        _split_consume(descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, 1, SEM, DETERMINISTIC,
                       CHAINS, SIGNAL_LAG, syncs, PIN_WAIT, convs, CONVERT, PROBE)  # fmt: skip

    # The same sums as attn_bwd_sm90 for head dim 128 (dq_desc's blocks are half a row wide).
    @gluon.jit(do_not_specialize=_INTEGER_ARGS)
    def attn_bwd_split_sm90(
        q_desc, k_desc, v_desc, do_desc, LSE, Delta, stride_lb, stride_lh, DK, stride_kb,
        stride_kh, stride_kn, DV, stride_vb, stride_vh, stride_vn, DQ, dq_desc, SEM, DQO,
        stride_ob, stride_oh, stride_on, n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale,
        sm_scale, CAUSAL: gl.constexpr,
        STAGES: gl.constexpr, DS_LAYOUT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        LOAD_REGS: gl.constexpr, NBUF: gl.constexpr = 2, DQ_BUFS: gl.constexpr = 1,
        ORDER: gl.constexpr = 0, DETERMINISTIC: gl.constexpr = False, CHAINS: gl.constexpr = 1,
        SIGNAL_LAG: gl.constexpr = 0, PIN_WAIT: gl.constexpr = False,
        CONVERT: gl.constexpr = False, NCONV: gl.constexpr = 8, CONVERT_REGS: gl.constexpr = 24,
        PROBE: gl.constexpr = 0,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        gl.static_assert(BLOCK_N == 64, "one warpgroup of 64 keys per consumer")
        gl.static_assert(BLOCK_M == BLOCK_N, "one descriptor block for queries and keys")
        gl.static_assert(2 * dq_desc.block_type.shape[3] == q_desc.block_type.shape[3],
                         "dQ in two column halves, one per consumer")  # fmt: skip
        dtype: gl.constexpr = q_desc.dtype
        cvt = (DQO, stride_ob, stride_oh, stride_on)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(
            dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout
        )
        k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NBUF, BLOCK_N, BLOCK_M], DS_LAYOUT)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFS] + dq_desc.block_type.shape,
                                            dq_desc.layout)  # fmt: skip
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=2)  # the TMA loads' bytes and the stats' stores
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(NBUF):
            mbarrier.init(ds_ready.index(i), count=2)  # both consumers' dS^T stored
            mbarrier.init(ds_empty.index(i), count=2)  # both consumers' dQ products read them
        stats = gl.allocate_shared_memory(  # each stage's LSE * log2 e and D rows
            gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        descs = (q_desc, k_desc, v_desc, do_desc)
        bufs = (q_smem, k_smem, v_smem, do_smem)
        bars = (kv_ready, ready, empty)
        sched = (n_bhk, n_kv_heads, group, seq_q, seq_k, qk_scale, sm_scale)
        outs = (LSE, Delta, stride_lb, stride_lh, DK, stride_kb, stride_kh, stride_kn, DV,
                stride_vb, stride_vh, stride_vn)  # fmt: skip
        dqs = (ds_smem, ds_ready, ds_empty, DQ, dq_desc, dq_smem, stats)
        # fmt: off
        if DETERMINISTIC:  # the sync warp's rings (4 > SIGNAL_LAG), both consumers add dQ
            gl.static_assert(SIGNAL_LAG < 4, "the rings hold 4 steps")
            syncs = _sync_rings(2)
            gl.warp_specialize(
                [
                    (_split_consumer0, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                        DETERMINISTIC, CHAINS, SIGNAL_LAG, syncs, PIN_WAIT, None,
                                        False, PROBE)),
                    (_split_consumer1, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                        DETERMINISTIC, CHAINS, SIGNAL_LAG, syncs, PIN_WAIT, None,
                                        False, PROBE)),
                    (_fused_load, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER)),
                    (_fused_sync, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                   CHAINS, SIGNAL_LAG, syncs)),
                ],
                [4, 1, 1],
                [CONSUMER_REGS, LOAD_REGS, 24],
            )
        elif CONVERT:  # the converter warp's rings: both consumers' sums landed
            convs = _conv_rings(NCONV, 2, dq_desc)
            gl.warp_specialize(
                [
                    (_split_consumer0, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                        DETERMINISTIC, CHAINS, SIGNAL_LAG, None, PIN_WAIT, convs,
                                        CONVERT, PROBE)),
                    (_split_consumer1, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                        DETERMINISTIC, CHAINS, SIGNAL_LAG, None, PIN_WAIT, convs,
                                        CONVERT, PROBE)),
                    (_fused_load, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER)),
                    (_dq_converter, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                     cvt, convs, CONVERT)),
                ],
                [4, 1, 1],
                [CONSUMER_REGS, LOAD_REGS, CONVERT_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (_split_consumer0, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                        DETERMINISTIC, CHAINS, SIGNAL_LAG, None, PIN_WAIT, None,
                                        False, PROBE)),
                    (_split_consumer1, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER, SEM,
                                        DETERMINISTIC, CHAINS, SIGNAL_LAG, None, PIN_WAIT, None,
                                        False, PROBE)),
                    (_fused_load, (descs, bufs, bars, sched, outs, dqs, CAUSAL, ORDER)),
                ],
                [4, 1],
                [CONSUMER_REGS, LOAD_REGS],
            )
        # fmt: on
