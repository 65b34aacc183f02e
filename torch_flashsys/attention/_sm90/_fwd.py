"""FlashAttention forward for Hopper (sm90) in Gluon: warp-specialized, TMA loads, async wgmma.

Programs walk the query tiles of ``CONSUMERS * BLOCK_M`` rows of every (batch, head) in
schedule order (:func:`_tile`): the host launches one program per SM (persistent: the next
tile's loads overlap this one's epilogue), which takes its tiles in rounds of ``num_programs``
that alternate direction (full attention, short causal sequences) or, ``DYNAMIC`` (longer causal
sequences, whose tiles differ in cost), one after another from a global counter, so the heaviest
tile left goes to whichever program is free first (``PERSISTENT_CAUSAL_MAX`` and ``FWD_DYNAMIC``
in ``_sm90``; a grid of one program per tile is the alternative). Each program runs these
partitions:

- a **load** warp issues TMA copies: a tile's query slices (once their buffers are free), then
  its key and value tiles into rings of ``STAGES`` shared-memory buffers, each guarded by a
  ready barrier (TMA byte count) and an empty barrier (every consumer releases it: a key tile
  once its S is computed, a value tile once its P V is, with ``KV_SPLIT``); with ``DYNAMIC`` it
  also takes the tiles from the counter and hands them to the consumers;
- two or three **consumer** warpgroups (``CONSUMERS``; three at head dim 64 without a causal
  mask over 2048 rows and causal from 8192, ``_sm90.FWD_CONSUMERS3_MIN``), each owning
  ``BLOCK_M`` (64) query rows of the tile, run the FA2 loop on the tensor cores: ``S = Q K^T`` (both operands in shared
  memory), the online softmax in base 2 with the scale inside the exponent, ``O += P V`` (P
  from registers). Within a warpgroup the softmax of tile j is written to run while the wgmma
  of ``P_{j-1} V_{j-1}`` is in flight (FA3's intra-warpgroup overlap), which takes ``PIN_WAIT``
  in the compiled code (ptxas hoists the wait otherwise; see :func:`_consume`; on only where it
  measured faster, ``_sm90.FWD_PIN_WAIT``); the warpgroups take turns to issue their products (a ring of turn barriers), so
  one's softmax runs while the others' matrix products use the tensor cores (inter-warpgroup
  overlap).

The descriptors are 4-D ``(batch, heads, seq, head_dim)`` over the tensors' own strides, so any
layout whose strides are 16-byte multiples works without a copy, and rows past a sequence's end
read as zeros (TMA bounds) rather than the next head's rows.

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
    tma_store,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Phases of a consumer's key-tile step that ``PROBE == 3`` times (``benchmarks/sm90_fwd.py``),
# and the per-tile rest (the first key tile, the last P V, the epilogue).
PROBE_PHASES = ("wait K/V loaded", "wait turn", "issue S, P V", "wait S", "softmax",
                "wait P V, release", "rescale O, convert P", "per tile (first, last, epilogue)")  # fmt: skip

_INTEGER_ARGS = [
    "stride_lb",
    "stride_lh",
    "n_bh",
    "n_heads",
    "group",
    "seq_q",
    "seq_k",
    "group_heads",
]

if AVAILABLE:
    LN2 = gl.constexpr(0.6931471805599453)  # ln(2): the kernel works in base 2, lse is natural

    @gluon.jit
    def _rounds(total):
        """How many schedule entries this program takes: one per round of ``num_programs``
        entries, the last round partly (see :func:`_entry`)."""
        nprog = gl.num_programs(0)
        pid = gl.program_id(0)
        full = total // nprog
        rem = total % nprog
        even = (full % 2) == 0
        in_last = (even & (pid < rem)) | ((not even) & (pid >= nprog - rem))
        return full + in_last.to(gl.int32)

    @gluon.jit
    def _entry(r):
        """The schedule entry this program takes in round ``r``: rounds alternate direction
        (a snake), so the program that took the heaviest tile of one round takes the lightest
        of the next and causal work evens out."""
        nprog = gl.num_programs(0)
        pid = gl.program_id(0)
        odd = r % 2
        return r * nprog + pid + odd * (nprog - 1 - 2 * pid)

    @gluon.jit
    def _static_tile(r, total):
        """The schedule entry a program takes in round ``r`` of the static schedule, ``total``
        once it has none left."""
        t = total
        if r < _rounds(total):
            t = _entry(r)
        return t

    @gluon.jit
    def _fetch_add(counter, last):
        """Lane 0 adds one to the int32 at ``counter`` (relaxed, GPU scope); every lane gets the
        value before (a one-warp partition's call: one addition). The addition that got
        ``last`` (the launch's final one: every program stops after its first value past the
        tiles, so a launch makes exactly ``last + 1`` of them) stores zero back, so the counter
        is zero again for the next launch on the stream."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b32 t, v, z;\n"
            "mov.u32 t, %laneid; setp.eq.u32 p, t, 0;\n"
            "mov.u32 v, 0; mov.u32 z, 0;\n"
            "@p atom.relaxed.gpu.global.add.u32 v, [$1], 1;\n"
            "setp.eq.and.u32 q, v, $2, p;\n"
            "@q st.relaxed.gpu.global.u32 [$1], z;\n"
            "shfl.sync.idx.b32 $0, v, 0, 31, -1; }",
            "=r,l,r", [counter.to(gl.int64, bitcast=True), last], dtype=gl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _publish(tiles, tid, r):
        """Load warp (DYNAMIC): schedule entry ``tid`` into the consumers' slot of round ``r``
        once both have released it (``total`` or more: no tile left)."""
        slots, ready, empty = tiles
        NT: gl.constexpr = slots.type.shape[0]
        slot = r % NT
        mbarrier.wait(empty.index(slot), ((r // NT) & 1) ^ 1)  # fresh: parity 1 passes
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        slots.index(slot).store(gl.full([1], tid, gl.int32, one))
        thread_barrier()
        mbarrier.arrive(ready.index(slot), count=1)

    @gluon.jit
    def _next_tile(r, total, tiles, DYNAMIC: gl.constexpr):
        """A consumer's schedule entry of round ``r``: the static schedule's, or (DYNAMIC) the
        one the load warp published (after releasing round ``r - 1``'s slot: every warp of the
        warpgroup read it before that tile's epilogue)."""
        if DYNAMIC:
            slots, ready, empty = tiles
            NT: gl.constexpr = slots.type.shape[0]
            if r > 0:
                mbarrier.arrive(empty.index((r - 1) % NT), count=1)
            slot = r % NT
            mbarrier.wait(ready.index(slot), (r // NT) & 1)
            wg: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            t = gl.max(slots.index(slot).load(wg), axis=0)
        else:
            t = _static_tile(r, total)
        return t

    @gluon.jit
    def _tile(t, sched, BLOCK_M2: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """Schedule entry ``t`` -> (b, h, hk, m0, n_kv): batch, head, key/value head, first query
        row and number of key tiles of that query tile.

        Full attention: one head's tiles after another (its K and V stay in L2). Causal: heads in
        groups of ``group_heads`` whose keys and values fit in L2 together, and within a group
        the heaviest tiles first with heads varying fastest (longest-processing-time order)."""
        n_m, n_bh, n_heads, group, seq_q, seq_k, qk_scale, group_heads = sched
        if CAUSAL:
            per_group = group_heads * n_m
            first = (t // per_group) * group_heads
            in_group = gl.minimum(group_heads, n_bh - first)  # the last group may be smaller
            within = t % per_group
            bh = first + within % in_group
            tile = n_m - 1 - within // in_group
        else:
            bh = t // n_m
            tile = t % n_m
        b = bh // n_heads
        h = bh % n_heads
        m0 = tile * BLOCK_M2
        hi = seq_k
        if CAUSAL:
            hi = gl.minimum(seq_k, m0 + BLOCK_M2)
        return b, h, h // group, m0, gl.cdiv(hi, BLOCK_N)

    @gluon.jit
    def _row_max(s):
        """Each row's maximum of a score tile in the wgmma accumulator layout, as a tree: the
        elementwise maximum of the two column halves while both halves of a row sit in the same
        thread (four halvings of 128 columns: each thread holds column pairs 8 apart), then the
        reduction over the quad's lanes. ``gl.max(s, 1)`` compiles to one dependent chain of 31
        maxima per row before the shuffles (ptxas keeps the order); this has depth 5. Maxima do
        not round, so the result is the same bits."""
        BLOCK_M: gl.constexpr = s.type.shape[0]
        BLOCK_N: gl.constexpr = s.type.shape[1]
        x = gl.max(gl.reshape(s, [BLOCK_M, 2, BLOCK_N // 2]), axis=1)
        x = gl.max(gl.reshape(x, [BLOCK_M, 2, BLOCK_N // 4]), axis=1)
        x = gl.max(gl.reshape(x, [BLOCK_M, 2, BLOCK_N // 8]), axis=1)
        x = gl.max(gl.reshape(x, [BLOCK_M, 2, BLOCK_N // 16]), axis=1)
        return gl.max(x, 1)

    @gluon.jit
    def _softmax_tile(s, j, n_full, r0, m_i, l_i, seq_k, qk_scale, CAUSAL: gl.constexpr,
                      ROW_BOUND: gl.constexpr = False, MASK: gl.constexpr = 0,
                      TREE: gl.constexpr = False):  # fmt: skip
        """Online softmax (base 2, scale in the exponent's FMA) of score tile j of rows r0.. :
        ``(p, alpha, m_new, l_new)``. Tiles from n_full on may cross the causal diagonal or the
        end of the keys and are masked (qk_scale > 0: max(s) * qk_scale is the scaled max);
        ``MASK`` 1 / 2: never / always, known at compile time. ``ROW_BOUND``: the causal mask as
        one bound per row (the three-consumer build's form, below). ``TREE``: the row maximum
        as a tree (:func:`_row_max`) instead of one chain per row (the same bits)."""
        BLOCK_M: gl.constexpr = s.type.shape[0]
        BLOCK_N: gl.constexpr = s.type.shape[1]
        s_layout: gl.constexpr = s.type.layout
        # MASK: 0 the tile is masked from n_full on (a runtime test), 1 never, 2 always
        if (MASK == 2) or ((MASK == 0) and (j >= n_full)):
            if CAUSAL and ROW_BOUND:
                # Column c is key j * BLOCK_N + c: kept where that key is < seq_k and <= the row,
                # i.e. c <= one bound per row, compared with the column offsets (constants). Fewer
                # registers than a key index per element: three consumers' causal build spills
                # 25 lines of SASS instead of 95 at 160 registers. Two consumers keep the form
                # below, whose builds were measured (the other form moved their registers).
                last = seq_k - 1 - j * BLOCK_N
                offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                keep = offs[None, :] <= gl.minimum(rows - j * BLOCK_N, last)[:, None]
            else:
                cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                keep = (cols < seq_k)[None, :]
                if CAUSAL:  # top-left aligned: row i attends keys j <= i
                    rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                    keep = keep & (cols[None, :] <= rows[:, None])
            s = gl.where(keep, s, float("-inf"))
        if TREE:
            m_new = gl.maximum(m_i, gl.convert_layout(_row_max(s), m_i.type.layout) * qk_scale)
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _step(q, k, v, s, acc, pa, m_i, l_i, j, n_full, r0, seq_k, qk_scale, turns, k_turn,
              k_empty, v_empty, st, sp, CAUSAL: gl.constexpr, KV_SPLIT: gl.constexpr,
              PIN_WAIT: gl.constexpr, MASK: gl.constexpr, WG: gl.constexpr,
              TREE: gl.constexpr = False):  # fmt: skip
        """One key-tile step of a consumer (its K and V loaded): S_j and P_{j-1} V_{j-1} in its
        turn, the softmax of S_j (masked by ``MASK``, as :func:`_softmax_tile`) while P V runs.
        The three-consumer causal loop's, split by mask (the same steps as :func:`_consume`'s
        loop, without the timeline probes)."""
        o_layout: gl.constexpr = acc.type.layout
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        _my_turn(turns, k_turn, WG)
        s = warpgroup_mma(q, k.permute((1, 0)), s, use_acc=False, is_async=True)
        acc = warpgroup_mma(pa, v, acc, is_async=True)
        _pass_turn(turns, WG)
        s = warpgroup_mma_wait(1, deps=(s, q, k))[0]  # S_j done; P V may still run
        if KV_SPLIT:
            mbarrier.arrive(k_empty.index(st), count=1)
        p, alpha, m_i, l_i = _softmax_tile(s, j, n_full, r0, m_i, l_i, seq_k, qk_scale, CAUSAL,
                                           True, MASK, TREE)  # fmt: skip
        if PIN_WAIT:
            schedule_fence(j)
        acc = warpgroup_mma_wait(0, deps=(acc, v, pa))[0]
        _release_kv(k_empty, v_empty, sp, KV_SPLIT)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        pa = gl.convert_layout(p.to(q.dtype), p_layout)
        return s, acc, pa, m_i, l_i

    @gluon.jit
    def _steps(lo, hi, it, q, rings, s, acc, pa, m_i, l_i, k_turn, n_full, r0, seq_k, qk_scale,
               CAUSAL: gl.constexpr, KV_SPLIT: gl.constexpr, PIN_WAIT: gl.constexpr,
               MASK: gl.constexpr, WG: gl.constexpr, TREE: gl.constexpr = False):  # fmt: skip
        """Key tiles ``lo`` to ``hi`` (exclusive) of the three-consumer causal loop, each a
        :func:`_step` once its K and V have landed (``it``: the tile's first ring slot); the two
        loops (without and with the mask) are this with MASK 1 and 2."""
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turns = rings
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[3]
        HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
        for j in range(lo, hi):
            st = (it + j) % STAGES
            k = k_smem.index(st).reshape([BLOCK_N, HEAD_DIM])
            mbarrier.wait(k_ready.index(st), ((it + j) // STAGES) & 1)
            sp = (it + j - 1) % STAGES
            v = v_smem.index(sp).reshape([BLOCK_N, HEAD_DIM])
            mbarrier.wait(v_ready.index(sp), ((it + j - 1) // STAGES) & 1)
            s, acc, pa, m_i, l_i = _step(q, k, v, s, acc, pa, m_i, l_i, j, n_full, r0, seq_k,
                                         qk_scale, turns, k_turn, k_empty, v_empty, st, sp,
                                         CAUSAL, KV_SPLIT, PIN_WAIT, MASK, WG, TREE)  # fmt: skip
            k_turn += 1
        return s, acc, pa, m_i, l_i, k_turn

    @gluon.jit
    def _my_turn(turns, k, WG: gl.constexpr):
        """Wait until warpgroup WG may issue its k-th round of matrix products: the consumers
        take turns in a ring (warpgroup 0 first), so one's softmax runs while the others' wgmma
        use the tensor cores (FA3's ping-pong; with three consumers, its round robin)."""
        FIRST: gl.constexpr = 1 if WG == 0 else 0  # a fresh barrier passes parity 1
        mbarrier.wait(turns.index(WG), (k & 1) ^ FIRST)

    @gluon.jit
    def _pass_turn(turns, WG: gl.constexpr):
        CONSUMERS: gl.constexpr = turns.type.shape[0]
        mbarrier.arrive(turns.index((WG + 1) % CONSUMERS), count=1)

    @gluon.jit
    def _consume(descs, bufs, bars, sched, out, CAUSAL: gl.constexpr, KV_SPLIT: gl.constexpr,
                 PROBE: gl.constexpr, DYNAMIC: gl.constexpr, QBUF: gl.constexpr,
                 PIN_WAIT: gl.constexpr, Q_RS: gl.constexpr, TREE_MAX: gl.constexpr,
                 WG: gl.constexpr):  # fmt: skip
        """Consumer warpgroup WG: rows [m0 + WG * BLOCK_M, + BLOCK_M) of each of this program's
        tiles over their key tiles, then O (q's dtype, a TMA store) and the natural logsumexp.
        ``KV_SPLIT``: a key tile is released once its S is computed, a value tile once its P V
        is (else both when P V is). ``PROBE == 3``: cycles per phase (:data:`PROBE_PHASES`),
        summed over the key tiles, stored in LSE's first ``32 * programs`` floats instead of
        the logsumexp (measurement only). ``DYNAMIC``: the tiles the load warp hands over.
        ``QBUF``: query buffers per warpgroup (tile ``n`` in buffer ``n % QBUF``).
        ``PIN_WAIT``: a :func:`schedule_fence` before each step's wait for ``P V``, without which
        ptxas hoists that wait above the softmax (Triton 3.6, H100 SASS), so the softmax of S_j
        does not overlap ``P_{j-1} V_{j-1}`` after all. ``Q_RS``: the query slice is read into
        registers once per tile (its buffer released at once) and each ``S = Q K^T`` takes it
        from there (a register operand: the product reads only K from shared memory).
        ``TREE_MAX``: each score tile's row maximum as a tree (:func:`_row_max`; the same bits)."""
        q_desc, k_desc, v_desc, o_desc = descs
        q_smem, k_smem, v_smem, o_smem = bufs
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tiles = bars
        n_m, n_bh, n_heads, group, seq_q, seq_k, qk_scale, group_heads = sched
        LSE, stride_lb, stride_lh, COUNTER = out
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        CONSUMERS: gl.constexpr = turns.type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        o_buf = o_smem.index(WG)
        it = 0  # key tiles consumed so far (the ring's position)
        n_done = 0  # query tiles done so far (the query buffer's phase)
        k_turn = 0  # rounds of matrix products issued so far (the turn barriers' phase)
        total = n_m * n_bh
        r = 0  # query tiles taken so far
        tid = _next_tile(r, total, tiles, DYNAMIC)
        if PROBE == 3:  # cycles per phase, summed over the key tiles
            c0 = total.to(gl.int64) * 0
            c1 = c0
            c2 = c0
            c3 = c0
            c4 = c0
            c5 = c0
            c6 = c0
            c7 = c0
            n_steps = c0
            t = clock64(total)
        while tid < total:
            b, h, hk, m0, n_kv = _tile(tid, sched, CONSUMERS * BLOCK_M, BLOCK_N, CAUSAL)
            r0 = m0 + WG * BLOCK_M
            if CAUSAL:  # key tiles every row of this warpgroup sees whole
                n_full = gl.minimum(r0 + 1, seq_k) // BLOCK_N
            else:
                n_full = seq_k // BLOCK_N
            n_mine = n_kv  # key tiles this warpgroup's rows see
            if CAUSAL and CONSUMERS == 3:  # a 192-row tile's last key tiles are past some rows
                n_mine = gl.cdiv(gl.minimum(seq_k, r0 + BLOCK_M), BLOCK_N)
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
            s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
            qb = (n_done % QBUF) * CONSUMERS + WG
            q = q_smem.index(qb).reshape([BLOCK_M, HEAD_DIM])
            mbarrier.wait(q_ready.index(qb), (n_done // QBUF) & 1)
            if Q_RS:  # Q as the products' register operand; its buffer is free at once
                q = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
                thread_barrier()  # (every thread has read it)
                mbarrier.arrive(q_empty.index(qb), count=1)
            # Key tile 0: S, then its softmax.
            st = it % STAGES
            k = k_smem.index(st).reshape([BLOCK_N, HEAD_DIM])
            mbarrier.wait(k_ready.index(st), (it // STAGES) & 1)
            _my_turn(turns, k_turn, WG)
            s = warpgroup_mma(q, k.permute((1, 0)), s, use_acc=False, is_async=True)
            _pass_turn(turns, WG)
            k_turn += 1
            s = warpgroup_mma_wait(0, deps=(s, q, k))[0]
            if KV_SPLIT:
                mbarrier.arrive(k_empty.index(st), count=1)  # every consumer releases a key tile
            p, alpha, m_i, l_i = _softmax_tile(s, 0, n_full, r0, m_i, l_i, seq_k, qk_scale, CAUSAL,
                                               CONSUMERS == 3, 0, TREE_MAX)  # fmt: skip
            pa = gl.convert_layout(p.to(q.dtype), p_layout)
            if PROBE == 3:
                c7, t = lap(c7, t, r)
            # Tile j: issue S_j and P_{j-1} V_{j-1} in this warpgroup's turn; the softmax of S_j
            # runs while P V and the other warpgroup's products use the tensor cores. Three
            # causal consumers: the steps without a mask, then those with one, in two loops (the
            # mask's registers then stay out of the first: fewer spills at 160 registers).
            if CAUSAL and CONSUMERS == 3:
                n_plain = gl.maximum(gl.minimum(n_full, n_mine), 1)
                rings = (k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turns)
                s, acc, pa, m_i, l_i, k_turn = _steps(
                    1, n_plain, it, q, rings, s, acc, pa, m_i, l_i, k_turn, n_full, r0, seq_k,
                    qk_scale, CAUSAL, KV_SPLIT, PIN_WAIT, 1, WG, TREE_MAX)  # fmt: skip
                s, acc, pa, m_i, l_i, k_turn = _steps(
                    n_plain, n_mine, it, q, rings, s, acc, pa, m_i, l_i, k_turn, n_full, r0,
                    seq_k, qk_scale, CAUSAL, KV_SPLIT, PIN_WAIT, 2, WG, TREE_MAX)  # fmt: skip
            else:
                for j in range(1, n_mine):
                    st = (it + j) % STAGES
                    k = k_smem.index(st).reshape([BLOCK_N, HEAD_DIM])
                    mbarrier.wait(k_ready.index(st), ((it + j) // STAGES) & 1)
                    sp = (it + j - 1) % STAGES
                    v = v_smem.index(sp).reshape([BLOCK_N, HEAD_DIM])
                    mbarrier.wait(v_ready.index(sp), ((it + j - 1) // STAGES) & 1)
                    if PROBE == 3:
                        c0, t = lap(c0, t, j)
                    _my_turn(turns, k_turn, WG)
                    if PROBE == 3:
                        c1, t = lap(c1, t, j)
                    s = warpgroup_mma(q, k.permute((1, 0)), s, use_acc=False, is_async=True)
                    acc = warpgroup_mma(pa, v, acc, is_async=True)
                    _pass_turn(turns, WG)
                    k_turn += 1
                    if PROBE == 3:
                        c2, t = lap(c2, t, j)
                    s = warpgroup_mma_wait(1, deps=(s, q, k))[0]  # S_j done; P V may still run
                    if KV_SPLIT:
                        mbarrier.arrive(k_empty.index(st), count=1)
                    if PROBE == 3:
                        c3, t = lap(c3, t, j)
                    p, alpha, m_i, l_i = _softmax_tile(
                        s, j, n_full, r0, m_i, l_i, seq_k, qk_scale, CAUSAL, False, 0, TREE_MAX
                    )  # fmt: skip
                    if PROBE == 3:
                        c4, t = lap(c4, t, j)
                    if PIN_WAIT:
                        schedule_fence(j)
                    acc = warpgroup_mma_wait(0, deps=(acc, v, pa))[0]
                    _release_kv(k_empty, v_empty, sp, KV_SPLIT)  # every consumer releases them
                    if PROBE == 3:
                        c5, t = lap(c5, t, j)
                    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                    pa = gl.convert_layout(p.to(q.dtype), p_layout)
                    if PROBE == 3:
                        c6, t = lap(c6, t, j)
                        n_steps += 1
            if not Q_RS:
                mbarrier.arrive(q_empty.index(qb), count=1)  # every S of this tile is done
            sp = (it + n_mine - 1) % STAGES
            v = v_smem.index(sp).reshape([BLOCK_N, HEAD_DIM])
            mbarrier.wait(v_ready.index(sp), ((it + n_mine - 1) // STAGES) & 1)
            _my_turn(turns, k_turn, WG)
            acc = warpgroup_mma(pa, v, acc, is_async=True)
            _pass_turn(turns, WG)
            k_turn += 1
            acc = warpgroup_mma_wait(0, deps=(acc, v, pa))[0]
            _release_kv(k_empty, v_empty, sp, KV_SPLIT)
            # Key tiles past this warpgroup's rows (three consumers, causal): release them once
            # loaded (a release before its load could count towards the stage's previous round)
            # and take their turns, so the ring and the turns stay in step with the others.
            if CAUSAL and CONSUMERS == 3:  # (other builds: n_mine == n_kv)
                for j in range(n_mine, n_kv):
                    st = (it + j) % STAGES
                    mbarrier.wait(k_ready.index(st), ((it + j) // STAGES) & 1)
                    if KV_SPLIT:
                        mbarrier.arrive(k_empty.index(st), count=1)
                    mbarrier.wait(v_ready.index(st), ((it + j) // STAGES) & 1)
                    _release_kv(k_empty, v_empty, st, KV_SPLIT)
                    _my_turn(turns, k_turn, WG)
                    _pass_turn(turns, WG)
                    k_turn += 1
            it += n_kv
            n_done += 1
            # Epilogue: O = acc / l through shared memory and a TMA store (rows past seq_q are
            # clipped by the descriptor), lse = (m + log2 l) ln 2 stored directly.
            o_tile = acc / gl.convert_layout(l_i, o_rows)[:, None]
            tma.store_wait(0)  # this warpgroup's previous store has left the buffer
            o_buf.reshape([BLOCK_M, HEAD_DIM]).store(o_tile.to(q.dtype))
            fence_async_shared()
            tma_store(o_desc, [b, h, r0, 0], o_buf)
            rows_s = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            lse = (m_i + gl.log2(l_i)) * LN2
            l_base = LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
            if PROBE != 3:
                gl.store(l_base + rows_s, lse, mask=rows_s < seq_q)
            else:
                c7, t = lap(c7, t, r)
            r += 1
            tid = _next_tile(r, total, tiles, DYNAMIC)
        tma.store_wait(0)
        if PROBE == 3:  # cycles per phase, summed over key tiles, into LSE (no logsumexp)
            base = LSE + gl.program_id(0).to(gl.int64) * 32 + WG * 16
            store_probes(base, (c0, c1, c2, c3, c4, c5, c6, c7, n_steps, r))

    @gluon.jit
    def _release_kv(k_empty, v_empty, st, KV_SPLIT: gl.constexpr):
        """A consumer's P V of stage ``st`` is done: release its value tile (and, without
        KV_SPLIT, the key tile beside it: both wait on ``v_empty``)."""
        mbarrier.arrive(v_empty.index(st), count=1)

    @gluon.jit
    def _drain(descs, bars, sched, CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr,
               QBUF: gl.constexpr, WG: gl.constexpr):  # fmt: skip
        """``PROBE == 4`` (measurement only: no output): consumer WG takes its tiles as
        :func:`_consume` does and releases each query, key and value buffer as soon as it has
        landed, with no products: the time of the load warp's TMA traffic alone, at the pace
        its ring allows (``benchmarks/sm90_fwd.py``)."""
        q_desc, k_desc, v_desc, o_desc = descs
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tiles = bars
        n_m, n_bh, n_heads, group, seq_q, seq_k, qk_scale, group_heads = sched
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        STAGES: gl.constexpr = k_ready.type.shape[0]
        CONSUMERS: gl.constexpr = turns.type.shape[0]
        it = 0
        n_done = 0
        total = n_m * n_bh
        r = 0
        tid = _next_tile(r, total, tiles, DYNAMIC)
        while tid < total:
            b, h, hk, m0, n_kv = _tile(tid, sched, CONSUMERS * BLOCK_M, BLOCK_N, CAUSAL)
            qb = (n_done % QBUF) * CONSUMERS + WG
            mbarrier.wait(q_ready.index(qb), (n_done // QBUF) & 1)
            for j in range(n_kv):
                st = (it + j) % STAGES
                phase = ((it + j) // STAGES) & 1
                mbarrier.wait(k_ready.index(st), phase)
                mbarrier.arrive(k_empty.index(st), count=1)
                mbarrier.wait(v_ready.index(st), phase)
                mbarrier.arrive(v_empty.index(st), count=1)
            mbarrier.arrive(q_empty.index(qb), count=1)
            it += n_kv
            n_done += 1
            r += 1
            tid = _next_tile(r, total, tiles, DYNAMIC)

    @gluon.jit
    def _consumer0(descs, bufs, bars, sched, out, CAUSAL: gl.constexpr, KV_SPLIT: gl.constexpr,
                   PROBE: gl.constexpr, DYNAMIC: gl.constexpr, QBUF: gl.constexpr,
                   PIN_WAIT: gl.constexpr, Q_RS: gl.constexpr,
                   TREE_MAX: gl.constexpr):  # fmt: skip
        if PROBE == 4:
            _drain(descs, bars, sched, CAUSAL, DYNAMIC, QBUF, 0)
        else:
            _consume(descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC, QBUF,
                     PIN_WAIT, Q_RS, TREE_MAX, 0)  # fmt: skip

    @gluon.jit
    def _consumer1(descs, bufs, bars, sched, out, CAUSAL: gl.constexpr, KV_SPLIT: gl.constexpr,
                   PROBE: gl.constexpr, DYNAMIC: gl.constexpr, QBUF: gl.constexpr,
                   PIN_WAIT: gl.constexpr, Q_RS: gl.constexpr,
                   TREE_MAX: gl.constexpr):  # fmt: skip
        if PROBE == 4:
            _drain(descs, bars, sched, CAUSAL, DYNAMIC, QBUF, 1)
        else:
            _consume(descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC, QBUF,
                     PIN_WAIT, Q_RS, TREE_MAX, 1)  # fmt: skip

    @gluon.jit
    def _consumer2(descs, bufs, bars, sched, out, CAUSAL: gl.constexpr, KV_SPLIT: gl.constexpr,
                   PROBE: gl.constexpr, DYNAMIC: gl.constexpr, QBUF: gl.constexpr,
                   PIN_WAIT: gl.constexpr, Q_RS: gl.constexpr,
                   TREE_MAX: gl.constexpr):  # fmt: skip
        if PROBE == 4:
            _drain(descs, bars, sched, CAUSAL, DYNAMIC, QBUF, 2)
        else:
            _consume(descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC, QBUF,
                     PIN_WAIT, Q_RS, TREE_MAX, 2)  # fmt: skip

    @gluon.jit
    def _kv_load(desc, coord, ready, buf, n, STAGES: gl.constexpr, PROBE: gl.constexpr):
        """Load warp: a key or value tile (the ``n``-th of this program) into ``buf``, landing on
        ``ready``. ``PROBE == 5`` (measurement only, wrong output): once the ring's ``STAGES``
        stages have been loaded, only an arrival on ``ready`` (the consumers reuse what the stage
        holds): the kernel without its key/value traffic (``benchmarks/sm90_fwd.py``)."""
        if PROBE == 5:
            if n >= STAGES:
                mbarrier.arrive(ready, count=1)
            else:
                mbarrier.expect(ready, desc.block_type.nbytes)
                tma_load(desc, coord, ready, buf)
        else:
            mbarrier.expect(ready, desc.block_type.nbytes)
            tma_load(desc, coord, ready, buf)

    @gluon.jit
    def _load(descs, bufs, bars, sched, out, CAUSAL: gl.constexpr, KV_SPLIT: gl.constexpr,
              PROBE: gl.constexpr, DYNAMIC: gl.constexpr, QBUF: gl.constexpr,
              PIN_WAIT: gl.constexpr, Q_RS: gl.constexpr, TREE_MAX: gl.constexpr):  # fmt: skip
        """Load warp: per tile, its query slices (one per consumer) once their buffers are free,
        then the key/value ring (with KV_SPLIT a key tile waits for its own buffer's release, else for
        the stage's value tile's). ``DYNAMIC``: a program's first tile is its id, the next the
        number of programs plus a global counter's value before this warp adds one to it (the
        heaviest tiles left go to whichever program is free first), each handed to the
        consumers through ``tiles``; the counter starts at zero and is left at zero. With
        ``QBUF`` 2 a tile's query halves load while the tile before it still runs (the next
        tile's key and value loads then queue behind the ring, not behind that tile's end)."""
        q_desc, k_desc, v_desc, o_desc = descs
        q_smem, k_smem, v_smem, o_smem = bufs
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tiles = bars
        n_m, n_bh, n_heads, group, seq_q, seq_k, qk_scale, group_heads = sched
        LSE, stride_lb, stride_lh, COUNTER = out
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        CONSUMERS: gl.constexpr = turns.type.shape[0]
        it = 0
        n_done = 0
        total = n_m * n_bh
        r = 0
        if DYNAMIC:
            tid = gl.program_id(0)
        else:
            tid = _static_tile(r, total)
        while tid < total:
            if DYNAMIC:
                _publish(tiles, tid, r)
            b, h, hk, m0, n_kv = _tile(tid, sched, CONSUMERS * BLOCK_M, BLOCK_N, CAUSAL)
            for i in gl.static_range(CONSUMERS):
                qb = (n_done % QBUF) * CONSUMERS + i
                mbarrier.wait(q_empty.index(qb), ((n_done // QBUF) & 1) ^ 1)  # fresh: passes
                mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes)
                tma_load(q_desc, [b, h, m0 + i * BLOCK_M, 0], q_ready.index(qb),
                         q_smem.index(qb))  # fmt: skip
            for j in range(n_kv):
                st = (it + j) % STAGES
                free = (((it + j) // STAGES) & 1) ^ 1  # fresh barriers: parity 1 passes
                if KV_SPLIT:
                    mbarrier.wait(k_empty.index(st), free)
                else:
                    mbarrier.wait(v_empty.index(st), free)
                _kv_load(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(st), k_smem.index(st),
                         it + j, STAGES, PROBE)  # fmt: skip
                if KV_SPLIT:
                    mbarrier.wait(v_empty.index(st), free)
                _kv_load(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(st), v_smem.index(st),
                         it + j, STAGES, PROBE)  # fmt: skip
            it += n_kv
            n_done += 1
            r += 1
            if DYNAMIC:
                tid = gl.num_programs(0) + _fetch_add(COUNTER, total - 1)
            else:
                tid = _static_tile(r, total)
        if DYNAMIC:
            _publish(tiles, tid, r)  # past the end: the consumers stop

    # O = softmax(Q K^T * scale) V;  LSE = logsumexp(Q K^T * scale, dim=-1)
    # (persistent: each program walks query tiles of CONSUMERS * BLOCK_M rows of one (batch, head)).
    # No integer argument is specialized: Triton would compile a kernel per combination of their
    # divisibility by 16, i.e. again for many new sequence lengths (2-3 s each on an H100).
    @gluon.jit(do_not_specialize=_INTEGER_ARGS)
    def attn_fwd_sm90(
        q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, n_bh, n_heads, group, seq_q,
        seq_k, qk_scale, group_heads, COUNTER, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
        KV_SPLIT: gl.constexpr, PROBE: gl.constexpr, DYNAMIC: gl.constexpr, QBUF: gl.constexpr,
        PIN_WAIT: gl.constexpr = False, CONSUMERS: gl.constexpr = 2,
        CONSUMER_REGS: gl.constexpr = 240, Q_RS: gl.constexpr = False,
        TREE_MAX: gl.constexpr = False,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        gl.static_assert(BLOCK_M == 64, "one warpgroup of 64 rows per consumer")
        gl.static_assert(BLOCK_N == 128, "key tiles of 128 rows")
        gl.static_assert(CONSUMERS == 2 or CONSUMERS == 3, "two or three consumer warpgroups")
        gl.static_assert(PROBE != 3 or CONSUMERS == 2, "the timeline probes two consumers")
        gl.static_assert(PROBE != 4 or KV_SPLIT, "the loads-only probe releases K and V apart")
        dtype: gl.constexpr = q_desc.dtype
        NQ: gl.constexpr = CONSUMERS * QBUF  # query buffers: QBUF per consumer
        q_smem = gl.allocate_shared_memory(dtype, [NQ] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + o_desc.block_type.shape,
                                           o_desc.layout)  # fmt: skip
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # DYNAMIC: tile ids from the load warp to the consumers, two slots
        slots = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(tile_ready.index(i), count=1)
            mbarrier.init(tile_empty.index(i), count=CONSUMERS)  # one arrival per consumer
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(turns.index(i), count=1)
        for i in gl.static_range(NQ):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)  # one arrival per consumer
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        n_m = gl.cdiv(seq_q, CONSUMERS * BLOCK_M)
        descs = (q_desc, k_desc, v_desc, o_desc)
        bufs = (q_smem, k_smem, v_smem, o_smem)
        tiles = (slots, tile_ready, tile_empty)
        bars = (q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns, tiles)
        sched = (n_m, n_bh, n_heads, group, seq_q, seq_k, qk_scale, group_heads)
        out = (LSE, stride_lb, stride_lh, COUNTER)
        # The default partition is consumer 0; the load warp gets 24 registers, each worker
        # consumer CONSUMER_REGS (``_sm90.FWD_REGS``). (The arguments are written out: constexprs
        # passed inside a tuple arrive as plain values.)
        # fmt: off
        if CONSUMERS == 2:
            gl.warp_specialize(
                [
                    (_consumer0, (descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC,
                                  QBUF, PIN_WAIT, Q_RS, TREE_MAX)),
                    (_consumer1, (descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC,
                                  QBUF, PIN_WAIT, Q_RS, TREE_MAX)),
                    (_load, (descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC,
                             QBUF, PIN_WAIT, Q_RS, TREE_MAX)),
                ],
                [4, 1],
                [CONSUMER_REGS, 24],
            )
        else:
            gl.warp_specialize(
                [
                    (_consumer0, (descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC,
                                  QBUF, PIN_WAIT, Q_RS, TREE_MAX)),
                    (_consumer1, (descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC,
                                  QBUF, PIN_WAIT, Q_RS, TREE_MAX)),
                    (_consumer2, (descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC,
                                  QBUF, PIN_WAIT, Q_RS, TREE_MAX)),
                    (_load, (descs, bufs, bars, sched, out, CAUSAL, KV_SPLIT, PROBE, DYNAMIC,
                             QBUF, PIN_WAIT, Q_RS, TREE_MAX)),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, 24],
            )
        # fmt: on
