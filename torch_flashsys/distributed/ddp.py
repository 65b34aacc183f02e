"""BucketedDDP: data parallelism with bucketed, overlapped gradient all-reduce."""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from torch_flashsys.distributed._buckets import Bucket, assign_buckets, broadcast_coalesced
from torch_flashsys.distributed._verify import describe_tensors, verify_same_across_ranks

_COMPRESSION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _option_problem(
    bucket_size_mb: Any, broadcast_buffers: Any, grad_compression: Any
) -> tuple[type[Exception], str] | None:
    """The first invalid option as (exception type, message), or None."""
    if bucket_size_mb is not None:
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
            return TypeError, (
                "BucketedDDP: bucket_size_mb must be a number or None, got "
                f"{type(bucket_size_mb).__name__} {bucket_size_mb!r}"
            )
        if not math.isfinite(bucket_size_mb) or bucket_size_mb < 0:
            return ValueError, (
                "BucketedDDP: bucket_size_mb must be finite and >= 0 (0: one parameter per bucket; "
                f"None: one bucket), got {bucket_size_mb!r}"
            )
    if not isinstance(broadcast_buffers, bool):
        return TypeError, (
            f"BucketedDDP: broadcast_buffers must be a bool, got {type(broadcast_buffers).__name__}"
        )
    if grad_compression is not None and grad_compression not in _COMPRESSION:
        return ValueError, (
            "BucketedDDP: grad_compression must be None, 'bf16' or 'fp16', got "
            f"{grad_compression!r}"
        )
    return None


def _grad_ready(ref: weakref.ref, b: int, k: int, param: torch.Tensor) -> None:
    ddp = ref()
    if ddp is not None:
        ddp._on_grad_ready(b, k, param)


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


