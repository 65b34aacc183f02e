"""Tile configs for the attention kernels: committed tables per GPU architecture, no autotuning.

A launch takes its ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` from a table made by
``benchmarks/tune_attention.py`` on that architecture (``tiles/sm90.json``: kernel, head-dim
class, causal or not, length bucket -> tile), so a first call costs the compile of one config per
kernel and nothing is benchmarked on a user's hot path. A shape the table does not hold (another
head-dim class, another GPU) takes the first config of the kernel's list for its head-dim class
that fits the device's shared memory. IEEE float32 dots (TF32 not allowed) take small tiles:
they run on CUDA cores, and large tiles take minutes to compile.

``TORCH_FLASHSYS_AUTOTUNE=1`` (read when the kernels are first imported) opts into Triton's
autotuner over each class's list instead, its results cached on disk (Triton's cache directory,
``TRITON_CACHE_DIR``), so a second process does not tune again.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Sequence
from importlib import resources

import torch

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
Tile = tuple[int, int, int, int]

INTERPRETER_TILE: Tile = (16, 16, 4, 1)  # the interpreter: every loop and edge runs on small inputs
FALLBACK_TILE: Tile = (32, 32, 4, 1)  # nothing of the list fits the device's shared memory
# IEEE float32: tl.dot runs as FMA loops unrolled over the tile, so compile time grows with it
# (H100, triton 3.6: 64x32 / 32x64 tiles took 4 s (fwd) and 15 s (bwd) to compile, ptxas a third).
IEEE_TILES: dict[str, Tile] = {"fwd": (32, 32, 4, 1), "dq": (32, 32, 4, 1), "dkdv": (32, 32, 4, 1)}


def autotune_requested() -> bool:
    """``TORCH_FLASHSYS_AUTOTUNE=1``: Triton's autotuner over each class's list, cached on disk."""
    return os.environ.get("TORCH_FLASHSYS_AUTOTUNE", "0") == "1"


def dim_class(head_dim: int) -> int:
    """Head dims share config lists in classes: <= 64, <= 128, larger."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


@functools.cache
def load_table(arch: str) -> dict[str, Tile]:
    """The committed tile table of ``arch`` (e.g. ``"sm90"``); empty when none was made."""
    try:
        text = resources.files("torch_flashsys.attention").joinpath(f"tiles/{arch}.json")
        data = json.loads(text.read_text())
    except FileNotFoundError:
        return {}
    return {key: tuple(tile) for key, tile in data["tiles"].items()}


def table_key(kernel: str, head_dim: int, causal: bool, seq_len: int) -> str:
    """``"fwd/64/causal/4096"``: the table's key for the measured length nearest to ``seq_len``."""
    return f"{kernel}/{dim_class(head_dim)}/{'causal' if causal else 'full'}/{seq_len}"


def build_table(rows: Sequence[dict], tolerance: float = 1.03) -> dict[str, list[int]]:
    """The tile table (:func:`table_key` -> tile) from a sweep's rows (``benchmarks/tune_attention.py``
    columns kernel, dim, causal, seq, config ``"BMxBNxWxS"``, ms, error).

    Each (kernel, head-dim class, causal) group gets one config, the one with the best geometric
    mean over the measured lengths; a length keeps its own fastest config only where that one is
    more than ``tolerance`` faster (every extra tile is one more compile at a first call).
    Failed points and warp-specialized variants (``ws`` True) are left out.
    """
    times: dict[tuple[str, int, bool], dict[str, dict[int, float]]] = {}
    for r in rows:
        ms = float(r["ms"])
        if ms != ms or str(r.get("ws", "False")) == "True" or r.get("error"):
            continue
        group = (r["kernel"], int(r["dim"]), str(r["causal"]) in ("True", "1"))
        times.setdefault(group, {}).setdefault(str(r["config"]), {})[int(r["seq"])] = ms
    table = {}
    for (kernel, dim, causal), configs in times.items():
        seqs = sorted({s for c in configs.values() for s in c})
        complete = [c for c in configs if len(configs[c]) == len(seqs)]
        compromise = min(complete, key=lambda c: sum(math.log(configs[c][s]) for s in seqs))
        for s in seqs:
            fastest = min(configs, key=lambda c, s=s: configs[c].get(s, math.inf))
            keep = configs[compromise][s] <= tolerance * configs[fastest][s]
            chosen = compromise if keep else fastest
            table[table_key(kernel, dim, causal, s)] = [int(x) for x in chosen.split("x")]
    return dict(sorted(table.items()))


def nearest_length(lengths: Sequence[int], seq_len: int) -> int:
    """The measured length nearest to ``seq_len`` on a log scale."""
    return min(lengths, key=lambda n: abs(math.log2(n) - math.log2(max(seq_len, 1))))


@functools.cache
def _table_lengths(arch: str, kernel: str, klass: int, causal: bool) -> tuple[int, ...]:
    prefix = f"{kernel}/{klass}/{'causal' if causal else 'full'}/"
    return tuple(int(k[len(prefix) :]) for k in load_table(arch) if k.startswith(prefix))


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def shared_memory_bytes(index: int) -> int:
    """Shared memory per block of CUDA device ``index``, in bytes."""
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["max_shared_mem"])
    except Exception:  # unknown driver or API: assume a small GPU
        return 100 * 1024


@functools.cache
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def pick_tile(
    kernel: str,
    device: torch.device,
    head_dim: int,
    block_d: int,
    elem_size: int,
    precision: str,
    causal: bool,
    seq_len: int,
    defaults: dict[int, Sequence[Tile]],
    footprint: Callable[[int, int, int, int], int],
    as_measured: bool = True,
) -> Tile:
    """The tile ``kernel`` runs with: the table's entry for this problem (as measured: 16-bit
    inputs and the plain kernel the sweep timed; otherwise only if it fits), else the first
    fitting config of ``defaults[dim_class(head_dim)]``.

    ``footprint(block_m, block_n, block_d, stages)`` estimates shared memory in elements, with
    a quarter of the device's capacity spare for layout conversions. It is conservative: the
    tables hold tiles it would reject that were measured to run (and to be faster), but a score
    modification or dropout needs more (e.g. d 128 with dropout: 240 KiB of 227 KiB), so those
    kernels take a table tile only when the estimate passes.
    """
    if device.type != "cuda":
        return INTERPRETER_TILE
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _arch(index)
    klass = dim_class(head_dim)
    candidates: list[Tile] = []
    if precision == "ieee":
        candidates.append(IEEE_TILES[kernel])
    else:
        lengths = _table_lengths(arch, kernel, klass, causal)
        if lengths:
            key = table_key(kernel, head_dim, causal, nearest_length(lengths, seq_len))
            if elem_size <= 2 and as_measured:  # the kernel the sweep ran: known to fit
                return load_table(arch)[key]
            candidates.append(load_table(arch)[key])
        candidates.extend(defaults[klass])
    for tile in candidates:
        if fits(tile, block_d, elem_size, footprint, index):
            return tile
    return FALLBACK_TILE


def fits(tile: Tile, block_d: int, elem_size: int, footprint: Callable[[int, int, int, int], int],
         index: int) -> bool:  # fmt: skip
    """Whether ``tile``'s shared-memory estimate (``footprint`` elements of ``elem_size`` bytes,
    see :func:`pick_tile`) is within three quarters of CUDA device ``index``'s."""
    bm, bn, _, stages = tile
    return elem_size * footprint(bm, bn, block_d, stages) <= 0.75 * shared_memory_bytes(index)


def tile_meta(tile: Tile) -> dict[str, int]:
    """A tile as launch keywords."""
    bm, bn, warps, stages = tile
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
