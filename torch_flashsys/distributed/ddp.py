"""BucketedDDP: data parallelism with bucketed, overlapped gradient all-reduce."""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

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


# Parameter -> the BucketedDDP that synchronizes it (weakly), so that
# ShardedOptimizer(..., shard_gradients=True) can find the wrapper of its parameters.
_WRAPPERS: WeakIdKeyDictionary = WeakIdKeyDictionary()

_AHEAD = 2  # ZeRO-2: other ranks' buckets given a buffer before their first gradient arrives
_IN_FLIGHT = 2  # ZeRO-2: reductions of other ranks' buckets left running before we wait


class _BackwardState:
    """Per-backward state of a BucketedDDP, updated from its hooks."""

    __slots__ = ("in_backward", "next_bucket", "remote_next", "syncing")

    def __init__(self) -> None:
        self.in_backward = False  # a backward started (first hook) and has not ended
        self.syncing = False  # ... and it synchronizes (its forward ran outside no_sync)
        self.next_bucket = 0  # buckets launch in index order: the same order on every rank
        self.remote_next = 0  # ZeRO-2: next of _remote to give a buffer ahead of its gradients


def wrapper_of(param: torch.Tensor) -> BucketedDDP | None:
    """The live BucketedDDP that synchronizes ``param``'s gradient, if any."""
    ref = _WRAPPERS.get(param)
    return None if ref is None else ref()


