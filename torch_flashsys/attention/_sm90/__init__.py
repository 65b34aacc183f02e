"""The Hopper (sm90) fast path: which calls take it, and its launch.

On by default with the Triton it was verified on (3.6: the whole GPU suite on an H100,
docs/benchmarks.md), opt-in with others whose Gluon API imports (``TORCH_FLASHSYS_SM90=1``),
off with ``TORCH_FLASHSYS_SM90=0``; the switch is read at import. With it on, the forward of a
call runs the warp-specialized Gluon kernel (``_fwd``) when all of these hold, else the portable
Triton kernel:

- a CUDA device of compute capability 9.0 (H100, H200) whose Triton's Gluon API imports
  (:mod:`._gluon`; checked on 3.6, compiles with 3.9);
- float16 or bfloat16, head dim 64 or 128 for query, key and value alike, or 48, 80, 96 or 112
  on the kernel of the next of those two (``FWD_PADDED_DIMS``: TMA's zero fill pads the head dim);
- no score modification: causal or not, with GQA, and nothing else (no mask, dropout, window,
  soft-capping, ALiBi, packed batch or KV cache);
- a positive scale, and every stride but the last a multiple of 16 bytes, 16-byte aligned data
  (what TMA descriptors need).

The backward of a problem that the forward rule admits (and whose dO a TMA descriptor can read)
runs a fused Gluon kernel (after the preprocessing kernel ``_prep``) at the lengths where it
measured faster, queries and keys alike: head dim 64, ``_bwd.attn_bwd_sm90`` at the lengths in
``FUSED_SEQ_Q`` (with GQA from 256; without GQA from 1024; and, without GQA or a causal
mask, 512-1023 keys against 2048 or more query rows where its programs fill the GPU,
``FUSED_FEW_KEYS``); head dim 128, ``_bwd.attn_bwd_split_sm90`` at those in ``SPLIT_SEQ_Q``
(with GQA from 256; without GQA from 1024, causal from 2048); head dims 48 and 80-112 on the
kernel of the next head dim at its lengths (``BWD_PADDED_DIMS``). Their dQ is summed in float32 by
TMA bulk reductions in no fixed order, so it is not bitwise reproducible; when
``torch.are_deterministic_algorithms_enabled()``,
the same kernels run with their dQ sums in a fixed order (``DETERMINISTIC``) at the lengths in
``DETERMINISTIC_SEQ_Q`` (head dim 64: causal without GQA, from 4096) and
``DETERMINISTIC_SPLIT_SEQ_Q`` (128: causal without GQA from 8192, without a causal mask
4096-8192), and every other problem takes the portable backward. Every other backward is the
portable one (deterministic; it reads the same ``out`` and ``lse``). The switches are below.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch

import torch_flashsys.attention._precompile as _precompile
from torch_flashsys.attention._extras import CAUSAL, PLAIN, Extras
from torch_flashsys.attention._kernel_config import sm_count as _sm_count
from torch_flashsys.attention._launch import (
    LaunchCache,
    fast_launch_allowed,
    launch_hooks_set,
    pointer_alignment,
    remember,
)
from torch_flashsys.attention._sm90._gluon import AVAILABLE, VERIFIED, TensorDescriptor, gl
from torch_flashsys.attention._sm90._prep import attn_bwd_dq_sum, attn_bwd_prep
from torch_flashsys.attention._sm90._rawlaunch import RawLaunch, TritonLaunch

if AVAILABLE:
    from torch_flashsys.attention._sm90._bwd import (
        attn_bwd_dkdv_sm90,
        attn_bwd_sm90,
        attn_bwd_split_sm90,
    )
    from torch_flashsys.attention._sm90._fwd import attn_fwd_sm90

LOG2E = 1.4426950408889634  # log2(e): the kernel's softmax is base 2
BLOCK_M = 64  # query rows per consumer warpgroup (two per program)
BLOCK_N = 128  # key rows per tile
STAGES = {64: 3, 128: 2}  # key/value ring depth per head dim (shared memory: 131 / 197 KB)
# Key tiles released once their S is computed, value tiles once their P V is (FA3's separate
# pipelines), instead of both when P V is: the next key tile's load then has a whole step to land.
# H100 (``benchmarks/sm90_fwd.py``, docs/benchmarks.md): 0.90-0.92x the kernel time at head dim
# 128 (the ring has two stages there; the %clock64 timeline showed each step waiting ~1500 cycles
# for its key tile), 0.97-1.00x at 64 (three stages); the same bits.
FWD_KV_SPLIT = True
# Causal problems of at most FWD_DYNAMIC_MAX[head dim] rows run on a persistent grid whose
# programs take the heaviest tile left from a global counter (FA3's dynamic scheduler), instead of
# one program per tile (the hardware's scheduler balancing them; longer than
# PERSISTENT_CAUSAL_MAX) or a static round-robin of the tiles (shorter). H100, two runs
# (``benchmarks/sm90_fwd.py``, same bits), its kernel time against one program per tile: head
# dim 64 0.87-0.88x at (4, 16, 2048), 0.93x at (4, 16, 4096), 0.98-1.00x at (1, 16, 16384); head
# dim 128 0.92-0.93x at 2048 rows, but 1.02-1.06x at (4, 16, 4096) and 0.99-1.01x at
# (1, 16, 16384). Against the static persistent grid at 512 and 1024 rows (eighth session, one
# run, batch 2-16 x 16 heads): 0.92-1.01x at head dim 64, 0.85-1.02x at 128 (16 x 16 x 512:
# 1.06x). The counter costs no launch: one per (device, stream), left at zero by each launch
# (:func:`schedule_counter`).
FWD_DYNAMIC = True
FWD_DYNAMIC_MAX = {64: 1 << 30, 128: 2048}
# Two query buffers per consumer warpgroup (else one) for the query lengths up to
# FWD_QBUF2_MAX[(head dim, causal)]: a tile's query halves, and behind them its first key and value
# tiles, then load while the tile before it runs, instead of once that tile's last S is done.
# H100 (``benchmarks/sm90_fwd.py``, kernel only, the same bits; ninth session): head dim 64 causal
# 0.96-0.99x the time at 1024-16384 rows; without a causal mask 0.92x (1024) and 0.97x (2048), but
# 1.00-1.01x from 4096; head dim 128 0.95-1.00x at 1024-2048, 1.01-1.02x from 4096 (its shared
# memory is then 225 of 227 KB, leaving little L1).
FWD_QBUF2_MAX = {(64, True): 1 << 30, (64, False): 2048, (128, True): 2048, (128, False): 2048}
# PIN_WAIT: a clock read (``_gluon.schedule_fence``) before the consumers' wait for the product
# their exponentials are written to overlap (forward: P V of the key tile before; fused backward:
# dP^T). Without it ptxas (Triton 3.6's and 3.9's, sm90) hoists that wait above the exponentials
# (the SASS: ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` before every ``MUFU.EX2`` of the forward's step,
# before 24-27 of the backward's 32), so the softmax waits for the product instead of running
# beside it; with it every exponential comes first (``tests/attention/sm90_offline.py`` checks the SASS).
# H100 (eleventh session, the same bits): the backward off: a fwd+bwd's kernel time 1.00-1.12x the
# unpinned build's on the peer grid's 20 problems (``benchmarks/gpu_checks/pin_wait_ab.py``;
# geomean against cuDNN 1.052 pinned, 1.027 unpinned). The forward (``benchmarks/sm90_fwd.py``,
# kernel only) per (head dim, causal): head dim 128 without a causal mask 0.965-0.996x the time
# (two runs, 2048-16384 rows; 0.94-0.99x in a third, the builds' order alternated), so on there;
# causal 0.98-1.05x and head dim 64 1.01-1.14x, off. A likely reason, not measured: the other
# consumers' products already keep the tensor cores busy while one computes its softmax, and the
# fence costs issue slots.
FWD_PIN_WAIT = {(64, False): False, (64, True): False, (128, False): True, (128, True): False}
BWD_PIN_WAIT = False
# Each score tile's row maximum as a tree of in-thread halves (``_fwd._row_max``: depth 5, not a
# chain of 31 dependent maxima per row before the exponentials can start; the same bits), per
# (head dim, causal). H100, ``benchmarks/sm90_fwd.py`` (kernel only, two runs, 2026-11-27): head
# dim 128 causal 0.96-0.97x the time at 4096 rows, 0.99x at 16384 (597 -> 600 TFLOP/s in the
# second run), 1.00x at 2048; without a causal mask 0.98-1.00x at 16384; head dim 64 causal
# (three consumers) 0.98x at 16384, 1.00-1.01x at 1024; head dim 64 without a causal mask (three
# consumers) 1.01x at 4096, so off there.
FWD_TREE_MAX = {(64, False): False, (64, True): True, (128, False): True, (128, True): True}
# Repeat launches through RawLaunch (the launcher's C entry point, descriptors' maps kept per
# address) instead of Triton's launcher object (``_rawlaunch``; host time per call below).
RAW_LAUNCH = True
NUM_WARPS = 4  # the default partition (consumer 0); the kernel adds 4 + 1 worker warps
MAX_REGS = 168  # registers per thread at launch: 168 x 384 threads fills the register file
# Three consumer warpgroups in the forward (tiles of 192 query rows, FA3's at head dim 64: a third
# warpgroup's products keep the tensor cores busy while two compute their softmax, where the
# exponentials weigh about as much as the products) from FWD_CONSUMERS3_MIN[(head dim, causal)]
# query rows; two (128 rows) otherwise. H100 (``benchmarks/sm90_fwd.py``, kernel only, the same
# bits; eleventh session, three runs): head dim 64 without a causal mask 0.85-0.90x the time at
# (1, 16, 16384), 0.87x at (2, 16, 3072) (two runs), 0.90-0.95x at (4, 16, 4096), 0.97x at
# (4, 8, 4096), 0.98x at (1, 16, 8192) (its 688 tiles take 5.2 rounds of the 132 SMs), 0.99x at
# (4, 16, 2048), 1.03x at (4, 16, 1024). Causal: 1.06-1.42x as first built (its consumers spilled,
# and multiplied the key tiles past their rows); with those tiles skipped per warpgroup, the mask
# bound per row and the masked steps in a loop of their own (no spill in the unmasked loop):
# 0.92-0.95x at (1, 16, 16384), 0.93-0.94x at (1, 32/8, 8192) (GQA), 1.00x at 4096 rows,
# 1.03-1.08x at 2048, 1.19x at 1024 (one run, three rounds of alternating order). A peer grid
# run with it measured (1, 16, 16384) causal's forward at 1.39 ms against 1.24 with two, but
# that grid's rows drift by 10-25% between runs (the GPU's power-capped clocks); through
# flash_attention in a plain process (``gpu_checks/rule_ab.py``, twelfth session, three rounds)
# the forward took 0.92x (16384), 0.96-0.99x (8192, GQA 32/8 included) the time of two, fwd+bwd
# 0.97-0.98x at 8192 and 1.01x at 16384 (spread 1.06-1.10), and kernel-only 0.91x and 0.94x
# (``sm90_fwd.py``): three from 8192 rows. Head dim 128 does not fit (registers, shared memory).
FWD_CONSUMERS3_MIN = {(64, False): 2049, (64, True): 8192}
# consumers -> (registers per thread at launch, each worker consumer's after setmaxnreg): three
# consumers and the load warp's group are 512 threads, 128 registers each at launch.
FWD_REGS = {2: (MAX_REGS, 240), 3: (128, 160)}
_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Head dims the forward serves with the kernel of the next head dim it has (:func:`kernel_dim`):
# its descriptors' blocks that wide over the narrower tensors, TMA reads the columns past the
# head dim as zeros (they add nothing to Q K^T, and P V's extra columns are zeros) and clips
# them from the O store, so no copy is made. The backward of these runs the portable kernels.
# H100 (``benchmarks/gpu_checks/rule_ab.py --studies padded``, flash_attention as called, three
# rounds; docs/benchmarks.md): the forward 0.59-0.79x the portable forward's time at head dims 48,
# 80, 96 and 112 (0.88-1.05x cuDNN's at 80 and 96), fwd+bwd 0.76-0.95x; at 32 1.04x (the portable
# kernel does not pad it), so 32 stays portable. Other head dims: not measured, portable.
FWD_PADDED_DIMS = frozenset({48, 80, 96, 112})
# Head dims whose backward runs the fused kernel of the next head dim the same way (loads over
# TMA's zero fill; dK, dV and the float32 dQ sums into buffers of the kernel's width, whose first
# columns are the gradients; the preprocessing kernel's D reads O and dO up to the head dim),
# where the length rules (FUSED_SEQ_Q, SPLIT_SEQ_Q) send the next kernel's head dim; not under
# deterministic algorithms (the portable kernels). H100 (``rule_ab.py --studies padded_bwd``,
# three rounds): fwd+bwd 0.75-0.89x the time with the portable backward at head dims 80 and 96,
# 4096-8192 tokens (1.01-1.14x cuDNN's, from 1.27-1.35x); 1.00-1.01x (a tie) at 2048 causal
# tokens, 80 and 112.
BWD_PADDED_DIMS = FWD_PADDED_DIMS
MIN_SEQ_K = 1  # shorter key sequences take the portable kernel
PERSISTENT_CAUSAL_MAX = 1024  # causal query lengths up to this run on the persistent grid
L2_BUDGET = 24 * 2**20  # bytes of keys and values a causal head group keeps in L2 (H100: 50 MB)


DEFAULT_ON = True  # the switch's default on a verified Triton (see the module docstring)


def _switch(name: str, values: tuple[str, ...]) -> str:
    """The environment variable ``name`` if one of ``values``; unset is ``""``, and any other
    value warns and counts as unset (the default)."""
    value = os.environ.get(name, "")
    if value and value not in values:
        warnings.warn(f"{name}={value!r} is not one of {', '.join(values)}; the default (unset) "
                      "is used", RuntimeWarning, stacklevel=2)  # fmt: skip
        return ""
    return value


# Read once at import (a per-call environment lookup would cost host time on every call):
# "1" on wherever Gluon's Hopper API imports, "0" off, unset: DEFAULT_ON on a verified Triton.
_MODE = _switch("TORCH_FLASHSYS_SM90", ("1", "0"))
ENABLED = AVAILABLE and (_MODE == "1" or (_MODE != "0" and DEFAULT_ON and VERIFIED))


# The Gluon backward kernels (``_bwd``), read once at import. Unset: the fused five-product kernel
# (dQ summed by TMA bulk reductions in no fixed order, so not bitwise reproducible) runs, on a
# verified Triton (FUSED_DEFAULT), the problems where it measured faster than the portable backward
# on an H100 (query lengths in FUSED_SEQ_Q per kind of problem; docs/benchmarks.md), the portable
# backward the rest. ``TORCH_FLASHSYS_SM90_BWD=fused``: the fused kernel for every problem it can
# run (FUSED_ALL); ``=1``: the deterministic dK/dV kernel after the portable dQ kernel; ``=0``:
# neither. Under torch.use_deterministic_algorithms(True) the fused kernels run with ordered dQ
# sums (at DETERMINISTIC_SEQ_Q's and DETERMINISTIC_SPLIT_SEQ_Q's lengths, or everywhere with
# FUSED_ALL).
_BWD_MODE = _switch("TORCH_FLASHSYS_SM90_BWD", ("fused", "1", "0"))
BWD_ENABLED = ENABLED and _BWD_MODE == "1"
FUSED_DEFAULT = True
FUSED_ENABLED = ENABLED and (_BWD_MODE == "fused" or (_BWD_MODE == "" and FUSED_DEFAULT
                                                      and VERIFIED))  # fmt: skip
FUSED_ALL = _BWD_MODE == "fused"
NO_BOUND = 1 << 30  # a length table's upper bound where it has none
# GQA from 256 rows: there its kernels took 0.54-0.77x the portable backward's time at 256-1024
# (H100, 2026-11-27, ``sm90_bwd.py --shapes``; the portable dK/dV kernel loops over a group's
# query heads), and the 1B LM's training step at context 512 went from 1.00x SDPA's to 0.99x.
# No upper bound: longer than 16384 (H100, 2026-11-27, ``sm90_bwd.py --shapes`` at 32768-131072
# rows, causal or not, GQA 4:1 or not) its kernels took 0.67-0.73x the portable ones' time (fwd+bwd
# 0.76-0.94x cuDNN's), where until then the portable backward ran (fwd+bwd 1.04-1.19x cuDNN's).
FUSED_SEQ_Q = {  # (causal, GQA) -> the lengths (queries and keys) where the fused kernel runs
    (True, True): (256, NO_BOUND),
    (True, False): (1024, NO_BOUND),
    (False, True): (256, NO_BOUND),
    (False, False): (1024, NO_BOUND),
}
# Cross-attention over a few hundred keys: per (causal, GQA), (query rows, keys) from which the
# fused kernel also runs with fewer keys than FUSED_SEQ_Q's lower bound (the queries and keys
# still at most its upper one). H100, 2026-11-27 (``gpu_checks/cross_shapes.py``, GPU time of a
# fwd+bwd, two runs of 4 x 16 x 4096 x 512 keys): without a causal mask or GQA, 512 keys, its
# kernels took 0.85x the portable ones' time at 4096 query rows (twice), 0.93x at 2048, 0.83x
# at 8192 (0.90-0.97x cuDNN's), but 1.01x at 1024 rows, 1.00x at 4096 x 256 keys, 1.14x at
# 4096 x 77 keys; causal 0.97x (top-left, 4096 x 512), left out. Only where its programs fill the
# GPU (:func:`_fills_the_gpu`).
FUSED_FEW_KEYS = {(False, False): (2048, 512)}
FUSED_STAGES = {64: 4, 128: 2}  # head dims the fused kernels serve -> Q/dO ring depth (64 KB)
# Head dim 128: the lengths (queries and keys) per (causal, GQA) where the split kernel runs by
# default (H100, ``benchmarks/sm90_bwd.py --rule --head-dim 128``: its backward took 0.60-0.97x the
# portable one's time at 1024-16384, but 1.08x causal without GQA at 1024, the same kernel time;
# with GQA its kernels took 0.68-0.76x the portable ones' at 256-512, ``--shapes``, 2026-11-27;
# longer than 16384, 0.76-0.79x at 32768-65536 rows, causal or not, GQA 4:1 or not, the same run
# as FUSED_SEQ_Q's, fwd+bwd 0.99-1.13x cuDNN's where the portable backward gave 1.25-1.36x: no
# upper bound).
SPLIT_SEQ_Q = {
    (True, True): (256, NO_BOUND),
    (True, False): (2048, NO_BOUND),
    (False, True): (256, NO_BOUND),
    (False, False): (1024, NO_BOUND),
}
SPLIT_HEAD_DIMS = frozenset({128})  # head dims the split kernel serves (the others: attn_bwd_sm90)
SPLIT_MAX_REGS = 168  # 168 x 384 threads (two consumer warpgroups and the load warp's group)
SPLIT_REGS = (240, 24)  # per thread: each consumer warpgroup, the load warp (4 bytes spill)
SPLIT_NBUF = 2  # dS^T buffer pairs
SPLIT_DQ_BUFS = 1  # float32 dQ tiles per consumer (64 x 64) for the TMA reductions (2: no faster)
# Program orders of the backward kernels (``_bwd._program_tile``'s ORDER bits): the heaviest
# causal key tiles of every head first, one head's key tiles after another, (a bit beside either)
# the lightest first, or chunks of heads in turn, each chunk heads first (``chunked``).
HEADS_FIRST, KEYS_FIRST, LIGHTEST_FIRST, CHUNKED = 0, 1, 2, 4
CHUNK_SHIFT = 8  # with CHUNKED, ORDER >> CHUNK_SHIFT: programs per chunk


def chunked(programs: int) -> int:
    """The ORDER of chunks of heads in turn, ``programs`` programs' worth of (batch, key/value
    head) pairs a chunk (at least one), each chunk's heaviest key tiles first."""
    return CHUNKED | programs << CHUNK_SHIFT


