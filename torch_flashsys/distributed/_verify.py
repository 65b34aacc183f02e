"""Cross-rank consistency checks, run before the first other collective.

A model or configuration that differs across ranks makes later collectives disagree in size or
order, which hangs (NCCL) or fails on one rank only (gloo). These checks all-gather a small
fingerprint first, so every rank takes the same branch and raises the same ``RuntimeError``.

Usage (shared by :class:`BucketedDDP` and :class:`ShardedOptimizer`)::

    items = describe_tensors(module.named_parameters(), kind="parameter")
    items += [("option bucket_size_mb", repr(bucket_size_mb))]
    verify_same_across_ranks("BucketedDDP", items, group, what="the wrapped module")

Each item is ``(label, value)``: values are compared across ranks, labels only name the item in
the error message (so parameter names may differ, as torch DDP allows).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_flashsys.distributed._release import mark_used

Item = tuple[str, str]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device small control tensors must live on for ``group``'s backend (NCCL: CUDA)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_process_group(caller: str, group: Any, name: str = "process_group") -> None:
    """Raise unless ``group`` is ``None`` or a process group this process is a member of
    (``name``: the caller's argument).

    ``torch.distributed.new_group`` gives the ranks it leaves out ``GroupMember.NON_GROUP_MEMBER``
    (an int): say that, rather than "got int". A non-member takes no part in the group's
    collectives, so raising here alone leaves no member waiting.
    """
    mark_used()  # our wrappers check their group first: the exit hook then waits for quiet threads
    non_member = dist.GroupMember.NON_GROUP_MEMBER
    if (group is non_member or (type(group) is int and group == non_member)) or (
        isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0
    ):
        raise ValueError(
            f"{caller}: this process (global rank {dist.get_rank()}) is not a member of {name} "
            "(torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER to the ranks it "
            "leaves out); only the group's members may use it"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{caller}: {name} must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__}"
        )


def check_bools(caller: str, values: dict[str, Any], show_value: bool = False) -> None:
    """Raise ``TypeError`` naming the first of ``values`` (argument name -> value) that is not a
    bool: ``"<caller>: <name> must be a bool, got <type>"`` (then the value if ``show_value``)."""
    for name, value in values.items():
        if not isinstance(value, bool):
            got = f"{type(value).__name__} {value!r}" if show_value else type(value).__name__
            raise TypeError(f"{caller}: {name} must be a bool, got {got}")


def describe_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, kind: str = "parameter"
) -> list[Item]:
    """``(label, value)`` items for named tensors: shape, dtype and requires_grad are compared.

    Example item: ``("parameter 3 ('fc.weight')",
    "shape=(4, 8) dtype=torch.float32 requires_grad=True")``.
    """
    items = []
    for i, (name, t) in enumerate(named_tensors):
        value = f"shape={tuple(t.shape)} dtype={t.dtype}"
        if kind == "parameter":
            value += f" requires_grad={t.requires_grad}"
        items.append((f"{kind} {i} ({name!r})", value))
    return items


def _fingerprint(items: Sequence[Item]) -> list[int]:
    digest = hashlib.sha256("\n".join(v for _, v in items).encode()).digest()
    return [len(items), int.from_bytes(digest[:7], "little")]  # 56 bits: fits in int64


def signature(items: Sequence[Item]) -> int:
    """A 56-bit digest of the items' values (and their count) for :func:`verify_signature`."""
    count, digest = _fingerprint(items)
    return (digest + count * 0x9E3779B97F4A7) % 2**56  # count mixed in (golden-ratio constant)


def verify_signature(
    caller: str,
    sig: int,
    items: Callable[[], Sequence[Item]],
    group: dist.ProcessGroup | None,
    *,
    what: str,
    guard: Callable[[Callable[[], Any]], Any] = lambda fn: fn(),
) -> None:
    """:func:`verify_same_across_ranks` for checks run often: one all-reduce of two int64 (the
    maximum of ``sig`` and of ``-sig``) when every rank passes the same ``sig`` (computed by
    :func:`signature`, e.g. cached until the items change); else every rank builds ``items()``
    and raises the same error naming the first difference and each rank's value. ``guard(fn)``
    runs the all-reduce (e.g. to re-raise a failed collective naming the rank and the check)."""
    device = collective_device(group)
    both = torch.tensor([sig, -sig], dtype=torch.int64, device=device)
    guard(lambda: dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group))
    high, neg_low = both.tolist()
    if high == -neg_low:  # the same on every rank, as every rank sees
        return
    verify_same_across_ranks(caller, items(), group, what=what)
    raise RuntimeError(  # the signatures differed but the items match: a signature bug
        f"{caller}: {what} signatures differ across ranks but the descriptions match"
    )


def _all_gather_bytes(data: bytes, group: dist.ProcessGroup | None) -> list[bytes]:
    """All-gather a byte string of any length from every rank (two collectives)."""
    device, world = collective_device(group), dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [bytes(b[: int(s.item())].cpu().tolist()) for b, s in zip(bufs, sizes, strict=True)]


def _describe_mismatch(per_rank: list[list[Item]]) -> str:
    counts = [len(items) for items in per_rank]
    if len(set(counts)) > 1:
        listed = ", ".join(f"rank {r} has {n}" for r, n in enumerate(counts))
        return f"different numbers of entries: {listed}"
    for i in range(counts[0]):
        values = [items[i][1] for items in per_rank]
        if len(set(values)) > 1:
            listed = "; ".join(
                f"rank {r}: {items[i][0]} {items[i][1]}" for r, items in enumerate(per_rank)
            )
            return f"first difference at entry {i}: {listed}"
    return "the fingerprints differ but the descriptions match (hash collision?)"


def verify_same_across_ranks(
    caller: str,
    items: Sequence[Item],
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "the model",
) -> None:
    """Raise the same ``RuntimeError`` on every rank of ``group`` unless all ranks agree.

    items: ``(label, value)`` string pairs; every rank must call this (it is a collective).
    Costs one all-gather of two int64 per rank when everything matches, two more on mismatch (to
    name the first difference).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor(_fingerprint(items), dtype=torch.int64, device=collective_device(group))
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    # Every rank saw the same gathered fingerprints, so every rank reaches this point together.
    raw = _all_gather_bytes(json.dumps([list(it) for it in items]).encode(), group)
    per_rank = [[tuple(it) for it in json.loads(r)] for r in raw]
    raise RuntimeError(
        f"{caller}: {what} differs across ranks (every rank must pass an identical one: same "
        f"tensor count, shapes, dtypes, requires_grad and options); {_describe_mismatch(per_rank)}"
    )
