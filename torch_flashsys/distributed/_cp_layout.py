"""How a sequence is laid out over the ranks of a context-parallel group, and the ring's work plan.

The sequence is cut into equal chunks. ``"contiguous"``: ``world`` chunks, rank ``r`` holds chunk
``r``. ``"zigzag"``: ``2 * world`` chunks, rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``
(in that order), which balances causal attention: every rank gets one early and one late chunk.

:func:`ring_plan` lists the attention calls a rank makes at one ring step (its queries against the
key/value shard of rank ``src``) as ``(query rows, key rows, causal)`` over the local shards; the
blocks a causal mask hides entirely are skipped.
"""

from __future__ import annotations

LAYOUTS = ("zigzag", "contiguous")

ALL = slice(None)
Block = tuple[slice, slice, bool]  # (local query rows, local key rows, causal within the block)


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` holds, in local order."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def shard_order(world: int, layout: str) -> list[int]:
    """Global chunk index of each chunk of the rank-ordered concatenation of all shards."""
    return [c for r in range(world) for c in chunk_ids(r, world, layout)]


def natural_order(world: int, layout: str) -> list[int]:
    """Where each global chunk sits in the rank-ordered concatenation (inverse of shard_order)."""
    order = shard_order(world, layout)
    inverse = [0] * len(order)
    for position, chunk in enumerate(order):
        inverse[chunk] = position
    return inverse


def ring_plan(rank: int, src: int, world: int, layout: str, causal: bool, seq: int) -> list[Block]:
    """The blocks rank ``rank`` computes against the shard of rank ``src`` (``seq``: shard length).

    Causal, contiguous: ``src < rank`` is all past (full), ``src == rank`` the causal diagonal,
    ``src > rank`` all future (skipped). Causal, zigzag: ``src == rank`` is causal over the local
    shard (its two chunks are in global order); ``src < rank``: both local query chunks see only
    the first key chunk, entirely; ``src > rank``: only the second query chunk sees keys, both
    chunks entirely. Every step but the first thus costs half a full block on every rank.
    """
    if not causal:
        return [(ALL, ALL, False)]
    if src == rank:
        return [(ALL, ALL, True)]
    if layout == "contiguous":
        return [(ALL, ALL, False)] if src < rank else []
    half = seq // 2
    if src < rank:
        return [(ALL, slice(0, half), False)]
    return [(slice(half, seq), ALL, False)]


def block_flops(rows: int, cols: int, causal: bool, head_dim: int) -> int:
    """Forward matmul FLOPs of one block (``q.k`` and ``p.v``, 2 each per score that is kept)."""
    scores = rows * (rows + 1) // 2 if causal else rows * cols
    return 4 * scores * head_dim


def _length(s: slice, seq: int) -> int:
    return len(range(seq)[s])


def ring_flops(rank: int, world: int, layout: str, causal: bool, seq: int, head_dim: int) -> int:
    """The attention FLOPs rank ``rank`` spends over a whole ring pass (one batch element, head)."""
    total = 0
    for step in range(world):
        for rows, cols, c in ring_plan(rank, (rank - step) % world, world, layout, causal, seq):
            total += block_flops(_length(rows, seq), _length(cols, seq), c, head_dim)
    return total