# Causal problems (both fused kernels, not deterministic): chunks of about one wave of programs on
# the H100's 132 SMs (``benchmarks/sm90_bwd.py --variants``: against the better of keys first and
# heads first, 1-9% faster from 1024 to 8192 tokens, 14% and 26% on two problems of few programs,
# d 64 and 128, GQA or not; equal at 16384, where a chunk is one head, i.e. keys first).
CAUSAL_ORDER = chunked(128)
SPLIT_ORDER = KEYS_FIRST  # the split kernel without a causal mask
# Deterministic (ordered dQ sums, head dim 64; docs/attention.md): causal, the lightest key tiles
# first, as the sums' order needs (a key tile's predecessors must start before it).
DETERMINISTIC_CAUSAL_ORDER = LIGHTEST_FIRST | KEYS_FIRST
# dQ copies, each summed in its own order, and how many steps later a step's counter counts up
# (``_bwd._fused_dq``; ``benchmarks/gpu_checks/ordered_variants.py``: 2 and 1 were the fastest
# causal pair, 1.11x the unordered kernel's time at (1, 16, 16384, 64), where one copy took 1.33x).
DETERMINISTIC_CHAINS = 2
DETERMINISTIC_SIGNAL_LAG = 1
DETERMINISTIC_SEQ_Q = {  # (causal, GQA) -> the lengths where the ordered fused kernel runs
    # H100, ``benchmarks/sm90_bwd.py --deterministic`` (docs/benchmarks.md): causal without GQA,
    # its backward took 0.85x (16384), 0.87x (8192) and 0.98x (4096) the portable one's time,
    # 1.16x at 2048 and 1.35x at 1024 (short problems: the copies' zeroing and sum, and the
    # tiles' first waits weigh more); with GQA 4:1, 1.02-1.04x at 1024-16384 (not analysed):
    # the portable backward. Longer (2026-11-27): its kernels 0.85x at (1, 16, 32768) and 0.77x
    # at (1, 8, 65536) the portable ones' time (fwd+bwd 0.93x and 0.88x): no upper bound.
    (True, False): (4096, NO_BOUND),
    # Without a causal mask every key tile reaches a query tile at the same step, so each waits
    # for the one before it: 1.36x the unordered kernel (two copies), no faster than the
    # portable backward; it keeps the portable one.
}
# Head dim 128: the split kernel with the same ordered sums (two copies, a lag of one step). H100,
# ``sm90_bwd.py --deterministic`` (docs/benchmarks.md), its backward against the portable one's
# under deterministic algorithms: causal without GQA 0.91x at 8192 and 16384 (fwd+bwd 1.01x and
# 0.92x), 0.97x at 4096 (the same kernel time), 1.14x at 2048; GQA 4:1 1.19x at 4096 (the
# portable backward); without a causal mask 0.93x at 4096, 0.84x at 8192 (fwd+bwd 0.93x, 0.85x),
# 1.03x at 2048, and at 16384 0.80x but fwd+bwd 1.08x (not understood: kept portable; at
# (1, 16, 32768) again its kernels 0.79x, fwd+bwd 0.98x). Causal at (1, 16, 32768) (2026-11-27):
# its kernels 0.93x, fwd+bwd 0.94x (the backward alone 1.03x): no upper bound.
DETERMINISTIC_SPLIT_SEQ_Q = {
    (True, False): (8192, NO_BOUND),
    (False, False): (4096, 8192),
}
FUSED_MAX_REGS = 128  # 128 x 512 threads (three warpgroups and the load warp's group)
FUSED_DQ_TMA = True  # dQ summed by TMA bulk reductions from shared memory (else atomics)
FUSED_NBUF = 4  # dS^T buffers between the consumers and the dQ warpgroup (shared memory 199 KB)
FUSED_REGS = (208, 72)  # per thread: each consumer warpgroup, the dQ warpgroup (no spills)
# dQ converted inside the fused kernels (not deterministic; off, opt-in): the warpgroups that add
# dQ tell a converter warp when a step's float32 sums have landed; it counts the query tile's
# int32 counter up, and the one that counts last converts the tile into dQ (instead of a
# conversion kernel after the backward). Correct (the GPU tests), but the backward took 1.2-3.2x
# the time of the kernel-after path on the H100 (``gpu_checks/dq_convert_ab.py --probe``,
# docs/benchmarks.md): the handshake and the counts cost little (without the conversions the
# backward took 0.90-1.03x), the conversions are the cost: one warp converts every tile whose
# sums its program completed, and the program that completes most tiles (causal: key tile 0
# reaches every query tile last) is the longest. CONVERT_RING: landed steps the converter may
# lag behind; CONVERT_REGS: its registers per thread.
FUSED_CONVERT = False
CONVERT_RING = 8
CONVERT_REGS = 24
BWD_BLOCK = 64  # keys per consumer warpgroup (two per program), query rows per step
BWD_STAGES = {64: 4, 128: 3}  # Q/dO ring depth per head dim (shared memory: 96 / 160 KB)
BWD_PIPELINE = True  # keep one step's dV/dK products in flight while the next S^T, dP^T issue