class BucketedDDP(torch.nn.Module):
    """Data-parallel wrapper: gradients are averaged over ranks by bucketed, overlapped all-reduce.

    Drop-in for ``torch.nn.parallel.DistributedDataParallel`` (one device per process)::

        model = BucketedDDP(model.to(device), bucket_size_mb=25.0)
        for tokens in loader:                    # each rank: its own (batch, seq) shard
            loss = loss_fn(model(tokens))        # forward(*args, **kwargs) calls model.module
            loss.backward()                      # gradients are averaged when backward returns
            opt.step(); opt.zero_grad()

    Args:
        module: the model, already on this rank's device; every rank must wrap the same
            architecture (checked across ranks at construction, before any other collective).
            Parameters and buffers are then broadcast from the group's rank 0.
        bucket_size_mb: most gradient MiB per all-reduce bucket; ``None``: one bucket per dtype;
            ``0``: one parameter per bucket.
        process_group: group to average over (default: the whole world).
        broadcast_buffers: broadcast buffers (e.g. BatchNorm statistics) from rank 0 at
            construction and at the start of each forward that follows a synchronizing forward,
            as torch DDP does; ``False``: buffers stay rank-local (never broadcast).
        grad_compression: ``"bf16"`` / ``"fp16"``: all-reduce a low-precision copy of each bucket
            and write the average back (torch DDP's compression hooks); ``None``: full precision.

    Each ``param.grad`` is a view into its bucket's flat buffer (no extra gradient memory). The
    wrapped module is ``.module``; its ``state_dict()`` keys are unchanged, and this wrapper's
    ``state_dict()`` prefixes them with ``module.`` exactly as torch DDP does.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_size_mb: float | None = 25.0,
        *,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        grad_compression: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"BucketedDDP: module must be a torch.nn.Module, got {type(module)}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "BucketedDDP: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) first (torchrun sets its environment)"
            )
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "BucketedDDP: process_group must be a torch.distributed.ProcessGroup or None, got "
                f"{type(process_group).__name__}"
            )
        if dist.get_rank(process_group) < 0:
            raise ValueError(
                f"BucketedDDP: this process (global rank {dist.get_rank()}) is not a member of "
                "process_group; only members may wrap a module with it"
            )
        self.module = module
        self.process_group = process_group
        self.bucket_size_mb = bucket_size_mb
        self.broadcast_buffers = broadcast_buffers
        self.grad_compression = grad_compression
        self._world = dist.get_world_size(process_group)
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)

        # Option errors go through the cross-rank check too: a rank passing a bad option then
        # raises with the others instead of leaving them hanging in the first collective.
        named = list(module.named_parameters())
        problem = _option_problem(bucket_size_mb, broadcast_buffers, grad_compression)
        items = [("argument check", problem[1] if problem else "ok")]  # first: named first
        items += describe_tensors(named)
        if broadcast_buffers is True:  # buffers are broadcast, so they must match too
            items += describe_tensors(module.named_buffers(), kind="buffer")
        items += [
            ("option bucket_size_mb", repr(bucket_size_mb)),
            ("option broadcast_buffers", repr(broadcast_buffers)),
            ("option grad_compression", repr(grad_compression)),
        ]
        verify_same_across_ranks("BucketedDDP", items, process_group, what="the wrapped module")
        if problem:
            raise problem[0](problem[1])
        trainable = [(name, p) for name, p in named if p.requires_grad]
        if not trainable:  # same on every rank: requires_grad was verified above
            raise ValueError(
                "BucketedDDP: module has no parameter that requires a gradient; "
                "there is nothing to synchronize"
            )
        # As torch DDP: broadcast_buffers=False leaves buffers rank-local from the start.
        states = [p.detach() for _, p in named] + (
            list(module.buffers()) if broadcast_buffers else []
        )
        broadcast_coalesced(states, self._src, process_group)

        params = [p for _, p in trainable]
        limit = None if bucket_size_mb is None else int(bucket_size_mb * 2**20)
        self._buckets = [
            Bucket([params[i] for i in idx], [trainable[i][0] for i in idx])
            for idx in assign_buckets(params, limit)
        ]
        self._comm_dtype = _COMPRESSION.get(grad_compression) if grad_compression else None
        # NCCL averages inside the all-reduce, saving a pass over the gradients; gloo cannot.
        self._reduce_avg = dist.get_backend(process_group) == "nccl"
        # Hooks hold the wrapper weakly: the param -> hook edge lives in C++, where Python's cycle
        # collector cannot see it, so a strong one would keep a dropped wrapper (and its
        # buffers) alive forever. When the wrapper goes, its hooks go too.
        this = weakref.ref(self)
        handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, this, b, k))
            for b, bucket in enumerate(self._buckets)
            for k, p in enumerate(bucket.params)
        ]
        weakref.finalize(self, _remove_hooks, handles)
        self._lock = threading.Lock()  # hooks of CUDA backwards run on autograd's device threads
        self._no_sync = False  # inside no_sync()
        self._grad_sync = True  # decided by the last forward, as in torch DDP
        self._sync_buffers_next = True  # torch DDP's require_forward_param_sync
        self._in_backward = False  # a synchronizing backward started and is not finished
        self._next_bucket = 0  # buckets launch in index order: the same order on every rank

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call ``self.module(*inputs, **kwargs)`` (after broadcasting buffers, see the class)."""
        if self._sync_buffers_next and self.broadcast_buffers and self._world > 1:
            buffers = list(self.module.buffers())
            if buffers:
                with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                    broadcast_coalesced(buffers, self._src, self.process_group)
        self._grad_sync = not self._no_sync
        self._sync_buffers_next = torch.is_grad_enabled() and self._grad_sync
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronization for backwards of forwards run inside this context.

        Gradients accumulate locally in ``param.grad``; the first backward of a forward run
        outside synchronizes the accumulated sum (as torch DDP's ``no_sync``)::

            with model.no_sync():
                for micro in micro_batches[:-1]:
                    loss_fn(model(micro)).backward()
            loss_fn(model(micro_batches[-1])).backward()   # averages the sum over ranks
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Wait until every bucket's all-reduce has finished and ``param.grad`` holds the average.

        The end of each synchronizing backward already does this (a callback queued on the
        autograd engine), so after ``loss.backward()`` this is a no-op; it is for code that needs
        the gradients before the backward call returns, or wants the wait explicit.
        """
        with self._lock:
            self._finish_locked()

    def extra_repr(self) -> str:
        return (
            f"bucket_size_mb={self.bucket_size_mb}, buckets={len(self._buckets)}, "
            f"world_size={self._world}, grad_compression={self.grad_compression}"
        )

    # Backward machinery: hook per parameter -> launch ready buckets in order -> wait at the end.

    def _on_grad_ready(self, b: int, k: int, _param: torch.Tensor) -> None:
        bucket = self._buckets[b]
        if not self._grad_sync:
            bucket.adopt_grad(k)
            return
        with self._lock:
            if not self._in_backward:
                for each in self._buckets:
                    each.reset()
                self._next_bucket, self._in_backward = 0, True
                torch.autograd.Variable._execution_engine.queue_callback(
                    self.finish_gradient_synchronization
                )
            if b < self._next_bucket:
                raise RuntimeError(
                    f"BucketedDDP: parameter {bucket.names[k]!r} received a gradient after its "
                    "bucket's all-reduce started; a parameter must get its gradient once per "
                    "backward (reentrant activation checkpointing, use_reentrant=True, is not "
                    "supported: use torch.utils.checkpoint.checkpoint(..., use_reentrant=False))"
                )
            bucket.adopt_grad(k)
            if not bucket.ready[k]:
                bucket.ready[k] = True
                bucket.pending -= 1
            while self._next_bucket < len(self._buckets):
                nxt = self._buckets[self._next_bucket]
                if nxt.pending:
                    break
                nxt.launch(self.process_group, self._world, self._comm_dtype, self._reduce_avg)
                self._next_bucket += 1

    def _finish_locked(self) -> None:
        if not self._in_backward:
            return
        try:
            # Buckets with parameters that got no gradient (unused) launch now, still in order.
            for bucket in self._buckets[self._next_bucket :]:
                bucket.launch(self.process_group, self._world, self._comm_dtype, self._reduce_avg)
            self._next_bucket = len(self._buckets)
            for bucket in self._buckets:
                bucket.finish()
        finally:
            self._in_backward = False
