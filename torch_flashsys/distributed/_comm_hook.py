"""Communication hooks for :class:`BucketedDDP` (``register_comm_hook``), torch DDP's contract.

A hook is ``hook(state, bucket) -> torch.futures.Future`` whose value is the reduced (averaged)
flat gradient tensor of the bucket, e.g. torch's own hooks, unchanged::

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

``bucket`` is a :class:`GradBucket`, with the methods of ``torch.distributed.GradBucket`` (which
cannot be built from Python): ``index()``, ``is_last()``, ``buffer()``, ``set_buffer()``,
``gradients()`` and ``parameters()``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


class GradBucket:
    """One bucket as a communication hook sees it (``torch.distributed.GradBucket``'s methods).

    buffer: the flat gradients of ``params``, in bucket order (a view into BucketedDDP's bucket:
    the hook may reduce it in place); ``index`` of ``count`` buckets in reduction order.
    """

    __slots__ = ("_buffer", "_count", "_index", "_numels", "_params")

    def __init__(
        self,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor],
        numels: Sequence[int],
        index: int,
        count: int,
    ) -> None:
        self._buffer, self._params, self._numels = buffer, list(params), list(numels)
        self._index, self._count = index, count

    def index(self) -> int:
        """Position of the bucket in the reduction order (the same on every rank)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket reduced in a backward."""
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        """The flat 1-D gradient tensor of the bucket."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace what :meth:`buffer` returns (e.g. by a low-precision copy, as torch's
        ``fp16_compress_wrapper`` does); the Future's value is what is written back."""
        if not isinstance(buffer, torch.Tensor) or buffer.numel() != self._buffer.numel():
            got = buffer.numel() if isinstance(buffer, torch.Tensor) else type(buffer).__name__
            raise ValueError(
                f"GradBucket.set_buffer: buffer must be a tensor of {self._buffer.numel()} "
                f"elements (the bucket's), got {got}"
            )
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views into :meth:`buffer`, in bucket order, shaped as the parameters."""
        flat = self._buffer.reshape(-1)
        return [
            chunk.view(p.shape)
            for chunk, p in zip(flat.split(self._numels), self._params, strict=True)
        ]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters of the bucket, in the order of :meth:`gradients`."""
        return list(self._params)


def hook_name(hook: Callable) -> str:
    """``module.qualname`` of a hook (of the wrapped function for ``functools.partial``)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    name = getattr(hook, "__qualname__", type(hook).__qualname__)
    return f"{getattr(hook, '__module__', '?')}.{name}"


def hook_problem(hook: Any, state: Any, group: dist.ProcessGroup) -> tuple[type, str] | None:
    """What is wrong with ``(state, hook)`` for ``register_comm_hook``, or None."""
    caller = "BucketedDDP.register_comm_hook"
    if not callable(hook):
        return TypeError, f"{caller}: hook must be callable, got {type(hook).__name__}"
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        try:
            signature.bind(state, None)
        except TypeError:
            return TypeError, (
                f"{caller}: hook must take two positional arguments (state, bucket), as torch "
                f"DDP's hooks do; {hook_name(hook)} has the signature {signature}"
            )
    their_group = state if isinstance(state, dist.ProcessGroup) else None
    if their_group is None and isinstance(getattr(state, "process_group", None), dist.ProcessGroup):
        their_group = state.process_group
    if their_group is not None and their_group is not group:
        return ValueError, (
            f"{caller}: the state's process group is not the BucketedDDP's; pass the wrapper's "
            "process_group (or None for the default group) so the hook reduces over the same ranks"
        )
    torch_hook = hook_name(hook).startswith("torch.distributed.algorithms.ddp_comm_hooks.")
    if torch_hook and their_group is None and group is not dist.group.WORLD:
        return ValueError, (
            f"{caller}: {hook_name(hook)} reads a state of None (or a process_group of None) as "
            "the default group, but this BucketedDDP reduces over a subgroup; pass its "
            "process_group (as state, or as PowerSGDState(process_group=...))"
        )
    return None


def hook_result(value: Any, numel: int, bucket: GradBucket | None) -> torch.Tensor:
    """The reduced tensor held by a hook's Future (a tensor, or a list whose first item is one)."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.numel() != numel:
        got = f"{value.numel()} elements" if isinstance(value, torch.Tensor) else repr(value)
        where = "" if bucket is None else f" (bucket {bucket.index()})"
        raise TypeError(
            "BucketedDDP: a communication hook's Future must hold the reduced bucket, a tensor "
            f"of {numel} elements{where}, got {got}"
        )
    return value