def enabled() -> bool:
    """Whether the Hopper path may run at all (Gluon available, not switched off)."""
    return ENABLED


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _tma_ok(t: torch.Tensor) -> bool:
    """16-byte aligned data and strides (but the last, which must be 1): a TMA descriptor."""
    strides = t.stride()
    if strides[-1] != 1 or t.data_ptr() % 16:
        return False
    return math.gcd(*strides[:-1]) % (16 // t.element_size()) == 0  # gcd(0, ..., 0) = 0


def kernel_dim(d: int) -> int:
    """The head dim of the kernels that serve head dim ``d``: ``d`` itself (64, 128; and any past
    128, which none serves), else the next of them (FWD_PADDED_DIMS, BWD_PADDED_DIMS)."""
    return d if d in STAGES or d > 128 else 64 if d <= 64 else 128


def forward_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  ex: Extras) -> bool:  # fmt: skip
    """Whether the forward of this 4-D problem runs on the Hopper kernel (the rule above)."""
    if not ENABLED:  # the switch first: off, the portable path pays one global read
        return False
    if not (ex is PLAIN or ex is CAUSAL) or scale <= 0 or q.dtype not in _GL_DTYPES:
        return False
    d = q.shape[-1]
    if (d not in STAGES and d not in FWD_PADDED_DIMS) or k.shape[-1] != d or v.shape[-1] != d:
        return False
    if not q.is_cuda:
        return False
    if k.shape[-2] < MIN_SEQ_K:
        return False
    if not _is_sm90(q.get_device()):
        return False
    return _tma_ok(q) and _tma_ok(k) and _tma_ok(v)


