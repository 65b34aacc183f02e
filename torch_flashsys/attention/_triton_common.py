"""Pieces shared by the Triton kernels: score masking and tile loads (``@triton.jit`` helpers),
and the tile set-up (table lookup per launch plan; the opt-in autotuner with its pruning and key)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from torch_flashsys.attention._backend import interpreter_active
from torch_flashsys.attention._dropout import as_int32, keep_scale, keep_threshold
from torch_flashsys.attention._extras import CAUSAL, PLAIN, Extras
from torch_flashsys.attention._kernel_config import (
    Tile,
    autotune_requested,
    dim_class,
    pick_tile,
    shared_memory_bytes,
    tile_meta,
)

LOG2E = 1.4426950408889634  # log2(e): the kernels use exp2, so scores are pre-multiplied by it

_LOG2E = tl.constexpr(1.4426950408889634)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # float32's largest finite value
_LN2 = tl.constexpr(0.6931471805599453)  # ln(2): turns a base-2 logsumexp into a natural one


@triton.jit
def keep_scores(q_idx, k_idx, seq_k, window, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """True where query ``q_idx`` may attend key ``k_idx`` (broadcast shapes) by position: the key
    is inside the sequence and inside the window ``(left, right)``: ``[q - left, q + right]``
    (is_causal: right = 0, top-left aligned)."""
    left, right = window
    keep = k_idx < seq_k
    if HAS_LEFT:
        keep = keep & (k_idx >= q_idx - left)
    if HAS_RIGHT:
        keep = keep & (k_idx <= q_idx + right)
    return keep


# tanh's Taylor coefficients (x^3, x^5, x^7, x^9) and where the polynomial takes over: below
# |x| = 1/4 the next term (1382/155925 x^11) is under 1e-8 relative.
_TANH_C3 = tl.constexpr(-1.0 / 3.0)
_TANH_C5 = tl.constexpr(2.0 / 15.0)
_TANH_C7 = tl.constexpr(-17.0 / 315.0)
_TANH_C9 = tl.constexpr(62.0 / 2835.0)
_TANH_SMALL = tl.constexpr(0.25)


@triton.jit
def _tanh_and_slope(x):
    """``(tanh(x), 1 - tanh(x)^2)``, each within a few float32 ulps relative at any ``|x|``.

    Large ``|x|``: ``u = 2 / (e^(2|x|) + 1)`` (exact limits: e^(2|x|) -> inf gives u = 0), then
    ``tanh = sign(x) (1 - u)`` and ``1 - tanh^2 = u (2 - u)`` (no cancellation when saturated).
    Small ``|x|`` (a softcap far above the scores makes every x small): ``1 - u`` would cancel
    (absolute error ~1e-7, i.e. all of tanh at x ~ 1e-7), so a Taylor polynomial instead.
    """
    ax = tl.abs(x)
    u = 2.0 / (tl.math.exp2(ax * (2.0 * _LOG2E)) + 1.0)
    x2 = x * x
    poly = x + x * x2 * (_TANH_C3 + x2 * (_TANH_C5 + x2 * (_TANH_C7 + x2 * _TANH_C9)))
    small = ax < _TANH_SMALL
    t = tl.where(small, poly, tl.where(x < 0, u - 1.0, 1.0 - u))
    slope = tl.where(small, 1.0 - t * t, u * (2.0 - u))
    return t, slope


@triton.jit
def mod_scores(
    qk, q_idx, k_idx, mods, mask_vals, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    FLOAT_MASK: tl.constexpr,
):  # fmt: skip
    """Raw ``q . k`` tile -> base-2 scores ``log2(e) * s`` with the score modifications applied:
    ``s = softcap * tanh(scale * qk / softcap)``, ``s -= slope * |i - j|``, ``s += mask``;
    ``mods`` is ``(qk_scale = log2(e) * scale, scale, softcap, slope)``. Also returns softcap's
    gradient factor ``d s / d (scale * qk) = 1 - tanh^2`` (qk when unused)."""
    qk_scale, sm_scale, softcap, slope = mods
    dcap = qk
    if (SOFTCAP or ALIBI) or FLOAT_MASK:  # (Triton refuses a chain A or B or C)
        s = qk * sm_scale
        if SOFTCAP:
            t, dcap = _tanh_and_slope(s / softcap)
            s = softcap * t
        if ALIBI:
            s = s - slope * tl.abs(q_idx - k_idx).to(tl.float32)
        if FLOAT_MASK:
            s = s + mask_vals
            # Finite scores stay finite in base 2: below -FLT_MAX / log2(e) (masks filled with
            # a dtype's minimum, -3.4e38) the product would overflow to -inf, and a row masked
            # entirely that way would read as one with no allowed key.
            s2 = s * _LOG2E
            s = tl.where((s2 == float("-inf")) & (s != float("-inf")), -_FLT_MAX, s2)
        else:
            s = s * _LOG2E
    else:
        s = qk * qk_scale
    return s, dcap


@triton.jit
def _interleave(a, b):
    """(R, C) and (R, C) -> (R, 2C) with a in the even columns and b in the odd ones."""
    x = tl.join(a, b)
    return tl.reshape(x, (x.shape[0], 2 * x.shape[1]))


@triton.jit
def _byte(word, SHIFT: tl.constexpr):
    return ((word >> SHIFT) & 0xFF).to(tl.uint8)


@triton.jit
def _quad(r0, r1, r2, r3, SHIFT: tl.constexpr):
    """Byte ``b = SHIFT // 8`` of words 0..3, i.e. group elements b, b + 4, b + 8, b + 12, at
    columns 4 g + 0..3."""
    return _interleave(
        _interleave(_byte(r0, SHIFT), _byte(r2, SHIFT)),
        _interleave(_byte(r1, SHIFT), _byte(r3, SHIFT)),
    )


@triton.jit
def dropout_keep(drop, q_idx, key_start, BLOCK_N: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Dropout keep mask for queries ``q_idx`` (a vector) and the ``BLOCK_N`` keys from
    ``key_start`` (a multiple of 16) of head ``bh``, ``drop = (seed, bh, threshold, 1 / keep
    probability)``: ``(len(q_idx), BLOCK_N)``, or its transpose when ``KEYS_FIRST``. Key ``j`` of query ``i`` uses byte ``j % 4`` of word ``(j % 16) // 4`` of
    Philox4x32-10(seed, counter=(j // 16, i, bh, 0)) and is kept when that byte is at least
    ``threshold`` (one Philox call serves 16 elements); ``torch_flashsys.attention._dropout``
    computes the same bytes in PyTorch."""
    tl.static_assert(BLOCK_N % 16 == 0)
    seed, bh, threshold, _inv_keep = drop
    groups = key_start // 16 + tl.arange(0, BLOCK_N // 16)
    c0 = groups[None, :] + q_idx[:, None] * 0
    c1 = q_idx[:, None] + c0 * 0
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero + bh, zero)
    # Element p = 4 w + k of a group (byte k of word w) goes to column 16 g + p: interleaving
    # halves the stride at each level (columns even/odd, then 0/2 mod 4, then 0/4 mod 8, 0/8 mod 16).
    b0 = _quad(r0, r1, r2, r3, 0)
    b1 = _quad(r0, r1, r2, r3, 8)
    b2 = _quad(r0, r1, r2, r3, 16)
    b3 = _quad(r0, r1, r2, r3, 24)
    bytes_ = _interleave(_interleave(b0, b2), _interleave(b1, b3))
    keep = bytes_.to(tl.int32) >= threshold
    if KEYS_FIRST:
        keep = tl.trans(keep)
    return keep


