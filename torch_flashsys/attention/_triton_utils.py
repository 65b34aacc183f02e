"""Shared pieces of the Triton kernels' launch wrappers: constants, config spaces, pruning."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import triton

from torch_flashsys.attention._backend import interpreter_active

LOG2E = 1.4426950408889634  # log2(e): the kernels use exp2, so scores are pre-multiplied by it

# (BLOCK_M, BLOCK_N, num_warps, num_stages); the first entry of each list is the default.
Shape = tuple[int, int, int, int]


def autotune_enabled() -> bool:
    """``TORCH_FLASHSYS_AUTOTUNE=0`` keeps only each kernel's default config (fast first call)."""
    return os.environ.get("TORCH_FLASHSYS_AUTOTUNE", "1") != "0"


def make_configs(shapes: Sequence[Shape]) -> list[triton.Config]:
    """Configs for ``shapes``; under the interpreter one 16x16 tile, so every loop and edge runs.

    With autotuning off the list stays whole and :func:`smem_pruner` picks the first config that
    fits (Triton skips pruning when a kernel has a single config).
    """
    if interpreter_active():
        shapes = [(16, 16, 4, 1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in shapes
    ]


@functools.cache
def _shared_memory_bytes(device_index: int) -> int:
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(props["max_shared_mem"])
    except Exception:  # unknown driver or API: assume a small GPU
        return 100 * 1024


def smem_pruner(footprint: Callable[[int, int, int, int], int]):
    """An ``early_config_prune`` that drops configs whose estimated shared memory does not fit.

    ``footprint(block_m, block_n, block_d, num_stages)`` estimates elements held in shared memory;
    the budget keeps a quarter of the device's capacity spare for layout conversions. If nothing
    fits, the smallest tile with one stage is used.
    """

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        if interpreter_active():
            return configs
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        q = named_args.get("Q")
        if block_d is None or q is None:
            return configs
        budget = 0.75 * _shared_memory_bytes(q.device.index or 0)
        elem = q.element_size()

        def bytes_of(c: triton.Config) -> int:
            return elem * footprint(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], block_d, c.num_stages)

        kept = [c for c in configs if bytes_of(c) <= budget]
        if kept:
            return kept if autotune_enabled() else kept[:1]
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]

    return prune