@functools.cache
def _layout(rows: int, d: int, dtype: torch.dtype):
    name = "float32" if dtype == torch.float32 else _GL_DTYPES[dtype]  # float32: the dQ sums
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], getattr(gl, name))


def _descriptor(t: torch.Tensor, rows: int, cols: int | None = None,
                descriptors: bool = True) -> TensorDescriptor | torch.Tensor:  # fmt: skip
    """A host TMA descriptor of ``t`` (4-D) with ``(1, 1, rows, cols)`` blocks (``cols``: the head
    dim unless given). Built without the dataclass's checks (a few microseconds each):
    :func:`_tma_ok` made them once per call. ``descriptors`` False: ``t`` itself (what a
    :class:`RawLaunch` takes in a descriptor's place)."""
    if not descriptors:
        return t
    d = t.shape[-1] if cols is None else cols
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=list(t.shape), strides=list(t.stride()),
                         block_shape=[1, 1, rows, d], layout=_layout(rows, d, t.dtype),
                         padding="zero")  # fmt: skip
    return desc


planned = 0  # launch keys planned so far (a new key: its first call, compiling if need be)
# launch key -> its launch (RawLaunch, or TritonLaunch): see _launch_planned
_PLANS: dict[tuple, RawLaunch | TritonLaunch] = {}


def launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, scale: float, counter: torch.Tensor | None = None,
                descriptors: bool = True) -> tuple:  # fmt: skip
    """The kernel's runtime arguments (descriptors, strides, sizes) for a 4-D problem;
    ``counter``: the dynamic schedule's zeroed int32 (else unused: lse stands in);
    ``descriptors`` False: the tensors in the descriptors' places."""
    batch, heads, seq_q, d = q.shape
    seq_k = k.shape[2]
    # Causal: heads grouped so that a group's keys and values fit in L2 (L2_BUDGET).
    group_heads = max(1, L2_BUDGET // (2 * seq_k * d * q.element_size()))
    desc, kd = descriptors, kernel_dim(d)
    return (_descriptor(q, BLOCK_M, kd, desc), _descriptor(k, BLOCK_N, kd, desc),
            _descriptor(v, BLOCK_N, kd, desc), _descriptor(out, BLOCK_M, kd, desc), lse,
            lse.stride(0), lse.stride(1), batch * heads, heads, heads // k.shape[1], seq_q,
            seq_k, scale * LOG2E, group_heads,
            lse if counter is None else counter)  # fmt: skip


def launch_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, scale: float,
                  counter: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """What of :func:`launch_args` changes between calls of one launch key (its tensors and
    floats, in order): what a planned launch takes."""
    return (q, k, v, out, lse, scale * LOG2E, lse if counter is None else counter)


def forward_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                causal: bool, index: int, persistent: bool | None,
                dynamic: bool) -> tuple:  # fmt: skip
    """The forward's launch key: what fixes its grid, constexprs and every integer argument
    (out takes q's layout: its strides follow from q's)."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), lse.stride(), q.dtype,
            causal, index, persistent, dynamic)  # fmt: skip


def constexprs(d: int, causal: bool, dynamic: bool = False, qbuf: int = 1,
               consumers: int = 2) -> dict:  # fmt: skip
    """The kernel's compile-time arguments (``dynamic``: tiles from a counter; ``qbuf``: query
    buffers per warpgroup; ``consumers``: consumer warpgroups; the variants and the ``PROBE``
    timeline: ``benchmarks/sm90_fwd.py`` overrides them)."""
    return {"CAUSAL": causal, "STAGES": STAGES[d], "KV_SPLIT": FWD_KV_SPLIT, "PROBE": 0,
            "DYNAMIC": dynamic, "QBUF": qbuf, "PIN_WAIT": FWD_PIN_WAIT[(d, causal)],
            "CONSUMERS": consumers, "CONSUMER_REGS": FWD_REGS[consumers][1],
            "Q_RS": False, "TREE_MAX": FWD_TREE_MAX[(d, causal)]}  # fmt: skip


def launch_options(consumers: int) -> dict:
    """The forward's launch options for ``consumers`` consumer warpgroups."""
    return {"num_warps": NUM_WARPS, "maxnreg": FWD_REGS[consumers][0]}


def forward_consumers(q: torch.Tensor, causal: bool) -> int:
    """Consumer warpgroups of the forward: three from FWD_CONSUMERS3_MIN's length for the
    problem's head dim and mask, else two."""
    key = (kernel_dim(q.shape[3]), causal)
    return 3 if q.shape[2] >= FWD_CONSUMERS3_MIN.get(key, 1 << 62) else 2