@triton.jit
def load_mask(ptrs, valid, MASK_KIND: tl.constexpr):
    """A tile of the attention mask: bool (True = attend; False outside ``valid``) or float (0.0
    outside ``valid``, as float32)."""
    if MASK_KIND == 1:
        vals = tl.load(ptrs, mask=valid, other=0) != 0
    else:
        vals = tl.load(ptrs, mask=valid, other=0.0).to(tl.float32)
    return vals


@triton.jit
def _tile_range(
    start, seq, before, after,
    HAS_BEFORE: tl.constexpr, HAS_AFTER: tl.constexpr, BLOCK: tl.constexpr, BLOCK_OTHER: tl.constexpr,
):  # fmt: skip
    """For the ``BLOCK`` positions [start, start + BLOCK) on one side, the range [lo, hi) of the
    other side (tiles of ``BLOCK_OTHER``, ``seq`` long) some of them may see, and [mid_lo, mid_hi)
    (whole tiles) where each of them sees each position; a position ``p`` sees
    [p - before, p + after]."""
    lo = start * 0
    hi = seq + lo
    mid_lo = lo
    mid_hi = (seq // BLOCK_OTHER) * BLOCK_OTHER + lo
    if HAS_BEFORE:
        lo = (tl.maximum(start - before, 0) // BLOCK_OTHER) * BLOCK_OTHER
        mid_lo = tl.cdiv(tl.maximum(start + BLOCK - 1 - before, 0), BLOCK_OTHER) * BLOCK_OTHER
    if HAS_AFTER:
        hi = tl.minimum(hi, start + BLOCK + after)
        mid_hi = tl.minimum(mid_hi, (tl.maximum(start + after + 1, 0) // BLOCK_OTHER) * BLOCK_OTHER)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def key_tile_range(
    start_m, seq_k, left, right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """For query rows [start_m, start_m + BLOCK_M): the key range [lo, hi) some row may attend,
    and [mid_lo, mid_hi) (multiples of BLOCK_N) where every row may attend every key by position.
    Tiles outside [lo, hi) are skipped: the cost follows the window, not the sequence."""
    return _tile_range(start_m, seq_k, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)


@triton.jit
def query_tile_range(
    start_n, seq_q, left, right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """For keys [start_n, start_n + BLOCK_N): the query range [lo, hi) whose rows may attend one of
    them, and [mid_lo, mid_hi) (multiples of BLOCK_M, full query tiles) where every row may attend
    every key by position (key j is seen by queries [j - right, j + left])."""
    return _tile_range(start_n, seq_q, right, left, HAS_RIGHT, HAS_LEFT, BLOCK_N, BLOCK_M)


@triton.jit
def segment(SEG: tl.constexpr, lo, mid_lo, mid_hi, hi):
    """Bounds of segment ``SEG`` of a tile range: 0 is [lo, mid_lo) (the window's leading edge),
    1 is [mid_lo, mid_hi) (no position mask), 2 is [mid_hi, hi) (causal diagonal / ragged end)."""
    seg_lo = lo
    seg_hi = mid_lo
    if SEG == 1:
        seg_lo = mid_lo
        seg_hi = mid_hi
    elif SEG == 2:
        seg_lo = mid_hi
        seg_hi = hi
    return seg_lo, seg_hi


@triton.jit
def check_blocks(
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Compile-time checks of a launch's blocks: the head dims fit their (power-of-two) blocks,
    and the tiles are at least tl.dot's minimum of 16."""
    tl.static_assert(BLOCK_D >= HEAD_DIM and BLOCK_DV >= HEAD_DIM_V)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)


@triton.jit
def program_setup(
    CuQ, CuK, seq_q, seq_k, n_heads,
    BLOCK: tl.constexpr, KEY_TILES: tl.constexpr, REVERSE: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """What program ``program_id(0)`` of a 1-D grid works on: ``(bh, b, h, start, q_start, seq_q,
    k_start, seq_k)``. The grid is (batch x heads) x tiles of ``BLOCK`` query rows (key rows when
    KEY_TILES); consecutive programs share a head, so K/V stay in L2, and there is no 65535 limit
    on batch x heads. REVERSE: a head's tiles from the last (most work when causal) first, for a
    better tail balance. ``b``, ``h`` are int64; ``start`` the tile's first row; ``q_start`` /
    ``k_start`` and the lengths are the sequence's own (a packed batch: b is the sequence, the
    lengths passed in the longest)."""
    length = seq_q
    if KEY_TILES:
        length = seq_k
    n_tiles = tl.cdiv(length, BLOCK)
    pid = tl.program_id(0)
    bh = pid // n_tiles
    tile = pid % n_tiles
    if REVERSE:
        tile = n_tiles - 1 - tile
    start = tile * BLOCK
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    q_start, seq_q = seq_bounds(CuQ, b, seq_q, VARLEN)
    k_start, seq_k = seq_bounds(CuK, b, seq_k, VARLEN)
    return bh, b, h, start, q_start, seq_q, k_start, seq_k


@triton.jit
def seq_bounds(Cu, b, length, VARLEN: tl.constexpr):
    """(first row, length) of sequence ``b``: from the cumulative lengths ``Cu`` of a packed batch
    when VARLEN, else (0, ``length``): every sequence of a padded batch has the same length."""
    if VARLEN:
        start = tl.load(Cu + b)
        length = tl.load(Cu + b + 1) - start
    else:
        start = b * 0
    return start.to(tl.int64), length


@triton.jit
def empty_if(cond, lo, mid_lo, mid_hi, hi):
    """The tile ranges, or four zeros (empty loops) when ``cond``: a program with nothing to do
    runs no loop (instead of an early return) and its masked stores write nothing."""
    return (
        tl.where(cond, 0, lo), tl.where(cond, 0, mid_lo), tl.where(cond, 0, mid_hi),
        tl.where(cond, 0, hi),
    )  # fmt: skip


@triton.jit
def head_scalars(
    Alibi, Mask, b, h, stride_ab, stride_ah, stride_mb, stride_mh, ALIBI: tl.constexpr
):
    """(ALiBi slope (0.0 when off), mask base pointer) of head ``h`` of batch entry ``b``."""
    slope = 0.0
    if ALIBI:
        slope = tl.load(Alibi + b * stride_ab + h * stride_ah)
    return slope, Mask + b * stride_mb + h * stride_mh


@triton.jit
def program_scalars(Seed, stride_mn, DROPOUT: tl.constexpr, MASK_CONTIG: tl.constexpr):
    """(dropout seed (0 when off), the mask's key stride): a contiguous mask's stride becomes the
    constant 1, so Triton sees contiguous keys and vectorizes the mask loads."""
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)
    if MASK_CONTIG:
        stride_mn = 1
    return seed, stride_mn


@triton.jit
def tile_ptrs(X, b, h, stride_b, stride_h, rows, stride_row, cols):
    """Pointers to the (rows, cols) tile of head ``h`` of batch entry ``b``: ``rows`` (64-bit)
    along the sequence, ``cols`` along the contiguous head dim."""
    return X + b * stride_b + h * stride_h + rows[:, None] * stride_row + cols[None, :]


@triton.jit
def mask_tile(
    mask, q_idx, k_idx, q_ok, k_ok,
    MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr, KEYS_FIRST: tl.constexpr,
):  # fmt: skip
    """The attention mask ``(base pointer, query stride, key stride)`` for queries ``q_idx`` x
    keys ``k_idx`` (:func:`load_mask`; 0.0 when MASK_KIND is 0): (queries, keys), or (keys,
    queries) when KEYS_FIRST. A key-padding mask (not MASK_ROWS) is one vector over the keys,
    broadcast along the queries."""
    mask_base, stride_mm, stride_mn = mask
    mvals = 0.0
    if MASK_KIND != 0:
        if MASK_ROWS:
            if KEYS_FIRST:
                ptrs = mask_base + q_idx[None, :] * stride_mm + k_idx[:, None] * stride_mn
                mvals = load_mask(ptrs, k_ok[:, None] & q_ok[None, :], MASK_KIND)
            else:
                ptrs = mask_base + q_idx[:, None] * stride_mm + k_idx[None, :] * stride_mn
                mvals = load_mask(ptrs, q_ok[:, None] & k_ok[None, :], MASK_KIND)
        else:
            keys = load_mask(mask_base + k_idx * stride_mn, k_ok, MASK_KIND)
            if KEYS_FIRST:
                mvals = keys[:, None]
            else:
                mvals = keys[None, :]
    return mvals


@triton.jit
def softmax_step(s, m_i, l_i, qk_scale, FOLD_SCALE: tl.constexpr, MAY_EMPTY: tl.constexpr):
    """One online-softmax step (base 2) over a score tile ``s``: ``(p, alpha, m_new, l_new)`` with
    ``p = exp2(s - m_new)``, ``alpha = exp2(m_i - m_new)`` (the rescale of what came before) and
    ``l_new = alpha l_i + rowsum(p)``. FOLD_SCALE: ``s`` are raw ``q.k`` and ``qk_scale > 0`` is
    applied in the exponent (one FMA per score). MAY_EMPTY: a row that has seen no allowed key
    (max -inf) subtracts 0 instead."""
    if FOLD_SCALE:  # max(qk) * qk_scale is the max of the scaled scores
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if MAY_EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    if FOLD_SCALE:
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
    else:
        p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def softmax_finish(acc, l_i, MAY_EMPTY: tl.constexpr):
    """The output rows ``acc / l``; a row that attended nothing (l = 0, when MAY_EMPTY) gives 0."""
    l_safe = l_i
    if MAY_EMPTY:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_safe[:, None]


@triton.jit
def softmax_lse(m_i, l_i):
    """The natural logsumexp of the rows from the base-2 running max and sum (-inf for a row
    that attended nothing). Separate from :func:`softmax_finish` so that a kernel keeps its
    order of stores and this arithmetic (it changes the register allocation)."""
    return (m_i + tl.math.log2(l_i)) * _LN2


@triton.jit
def store_rows(ptrs, tile, row_ok, mask_d, EVEN_D: tl.constexpr):
    """Store a float32 (rows, BLOCK_D) tile in the destination's dtype: rows where ``row_ok``
    and, unless EVEN_D, the head dims of ``mask_d`` (the padding to BLOCK_D is not written)."""
    if EVEN_D:
        tl.store(ptrs, tile.to(ptrs.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(ptrs, tile.to(ptrs.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])


@triton.jit
def load_rows(ptrs, idx, n_rows, mask_d, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows, BLOCK_D) tile; rows ``idx >= n_rows`` (when CHECK_ROWS) and padded head-dim
    columns (unless EVEN_D) read as zero."""
    if CHECK_ROWS:
        if EVEN_D:
            tile = tl.load(ptrs, mask=(idx < n_rows)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=(idx < n_rows)[:, None] & mask_d[None, :], other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    return tile


class Flags(NamedTuple):
    """The constexpr switches of the score modifications (part of every launch and tuning key)."""

    HAS_LEFT: bool
    HAS_RIGHT: bool
    MASK_KIND: int  # 0: none, 1: bool, 2: float
    MASK_ROWS: bool  # the mask varies along queries (False: a key-padding mask, one row)
    MASK_CONTIG: bool  # the mask's key stride is 1: vectorized, coalesced mask loads
    SOFTCAP: bool
    ALIBI: bool
    DROPOUT: bool
    MAY_EMPTY: bool  # some row may attend nothing (guards for -inf maxima)
    VARLEN: bool  # a packed batch: per-sequence bounds from cumulative lengths
    SEQUSED: bool  # a KV cache: per-sequence numbers of valid keys (forward only)


_NO_STRIDES = (0, 0, 0, 0, 0, 0)


def kernel_extras(ex: Extras, dummy: torch.Tensor) -> tuple[tuple, tuple, Flags]:
    """Kernel arguments for ``ex``: pointer tensors (Mask, Alibi, Seed, CuQ, CuK, SeqUsed;
    ``dummy`` where absent), runtime scalars (mask strides b/h/m/n, alibi strides b/h, left, right,
    softcap, dropout threshold, 1 / keep probability) and the constexpr :class:`Flags`."""
    preset = _PRESETS.get(id(ex))  # PLAIN / CAUSAL (every call without mask, window or dropout)
    if preset is not None and preset[0] is ex:
        return (dummy,) * 6, preset[1], preset[2]
    return _kernel_extras(ex, dummy)


def _kernel_extras(ex: Extras, dummy: torch.Tensor | None) -> tuple[tuple, tuple, Flags]:
    mask, alibi = ex.mask, ex.alibi
    strides = list(_NO_STRIDES)
    kind, mask_rows, mask_contig = 0, False, False
    if mask is not None:
        mask_contig = mask.stride(3) == 1
        strides[0:4] = mask.stride()
        kind = 1 if mask.dtype == torch.bool else 2
        mask_rows = mask.stride(2) != 0 and mask.shape[2] > 1
    if alibi is not None:
        strides[4:6] = alibi.stride()
    p = ex.dropout_p
    runtime = (
        *strides, ex.left, ex.right, ex.softcap, as_int32(keep_threshold(p)), keep_scale(p),
    )  # fmt: skip
    flags = Flags(
        ex.left >= 0, ex.right >= 0, kind, mask_rows, mask_contig, ex.softcap > 0, alibi is not None, p > 0,
        ex.may_empty_rows, ex.varlen, ex.seqused_k is not None,
    )  # fmt: skip
    tensors = (
        dummy if mask is None else mask,
        dummy if alibi is None else alibi,
        dummy if ex.seed is None else ex.seed,
        dummy if ex.cu_q is None else ex.cu_q,
        dummy if ex.cu_k is None else ex.cu_k,
        dummy if ex.seqused_k is None else ex.seqused_k,
    )
    return tensors, runtime, flags


# The arguments of the shared tensor-free Extras, computed once: (the Extras, runtime, flags).
_PRESETS = {id(ex): (ex, *_kernel_extras(ex, None)[1:]) for ex in (PLAIN, CAUSAL)}


def problem_dims(q: torch.Tensor, k: torch.Tensor, ex: Extras) -> tuple[int, int, int, tuple]:
    """(batch, seq_q, seq_k, lse strides (b, h)) of the launch: for a packed batch the number of
    sequences and the longest lengths (the lse is then (1, heads, total))."""
    if ex.varlen:
        return ex.cu_q.shape[0] - 1, ex.max_q, ex.max_k, (0, q.shape[2])
    return q.shape[0], q.shape[2], k.shape[2], (q.shape[1] * q.shape[2], q.shape[2])


def batch_strides(t: torch.Tensor, ex: Extras) -> tuple[int, int, int]:
    """(batch, head, row) strides of a 4-D view; a packed batch has no batch stride (b is the
    sequence, located by its cumulative length)."""
    s = t.stride()
    return (0 if ex.varlen else s[0]), s[1], s[2]


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1), for host code: ``triton.next_power_of_2`` is a
    ``constexpr_function`` and costs microseconds per call outside a kernel."""
    return 1 << max(n - 1, 0).bit_length()


def tune_len(seq_q: int, seq_k: int) -> int:
    """The sequence-length part of the autotune key: a power of two in [128, 16384]."""
    return min(max(next_pow2(max(seq_q, seq_k)), 128), 16384)


AUTOTUNE = autotune_requested() and not interpreter_active()
"""Whether the kernels are wrapped in Triton's autotuner (opt-in); else tiles come from the tables."""


def make_autotune(kernel, shapes: dict[int, Sequence[Tile]], footprint: Callable[..., int]):
    """``kernel`` itself, launched with the tile ``plan_tile`` picks (the default), or with
    ``TORCH_FLASHSYS_AUTOTUNE=1`` on a GPU, ``triton.autotune`` over ``shapes[dim_class(HEAD_DIM)]``
    keyed by (head dim, flags, dot precision, length bucket, dtypes), results cached on disk.

    Configs whose estimated shared memory (``footprint(block_m, block_n, block_d, stages)``
    elements) does not fit are pruned, as ``pick_tile`` does.
    """
    if not AUTOTUNE:
        return kernel
    unique = list(dict.fromkeys(s for group in shapes.values() for s in group))
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in unique
    ]

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        head_dim = max(kwargs["HEAD_DIM"], kwargs["HEAD_DIM_V"])
        block_d = max(kwargs["BLOCK_D"], kwargs["BLOCK_DV"])
        first = next(iter(named_args.values()))
        budget = 0.75 * shared_memory_bytes(first.device.index or 0)
        elem = first.element_size()
        kept = []
        for bm, bn, w, st in shapes[dim_class(head_dim)]:
            if elem * footprint(bm, bn, block_d, st) <= budget:
                kept.append(configs[unique.index((bm, bn, w, st))])
        return kept or [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]

    cache = {"cache_results": True} if _AUTOTUNE_CACHES else {}  # Triton >= 3.2
    return triton.autotune(
        configs=configs,
        key=["HEAD_DIM", "HEAD_DIM_V", *Flags._fields, "PRECISION", "tune_len"],  # + dtypes
        prune_configs_by={"early_config_prune": prune},
        **cache,
    )(kernel)


_AUTOTUNE_CACHES = "cache_results" in inspect.signature(triton.autotune).parameters


def kernel_constexprs(head_dim: int, dim_v: int, precision: str, flags: dict) -> dict:
    """The constexprs every kernel takes: the head dims of query/key and of value with their
    power-of-two blocks, the feature ``flags`` (:class:`Flags` as a dict, or the decode kernel's
    subset) and ``tl.dot``'s input precision."""
    return {
        "HEAD_DIM": head_dim, "BLOCK_D": next_pow2(head_dim), "HEAD_DIM_V": dim_v,
        "BLOCK_DV": next_pow2(dim_v), **flags, "PRECISION": precision,
    }  # fmt: skip


def plan_tile(
    kernel: str, q: torch.Tensor, constexprs: dict, flags: Flags, seq_len: int,
    shapes: dict[int, Sequence[Tile]], footprint: Callable[..., int],
) -> dict[str, int]:  # fmt: skip
    """The launch keywords of ``kernel``'s tile for this problem (none when autotuning), from
    the head dims and precision of its :func:`kernel_constexprs`."""
    if AUTOTUNE:
        return {}
    tile = pick_tile(
        kernel, q.device, max(constexprs["HEAD_DIM"], constexprs["HEAD_DIM_V"]),
        max(constexprs["BLOCK_D"], constexprs["BLOCK_DV"]), q.element_size(),
        constexprs["PRECISION"], flags.HAS_RIGHT, seq_len, shapes, footprint,
        flags == _SWEPT[flags.HAS_RIGHT],
    )  # fmt: skip
    return tile_meta(tile)


# The kernels the tile sweep timed (benchmarks/tune_attention.py): plain causal and not.
_SWEPT = {
    causal: Flags(False, causal, 0, False, False, False, False, False, False, False, False)
    for causal in (False, True)
}
