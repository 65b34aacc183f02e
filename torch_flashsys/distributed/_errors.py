"""Errors of failed collectives: which rank saw it, and which collective it was.

A rank that raises, is killed or stops communicating makes the collectives it takes part in
fail on the other ranks: gloo raises at once when the peer's connection closes ("Connection
closed by peer", "Connection reset by peer") and after the process group's ``timeout`` when the
peer is alive but silent. The backend's message names an address, not a rank or an operation, so
BucketedDDP and ShardedOptimizer re-raise it with both (``from`` the original)::

    try:
        work.wait()
    except Exception as exc:
        raise collective_error("BucketedDDP", "the all-reduce of gradient bucket 3 ...", group, exc)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")

_HINT = (
    "If another rank raised, was killed or stopped communicating, this is the consequence, not "
    "the cause: a rank whose process exits makes the collectives of the others fail at once, a "
    "rank that is alive but silent after the process group's timeout; see the first error "
    "among all ranks' logs"
)


def describe_rank(group: dist.ProcessGroup | None) -> str:
    """``"rank 1 of 4"`` (group rank), with the global rank when it differs."""
    try:
        rank, world, global_rank = (
            dist.get_rank(group),
            dist.get_world_size(group),
            dist.get_rank(),
        )
    except (RuntimeError, ValueError):  # the group is gone (destroyed after the failure)
        return "rank ?"
    where = f"rank {rank} of {world}"
    return where if rank == global_rank else f"{where} (global rank {global_rank})"


def collective_error(
    caller: str, what: str, group: dist.ProcessGroup | None, exc: BaseException
) -> Exception:
    """An exception of ``exc``'s type when it can be built from a message (``DistBackendError``,
    ``RuntimeError``), else a ``RuntimeError``: ``"<caller>: <rank>: <what> failed: <exc>. <hint>"``.
    Raise it ``from exc``."""
    message = f"{caller}: {describe_rank(group)}: {what} failed: {exc}. {_HINT}"
    try:
        error = type(exc)(message)
    except Exception:
        error = RuntimeError(message)
    return error if isinstance(error, Exception) else RuntimeError(message)


def guarded(
    caller: str, what: str | Callable[[], str], group: dist.ProcessGroup | None, fn: Callable[[], T]
) -> T:
    """``fn()``; a failure is re-raised as :func:`collective_error` naming ``what`` (a string,
    or a function making it, called only on failure)."""
    try:
        return fn()
    except Exception as exc:
        raise collective_error(
            caller, what if isinstance(what, str) else what(), group, exc
        ) from exc