def _grad_ready(ref: weakref.ref, i: int, param: torch.Tensor) -> None:
    ddp = ref()
    if ddp is not None:
        ddp._on_grad_ready(i)


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
        self._group = process_group if process_group is not None else dist.group.WORLD
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

        self._params = [p for _, p in trainable]
        self._names = [name for name, _ in trainable]
        self._limit = None if bucket_size_mb is None else int(bucket_size_mb * 2**20)
        # Pointing grads at their views before AccumulateGrad runs is safe when one autograd
        # thread does all the accumulation: one device (the supported setup, as in torch DDP).
        self._prepoint = len({p.device for p in self._params}) == 1
        self._owners: list[int] | None = None  # ZeRO-2: owner group rank of each parameter
        self._build_buckets()
        self._comm_dtype = _COMPRESSION.get(grad_compression) if grad_compression else None
        # NCCL averages inside the collective, saving a pass over the gradients; gloo cannot.
        self._reduce_avg = dist.get_backend(process_group) == "nccl"
        # Hooks hold the wrapper weakly: the param -> hook edge lives in C++, where Python's cycle
        # collector cannot see it, so a strong one would keep a dropped wrapper (and its
        # buffers) alive forever. When the wrapper goes, its hooks go too.
        this = weakref.ref(self)
        handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, this, i))
            for i, p in enumerate(self._params)
        ]
        weakref.finalize(self, _remove_hooks, handles)
        for p in self._params:
            _WRAPPERS[p] = this
        self._lock = threading.Lock()  # hooks of CUDA backwards run on autograd's device threads
        self._no_sync = False  # inside no_sync()
        self._grad_sync = True  # decided by the last forward, as in torch DDP
        self._sync_buffers_next = True  # torch DDP's require_forward_param_sync
        self._bw = _BackwardState()  # plain object: nn.Module.__setattr__ costs ~7 us a call

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
        """Wait until every bucket's reduction has finished and ``param.grad`` holds the average.

        The end of each synchronizing backward already does this (a callback queued on the
        autograd engine), so after ``loss.backward()`` this is a no-op; it is for code that needs
        the gradients before the backward call returns, or wants the wait explicit.
        """
        with self._lock:
            if self._bw.in_backward and self._bw.syncing:
                self._finish_locked()

    def extra_repr(self) -> str:
        return (
            f"bucket_size_mb={self.bucket_size_mb}, buckets={len(self._buckets)}, "
            f"world_size={self._world}, grad_compression={self.grad_compression}, "
            f"shard_gradients={self._owners is not None}"
        )

    # Buckets: built at construction, rebuilt per owner when a ShardedOptimizer shards gradients.

    def _build_buckets(self) -> None:
        owners, rank = self._owners, dist.get_rank(self.process_group)
        assignment = assign_buckets(self._params, self._limit, owners)
        self._buckets = []
        self._slots = [(0, 0)] * len(self._params)  # parameter index -> (bucket, position)
        for b, idx in enumerate(assignment):
            owner = None if owners is None else owners[idx[0]]
            self._buckets.append(
                Bucket(
                    [self._params[i] for i in idx],
                    [self._names[i] for i in idx],
                    owner=owner,
                    keeps=owner is None or owner == rank,
                )
            )
            for k, i in enumerate(idx):
                self._slots[i] = (b, k)
        # Buckets this rank keeps share one storage per (device, dtype): one memset clears them.
        self._storages: list[tuple[torch.Tensor, list[Bucket], torch.Tensor]] = []
        kinds: dict[tuple[torch.device, torch.dtype], list[Bucket]] = {}
        for bucket in self._buckets:
            if bucket.keeps:
                kinds.setdefault((bucket.device, bucket.dtype), []).append(bucket)
        for (device, dtype), buckets in kinds.items():
            storage = torch.zeros(sum(b.size for b in buckets), dtype=dtype, device=device)
            flag_index, offset = [], 0
            for bucket in buckets:
                bucket.bind(storage[offset : offset + bucket.size])
                flag_index += range(offset + bucket.total, offset + bucket.size)
                offset += bucket.size
            index = torch.tensor(flag_index, dtype=torch.long, device=device)
            self._storages.append((storage, buckets, index))
        self._remote = [b for b, bucket in enumerate(self._buckets) if not bucket.keeps]
        self._in_flight: collections.deque[Bucket] = collections.deque()

    def _shard_gradients(self, owners: Sequence[int]) -> None:
        """ZeRO-2 (called by ``ShardedOptimizer(..., shard_gradients=True)``): reduce each
        parameter's gradient to its owner only; ``owners[i]`` is the group rank owning
        ``self._params[i]``. Buckets are rebuilt per owner; gradients of parameters owned by
        other ranks are ``None`` after each synchronizing backward."""
        with self._lock:
            if self._bw.in_backward:
                raise RuntimeError(
                    "BucketedDDP: cannot shard gradients during a backward; build the "
                    "ShardedOptimizer between training steps"
                )
            self._owners = list(owners)
            self._build_buckets()

    # Backward machinery: hook per parameter -> launch ready buckets in order -> wait at the end.

    def _on_grad_ready(self, i: int) -> None:
        b, k = self._slots[i]
        bucket, bw = self._buckets[b], self._bw
        with self._lock:
            if not bw.in_backward:
                self._start_backward()
            if not bw.syncing:
                if bucket.buffer is not None:
                    bucket.adopt_grad(k)
                return
            if b < bw.next_bucket:
                raise RuntimeError(
                    f"BucketedDDP: parameter {bucket.names[k]!r} received a gradient after its "
                    "bucket's reduction started; a parameter must get its gradient once per "
                    "backward (reentrant activation checkpointing, use_reentrant=True, is not "
                    "supported: use torch.utils.checkpoint.checkpoint(..., use_reentrant=False))"
                )
            if self._remote:
                self._allocate_ahead(b)
            bucket.adopt_grad(k)
            if not bucket.ready[k]:
                bucket.ready[k] = True
                bucket.pending -= 1
                if not bucket.pending and b == bw.next_bucket:
                    buckets, n = self._buckets, len(self._buckets)
                    while bw.next_bucket < n and not buckets[bw.next_bucket].pending:
                        self._launch(bw.next_bucket)

    def _start_backward(self) -> None:
        """First hook of a backward: end-of-backward callback, per-backward state, and every
        ``None`` grad pointed at its zeroed bucket view so that the backward adds in place."""
        bw = self._bw
        bw.in_backward, bw.syncing = True, self._grad_sync
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if bw.syncing:
            for bucket in self._buckets:
                bucket.reset()
            bw.next_bucket, bw.remote_next = 0, 0
        if self._prepoint:
            self._prepare()
            if bw.syncing and self._remote:
                self._allocate_ahead(-1)

    def _prepare(self) -> None:
        for storage, buckets, flag_index in self._storages:
            holding = [bucket.holds_views() for bucket in buckets]
            if not any(holding):  # the default loop, after zero_grad(): one memset
                storage.zero_()
                storage.index_fill_(0, flag_index, 1)
                for bucket in buckets:
                    bucket.flags_set = True
                    bucket.point_grads(zeroed=True)
                continue
            for bucket, holds in zip(buckets, holding, strict=True):
                if holds:  # accumulated gradients (no_sync, set_to_none=False): keep them
                    bucket.flags_set = False
                    bucket.point_grads(zeroed=False)
                else:
                    bucket.buffer.zero_()
                    bucket.flags.fill_(1)
                    bucket.flags_set = True
                    bucket.point_grads(zeroed=True)

    def _allocate_ahead(self, b: int) -> None:
        """ZeRO-2: give other ranks' buckets up to ``_AHEAD`` past bucket ``b`` a buffer (and
        bucket ``b`` itself if it is one of them and has none)."""
        bucket = self._buckets[b] if b >= 0 else None
        if bucket is not None and not bucket.keeps and bucket.buffer is None:
            bucket.allocate(point=self._prepoint)
        target = min(len(self._remote), bisect.bisect_right(self._remote, b) + _AHEAD)
        while self._bw.remote_next < target:
            ahead = self._buckets[self._remote[self._bw.remote_next]]
            if ahead.buffer is None and ahead.work is None and self._prepoint:
                ahead.allocate()
            self._bw.remote_next += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        bucket.launch(self._group, self._world, self._comm_dtype, self._reduce_avg)
        self._bw.next_bucket = b + 1
        if not bucket.keeps:  # bound the transient buffers: wait for older reductions
            self._in_flight.append(bucket)
            while len(self._in_flight) > _IN_FLIGHT:
                self._in_flight.popleft().finish()

    def _end_backward(self) -> None:
        with self._lock:
            if not self._bw.in_backward:
                return
            if self._bw.syncing:
                self._finish_locked()
            else:
                for bucket in self._buckets:
                    if bucket.keeps:
                        bucket.clear_phantoms()
                self._bw.in_backward = False

    def _finish_locked(self) -> None:
        try:
            # Buckets with parameters that got no gradient (unused) launch now, still in order.
            for b in range(self._bw.next_bucket, len(self._buckets)):
                self._launch(b)
            while self._in_flight:
                self._in_flight.popleft().finish()
            for bucket in self._buckets:
                bucket.finish()
        finally:
            self._bw.in_backward = False
