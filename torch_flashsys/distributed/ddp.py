"""BucketedDDP: data parallelism with bucketed, overlapped gradient all-reduce."""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.utils.weak import WeakIdKeyDictionary

from torch_flashsys.distributed import _join
from torch_flashsys.distributed._buckets import Bucket, assign_buckets, broadcast_coalesced
from torch_flashsys.distributed._comm_hook import hook_name, hook_problem
from torch_flashsys.distributed._errors import collective_error
from torch_flashsys.distributed._sparse import SparseReduction, sparse_gradient_params
from torch_flashsys.distributed._verify import (
    collective_device,
    describe_tensors,
    verify_same_across_ranks,
)

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


class BucketedDDP(torch.nn.Module, Joinable):
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

    Weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` get sparse gradients
    reduced as sparse tensors (as torch DDP). ``join()`` trains on uneven inputs (a
    ``torch.distributed.algorithms.Join`` joinable); ``register_comm_hook`` takes torch DDP's
    communication hooks. A collective that fails (another rank raised, died or hangs) raises on
    this rank naming the rank and the collective.
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
        sparse_ids = sparse_gradient_params(module)
        items += [
            ("option bucket_size_mb", repr(bucket_size_mb)),
            ("option broadcast_buffers", repr(broadcast_buffers)),
            ("option grad_compression", repr(grad_compression)),
            (
                "parameters with sparse gradients (nn.Embedding(sparse=True))",
                repr([i for i, (_, p) in enumerate(named) if id(p) in sparse_ids]),
            ),
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
        self._is_sparse = [id(p) in sparse_ids for p in self._params]
        sparse = [i for i, flag in enumerate(self._is_sparse) if flag]
        self._sparse = (
            SparseReduction(
                [self._params[i] for i in sparse], [self._names[i] for i in sparse], self._guard
            )
            if sparse
            else None
        )
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
        self._comm_hook: tuple[Any, Callable[..., torch.futures.Future]] | None = None
        self._comm_checked = False  # hooks compared across ranks (first synchronizing backward)
        Joinable.__init__(self)  # _join_config: outside a Join context
        self._divisor = self._world  # the sum is divided by this (join(): maybe fewer ranks)
        self._divide_by_initial = True
        self._join_synced = True  # joined rank: the last shadowed forward synchronized

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call ``self.module(*inputs, **kwargs)`` (after broadcasting buffers, see the class)."""
        if self._join_config.enable:
            self._join_forward()
        elif self._sync_buffers_next and self.broadcast_buffers and self._world > 1:
            self._broadcast_buffers(self._src)
        self._grad_sync = not self._no_sync
        self._sync_buffers_next = torch.is_grad_enabled() and self._grad_sync
        return self.module(*inputs, **kwargs)

    def _broadcast_buffers(self, src: int) -> None:
        """Overwrite the buffers with global rank ``src``'s."""
        buffers = list(self.module.buffers())
        if buffers:
            with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                self._guard(
                    f"the broadcast of the buffers from global rank {src}",
                    lambda: broadcast_coalesced(buffers, src, self.process_group),
                )

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; a failure is re-raised naming this rank and ``what`` (see ``_errors``)."""
        try:
            return fn()
        except Exception as exc:
            raise collective_error("BucketedDDP", what, self._group, exc) from exc

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

    def register_comm_hook(self, state: Any, hook: Callable[..., torch.futures.Future]) -> None:
        """Reduce each gradient bucket with ``hook(state, bucket)``, torch DDP's contract.

        ``hook`` gets a GradBucket (``index()``, ``is_last()``, ``buffer()``, ``set_buffer()``,
        ``gradients()``, ``parameters()``; the buffer holds this rank's gradients of the bucket,
        not divided) and returns a ``torch.futures.Future`` whose value is the reduced flat
        tensor, e.g. torch's hooks unchanged::

            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
            state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=10)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

        Call it once, on every rank, before the first synchronizing backward (the hooks are
        compared across ranks then). Not with ``grad_compression`` (use the hook instead) nor
        with ZeRO-2 (``ShardedOptimizer(..., shard_gradients=True)`` reduces to owners).
        Sparse gradients (``nn.Embedding(sparse=True)``) do not go through the hook.
        """
        caller = "BucketedDDP.register_comm_hook"
        if self._comm_hook is not None:
            raise RuntimeError(
                f"{caller}: a communication hook is already registered "
                f"({hook_name(self._comm_hook[1])}); it can be registered only once"
            )
        if self._comm_checked:
            raise RuntimeError(
                f"{caller}: must be called before the first synchronizing backward (every rank "
                "must reduce the same way from the first one)"
            )
        if self.grad_compression is not None:
            raise ValueError(
                f"{caller}: this BucketedDDP was built with grad_compression="
                f"{self.grad_compression!r}; the two are exclusive (pass grad_compression=None "
                f"and register default_hooks.{self.grad_compression}_compress_hook instead)"
            )
        if self._owners is not None:
            raise ValueError(
                f"{caller}: not supported with ZeRO-2 (ShardedOptimizer(..., "
                "shard_gradients=True)), whose buckets are reduced to their owner ranks"
            )
        problem = hook_problem(hook, state, self._group)
        if problem is not None:
            raise problem[0](problem[1])
        self._comm_hook = (state, hook)

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for uneven inputs (torch DDP's ``join``): ranks that run out of
        batches shadow the collectives of the others until every rank is done::

            with model.join():                    # or Join([model, sharded_optimizer])
                for batch in my_batches:          # a different number on each rank
                    loss_fn(model(batch)).backward()
                    opt.step(); opt.zero_grad()

        A joined rank contributes zero gradients. ``divide_by_initial_world_size``: divide the
        sums by the world size (every sample weighs the same) or, ``False``, by the number of
        ranks still training. ``enable=False``: no uneven-input handling (no extra collective).
        ``throw_on_early_termination``: every rank raises once one runs out of inputs. At the
        end the parameters (and buffers) of the highest last-joining rank are broadcast.

        Each forward inside must be followed by its backward (as with torch DDP); with other
        joinables, pass the model first: ``Join([model, optimizer])``.
        """
        for name, value in (
            ("divide_by_initial_world_size", divide_by_initial_world_size),
            ("enable", enable),
            ("throw_on_early_termination", throw_on_early_termination),
        ):
            if not isinstance(value, bool):
                raise TypeError(
                    f"BucketedDDP.join: {name} must be a bool, got {type(value).__name__}"
                )
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The ``Join`` hook: shadows the forward and backward collectives of the ranks still
        training (kwarg ``divide_by_initial_world_size``, default ``True``)."""
        divide = kwargs.get("divide_by_initial_world_size", True)
        if not isinstance(divide, bool):
            raise TypeError(
                "BucketedDDP.join_hook: divide_by_initial_world_size must be a bool, got "
                f"{type(divide).__name__}"
            )
        return _join.DDPJoinHook(self, divide)

    @property
    def join_device(self) -> torch.device:
        """Device of the ``Join`` context's own collectives (CUDA under NCCL)."""
        return collective_device(self.process_group)

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self._group

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
            f"shard_gradients={self._owners is not None}, sparse_params={sum(self._is_sparse)}, "
            f"comm_hook={None if self._comm_hook is None else hook_name(self._comm_hook[1])}"
        )

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
            storage = torch.zeros(sum(b.size for b in buckets), dtype=dtype, device=device)
            flag_index, offset = [], 0
            for bucket in buckets:
                bucket.bind(storage[offset : offset + bucket.size])
                flag_index += range(offset + bucket.total, offset + bucket.size)
                offset += bucket.size
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
        bw = self._bw
        bw.in_backward, bw.syncing = True, self._grad_sync
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if bw.syncing:
            if not self._comm_checked:
                self._check_comm_hooks()
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
        self._comm_checked = True
        hook = "none" if self._comm_hook is None else hook_name(self._comm_hook[1])
        if self._comm_hook is not None:
            hook += f" with a state of type {type(self._comm_hook[0]).__qualname__}"
        verify_same_across_ranks(
            "BucketedDDP",
            [("communication hook (register_comm_hook)", hook)],
            self.process_group,
            what="the communication hook",
        )

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
            self._guard_bucket(b, lambda: bucket.finish(expose))

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
        finally:
            self._bw.in_backward = False

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

    # Uneven inputs (join()): see _join.py for the protocol.

    def _join_forward(self) -> None:
        """A forward inside Join on a rank still training: tell the joined ranks what follows."""
        if not self._join_config.is_first_joinable:
            raise ValueError(
                "BucketedDDP: inside Join, the model must be the first joinable, e.g. "
                "Join([model, optimizer]): its forward is the first collective of an iteration, "
                "the one the joined ranks' Join loop answers"
            )
        Join.notify_join_context(self)
        sync = torch.is_grad_enabled() and not self._no_sync
        bcast = self._sync_buffers_next and self.broadcast_buffers and self._world > 1
        bcast = bcast and next(self.module.buffers(), None) is not None
        state = self._join_exchange(sync, bcast, joined=False)
        self._divisor = self._world if self._divide_by_initial else state.active
        if state.broadcast_buffers:
            self._broadcast_buffers(self._global_rank(state.source))

    def _join_exchange(self, sync: bool, bcast: bool, joined: bool) -> _join.JoinState:
        return self._guard(
            "the all-reduce of the join state (Join / BucketedDDP.join)",
            lambda: _join.exchange_join_state(self._group, sync, bcast, joined),
        )

    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def _join_shadow(self) -> None:
        """Join's main hook on a joined rank: mirror one forward and backward of the others."""
        state = self._join_exchange(False, False, joined=True)
        if state.broadcast_buffers:
            self._broadcast_buffers(self._global_rank(state.source))
        self._sync_buffers_next = self._join_synced = state.sync
        if not state.sync:
            return
        with self._lock:
            if self._bw.in_backward:
                raise RuntimeError("BucketedDDP: join shadowing started during a backward")
            if not self._comm_checked:
                self._check_comm_hooks()
            # This rank contributes zeros (no gradient) and receives the average.
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

    def _join_final_sync(self, is_last_joiner: bool) -> None:
        """Join's post hook: every rank takes the model of the highest last-joining rank."""
        src = self._guard(
            "the agreement on the last joined rank (Join)",
            lambda: _join.last_joiner(self._group, is_last_joiner),
        )
        states = [p.detach() for p in self.module.parameters()]
        if self.broadcast_buffers:
            states += list(self.module.buffers())
        self._guard(
            f"the broadcast of the final model from rank {src} (Join)",
            lambda: broadcast_coalesced(states, self._global_rank(src), self.process_group),
        )
        self._join_config = _join.disabled()  # back to the plain forward
        self._divisor = self._world