def query_buffers(q: torch.Tensor, causal: bool) -> int:
    """Query buffers per consumer warpgroup of the forward: two up to FWD_QBUF2_MAX's length for
    the problem's head dim and mask, else one."""
    return 2 if q.shape[2] <= FWD_QBUF2_MAX[(kernel_dim(q.shape[3]), causal)] else 1


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
            persistent: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out, lse)`` of a 4-D problem :func:`forward_takes` accepted: out in q's layout, lse
    float32 (B, H, L), natural log. After the first call for a launch key (shapes, strides,
    dtype, causal, device) the compiled kernel is launched directly."""
    batch, heads, seq_q, d = q.shape
    out = torch.empty_like(q)  # q's layout (empty_like_layout with q's own head dim)
    lse = q.new_empty((batch, heads, seq_q), dtype=torch.float32)
    index = q.get_device()
    dynamic = dynamic_schedule(q, causal, persistent)
    counter = schedule_counter(q, index) if dynamic else None

    def plan() -> tuple[tuple, dict]:
        consumers = forward_consumers(q, causal)
        return forward_grid(q, causal, persistent, dynamic, consumers), forward_meta(q, causal,
                                                                                     dynamic)  # fmt: skip

    args = functools.partial(launch_args, q, k, v, out, lse, scale, counter)
    if _launch_planned(attn_fwd_sm90, _PLANS, forward_key(q, k, v, lse, causal, index, persistent,
                                                          dynamic),
                       index, launch_values(q, k, v, out, lse, scale, counter), args, plan
                       ) and _precompile.first(("forward", d, causal, q.dtype, index)):  # fmt: skip
        _precompile.submit(forward_jobs(q, k, v, out, lse, scale, causal, index))
    return out, lse


def forward_jobs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, scale: float, causal: bool, index: int) -> list:  # fmt: skip
    """Background compile jobs (``_precompile``) of every forward build for q's head dim and the
    mask (:func:`forward_builds`), with stand-ins of one call's arguments: the dynamic schedule's
    builds take an int32 counter, the others lse in its place (a pointer of another type: another
    build)."""
    counter = _precompile.mock(torch.int32, [1])
    return [_precompile.Job(attn_fwd_sm90, tuple(map(_precompile.stand_in, launch_args(
        q, k, v, out, lse, scale, counter if meta["DYNAMIC"] else None))), meta, index)
            for meta in forward_builds(kernel_dim(q.shape[-1]), causal)]  # fmt: skip


def forward_meta(q: torch.Tensor, causal: bool, dynamic: bool) -> dict:
    """The forward's constexprs and launch options for q's shape (``q``: anything with a 4-D
    ``shape``), by the length rules above."""
    consumers = forward_consumers(q, causal)
    return {**constexprs(kernel_dim(q.shape[3]), causal, dynamic, query_buffers(q, causal),
                         consumers),
            **launch_options(consumers)}  # fmt: skip


class _Shape:
    """A stand-in with just a ``shape``, for the length rules."""

    __slots__ = ("shape",)

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


@functools.cache
def rule_lengths() -> tuple[int, ...]:
    """Sequence lengths on both sides of every bound the length rules have (the forward's
    builds, the fused backward's ranges) and of every power of two from 64 to 2**17 (the
    portable kernels' tiles, from tables keyed on the nearest measured length), up to
    RULE_LENGTH_MAX: evaluated at these, the rules pick every build they pick at any length."""
    bounds = {PERSISTENT_CAUSAL_MAX, *FWD_DYNAMIC_MAX.values(), *FWD_QBUF2_MAX.values(),
              *FWD_CONSUMERS3_MIN.values(), *(1 << e for e in range(6, 18)),
              *(n for pair in FUSED_FEW_KEYS.values() for n in pair)}  # fmt: skip
    for rule in (FUSED_SEQ_Q, SPLIT_SEQ_Q, DETERMINISTIC_SEQ_Q, DETERMINISTIC_SPLIT_SEQ_Q):
        for lo, hi in rule.values():
            bounds |= {lo, hi + 1}
    lengths = {1, *(max(1, n + delta) for n in bounds for delta in (-1, 0, 1))}
    return tuple(sorted(n for n in lengths if n <= RULE_LENGTH_MAX))


RULE_LENGTH_MAX = 1 << 21  # longer: the tables' "no bound" (NO_BOUND), no build compiled for it


def with_length(t, n: int) -> _Shape:
    """A stand-in of ``t``'s shape with ``n`` rows (dim -2)."""
    return _Shape((*t.shape[:-2], n, t.shape[-1]))


def forward_builds(d: int, causal: bool) -> list[dict]:
    """Every build (constexprs and launch options) the forward takes for head dim ``d`` and the
    mask at some length (:func:`rule_lengths`), each once."""
    builds: list[dict] = []
    for n in rule_lengths():
        shape = _Shape((1, 1, n, d))
        meta = forward_meta(shape, causal, dynamic_schedule(shape, causal))
        if meta not in builds:
            builds.append(meta)
    return builds


_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> the schedule's int32


def schedule_counter(q: torch.Tensor, index: int) -> torch.Tensor:
    """The dynamic schedule's counter for a launch on the current stream: zero when the kernel
    starts, and the kernel leaves it at zero (its final addition stores zero back), so one
    int32 per (device, stream), zeroed once, serves every launch on that stream in turn
    (launches on one stream run one after another; each stream has its own). While the stream
    is being captured into a CUDA graph, or the tensors are not on the current device (whose
    capture state is the one PyTorch reports), a fresh zeroed one per call (a graph keeps it)."""
    if index != torch.cuda.current_device() or torch.cuda.is_current_stream_capturing():
        return q.new_zeros(1, dtype=torch.int32)
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = q.new_zeros(1, dtype=torch.int32)
    return counter


def dynamic_schedule(q: torch.Tensor, causal: bool, persistent: bool | None = None) -> bool:
    """Whether the forward takes its tiles from a counter (FWD_DYNAMIC: causal, at most
    FWD_DYNAMIC_MAX rows for its head dim, the grid not forced)."""
    return (FWD_DYNAMIC and causal and persistent is None
            and q.shape[2] <= FWD_DYNAMIC_MAX[kernel_dim(q.shape[3])])  # fmt: skip


def forward_grid(q: torch.Tensor, causal: bool, persistent: bool | None = None,
                 dynamic: bool = False, consumers: int = 2) -> tuple:  # fmt: skip
    """The forward's grid. Persistent (one program per SM) for full attention and short causal
    sequences (the next tile's loads overlap this one's epilogue); longer causal tiles differ in
    cost, so one program per tile and the hardware's scheduler balances them (H100 measurements:
    docs/benchmarks.md), or with ``dynamic`` persistent again, each program taking the heaviest
    tile left when it is free. ``persistent`` True/False forces either static grid; tiles have
    ``consumers * BLOCK_M`` rows."""
    batch, heads, seq_q, _ = q.shape
    n_tiles = triton_cdiv(seq_q, consumers * BLOCK_M) * batch * heads
    long = not dynamic and (persistent is False or (persistent is None and causal
                                                    and seq_q > PERSISTENT_CAUSAL_MAX))  # fmt: skip
    return (n_tiles if long else min(n_tiles, _sm_count(q.get_device())), 1, 1)


def _launch_planned(kernel, plans: dict, key: tuple, index: int, values: tuple, args,
                    plan) -> bool:  # fmt: skip
    """Launch a Gluon ``kernel`` (or a plain Triton one: the backward's preprocessing). After
    the key's first call on the current device, the launch kept in ``plans[key]`` takes
    ``values`` (what changes between calls of the key: its tensors, in the descriptors' places
    too, and floats, in parameter order; ``_rawlaunch``): a
    :class:`RawLaunch` where RAW_LAUNCH and the launcher's layout allow, else a
    :class:`TritonLaunch`. Otherwise ``plan()`` gives ``(grid, meta)`` (every constexpr, and
    launch options), the JIT launches ``args(True)`` (every runtime argument, with host TMA
    descriptors; compiling once), and the launch is kept, its constexprs in parameter order
    (the direct launch passes every parameter, defaults included). The key must fix every
    integer argument, and the pointer arguments' 16-byte alignment that Triton specializes on:
    the Gluon kernels' plain pointers are buffers the library allocates (the caching
    allocator's: aligned), their descriptors' tensors are checked by :func:`_tma_ok`; the
    preprocessing kernel's key has its inputs' alignment. CPU tensors (``index`` -1, the
    interpreter) take the JIT every call. True when the key was new (planned now)."""
    if index < 0:  # CPU tensors (the interpreter): the JIT, nothing kept
        grid, meta = plan()
        kernel[grid](*args(True), **meta)
        return False
    entry = plans.get(key)
    current = index == torch.cuda.current_device()
    if entry is not None and current and not launch_hooks_set():
        entry(torch._C._cuda_getCurrentRawStream(index), values)
        return False
    grid, meta = plan()
    full = args(True)
    global planned
    planned += 1
    with _precompile.foreground(), torch.cuda.device(index):
        _precompile.claim(kernel, meta, full)  # (queued for the background, or compiling there)
        compiled = kernel[grid](*full, **meta)
    if fast_launch_allowed() and current:
        tail = tuple(meta[name] for name in kernel.arg_names[len(full) :])
        launch = RawLaunch.build(compiled, grid, full, tail, values) if RAW_LAUNCH else None
        launch = launch or TritonLaunch.build(compiled, grid, full, tail, values)
        if launch is not None:  # (None: the values are not the arguments' own: stay on the JIT)
            remember(plans, key, launch)
    return entry is None


def forget_launches() -> None:
    """Drop every kept launch, so that each launch key's next call compiles (or finds compiled)
    the build the module's switches choose now. The switches (FWD_PIN_WAIT, FWD_QBUF2_MAX, ...)
    are read when a key is first planned and are not in the keys: changing one at run time (the
    tests and benchmarks that compare builds) needs this after."""
    for plans in (_PLANS, _BWD_PLANS, _PREP_PLANS, _FUSED_PLANS, _KEPT):
        plans.clear()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def backward_grid(k: torch.Tensor) -> tuple[int, int, int]:
    """The backward kernels' grid (dK/dV and fused): one program per 2 x BWD_BLOCK keys of one
    (batch, key/value head)."""
    batch, n_kv, seq_k, _ = k.shape
    return (triton_cdiv(seq_k, 2 * BWD_BLOCK) * batch * n_kv, 1, 1)


def backward_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   scale: float, ex: Extras) -> bool:  # fmt: skip
    """Whether the dK/dV of this 4-D problem run on the Hopper kernel: the forward's rule, the
    switch, and dO a TMA operand of q's shape."""
    return (BWD_ENABLED and dout.shape == q.shape and dout.dtype == q.dtype
            and q.shape[-1] in BWD_STAGES and forward_takes(q, k, v, scale, ex)
            and _tma_ok(dout))  # fmt: skip


_BWD_PLANS: dict[tuple, RawLaunch | TritonLaunch] = {}


def backward_launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                         lse: torch.Tensor, delta: torch.Tensor, dk: torch.Tensor,
                         dv: torch.Tensor, scale: float,
                         descriptors: bool = True) -> tuple:  # fmt: skip
    """The dK/dV kernel's runtime arguments (descriptors, strides, sizes) for a 4-D problem
    (``descriptors`` False: the tensors in their places)."""
    batch, heads, seq_q, d = q.shape
    n_kv, seq_k = k.shape[1], k.shape[2]
    desc, kd = descriptors, kernel_dim(d)
    return (_descriptor(q, BWD_BLOCK, kd, desc), _descriptor(k, BWD_BLOCK, kd, desc),
            _descriptor(v, BWD_BLOCK, kd, desc), _descriptor(dout, BWD_BLOCK, kd, desc), lse,
            delta, lse.stride(0), lse.stride(1), dk, dk.stride(0), dk.stride(1), dk.stride(2),
            dv, dv.stride(0), dv.stride(1), dv.stride(2), batch * n_kv, n_kv, heads // n_kv,
            seq_q, seq_k, scale * LOG2E, scale)  # fmt: skip


def backward_launch_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                           dk: torch.Tensor, dv: torch.Tensor, scale: float) -> tuple:  # fmt: skip
    """What of :func:`backward_launch_args` changes between calls of one launch key."""
    return (q, k, v, dout, lse, delta, dk, dv, scale * LOG2E, scale)


