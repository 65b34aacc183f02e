"""Pieces shared by the Triton kernels: score masking and tile loads (``@triton.jit`` helpers),
and the autotune set-up (config lists per head dim, shared-memory pruning, tuning key)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import triton
import triton.language as tl

from torch_flashsys.attention._backend import interpreter_active

LOG2E = 1.4426950408889634  # log2(e): the kernels use exp2, so scores are pre-multiplied by it

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
Shape = tuple[int, int, int, int]


@triton.jit
def keep_scores(q_idx, k_idx, seq_k, CAUSAL: tl.constexpr):
    """True where query ``q_idx`` may attend key ``k_idx`` (broadcast shapes): key inside the
    sequence and, when CAUSAL, not after the query (top-left aligned)."""
    keep = k_idx < seq_k
    if CAUSAL:
        keep = keep & (k_idx <= q_idx)
    return keep


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
        if EVEN_D:  # noqa: SIM108 (constexpr branches, spelled out for Triton)
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    return tile


def tune_len(seq_q: int, seq_k: int) -> int:
    """The sequence-length part of the autotune key: a power of two in [128, 16384]."""
    return min(max(triton.next_power_of_2(max(seq_q, seq_k)), 128), 16384)


def autotune_enabled() -> bool:
    """``TORCH_FLASHSYS_AUTOTUNE=0`` keeps only each kernel's default config (fast first call)."""
    return os.environ.get("TORCH_FLASHSYS_AUTOTUNE", "1") != "0"


def dim_class(head_dim: int) -> int:
    """Head dims share config lists in classes: <= 64, <= 128, larger."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


@functools.cache
def _shared_memory_bytes(device_index: int) -> int:
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(props["max_shared_mem"])
    except Exception:  # unknown driver or API: assume a small GPU
        return 100 * 1024


def make_autotune(
    kernel,
    shapes: dict[int, Sequence[Shape]],
    footprint: Callable[[int, int, int, int], int],
):
    """Wrap ``kernel`` in ``triton.autotune`` over ``shapes[dim_class(HEAD_DIM)]``.

    The key is (head dim, causal, dot precision, length bucket, dtypes). Configs whose estimated
    shared memory (``footprint(block_m, block_n, block_d, stages)`` elements) does not fit are
    pruned, keeping a quarter of the device's capacity spare for layout conversions; if none fits,
    the smallest tile with one stage is used. Under the interpreter: one 16x16 tile, so every loop
    and edge runs. With autotuning off the first fitting config of the class is used.
    """
    if interpreter_active():
        configs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
        return triton.autotune(configs=configs, key=["HEAD_DIM"])(kernel)
    unique = list(dict.fromkeys(s for group in shapes.values() for s in group))
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in unique
    ]

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        head_dim, block_d = kwargs["HEAD_DIM"], kwargs["BLOCK_D"]
        first = next(iter(named_args.values()))
        budget = 0.75 * _shared_memory_bytes(first.device.index or 0)
        elem = first.element_size()
        kept = []
        for bm, bn, w, st in shapes[dim_class(head_dim)]:
            if elem * footprint(bm, bn, block_d, st) <= budget:
                kept.append(configs[unique.index((bm, bn, w, st))])
        if not kept:
            return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
        return kept if autotune_enabled() else kept[:1]

    return triton.autotune(
        configs=configs,
        key=["HEAD_DIM", "CAUSAL", "PRECISION", "tune_len"],  # tensor dtypes are added by Triton
        prune_configs_by={"early_config_prune": prune},
    )(kernel)
