"""ShardedOptimizer internals: the parameter partition and the flat per-rank parameter buckets.

Partition: whole parameters go to ranks, one param group at a time, largest first, each to the
least-loaded rank (lowest rank on ties), loads carried over from group to group. It depends only on
the parameters' sizes, order and grouping, so every rank computes the same one, and building an
optimizer with groups ``[a, b]`` gives the same partition as building it with ``[a]`` and calling
``add_param_group(b)`` later (so sharded checkpoints stay loadable). Trainable and frozen parameters
are balanced separately, so frozen ones never skew the state balance. Assigning each item to the
least-loaded rank keeps max load - min load <= the largest item, in any order, so no rank's load
exceeds ``total / world_size + largest``.

Buckets: for each (device, dtype, owner rank, chunk) the trainable parameters become views into one
flat buffer, so one broadcast from the owner refreshes all of them with no copies; aligning each view
to ``_ALIGN_BYTES`` keeps the vectorised kernels of the optimizers on their fast path. Chunks split
each owner's parameters (in order) into a few pieces of at least ``_MIN_CHUNK_BYTES``, so that the
broadcast of one piece can run while the owner steps the next (see ``ShardedOptimizer.step``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

_ALIGN_BYTES = 64  # each parameter view starts at a multiple of 64 bytes in its bucket
_CHUNKS_PER_RANK = 4  # pieces of a rank's shard stepped one after another, each then broadcast
_MIN_CHUNK_BYTES = 64 * 2**20  # smaller pieces cost more per-call overhead than overlap saves


def assign_owners(
    sizes: Sequence[int], trainable: Sequence[bool], loads: list[list[int]]
) -> list[int]:
    """Owner rank of each parameter: largest first, to the least-loaded rank.

    sizes: bytes per parameter; trainable: its requires_grad; loads: ``[trainable_loads,
    frozen_loads]``, one int per rank, updated in place (so later calls, as in
    ``add_param_group``, keep balancing).

    Example:
        >>> loads = [[0, 0], [0, 0]]
        >>> assign_owners([4, 8, 4, 2], [True] * 4, loads), loads[0]
        ([1, 0, 1, 0], [10, 8])
    """
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load = loads[0] if trainable[i] else loads[1]
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


@dataclasses.dataclass
class ParamBucket:
    """Trainable parameters of one (device, dtype, owner, chunk) as views into ``buffer`` (1-D)."""

    owner: int
    chunk: int
    buffer: torch.Tensor
    params: list[torch.Tensor]
    offsets: list[int]  # element offset of each parameter's view in ``buffer``

    def intact(self) -> bool:
        """Whether every parameter still views this bucket (``p.data = ...`` elsewhere breaks it)."""
        base, size = self.buffer.data_ptr(), self.buffer.element_size()
        return all(
            p.data_ptr() == base + off * size
            for p, off in zip(self.params, self.offsets, strict=True)
        )


def _aligned(n: int, element_size: int) -> int:
    step = max(1, _ALIGN_BYTES // element_size)
    return -(-n // step) * step


@torch.no_grad()
def build_bucket(owner: int, chunk: int, params: list[torch.Tensor]) -> ParamBucket:
    """Copy ``params`` (same device and dtype) into a new flat buffer and make them views of it."""
    first = params[0]
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total = _aligned(total + p.numel(), first.element_size())
    buffer = torch.empty(total, dtype=first.dtype, device=first.device)
    buffer.zero_()  # padding is broadcast too: keep it deterministic
    for p, off in zip(params, offsets, strict=True):
        view = buffer[off : off + p.numel()].view(p.shape)
        view.copy_(p.detach())
        p.data = view
    return ParamBucket(owner, chunk, buffer, list(params), offsets)


def chunk_bytes_for(loads: Sequence[int]) -> int:
    """Chunk size for trainable ``loads`` (bytes per rank): about ``_CHUNKS_PER_RANK`` per rank."""
    return max(_MIN_CHUNK_BYTES, -(-max(loads, default=0) // _CHUNKS_PER_RANK), 1)


def assign_chunks(
    params: Sequence[torch.Tensor], owners: Sequence[int], chunk_bytes: int
) -> list[int]:
    """Chunk index of each parameter: per owner, in parameter order, a new chunk starts when the
    current one holds at least ``chunk_bytes`` (frozen parameters: chunk 0, never bucketed).

    Example: sizes 4, 4, 4, 4 bytes, all owned by rank 0, ``chunk_bytes=8`` -> ``[0, 0, 1, 1]``.
    """
    filled: dict[int, tuple[int, int]] = {}  # owner -> (current chunk, its bytes)
    chunks = []
    for p, owner in zip(params, owners, strict=True):
        if not p.requires_grad:
            chunks.append(0)
            continue
        chunk, nbytes = filled.get(owner, (0, 0))
        if nbytes >= chunk_bytes:
            chunk, nbytes = chunk + 1, 0
        filled[owner] = (chunk, nbytes + p.numel() * p.element_size())
        chunks.append(chunk)
    return chunks


@torch.no_grad()
def build_buckets(
    params: Sequence[torch.Tensor],
    owners: Sequence[int],
    old: Sequence[ParamBucket] = (),
    chunk_bytes: int | None = None,
) -> list[ParamBucket]:
    """One bucket per (device, dtype, owner, chunk) over the trainable ``params``, ordered by chunk
    (the order of the pipelined step), then device, dtype and owner: the same on every rank.

    Frozen parameters are not bucketed (never updated, so never broadcast); one that was a view of
    an ``old`` bucket gets its own copy so that the old buffer can be freed. Trainable ones keep
    their values (copied into the new buffers). ``chunk_bytes=None``: one chunk per owner.
    """
    chunks = assign_chunks(params, owners, chunk_bytes or 2**62)
    previously_bucketed = {p for b in old for p in b.params}
    groups: dict[tuple[int, str, str, int], list[torch.Tensor]] = {}
    for p, owner, chunk in zip(params, owners, chunks, strict=True):
        if p.requires_grad:
            groups.setdefault((chunk, str(p.device), str(p.dtype), owner), []).append(p)
        elif p in previously_bucketed:
            p.data = p.detach().clone()
    return [build_bucket(key[3], key[0], groups[key]) for key in sorted(groups)]


def broadcast_buckets(
    buckets: Sequence[ParamBucket], group: dist.ProcessGroup, global_ranks: Sequence[int]
) -> list[dist.Work]:
    """Start the broadcast of every bucket from its owner (asynchronous); returns the handles."""
    return [
        dist.broadcast(b.buffer, src=global_ranks[b.owner], group=group, async_op=True)
        for b in buckets
    ]