def backward_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                 lse: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool, index: int,
                 *flags) -> tuple:  # fmt: skip
    """The backward kernels' launch key: what fixes their grid, constexprs and every integer
    argument (delta takes lse's layout; ``flags``: the caller's own)."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.shape,
            dout.stride(), lse.stride(), dk.stride(), dv.stride(), q.dtype, causal, index,
            *flags)  # fmt: skip


def backward_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                  lse: torch.Tensor, delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                  scale: float, causal: bool, pipeline: bool | None = None) -> None:  # fmt: skip
    """dK and dV of a problem :func:`backward_takes` accepted into ``dk``/``dv`` (k's and v's
    shapes, any strides with a unit last one), from ``lse`` and ``delta`` (float32 (B, H, L),
    one layout; delta as the portable dQ kernel stores it)."""
    d = k.shape[-1]
    pipeline = BWD_PIPELINE if pipeline is None else pipeline
    index = q.get_device()

    def plan() -> tuple[tuple, dict]:
        return backward_grid(k), {"CAUSAL": causal, "STAGES": BWD_STAGES[d],
                                  "PIPELINE": pipeline, "num_warps": NUM_WARPS,
                                  "maxnreg": MAX_REGS}  # fmt: skip

    _launch_planned(attn_bwd_dkdv_sm90, _BWD_PLANS,
                    backward_key(q, k, v, dout, lse, dk, dv, causal, index, delta.stride(),
                                 pipeline), index,
                    backward_launch_values(q, k, v, dout, lse, delta, dk, dv, scale),
                    functools.partial(backward_launch_args, q, k, v, dout, lse, delta, dk, dv,
                                      scale), plan)  # fmt: skip


def fused_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                scale: float, ex: Extras) -> bool:  # fmt: skip
    """Whether the backward of this 4-D problem runs on the fused Hopper kernel: the forward's
    rule, the switch, a head dim it has a configuration for, a problem where it is the faster
    backward (or FUSED_ALL), and dO a TMA operand of q's shape. Under deterministic algorithms
    the kernels run with ordered dQ sums, where DETERMINISTIC_SEQ_Q (head dim 64) and
    DETERMINISTIC_SPLIT_SEQ_Q (128) say."""
    if not fused_rule(q, k, ex, torch.are_deterministic_algorithms_enabled()):
        return False
    return fused_fits(q, k, v, dout, scale, ex)


def fused_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
               scale: float, ex: Extras) -> bool:  # fmt: skip
    """The part of :func:`fused_takes` that does not depend on the lengths: the forward's rule,
    and dO a TMA operand of q's shape and dtype."""
    d = q.shape[-1]
    return (dout.shape == q.shape and dout.dtype == q.dtype
            and (d in FUSED_STAGES or d in BWD_PADDED_DIMS)
            and forward_takes(q, k, v, scale, ex) and _tma_ok(dout))  # fmt: skip


def fused_rule(q, k, ex: Extras, deterministic: bool) -> bool:
    """The part of :func:`fused_takes` that depends on the problem's kind and lengths (``q``,
    ``k``: anything with a 4-D ``shape``): the switch, the head dim, and the lengths where the
    fused kernel runs (with ordered dQ sums when ``deterministic``)."""
    d = q.shape[-1]
    if not (FUSED_ENABLED and (d in FUSED_STAGES or (d in BWD_PADDED_DIMS and not deterministic))):
        return False
    if FUSED_ALL:
        return True
    return _deterministic_wins(q, k, ex) if deterministic else _fused_wins(q, k, ex)


def _deterministic_wins(q: torch.Tensor, k: torch.Tensor, ex: Extras) -> bool:
    """Where the fused kernel with ordered dQ sums (DETERMINISTIC) runs under
    ``torch.use_deterministic_algorithms(True)``: the query and key lengths in
    DETERMINISTIC_SEQ_Q (head dim 128: DETERMINISTIC_SPLIT_SEQ_Q) for the problem's kind."""
    rule = DETERMINISTIC_SPLIT_SEQ_Q if q.shape[-1] in SPLIT_HEAD_DIMS else DETERMINISTIC_SEQ_Q
    return _in_rule(rule, q, k, ex)


def _rule_kind(q: torch.Tensor, k: torch.Tensor, ex: Extras) -> tuple[bool, bool] | None:
    """The length rules' key of a causal or plain problem, (causal, GQA); None for the others
    (no rule takes them)."""
    if not (ex is CAUSAL or ex is PLAIN):
        return None
    return ex is CAUSAL, q.shape[1] > k.shape[1]


def _in_rule(rule: dict, q: torch.Tensor, k: torch.Tensor, ex: Extras) -> bool:
    """Whether a causal or plain problem's query and key lengths are both in ``rule``'s range
    for its kind ((causal, GQA) -> (lo, hi); a kind not in ``rule``: never)."""
    kind = _rule_kind(q, k, ex)
    if kind is None:
        return False
    lo, hi = rule.get(kind, (1, 0))
    return lo <= q.shape[2] <= hi and lo <= k.shape[2] <= hi


def _fused_wins(q: torch.Tensor, k: torch.Tensor, ex: Extras) -> bool:
    """Where the fused backward measured faster than the portable one (H100, head dim 64,
    ``benchmarks/sm90_bwd.py --rule``, 1024-16384 query rows, 16384 tokens a problem; the
    training step): the query lengths in FUSED_SEQ_Q for the problem's kind. In two runs its
    backward took 0.72-0.80x the portable one's time with causal GQA 4:1 at 2048-16384 (1024:
    host-bound, 0.73x and 1.32x here, 0.81-0.83x in earlier runs), 0.82-0.94x causal without GQA
    at 4096-16384 (1.29-1.34x slower at 1024-2048, where a key tile has few query tiles; with
    one head's key tiles in turn, KEYS_FIRST, its kernel took 0.77-0.82x the portable kernels'
    time there, ``gpu_checks/order_ab.py``), 0.75-0.88x without a causal mask at 2048-8192, and
    (one run, with the load warp's LSE/D rows) 0.78-0.81x at 16384 (1024: host-bound, no clear
    winner). Short rows, kernel times (``--shapes``, 16384 tokens a problem, 2026-11-27): with GQA
    4:1 its kernels took 0.54-0.77x the portable ones' at 256-1024, causal or not (the ranges
    start at 256); without GQA and without a causal mask 0.91x at 1024 (1.03x at 512), causal
    1.09-1.22x at 256-512. Only self-attention was measured (as many keys as query rows), so
    the keys must be in the range too: with few keys (cross-attention) the kernel has few
    programs, each looping over every query tile. Head dim 128 (the split kernel): the lengths
    in SPLIT_SEQ_Q, from one ``--rule --head-dim 128`` run (docs/benchmarks.md). Cross-attention
    over fewer keys: FUSED_FEW_KEYS (head dim 64)."""
    if kernel_dim(q.shape[-1]) in SPLIT_HEAD_DIMS:
        return _in_rule(SPLIT_SEQ_Q, q, k, ex)
    if _in_rule(FUSED_SEQ_Q, q, k, ex):
        return True
    kind = _rule_kind(q, k, ex)
    few, bounds = FUSED_FEW_KEYS.get(kind), FUSED_SEQ_Q.get(kind)
    if few is None or bounds is None:
        return False
    (min_q, min_k), hi = few, bounds[1]
    return min_q <= q.shape[2] <= hi and min_k <= k.shape[2] <= hi and _fills_the_gpu(q, k)


def _fills_the_gpu(q, k) -> bool:
    """Whether the fused backward has at least one program per SM (its grid: a program per 128
    keys and key/value head); a stand-in shape (no device: the background compiles) counts as
    filling it. FUSED_FEW_KEYS needs it: over 512 keys, 4-8 x 16 heads (256-512 programs) took
    the fused kernel 0.83-0.93x the portable ones' time at 2048-8192 query rows, 1 x 16 (64
    programs) 1.02x at 16384 and 1.03x at 32768 (``cross_shapes.py``, 2026-11-27)."""
    if not isinstance(q, torch.Tensor):
        return True
    return backward_grid(k)[0] >= _sm_count(q.get_device())


_PREP_PLANS: dict[tuple, RawLaunch | TritonLaunch] = {}
PREP_BLOCK = 64  # query rows per program: BWD_BLOCK, the fused kernel's query tile (counters)


