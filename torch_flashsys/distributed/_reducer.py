"""The gradient reducer of :class:`BucketedDDP`: buckets, per-parameter hooks, reductions.

One post-accumulate-grad hook per parameter marks its gradient ready; the first hook of a
backward queues the end-of-backward callback on the autograd engine and points ``None`` grads at
their (zeroed) bucket views; a bucket whose last gradient is ready starts its reduction, strictly
in bucket order so every rank issues the same collectives in the same order; the callback
starts the rest (unused parameters), reduces the sparse gradients and waits for everything::

    hook(param i) -> on_grad_ready(i) -> bucket ready? -> _launch(b) -> Bucket.launch / launch_hook
    end of backward -> _end_backward -> _finish_locked: launch the rest, sparse, wait, expose

BucketedDDP holds one :class:`GradientReducer`, built from explicit inputs (its trainable
parameters and their names, which of them get sparse gradients, the bucket size, the process
group, the compression dtype) and driven through its public methods and attributes. ZeRO-2
(``_zero2``) finds the reducer of a parameter with :func:`reducer_of` and makes it reduce each
gradient to its owner only (:meth:`GradientReducer.shard_gradients`).
"""

from __future__ import annotations

import bisect
import collections
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import _JoinConfig
from torch.utils.weak import WeakIdKeyDictionary

from torch_flashsys.distributed._buckets import Bucket, assign_buckets
from torch_flashsys.distributed._comm_hook import hook_name
from torch_flashsys.distributed._errors import guarded
from torch_flashsys.distributed._sparse import SparseReduction
from torch_flashsys.distributed._verify import collective_device, verify_same_across_ranks

_AHEAD = 2  # ZeRO-2: other ranks' buckets given a buffer before their first gradient arrives
_IN_FLIGHT = 2  # ZeRO-2: reductions of other ranks' buckets left running before we wait
_ALIGN_BYTES = 64  # each bucket's buffer starts at a multiple of 64 bytes of its storage

# Parameter -> the live reducer that synchronizes its gradient (weakly), so that a second
# BucketedDDP over it is refused and ShardedOptimizer(..., shard_gradients=True) finds it.
_REDUCERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def reducer_of(param: torch.Tensor) -> GradientReducer | None:
    """The live reducer (of a BucketedDDP) that synchronizes ``param``'s gradient, if any."""
    ref = _REDUCERS.get(param)
    return None if ref is None else ref()


def _grad_ready(ref: weakref.ref, i: int, param: torch.Tensor) -> None:
    reducer = ref()
    if reducer is not None:
        reducer.on_grad_ready(i)


def _grad_arriving(ref: weakref.ref, i: int, grad: torch.Tensor) -> None:
    reducer = ref()
    if reducer is not None:
        reducer.before_grad(i)


def _output_grad(ref: weakref.ref, grad: torch.Tensor) -> None:
    reducer = ref()
    if reducer is not None:
        reducer.on_output_grad()


def remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _nonfinite(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One bool per tensor on ``device``: whether it holds an inf or NaN. Max |x| is finite
    exactly when every element is (NaN propagates), so one reduction per tensor, no copy."""
    if not tensors:
        return torch.zeros(0, dtype=torch.bool, device=device)
    norms = [
        torch.linalg.vector_norm(t, float("inf")) if t.numel() else t.new_zeros(()) for t in tensors
    ]
    return ~torch.isfinite(torch.stack([n.to(device, torch.float64) for n in norms]))


class BackwardState:
    """Per-backward state of a BucketedDDP, updated from its hooks."""

    __slots__ = ("ahead_next", "in_backward", "next_bucket", "syncing")

    def __init__(self) -> None:
        self.in_backward = False  # a backward started (first hook) and has not ended
        self.syncing = False  # ... and it synchronizes (its forward ran outside no_sync)
        self.next_bucket = 0  # buckets launch in index order: the same order on every rank
        self.ahead_next = 0  # next of the reducer's _ahead to give a buffer before its gradients


class GradientReducer:
    """Buckets and the backward machinery of one BucketedDDP (see the module docstring).

    params/names: the trainable parameters and their names; is_sparse: which of them get sparse
    gradients (reduced at the end of the backward, outside the buckets); bucket_bytes: the
    gradient bytes at which a bucket closes (``None``: one bucket per dtype); process_group: the
    group to average over (``None``: the world); comm_dtype: the dtype the buckets are reduced
    in (``None``: their own). Registers one hook per parameter, removed with the reducer.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        is_sparse: Sequence[bool],
        bucket_bytes: int | None,
        process_group: dist.ProcessGroup | None,
        comm_dtype: torch.dtype | None,
    ) -> None:
        self.params, self.names, self.is_sparse = list(params), list(names), list(is_sparse)
        self.process_group = process_group
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world = dist.get_world_size(process_group)
        self._limit = bucket_bytes
        self._comm_dtype = comm_dtype
        # NCCL averages inside the collective, saving a pass over the gradients; gloo cannot.
        self._reduce_avg = dist.get_backend(process_group) == "nccl"
        sparse = [i for i, flag in enumerate(self.is_sparse) if flag]
        group = self.group  # the sparse reduction's errors (not self.guard: no reference cycle)
        self._sparse = (
            SparseReduction(
                [self.params[i] for i in sparse],
                [self.names[i] for i in sparse],
                lambda what, fn: guarded("BucketedDDP", what, group, fn),
            )
            if sparse
            else None
        )
        # Pointing grads at their views before AccumulateGrad runs is safe when one autograd
        # thread does all the accumulation: one device (the supported setup, as in torch DDP).
        self.prepoint = len({p.device for p in self.params}) == 1
        self.owners: list[int] | None = None  # ZeRO-2: owner group rank of each parameter
        self.lock = threading.Lock()  # hooks of CUDA backwards run on autograd's device threads
        self.grad_sync = True  # the last forward ran outside no_sync()
        # A synchronizing forward ran and no synchronizing backward has finished since: the
        # next backward to reach the parameters synchronizes (torch DDP's rule), even if it
        # does not pass through the forward's outputs (a loss kept in an attribute).
        self.pending_sync = False
        self._marked_task = -1  # the backward that passed through a synchronizing forward's output
        self.bw = BackwardState()
        self.comm_hook: tuple[Any, Callable[..., torch.futures.Future]] | None = None
        self.comm_checked = False  # hooks compared across ranks (first synchronizing backward)
        self.divisor = self.world  # the sum is divided by this (join(): maybe fewer ranks)
        # The wrapper's Join configuration (set by Join through it), and whether, on a joined
        # rank, the last shadowed forward synchronized: what a ShardedOptimizer's join hook reads.
        self.join_config = _JoinConfig.construct_disabled_join_config()
        self.join_synced = True
        self.release_between_steps = True  # release_idle (False: keep the buffers; benchmarks)
        self._owner_handles: list = []  # ZeRO-2: hooks before the kept gradients accumulate
        self._task = -1  # the autograd graph task _begin_task last saw
        self._build_buckets()
        self._register_hooks()

    def _register_hooks(self) -> None:
        """One post-accumulate-grad hook per parameter. The hooks hold the reducer weakly: the
        param -> hook edge lives in C++, where Python's cycle collector cannot see it, so a
        strong one would keep a dropped wrapper's reducer (and its buffers) alive forever. When
        the reducer goes, its hooks go too."""
        this = weakref.ref(self)
        handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, this, i))
            for i, p in enumerate(self.params)
        ]
        weakref.finalize(self, remove_hooks, handles)
        for p in self.params:
            _REDUCERS[p] = this

    def guard(self, what: str | Callable[[], str], fn: Callable[[], Any]) -> Any:
        """``fn()``; a failure is re-raised naming this rank and ``what`` (see ``_errors``)."""
        return guarded("BucketedDDP", what, self.group, fn)

    # Buckets: built at construction, rebuilt per owner when a ShardedOptimizer shards gradients.

    def _build_buckets(self) -> None:
        owners, rank = self.owners, dist.get_rank(self.process_group)
        dense = [i for i, sparse in enumerate(self.is_sparse) if not sparse]
        assignment = assign_buckets(
            [self.params[i] for i in dense],
            self._limit,
            None if owners is None else [owners[i] for i in dense],
        )
        self.buckets = []
        # parameter index -> (bucket, position); None: sparse (reduced at the end of backward)
        self._slots: list[tuple[int, int] | None] = [None] * len(self.params)
        for b, positions in enumerate(assignment):
            idx = [dense[j] for j in positions]
            owner = None if owners is None else owners[idx[0]]
            self.buckets.append(
                Bucket(
                    [self.params[i] for i in idx],
                    [self.names[i] for i in idx],
                    owner=owner,
                    keeps=owner is None or owner == rank,
                )
            )
            for k, i in enumerate(idx):
                self._slots[i] = (b, k)
        # Buckets this rank keeps share one storage per (device, dtype): one memset clears them.
        self.storages: list[tuple[torch.Tensor, list[Bucket], torch.Tensor]] = []
        kinds: dict[tuple[torch.device, torch.dtype], list[Bucket]] = {}
        for bucket in self.buckets:
            if bucket.keeps:
                kinds.setdefault((bucket.device, bucket.dtype), []).append(bucket)
        for (device, dtype), buckets in kinds.items():
            # Each bucket starts _ALIGN_BYTES-aligned: its flags would otherwise shift the next
            # bucket (and the grads in it) off the 16-byte alignment that vectorized kernels
            # (the foreach optimizers, NCCL) need for their fast path.
            step = max(1, _ALIGN_BYTES // dtype.itemsize)
            starts = [0]
            for bucket in buckets[:-1]:
                starts.append(-(-(starts[-1] + bucket.size) // step) * step)
            storage = torch.zeros(starts[-1] + buckets[-1].size, dtype=dtype, device=device)
            flag_index = []
            for bucket, offset in zip(buckets, starts, strict=True):
                bucket.bind(storage[offset : offset + bucket.size])
                flag_index += range(offset + bucket.total, offset + bucket.size)
            index = torch.tensor(flag_index, dtype=torch.long, device=device)
            self.storages.append((storage, buckets, index))
        self._remote = [b for b, bucket in enumerate(self.buckets) if not bucket.keeps]
        # After release_idle: the kept buckets, each with a buffer of its own (or none yet)
        self._loose: list[Bucket] = []
        # This backward: buckets without a buffer, given one shortly before their gradients
        self._ahead: list[int] = []
        self._in_flight: collections.deque[int] = collections.deque()
        sparse = [i for i, flag in enumerate(self.is_sparse) if flag]
        self._sparse_keep = None if owners is None else [owners[i] == rank for i in sparse]

    def shard_gradients(self, owners: Sequence[int]) -> None:
        """ZeRO-2 (called by ``ShardedOptimizer(..., shard_gradients=True)``): reduce each
        parameter's gradient to its owner only; ``owners[i]`` is the group rank owning
        ``self.params[i]``. Buckets are rebuilt per owner; gradients of parameters owned by
        other ranks are ``None`` after each synchronizing backward."""
        with self.lock:
            if self.bw.in_backward:
                raise RuntimeError(
                    "BucketedDDP: cannot shard gradients during a backward; build the "
                    "ShardedOptimizer between training steps"
                )
            self.owners = list(owners)
            self._build_buckets()
            self._register_owner_hooks()

    def _register_owner_hooks(self) -> None:
        """ZeRO-2: a hook on each parameter this rank keeps, run before its gradient accumulates
        (a leaf tensor hook), so that an average held as its owner is set apart before a
        backward adds to it (:meth:`separate_reduced`)."""
        remove_hooks(self._owner_handles)
        this = weakref.ref(self)
        self._owner_handles = [
            p.register_hook(functools.partial(_grad_arriving, this, i))
            for i, p in enumerate(self.params)
            if (slot := self._slots[i]) is not None and self.buckets[slot[0]].keeps
        ]
        weakref.finalize(self, remove_hooks, list(self._owner_handles))

    def _will_sync(self) -> bool:
        """Whether the backward running now synchronizes (or would, if it started now): it
        passed through an output of a synchronizing forward, or it is the first to reach the
        parameters since such a forward (:attr:`pending_sync`)."""
        if self.bw.in_backward:
            return self.bw.syncing
        return self.pending_sync or self._marked_task == torch._C._current_graph_task_id()

    def mark_outputs(self, outputs: Sequence[torch.Tensor]) -> None:
        """A synchronizing forward returned ``outputs``: a backward that passes through one of
        them synchronizes. Each gets a hook (holding this reducer weakly) that runs when the
        backward reaches it, before it reaches the parameters it used."""
        this = weakref.ref(self)
        hook = functools.partial(_output_grad, this)
        for out in outputs:
            out.register_hook(hook)

    def on_output_grad(self) -> None:
        """A backward reached an output of a synchronizing forward: it synchronizes. One that
        started without it (a parameter reached first through another path, before this
        output) becomes synchronizing now (:meth:`_upgrade`)."""
        with self.lock:
            if not self.bw.in_backward:
                self._marked_task = torch._C._current_graph_task_id()
            elif not self.bw.syncing:
                self._upgrade()

    def _upgrade(self) -> None:
        """A backward that started as local turns out to synchronize: set up what
        :meth:`_start_backward` sets up for one. The gradients that arrived before are already
        in the buckets (adopted by their hooks); not marked ready, they are taken at launch as
        any gradient accumulated earlier (:meth:`Bucket.prepare`)."""
        if not self.comm_checked:
            self._check_comm_hooks()
        bw = self.bw
        bw.syncing, bw.next_bucket, bw.ahead_next = True, 0, 0
        for bucket in self.buckets:
            bucket.reset()
        task = torch._C._current_graph_task_id()
        for bucket in self.buckets:  # ZeRO-2: averages set aside in this backward count in
            if bucket.carry is not None and bucket.seen_task == task:
                bucket.buffer[: bucket.total].add_(bucket.carry, alpha=self.divisor - 1)
                bucket.carry = None
        self._ahead = [b for b, bucket in enumerate(self.buckets) if bucket.buffer is None]

    def before_grad(self, i: int) -> None:
        """ZeRO-2, before a gradient of a parameter this rank keeps accumulates."""
        slot = self._slots[i]
        bucket = self.buckets[slot[0]]
        if bucket.reduced or bucket.carry is not None:
            with self.lock:
                self._begin_task()
                self.separate_reduced(bucket, self._will_sync())

    def _begin_task(self) -> None:
        """Once per backward (autograd graph task), before it changes a kept gradient: an average
        set aside (``carry``) whose buffer changed since (``zero_grad(set_to_none=False)``, a
        gradient set by hand) is dropped; what the gradients hold then counts as local."""
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return
        self._task = task
        for bucket in self.buckets:
            if bucket.carry is not None and (
                bucket.buffer is None or bucket.buffer._version != bucket.carry_version
            ):
                bucket.carry = None

    def separate_reduced(self, bucket: Bucket, sync: bool) -> None:
        """ZeRO-2 owner, before a backward adds to ``bucket``'s gradients (or reduces them).

        After a synchronizing backward the owner alone holds the average (``bucket.reduced``),
        which stands for every rank's copy of it under torch DDP; the next reduction divides the
        sum of the ranks' buffers by ``divisor``, so that average must enter it ``divisor``
        times, else it would count ``1 / divisor`` (gradient accumulation across synchronizing
        backwards). A synchronizing backward scales it in place; a local one (no_sync, a
        backward outside the wrapper) sets it apart as ``carry`` (the gradients show average +
        local sum, as with torch DDP) and the next synchronizing backward adds it ``divisor - 1``
        more times."""
        task = torch._C._current_graph_task_id()
        if task != -1 and bucket.seen_task == task:  # looked at in this backward already
            return
        bucket.seen_task = task
        if bucket.buffer is None or not bucket.holds_views():  # zero_grad(): nothing held
            bucket.reduced, bucket.carry = False, None
            return
        grads = bucket.buffer[: bucket.total]
        if bucket.reduced:
            bucket.reduced = False
            if sync:
                grads.mul_(self.divisor)
            else:
                bucket.carry = grads.clone()
        elif bucket.carry is not None and sync:
            grads.add_(bucket.carry, alpha=self.divisor - 1)
            bucket.carry = None

    # Backward machinery: hook per parameter -> launch ready buckets in order -> wait at the end.

    def on_grad_ready(self, i: int) -> None:
        slot, bw = self._slots[i], self.bw
        with self.lock:
            if not bw.in_backward:
                self._start_backward()
            if slot is None:  # a sparse gradient: reduced at the end of the backward
                return
            b, k = slot
            bucket = self.buckets[b]
            if not bw.syncing:
                if self._ahead:
                    self._allocate_ahead(b)
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
            if self._ahead:
                self._allocate_ahead(b)
            bucket.adopt_grad(k)
            if not bucket.ready[k]:
                bucket.ready[k] = True
                bucket.pending -= 1
                if not bucket.pending and b == bw.next_bucket:
                    buckets, n = self.buckets, len(self.buckets)
                    while bw.next_bucket < n and not buckets[bw.next_bucket].pending:
                        self._launch(bw.next_bucket)

    def _start_backward(self) -> None:
        """First hook of a backward: end-of-backward callback, per-backward state, and every
        ``None`` grad pointed at its zeroed bucket view so that the backward adds in place."""
        syncing = self._will_sync()
        if syncing and not self.comm_checked:
            self._check_comm_hooks()  # before any state changes: a mismatch leaves it as it was
        if self.owners is not None:
            self._begin_task()  # before _prepare changes the kept buffers
        bw = self.bw
        bw.in_backward, bw.syncing = True, syncing
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if bw.syncing:
            for bucket in self.buckets:
                bucket.reset()
            bw.next_bucket = 0
        # Buffers to give out during this backward: any bucket's when it synchronizes, else
        # (no_sync) only those of kept buckets, so that accumulation adds into their views.
        bw.ahead_next = 0
        self._ahead = [
            b
            for b, bucket in enumerate(self.buckets)
            if bucket.buffer is None and (bw.syncing or bucket.keeps)
        ]
        if self.prepoint:
            self._prepare()
            if self._ahead:
                self._allocate_ahead(-1)

    def _check_comm_hooks(self) -> None:
        """Once, at the first synchronizing backward (or its shadow under ``join()``): every rank
        must reduce the same way, else the buckets' collectives would not match."""
        hook = "none" if self.comm_hook is None else hook_name(self.comm_hook[1])
        if self.comm_hook is not None:
            hook += f" with a state of type {type(self.comm_hook[0]).__qualname__}"
        verify_same_across_ranks(
            "BucketedDDP",
            [("communication hook (register_comm_hook)", hook)],
            self.process_group,
            what="the communication hook",
        )
        self.comm_checked = True

    def _prepare(self) -> None:
        for bucket in self._loose:  # kept buckets with buffers of their own (see release_idle)
            if bucket.buffer is not None:  # (else given one ahead of its gradients)
                bucket.start_backward(bucket.holds_views())
        for storage, buckets, flag_index in self.storages:
            holding = [bucket.holds_views() for bucket in buckets]
            if not any(holding):  # the default loop, after zero_grad(): one memset
                storage.zero_()
                storage.index_fill_(0, flag_index, 1)
                for bucket in buckets:
                    bucket.flags_set = True
                    bucket.point_grads(zeroed=True)
                continue
            for bucket, holds in zip(buckets, holding, strict=True):
                bucket.start_backward(holds)

    def _allocate_ahead(self, b: int) -> None:
        """Give the buckets of ``_ahead`` (without a buffer at the start of this backward: other
        ranks' under ZeRO-2, and every bucket after :meth:`release_idle`) up to ``_AHEAD`` past
        bucket ``b`` a zeroed buffer with the grads pointed at it, so that AccumulateGrad adds
        in place (and bucket ``b`` itself if it is one of them and still has none)."""
        bucket = self.buckets[b] if b >= 0 else None
        if bucket is not None and bucket.buffer is None and (self.bw.syncing or bucket.keeps):
            bucket.allocate(point=self.prepoint)
        ahead = self._ahead
        target = min(len(ahead), bisect.bisect_right(ahead, b) + _AHEAD)
        while self.bw.ahead_next < target:
            nxt = self.buckets[ahead[self.bw.ahead_next]]
            if nxt.buffer is None and not nxt.busy and self.prepoint:
                nxt.allocate()
            self.bw.ahead_next += 1

    def release_idle(self) -> None:
        """Between steps, when no parameter has a gradient (the default loop after
        ``zero_grad()``, which sets them to ``None``): drop the buffers of the buckets this rank
        keeps, so that the next forward's activations can use that memory. The next backward
        gives each bucket a buffer again shortly before its first gradient
        (:meth:`_allocate_ahead`), so gradient memory grows as activations are freed, as it
        does without a wrapper. Called by BucketedDDP's forward; a gradient that is a view
        (accumulation, ``zero_grad(set_to_none=False)``) keeps every buffer."""
        with self.lock:
            if self.bw.in_backward or not self.release_between_steps:
                return
            kept = [b for b in self.buckets if b.keeps and b.buffer is not None]
            if not kept or any(b.busy for b in self.buckets):
                return
            if any(p.grad is not None for p in self.params):
                return
            for bucket in kept:
                bucket.release()
            self._loose = [b for b in self.buckets if b.keeps]
            self.storages = []

    def _describe_bucket(self, b: int) -> str:
        bucket, n = self.buckets[b], len(self.buckets)
        names = ", ".join(repr(name) for name in bucket.names[:3])
        more = f" and {len(bucket.names) - 3} more" if len(bucket.names) > 3 else ""
        what = f"gradient bucket {b} of {n} (parameters {names}{more})"
        if self.comm_hook is not None:
            return f"the communication hook {hook_name(self.comm_hook[1])} on {what}"
        if bucket.owner is not None:
            return f"the reduce to rank {bucket.owner} of {what}"
        return f"the all-reduce of {what}"

    def _launch(self, b: int) -> None:
        bucket, describe = self.buckets[b], functools.partial(self._describe_bucket, b)
        if bucket.reduced or bucket.carry is not None:  # ZeRO-2: no gradient of it came
            self.separate_reduced(bucket, sync=True)
        if self.comm_hook is not None:
            state, hook = self.comm_hook
            run = lambda grad_bucket: hook(state, grad_bucket)
            self.guard(describe, lambda: bucket.launch_hook(run, b, len(self.buckets)))
        else:
            divisor = self.divisor
            reduce_avg = self._reduce_avg and divisor == self.world
            self.guard(
                describe, lambda: bucket.launch(self.group, divisor, self._comm_dtype, reduce_avg)
            )
        self.bw.next_bucket = b + 1
        if not bucket.keeps:  # bound the transient buffers: wait for older reductions
            self._in_flight.append(b)
            while len(self._in_flight) > _IN_FLIGHT:
                self._finish_bucket(self._in_flight.popleft())

    def _finish_bucket(self, b: int, expose: bool = True) -> None:
        bucket = self.buckets[b]
        if bucket.busy:
            self.guard(functools.partial(self._describe_bucket, b), lambda: bucket.finish(expose))

    def _end_backward(self) -> None:
        with self.lock:
            if not self.bw.in_backward:
                return
            if self.bw.syncing:
                self._finish_locked()
            else:
                self._forget_backward()

    def _forget_backward(self) -> None:
        """End a backward that communicated nothing (under no_sync): gradients keep what was
        accumulated."""
        for bucket in self.buckets:
            if bucket.keeps:
                bucket.clear_phantoms()
                if bucket.carry is not None:  # ZeRO-2: see _begin_task
                    bucket.carry_version = bucket.buffer._version
        self.bw.in_backward = False

    def _finish_locked(self) -> None:
        hooked = self.comm_hook is not None
        try:
            # Buckets with parameters that got no gradient (unused) launch now, still in order.
            for b in range(self.bw.next_bucket, len(self.buckets)):
                self._launch(b)
            # Sparse gradients overlap the dense reductions, except behind a hook: hooks (such
            # as PowerSGD) may issue collectives from Future callbacks, so nothing else is issued
            # until they are done, to keep the order of collectives the same on every rank.
            if self._sparse is not None and not hooked:
                self._sparse.start(self.group, self.divisor)
            while self._in_flight:
                self._finish_bucket(self._in_flight.popleft())
            for b in range(len(self.buckets)):
                self._finish_bucket(b, expose=not hooked)
            if hooked:
                self._reduce_flags()
                if self._sparse is not None:
                    self._sparse.start(self.group, self.divisor)
            if self._sparse is not None:
                self._sparse.finish(self._sparse_keep)
            if self.owners is not None and self.world > 1:
                self._share_nonfinite()
        finally:
            self.bw.in_backward = False
            self.pending_sync = False

    def kept_buffers(self) -> list[torch.Tensor]:
        """The memory holding this rank's kept gradients: one storage per (device, dtype), or
        after :meth:`release_idle` each kept bucket's own buffer."""
        if self.storages:
            return [s for s, _, _ in self.storages]
        return [b.buffer for b in self._loose if b.buffer is not None]

    def _share_nonfinite(self) -> None:
        """ZeRO-2, end of a synchronizing backward: a non-finite averaged gradient is seen only
        by its owner, so a GradScaler (or any inf check) would skip the step on that rank alone
        and the ranks would disagree on the loss scale, then hang. Every rank tells whether it
        holds one (one max-abs pass per gradient storage, one all-reduce of one float and, on
        GPUs, a host sync); only if some rank does, a second all-reduce of one flag per bucket
        (and sparse parameter) says which, and each parameter of a flagged bucket that another
        rank owns gets a NaN gradient here, so every rank's check finds it (as with ZeRO-1,
        where every rank holds every gradient)."""
        device = collective_device(self.process_group)
        owned_sparse = [] if self._sparse is None else self._owned_sparse_grads()
        local = _nonfinite(self.kept_buffers() + owned_sparse, device)
        any_bad = local.any().float().reshape(1)
        what = "the all-reduce of the non-finite gradient flags (ZeRO-2)"
        self.guard(what, lambda: dist.all_reduce(any_bad, op=dist.ReduceOp.MAX, group=self.group))
        if not any_bad.item():
            return
        sparse = [] if self._sparse is None else self._sparse.params
        flags = torch.zeros(len(self.buckets) + len(sparse), dtype=torch.float32, device=device)
        kept = [b for b, bucket in enumerate(self.buckets) if bucket.keeps]
        kept += [len(self.buckets) + i for i, keep in enumerate(self._sparse_keep or []) if keep]
        if kept:
            tensors = [self.buckets[b].buffer for b in kept if b < len(self.buckets)]
            flags[torch.tensor(kept, device=device)] = _nonfinite(
                tensors + owned_sparse, device
            ).float()
        self.guard(what, lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group))
        for j in flags.nonzero().flatten().tolist():
            if j < len(self.buckets):
                params = [] if self.buckets[j].keeps else self.buckets[j].params
            else:
                i = j - len(self.buckets)
                params = [] if self._sparse_keep[i] else [sparse[i]]
            for p in params:
                p.grad = torch.full_like(p, float("nan"), memory_format=torch.contiguous_format)

    def _owned_sparse_grads(self) -> list[torch.Tensor]:
        """The values of this rank's sparse parameters' gradients (ZeRO-2), in parameter order;
        an empty tensor for one without a gradient."""
        out = []
        for p, keep in zip(self._sparse.params, self._sparse_keep, strict=True):
            if keep:
                grad = p.grad if p.grad is not None else p.new_zeros(0)
                out.append(grad._values() if grad.is_sparse else grad.reshape(-1))
        return out

    def _reduce_flags(self) -> None:
        """Behind a communication hook (which reduces only the gradients): one all-reduce of
        every bucket's "has a gradient" flags, then the grads no rank had become ``None``."""
        if not self.buckets:
            return
        device = collective_device(self.process_group)
        flags = torch.cat([b.flags.to(device=device, dtype=torch.float32) for b in self.buckets])
        self.guard(
            "the all-reduce of the gradient flags (after the communication hook)",
            lambda: dist.all_reduce(flags, group=self.group),
        )
        for bucket, chunk in zip(
            self.buckets, flags.split([b.flags.numel() for b in self.buckets]), strict=True
        ):
            bucket.flags.copy_(chunk)
            bucket.expose()

    def shadow_backward(self) -> None:
        """Under ``join()``, on a joined rank: take part in every reduction of a synchronizing
        backward of the other ranks, contributing zeros (no gradient), and receive the
        average (so a joined owner can still step its shard of a ShardedOptimizer). The caller
        sets :attr:`divisor` to the training ranks' (the zeros need none, but the op they choose
        by it, SUM or AVG, must be theirs)."""
        with self.lock:
            if self.bw.in_backward:
                raise RuntimeError("BucketedDDP: join shadowing started during a backward")
            if not self.comm_checked:
                self._check_comm_hooks()
            for bucket in self.buckets:
                for p in bucket.params:
                    p.grad = None
                bucket.reduced, bucket.carry = False, None
                bucket.reset()
                bucket.phantom.clear()
                bucket.flags_set = False
            if self._sparse is not None:
                for p in self._sparse.params:
                    p.grad = None
            bw = self.bw
            bw.in_backward, bw.syncing, bw.next_bucket, bw.ahead_next = True, True, 0, 0
            self._ahead = []  # buffers come from Bucket.prepare as each bucket launches
            self._finish_locked()

    def finish(self) -> None:
        """Wait until every bucket's reduction of the running synchronizing backward (if any)
        has finished and ``param.grad`` holds the average."""
        with self.lock:
            if self.bw.in_backward and self.bw.syncing:
                self._finish_locked()

    def unfinished_backward(self) -> None:
        """A forward after a backward that raised before its end (the callback that finishes it
        never ran). Under no_sync nothing was communicated: forget it (the gradients hold what
        was accumulated, as without a wrapper). Otherwise this rank's collectives no longer
        match the other ranks': raise, as torch DDP does."""
        with self.lock:
            if self.bw.syncing:
                raise RuntimeError(
                    "BucketedDDP: the previous backward did not finish (an exception was raised "
                    f"during it?) after {self.bw.next_bucket} of {len(self.buckets)} gradient "
                    "buckets had started their reductions, so this rank's collectives no longer "
                    "match the other ranks'; training cannot go on after an exception inside a "
                    "synchronizing backward: restart it (e.g. from a checkpoint)"
                )
            self._forget_backward()
