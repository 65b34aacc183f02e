"""The backward machinery of :class:`BucketedDDP`: buckets, per-parameter hooks, reductions.

One post-accumulate-grad hook per parameter marks its gradient ready; the first hook of a
backward queues the end-of-backward callback on the autograd engine and points ``None`` grads at
their (zeroed) bucket views; a bucket whose last gradient is ready starts its reduction, strictly
in bucket order so every rank issues the same collectives in the same order; the callback
starts the rest (unused parameters), reduces the sparse gradients and waits for everything::

    hook(param i) -> _on_grad_ready(i) -> bucket ready? -> _launch(b) -> Bucket.launch / launch_hook
    end of backward -> _end_backward -> _finish_locked: launch the rest, sparse, wait, expose

:class:`GradientReducer` is a mixin of BucketedDDP, whose constructor sets the attributes it
uses (``_params``, ``_names``, ``_is_sparse``, ``_owners``, ``_limit``, ``_group``, ``_world``,
``_divisor``, ``_comm_dtype``, ``_reduce_avg``, ``_comm_hook``, ``_comm_checked``, ``_sparse``,
``_prepoint``, ``_grad_sync``, ``_lock``, ``_bw``) and then calls ``_build_buckets()``.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_flashsys.distributed._buckets import Bucket, assign_buckets
from torch_flashsys.distributed._comm_hook import hook_name
from torch_flashsys.distributed._errors import collective_error
from torch_flashsys.distributed._verify import collective_device, verify_same_across_ranks

_AHEAD = 2  # ZeRO-2: other ranks' buckets given a buffer before their first gradient arrives
_IN_FLIGHT = 2  # ZeRO-2: reductions of other ranks' buckets left running before we wait
_ALIGN_BYTES = 64  # each bucket's buffer starts at a multiple of 64 bytes of its storage


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

    __slots__ = ("in_backward", "next_bucket", "remote_next", "syncing")

    def __init__(self) -> None:
        self.in_backward = False  # a backward started (first hook) and has not ended
        self.syncing = False  # ... and it synchronizes (its forward ran outside no_sync)
        self.next_bucket = 0  # buckets launch in index order: the same order on every rank
        self.remote_next = 0  # ZeRO-2: next of _remote to give a buffer ahead of its gradients


class GradientReducer:
    """Buckets and the backward machinery of BucketedDDP (see the module docstring)."""

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; a failure is re-raised naming this rank and ``what`` (see ``_errors``)."""
        try:
            return fn()
        except Exception as exc:
            raise collective_error("BucketedDDP", what, self._group, exc) from exc

    # Buckets: built at construction, rebuilt per owner when a ShardedOptimizer shards gradients.

    def _build_buckets(self) -> None:
        owners, rank = self._owners, dist.get_rank(self.process_group)
        dense = [i for i, sparse in enumerate(self._is_sparse) if not sparse]
        assignment = assign_buckets(
            [self._params[i] for i in dense],
            self._limit,
            None if owners is None else [owners[i] for i in dense],
        )
        self._buckets = []
        # parameter index -> (bucket, position); None: sparse (reduced at the end of backward)
        self._slots: list[tuple[int, int] | None] = [None] * len(self._params)
        for b, positions in enumerate(assignment):
            idx = [dense[j] for j in positions]
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
            self._storages.append((storage, buckets, index))
        self._remote = [b for b, bucket in enumerate(self._buckets) if not bucket.keeps]
        self._in_flight: collections.deque[int] = collections.deque()
        sparse = [i for i, flag in enumerate(self._is_sparse) if flag]
        self._sparse_keep = None if owners is None else [owners[i] == rank for i in sparse]

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
        slot, bw = self._slots[i], self._bw
        with self._lock:
            if not bw.in_backward:
                self._start_backward()
            if slot is None:  # a sparse gradient: reduced at the end of the backward
                return
            b, k = slot
            bucket = self._buckets[b]
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
        if self._grad_sync and not self._comm_checked:
            self._check_comm_hooks()  # before any state changes: a mismatch leaves it as it was
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

    def _check_comm_hooks(self) -> None:
        """Once, at the first synchronizing backward (or its shadow under ``join()``): every rank
        must reduce the same way, else the buckets' collectives would not match."""
        hook = "none" if self._comm_hook is None else hook_name(self._comm_hook[1])
        if self._comm_hook is not None:
            hook += f" with a state of type {type(self._comm_hook[0]).__qualname__}"
        verify_same_across_ranks(
            "BucketedDDP",
            [("communication hook (register_comm_hook)", hook)],
            self.process_group,
            what="the communication hook",
        )
        self._comm_checked = True

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
            if ahead.buffer is None and not ahead.busy and self._prepoint:
                ahead.allocate()
            self._bw.remote_next += 1

    def _describe_bucket(self, b: int) -> str:
        bucket, n = self._buckets[b], len(self._buckets)
        names = ", ".join(repr(name) for name in bucket.names[:3])
        more = f" and {len(bucket.names) - 3} more" if len(bucket.names) > 3 else ""
        what = f"gradient bucket {b} of {n} (parameters {names}{more})"
        if self._comm_hook is not None:
            return f"the communication hook {hook_name(self._comm_hook[1])} on {what}"
        if bucket.owner is not None:
            return f"the reduce to rank {bucket.owner} of {what}"
        return f"the all-reduce of {what}"

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        if self._comm_hook is not None:
            state, hook = self._comm_hook
            run = lambda grad_bucket: hook(state, grad_bucket)
            self._guard_bucket(b, lambda: bucket.launch_hook(run, b, len(self._buckets)))
        else:
            divisor = self._divisor
            reduce_avg = self._reduce_avg and divisor == self._world
            try:
                bucket.launch(self._group, divisor, self._comm_dtype, reduce_avg)
            except Exception as exc:
                what = self._describe_bucket(b)
                raise collective_error("BucketedDDP", what, self._group, exc) from exc
        self._bw.next_bucket = b + 1
        if not bucket.keeps:  # bound the transient buffers: wait for older reductions
            self._in_flight.append(b)
            while len(self._in_flight) > _IN_FLIGHT:
                self._finish_bucket(self._in_flight.popleft())

    def _guard_bucket(self, b: int, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise collective_error(
                "BucketedDDP", self._describe_bucket(b), self._group, exc
            ) from exc

    def _finish_bucket(self, b: int, expose: bool = True) -> None:
        bucket = self._buckets[b]
        if bucket.busy:
            try:
                bucket.finish(expose)
            except Exception as exc:
                what = self._describe_bucket(b)
                raise collective_error("BucketedDDP", what, self._group, exc) from exc

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
        hooked = self._comm_hook is not None
        try:
            # Buckets with parameters that got no gradient (unused) launch now, still in order.
            for b in range(self._bw.next_bucket, len(self._buckets)):
                self._launch(b)
            # Sparse gradients overlap the dense reductions, except behind a hook: hooks (such
            # as PowerSGD) may issue collectives from Future callbacks, so nothing else is issued
            # until they are done, to keep the order of collectives the same on every rank.
            if self._sparse is not None and not hooked:
                self._sparse.start(self._group, self._divisor)
            while self._in_flight:
                self._finish_bucket(self._in_flight.popleft())
            for b in range(len(self._buckets)):
                self._finish_bucket(b, expose=not hooked)
            if hooked:
                self._reduce_flags()
                if self._sparse is not None:
                    self._sparse.start(self._group, self._divisor)
            if self._sparse is not None:
                self._sparse.finish(self._sparse_keep)
            if self._owners is not None and self._world > 1:
                self._share_nonfinite()
        finally:
            self._bw.in_backward = False

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
        local = _nonfinite([s for s, _, _ in self._storages] + owned_sparse, device)
        any_bad = local.any().float().reshape(1)
        what = "the all-reduce of the non-finite gradient flags (ZeRO-2)"
        self._guard(what, lambda: dist.all_reduce(any_bad, op=dist.ReduceOp.MAX, group=self._group))
        if not any_bad.item():
            return
        sparse = [] if self._sparse is None else self._sparse.params
        flags = torch.zeros(len(self._buckets) + len(sparse), dtype=torch.float32, device=device)
        kept = [b for b, bucket in enumerate(self._buckets) if bucket.keeps]
        kept += [len(self._buckets) + i for i, keep in enumerate(self._sparse_keep or []) if keep]
        if kept:
            tensors = [self._buckets[b].buffer for b in kept if b < len(self._buckets)]
            flags[torch.tensor(kept, device=device)] = _nonfinite(
                tensors + owned_sparse, device
            ).float()
        self._guard(what, lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group))
        for j in flags.nonzero().flatten().tolist():
            if j < len(self._buckets):
                params = [] if self._buckets[j].keeps else self._buckets[j].params
            else:
                i = j - len(self._buckets)
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
        if not self._buckets:
            return
        device = collective_device(self.process_group)
        flags = torch.cat([b.flags.to(device=device, dtype=torch.float32) for b in self._buckets])
        self._guard(
            "the all-reduce of the gradient flags (after the communication hook)",
            lambda: dist.all_reduce(flags, group=self._group),
        )
        for bucket, chunk in zip(
            self._buckets, flags.split([b.flags.numel() for b in self._buckets]), strict=True
        ):
            bucket.flags.copy_(chunk)
            bucket.expose()

    def _shadow_backward(self) -> None:
        """Under ``join()``, on a joined rank: take part in every reduction of a synchronizing
        backward of the other ranks, contributing zeros (no gradient), and receive the
        average (so a joined owner can still step its shard of a ShardedOptimizer)."""
        with self._lock:
            if self._bw.in_backward:
                raise RuntimeError("BucketedDDP: join shadowing started during a backward")
            if not self._comm_checked:
                self._check_comm_hooks()
            for bucket in self._buckets:
                for p in bucket.params:
                    p.grad = None
                bucket.reset()
                bucket.phantom.clear()
                bucket.flags_set = False
            if self._sparse is not None:
                for p in self._sparse.params:
                    p.grad = None
            bw = self._bw
            bw.in_backward, bw.syncing, bw.next_bucket, bw.remote_next = True, True, 0, 0
            self._divisor = self._world  # zeros: any divisor
            self._finish_locked()