def backward_prep(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                  dlse: torch.Tensor | None, deterministic: bool = False, copies: int = 1,
                  convert: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(delta, dq_acc, sem)``: D = rowsum(dO * O) - dLSE in lse's layout, a zeroed float32
    (copies x B, H, L, d) buffer for the fused kernel's dQ sums (``copies``: the deterministic
    kernel's CHAINS), and (``deterministic``: the ordered sums'; ``convert``: the in-kernel dQ
    conversion's; else None) zeroed int32 counters, one per (copy x batch, head, tile of
    BWD_BLOCK query rows). A planned launch
    after the first call of a key (as the Gluon kernels'): Triton specializes a kernel on each
    pointer's 16-byte alignment, so the key has that of the three inputs (the buffers made here
    are the caching allocator's, always aligned)."""
    batch, heads, seq_q, d = out.shape
    n_blocks = triton_cdiv(seq_q, PREP_BLOCK)
    counters = deterministic or convert
    delta, dq_acc, sem = prep_buffers(out, lse, copies, counters)
    rows = lse if dlse is None else dlse
    index = out.get_device()
    key = prep_key(out, dout, lse, dlse, counters, copies, index)
    values = (out, dout, rows, delta, dq_acc, dq_acc if sem is None else sem)

    def args(descriptors: bool = True) -> tuple:
        return prep_args(values, out, dout, lse)

    def plan() -> tuple[tuple, dict]:
        return (n_blocks, batch * heads, 1), prep_meta(d, dlse is not None, counters, copies)

    _launch_planned(attn_bwd_prep, _PREP_PLANS, key, index, values, args, plan)
    return delta, dq_acc, sem


def prep_buffers(out: torch.Tensor, lse: torch.Tensor, copies: int, counters: bool,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The buffers :func:`backward_prep` fills (unfilled): delta, the float32 dQ sums and, with
    ``counters``, the int32 counters."""
    batch, heads, seq_q, d = out.shape
    delta = torch.empty_like(lse)
    dq_acc = out.new_empty((copies * batch, heads, seq_q, kernel_dim(d)), dtype=torch.float32)
    sem = (out.new_empty((copies * batch, heads, triton_cdiv(seq_q, PREP_BLOCK)),
                         dtype=torch.int32) if counters else None)  # fmt: skip
    return delta, dq_acc, sem


def prep_key(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
             dlse: torch.Tensor | None, counters: bool, copies: int, index: int) -> tuple:  # fmt: skip
    """The preprocessing kernel's launch key (see :func:`backward_prep`)."""
    rows = lse if dlse is None else dlse
    aligned = pointer_alignment((out.data_ptr(), dout.data_ptr(), rows.data_ptr()))
    return (out.shape, out.stride(), dout.stride(), lse.stride(), rows.stride(), out.dtype,
            dlse is None, counters, copies, index, aligned)  # fmt: skip


def prep_args(values: tuple, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor) -> tuple:
    """The preprocessing kernel's runtime arguments: ``values`` (its six tensors), then the
    strides and sizes."""
    return (*values, *out.stride()[:3], *dout.stride()[:3], lse.stride(0), lse.stride(1),
            out.shape[1], out.shape[2])  # fmt: skip


def prep_meta(d: int, has_dlse: bool, counters: bool, copies: int) -> dict:
    """The preprocessing kernel's constexprs for head dim ``d`` (``counters``: it zeroes them, see
    :func:`backward_prep`): tiles of the fused kernel's head dim (:func:`kernel_dim`), and ``DIM``
    the head dim's own where that is wider (0: the same)."""
    kd = kernel_dim(d)
    return {"HAS_DLSE": has_dlse, "BLOCK_M": PREP_BLOCK, "HEAD_DIM": kd,
            "HAS_SEM": counters, "COPIES": copies, "DIM": 0 if kd == d else d}  # fmt: skip


def fused_builds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, scale: float,
                 causal: bool, deterministic: bool) -> list:  # fmt: skip
    """The builds :func:`backward` compiles for a problem of this kind (dtype, head dim, mask,
    GQA, dLSE, deterministic), as background compile jobs with stand-in arguments
    (``_precompile``): the preprocessing kernel, the fused kernel and, deterministic, the sum of
    the dQ copies."""
    mock = _precompile.stand_in
    index, d, kd = q.get_device(), q.shape[-1], kernel_dim(q.shape[-1])
    copies = DETERMINISTIC_CHAINS if deterministic else 1
    counters = deterministic or fused_converts(deterministic)
    acc = _precompile.mock(torch.float32, [copies * q.shape[0], *q.shape[1:3], kd])  # contiguous
    sem = _precompile.mock(torch.int32, [copies, *q.shape[:2]]) if counters else None
    rows = lse if dlse is None else dlse
    values = tuple(map(mock, (out, dout, rows, lse))) + (acc, acc if sem is None else sem)
    jobs = [
        _precompile.Job(attn_bwd_prep, prep_args(values, out, dout, lse),
                        prep_meta(d, dlse is not None, counters, copies), index),
        _precompile.Job(fused_kernel(kd), tuple(map(mock, fused_launch_args(
            q, k, v, dout, lse, lse, k, v, acc, scale, sem, dq=q))),
            fused_constexprs(kd, causal, q.dtype, deterministic), index),
    ]  # fmt: skip
    if copies > 1:  # (dQ takes q's layout; never a padded head dim: not deterministic)
        jobs.append(_precompile.Job(attn_bwd_dq_sum, tuple(map(mock, dq_sum_args(acc, q))),
                                    dq_sum_meta(d, copies), index))  # fmt: skip
    return jobs


_launch_dq_sum = LaunchCache(attn_bwd_dq_sum, n_tensors=2)


def dq_sum(dq_acc: torch.Tensor, q: torch.Tensor, copies: int) -> torch.Tensor:
    """dQ in q's dtype and layout: the sum of ``dq_acc``'s ``copies`` float32 copies ((copies x
    B, H, L, d), contiguous), added in copy order (one kernel; the deterministic backward's)."""
    batch, heads, seq_q, d = q.shape
    dq = torch.empty_like(q)
    key = (q.shape, dq.stride(), q.dtype, copies)
    grid = (triton_cdiv(seq_q, PREP_BLOCK), batch * heads)
    _launch_dq_sum(key, lambda meta: grid, dq_sum_args(dq_acc, dq), dq_sum_meta(d, copies))
    return dq


def dq_sum_args(dq_acc, dq) -> tuple:
    """The dQ copies' sum kernel's runtime arguments (``dq``: q's shape and layout)."""
    return (dq_acc, dq, *dq.stride()[:3], dq.shape[1], dq.shape[2])


def dq_sum_meta(d: int, copies: int) -> dict:
    """The dQ copies' sum kernel's constexprs."""
    return {"COPIES": copies, "BLOCK_M": PREP_BLOCK, "HEAD_DIM": d}


_FUSED_PLANS: dict[tuple, RawLaunch | TritonLaunch] = {}


def fused_launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                      lse: torch.Tensor, delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                      dq_acc: torch.Tensor, scale: float, sem: torch.Tensor | None = None,
                      descriptors: bool = True, dq: torch.Tensor | None = None,
                      ) -> tuple:  # fmt: skip
    """The fused kernel's runtime arguments: the dK/dV kernel's, with the dQ buffer (contiguous
    float32 (B, H, L, d)) inserted, the counters of :func:`backward_prep` (``sem``; unused, the
    dQ buffer stands in) and dQ with its batch, head and row strides (``dq``, in q's dtype: what
    the kernel converts the sums into when CONVERT; unused, q and zero strides stand in)."""
    args = backward_launch_args(q, k, v, dout, lse, delta, dk, dv, scale, descriptors)
    d = kernel_dim(q.shape[-1])  # the split kernel: each consumer adds half of a dQ row
    dq_desc = _descriptor(dq_acc, BWD_BLOCK, d // 2 if d in SPLIT_HEAD_DIMS else d, descriptors)
    out = (q, 0, 0, 0) if dq is None else (dq, *dq.stride()[:3])
    return (*args[:16], dq_acc, dq_desc, dq_acc if sem is None else sem, *out, *args[16:])


def fused_launch_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                        lse: torch.Tensor, delta: torch.Tensor, dk: torch.Tensor,
                        dv: torch.Tensor, dq_acc: torch.Tensor, scale: float,
                        sem: torch.Tensor | None = None,
                        dq: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """What of :func:`fused_launch_args` changes between calls of one launch key."""
    return (q, k, v, dout, lse, delta, dk, dv, dq_acc, dq_acc, dq_acc if sem is None else sem,
            q if dq is None else dq, scale * LOG2E, scale)  # fmt: skip


def fused_converts(deterministic: bool) -> bool:
    """Whether the fused kernels convert dQ themselves (FUSED_CONVERT; never with ordered sums,
    whose copies are summed after the kernel)."""
    return FUSED_CONVERT and not deterministic


def fused_kernel(d: int):
    """The fused backward kernel of head dim ``d`` (a key of FUSED_STAGES): the split kernel for
    SPLIT_HEAD_DIMS, else attn_bwd_sm90."""
    return attn_bwd_split_sm90 if d in SPLIT_HEAD_DIMS else attn_bwd_sm90


def fused_constexprs(d: int, causal: bool, dtype: torch.dtype,
                     deterministic: bool = False) -> dict:  # fmt: skip
    """The fused kernel's compile-time arguments, every one (the direct launch passes them all),
    and launch options, for head dim ``d``. The variants beside the defaults:
    ``benchmarks/sm90_bwd.py --variants``. Program order: causal, CAUSAL_ORDER (chunks of heads,
    heaviest key tiles first in each); else one head's key tiles after another (SPLIT_ORDER at
    head dim 128; docs/benchmarks.md); ``deterministic`` (ordered dQ sums), causal:
    DETERMINISTIC_CAUSAL_ORDER."""
    ds_layout = gl.NVMMASharedLayout.get_default_for([BWD_BLOCK, BWD_BLOCK],
                                                     getattr(gl, _GL_DTYPES[dtype]))  # fmt: skip
    ordered = {"DETERMINISTIC": deterministic,
               "CHAINS": DETERMINISTIC_CHAINS if deterministic else 1,
               "SIGNAL_LAG": DETERMINISTIC_SIGNAL_LAG if deterministic else 0}  # fmt: skip
    order = CAUSAL_ORDER if causal else SPLIT_ORDER if d in SPLIT_HEAD_DIMS else KEYS_FIRST
    if deterministic and causal:
        order = DETERMINISTIC_CAUSAL_ORDER
    ordered.update(CONVERT=fused_converts(deterministic), NCONV=CONVERT_RING,
                   CONVERT_REGS=CONVERT_REGS)  # fmt: skip
    if d in SPLIT_HEAD_DIMS:
        return {"CAUSAL": causal, "STAGES": FUSED_STAGES[d], "DS_LAYOUT": ds_layout,
                "CONSUMER_REGS": SPLIT_REGS[0], "LOAD_REGS": SPLIT_REGS[1], "NBUF": SPLIT_NBUF,
                "DQ_BUFS": SPLIT_DQ_BUFS, "ORDER": order, **ordered, "PIN_WAIT": BWD_PIN_WAIT,
                "PROBE": 0, "num_warps": NUM_WARPS, "maxnreg": SPLIT_MAX_REGS}  # fmt: skip
    return {"CAUSAL": causal, "STAGES": FUSED_STAGES[d], "DS_LAYOUT": ds_layout,
            "CONSUMER_REGS": FUSED_REGS[0], "DQ_REGS": FUSED_REGS[1], "NBUF": FUSED_NBUF,
            "KV_RS": False, "DK_RS": False, "PROBE": 0, "DQ_TMA": FUSED_DQ_TMA or deterministic,
            "ORDER": order, **ordered, "PIN_WAIT": BWD_PIN_WAIT, "num_warps": NUM_WARPS,
            "maxnreg": FUSED_MAX_REGS}  # fmt: skip


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, scale: float,
             causal: bool, kept: _KeptBackward | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` of a problem :func:`fused_takes` accepted, in q's, k's and v's layouts:
    the preprocessing kernel, the fused kernel, then dQ's float32 sums converted. ``kept``: the
    problem's kept backward (:func:`kept_backward`), which does just that."""
    if kept is not None:
        return kept(dout, q, k, v, out, lse, scale)
    if kernel_dim(q.shape[-1]) != q.shape[-1]:
        return _padded_backward(dout, q, k, v, out, lse, dlse, scale, causal)
    deterministic = torch.are_deterministic_algorithms_enabled()
    copies = DETERMINISTIC_CHAINS if deterministic else 1
    convert = fused_converts(deterministic)
    delta, dq_acc, sem = backward_prep(out, dout, lse, dlse, deterministic, copies, convert)
    dq = torch.empty_like(q) if convert else None  # (converted by the kernel)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    index = q.get_device()

    def plan() -> tuple[tuple, dict]:
        return backward_grid(k), fused_constexprs(k.shape[-1], causal, q.dtype, deterministic)

    key = backward_key(q, k, v, dout, lse, dk, dv, causal, index, deterministic)
    _launch_planned(fused_kernel(k.shape[-1]), _FUSED_PLANS, key, index,
                    fused_launch_values(q, k, v, dout, lse, delta, dk, dv, dq_acc, scale, sem,
                                        dq),
                    functools.partial(fused_launch_args, q, k, v, dout, lse, delta, dk, dv,
                                      dq_acc, scale, sem, dq=dq), plan)  # fmt: skip
    if dlse is None and not deterministic:  # the next calls of this key: kept_backward
        _keep_backward(dout, q, k, v, out, lse, causal, convert, index, key)
    if dq is not None:
        return dq, dk, dv
    if copies > 1:  # the chains' sums, added in a fixed order
        return dq_sum(dq_acc, q, copies), dk, dv
    return torch.empty_like(q).copy_(dq_acc), dk, dv


def _padded_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
                     scale: float, causal: bool,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`backward` for a head dim of BWD_PADDED_DIMS: the fused kernel of the next head dim
    (:func:`kernel_dim`) reads q, k, v and dO through descriptors of its width (TMA's zero fill
    past the head dim: the extra columns add nothing to S and dP, and their dQ, dK and dV
    columns are zeros) and writes dK, dV and the float32 dQ sums into buffers of its width
    (the preprocessing kernel's D reads O and dO up to the head dim); the gradients are their
    first columns (dQ converted into q's layout, dK and dV as views). Not kept
    (:func:`kept_backward`), not deterministic, dQ never converted by the kernel."""
    d, kd = q.shape[-1], kernel_dim(q.shape[-1])
    delta, dq_acc, _ = backward_prep(out, dout, lse, dlse)
    dk, dv = k.new_empty((*k.shape[:-1], kd)), v.new_empty((*v.shape[:-1], kd))
    index = q.get_device()

    def plan() -> tuple[tuple, dict]:  # (no dQ conversion in the kernel: dQ is narrower)
        return backward_grid(k), {**fused_constexprs(kd, causal, q.dtype), "CONVERT": False}

    _launch_planned(fused_kernel(kd), _FUSED_PLANS,
                    backward_key(q, k, v, dout, lse, dk, dv, causal, index, False), index,
                    fused_launch_values(q, k, v, dout, lse, delta, dk, dv, dq_acc, scale),
                    functools.partial(fused_launch_args, q, k, v, dout, lse, delta, dk, dv,
                                      dq_acc, scale, None), plan)  # fmt: skip
    return torch.empty_like(q).copy_(dq_acc[..., :d]), dk[..., :d], dv[..., :d]


# The kept backwards: a launch key (:func:`_kept_key`) -> its decisions and planned launches
_KEPT: dict[tuple, _KeptBackward] = {}


class _KeptBackward:
    """The fused backward of one launch key, its two planned launches (the preprocessing kernel's
    and the fused kernel's) and the buffers it allocates, decided once: what :func:`backward`
    runs for a problem :func:`kept_backward` found."""

    __slots__ = ("convert", "fused", "index", "prep")

    def __init__(self, prep, fused, index: int, convert: bool) -> None:
        self.prep, self.fused, self.index, self.convert = prep, fused, index, convert

    def __call__(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """:func:`backward`'s buffers and launches, nothing else."""
        delta, dq_acc, sem = prep_buffers(out, lse, 1, self.convert)
        dq = torch.empty_like(q) if self.convert else None
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        self.prep(stream, (out, dout, lse, delta, dq_acc, dq_acc if sem is None else sem))
        self.fused(stream, fused_launch_values(q, k, v, dout, lse, delta, dk, dv, dq_acc, scale,
                                               sem, dq))  # fmt: skip
        if dq is None:
            dq = torch.empty_like(q).copy_(dq_acc)
        return dq, dk, dv


def _kept_key(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, causal: bool) -> tuple:  # fmt: skip
    """What fixes a backward's decisions and launches but the switches and rules that
    :func:`kept_backward` reads each call: shapes, strides, dtypes, the mask, the device, and
    whether every pointer is 16-byte aligned (TMA's and Triton's specialization)."""
    ptrs = (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr() | out.data_ptr()
            | lse.data_ptr())  # fmt: skip
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.shape,
            dout.stride(), out.stride(), lse.stride(), q.dtype, dout.dtype, causal,
            q.get_device(), not ptrs & 15)  # fmt: skip


def _keep_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, convert: bool, index: int,
                   fused_key: tuple) -> None:  # fmt: skip
    """After :func:`backward` ran a key without dLSE or ordered sums: keep its launches for
    :func:`kept_backward`, where both were planned and every pointer is aligned."""
    key = _kept_key(dout, q, k, v, out, lse, causal)
    if not key[-1] or key in _KEPT:
        return
    prep = _PREP_PLANS.get(prep_key(out, dout, lse, None, convert, 1, index))
    fused = _FUSED_PLANS.get(fused_key)
    if prep is not None and fused is not None:
        remember(_KEPT, key, _KeptBackward(prep, fused, index, convert))


def kept_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, scale: float,
                  ex: Extras) -> _KeptBackward | None:  # fmt: skip
    """The kept backward of a problem whose launch key (shapes, strides, dtypes, mask, device,
    alignment) the fused backward has run before without dLSE or ordered sums, where the
    switches and rules still send it there (:func:`backward` runs it); else None (the caller
    decides as usual). An eager backward's host work (autograd runs it on its CUDA device
    thread): one key and a few checks, not the rules' and launch keys' (docs/benchmarks.md)."""
    if not _KEPT or dlse is not None or not ENABLED:
        return None
    causal = ex is CAUSAL
    if not (causal or ex is PLAIN) or torch.are_deterministic_algorithms_enabled():
        return None
    kept = _KEPT.get(_kept_key(dout, q, k, v, out, lse, causal))
    if (kept is None or scale <= 0 or k.shape[2] < MIN_SEQ_K or not fused_rule(q, k, ex, False)
            or kept.index != torch.cuda.current_device() or launch_hooks_set()):  # fmt: skip
        return None
    return kept
