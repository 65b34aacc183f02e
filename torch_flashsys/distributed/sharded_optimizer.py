"""ShardedOptimizer: ZeRO-1/2 state (and gradient) sharding for any ``torch.optim.Optimizer``."""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim.optimizer import ParamsT

from torch_flashsys.distributed._errors import guarded
from torch_flashsys.distributed._join import (
    GroupJoinable,
    OwnerJoinHook,
    disabled,
    sync_hyperparameters,
)
from torch_flashsys.distributed._shard_state import State, check_plain_format, gather_states
from torch_flashsys.distributed._sharding import (
    ParamBucket,
    assign_owners,
    broadcast_buckets,
    build_buckets,
    chunk_bytes_for,
)
from torch_flashsys.distributed._verify import (
    check_bools,
    check_process_group,
    describe_tensors,
    signature,
    verify_same_across_ranks,
    verify_signature,
)
from torch_flashsys.distributed._zero2 import (
    check_model_joins,
    clip_grad_norm,
    find_reducer,
    reduce_to_owners,
    shadow_skips_step,
)

_NOT_HYPER = ("params", "param_names")  # group keys that are not hyperparameters


def _same(problem: str) -> tuple[str, str]:
    """A problem whose message names nothing rank-specific: the rule is the message."""
    return problem, problem


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def _unshardable(optimizer_cls: type[torch.optim.Optimizer]) -> str | None:
    """Why ``optimizer_cls`` cannot run on one rank's shard, or None. Sharding is exact only for
    optimizers that update each parameter from its own gradient and state; one whose step needs a
    closure (LBFGS: line search and directions over the whole flattened parameter vector) would
    run a different algorithm on each rank's part of the vector."""
    closure = inspect.signature(optimizer_cls.step).parameters.get("closure")
    needs_closure = closure is not None and closure.default is inspect.Parameter.empty
    if not (issubclass(optimizer_cls, torch.optim.LBFGS) or needs_closure):
        return None
    return (
        f"ShardedOptimizer: optimizer_cls {optimizer_cls.__qualname__} cannot be sharded: its "
        "step() requires a closure and works on the whole parameter vector at once (directions, "
        "line search and norms over every parameter), while each rank steps only the parameters "
        "it owns, which would run a different algorithm on each shard; use it unsharded (only "
        "optimizers that update each parameter from its own gradient and state can be sharded)"
    )


def _optimizer_class(cls: Any, torch_name: Any) -> type[torch.optim.Optimizer]:
    """The optimizer class, given as ``optimizer_cls`` or as ZeroRedundancyOptimizer's
    ``optimizer_class``."""
    if cls is not None and torch_name is not None:
        raise TypeError(
            "ShardedOptimizer: optimizer_class is ZeroRedundancyOptimizer's name for "
            f"optimizer_cls; pass one of them, got optimizer_cls={cls!r} and "
            f"optimizer_class={torch_name!r}"
        )
    if cls is None and torch_name is None:
        raise TypeError(
            "ShardedOptimizer: missing the optimizer class: pass optimizer_cls (or "
            "ZeroRedundancyOptimizer's name, optimizer_class), e.g. "
            "ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)"
        )
    name, cls = ("optimizer_cls", cls) if cls is not None else ("optimizer_class", torch_name)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"ShardedOptimizer: {name} must be a torch.optim.Optimizer subclass (the class, e.g. "
            f"torch.optim.AdamW, not an instance), got {cls!r}"
        )
    if issubclass(cls, ShardedOptimizer):
        raise TypeError(f"ShardedOptimizer: {name} cannot be ShardedOptimizer itself")
    return cls


def _param_list(params: ParamsT) -> ParamsT:
    """``params`` as a list (a generator is consumed once); an empty one raises."""
    if isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        params = list(params)
        if not params:
            raise ValueError("ShardedOptimizer: params is empty (no parameters to optimize)")
    return params


def _check_zero_flags(
    shard_gradients: Any, parameters_as_bucket_view: Any, overlap_with_ddp: Any
) -> None:
    flags = {
        "shard_gradients": shard_gradients,
        "parameters_as_bucket_view": parameters_as_bucket_view,
        "overlap_with_ddp": overlap_with_ddp,
    }
    check_bools("ShardedOptimizer", flags, show_value=True)
    if overlap_with_ddp:
        raise NotImplementedError(
            "ShardedOptimizer: overlap_with_ddp=True is not supported (ZeroRedundancyOptimizer "
            "then steps inside a DDP communication hook, ddp_zero_hook); step() here already "
            "overlaps each chunk's parameter broadcast with the next chunk's step, and "
            "shard_gradients=True with BucketedDDP reduces each gradient to its owner only"
        )


class ShardedOptimizer(torch.optim.Optimizer, GroupJoinable):
    """Shard the state of any optimizer across the ranks of a process group (ZeRO stage 1, and
    stage 2 with :class:`~torch_flashsys.BucketedDDP`).

    Each parameter is owned by one rank (whole parameters, largest first to the least-loaded
    rank); rank ``r`` keeps optimizer state only for the parameters it owns, so each rank holds
    about ``1 / world_size`` of the state. ``step()`` updates the owned parameters with the local
    optimizer ``self.optim``, then every rank receives every other rank's updated parameters
    through a few large broadcasts (one per owner, dtype and chunk of about a quarter of a
    rank's shard, each started as soon as its chunk is stepped). The result equals the plain
    optimizer on every rank, provided the gradients are the same on every rank (e.g. averaged by
    :class:`~torch_flashsys.BucketedDDP` or torch DDP). At world size 1 ``step()`` is the local
    optimizer's step and nothing else (no buffers, no collectives).

    Args:
        params: tensors or param-group dicts, as for any ``torch.optim.Optimizer``. Every rank must
            pass the same parameters (shapes, dtypes, requires_grad) in the same order.
        optimizer_cls: the optimizer to shard, a ``torch.optim.Optimizer`` subclass
            (``torch.optim.AdamW``, ...) that updates each parameter from its own gradient and
            state: not ``torch.optim.LBFGS`` nor any optimizer whose ``step()`` requires a
            closure (``TypeError``: they need the whole parameter vector);
            ``optimizer_class=`` (ZeroRedundancyOptimizer's name) works too.
        process_group: the ranks to shard across (default: the default group).
        parameters_as_bucket_view: accepted for ZeroRedundancyOptimizer's calls; no effect:
            trainable parameters always become bucket views (below), as its ``True`` makes them.
        overlap_with_ddp: ZeroRedundancyOptimizer's; ``True`` raises ``NotImplementedError``
            (the step here already overlaps its broadcasts; ZeRO-2 is ``shard_gradients``).
        shard_gradients: ZeRO-2. The parameters' :class:`~torch_flashsys.BucketedDDP` (built
            first, over the same process group) then reduces each gradient only to the rank that
            owns the parameter, instead of all-reducing it: after each backward a rank holds the
            averaged gradients of its own parameters and ``grad is None`` for the others, so
            gradient memory drops to about ``1 / world_size``. Clip gradients with
            :meth:`clip_grad_norm_` (it sums over ranks), not ``torch.nn.utils.clip_grad_norm_``.
            A non-finite gradient shows on every rank (NaN where another rank owns it), so
            ``torch.amp.GradScaler`` skips the step on all ranks together.
        **kwargs: passed to ``optimizer_cls`` (``lr=...``, ``betas=...``).

    Trainable parameters become views into per-(device, dtype, owner) flat buffers (their values,
    shapes and identities are unchanged; non-contiguous ones become contiguous). ``.optim`` is
    this rank's local optimizer and ``.optim.state`` its part of the state; ``.state`` of this
    object stays empty, as in torch's ZeroRedundancyOptimizer.

    Checkpoints: ``consolidate_state_dict(to=0)`` on every rank, then ``state_dict()`` on rank 0
    gives the plain ``optimizer_cls`` format (CPU tensors); ``load_state_dict`` takes that format
    on every rank. ``sharded_state_dict()`` / ``load_sharded_state_dict()`` save and load each
    rank's shard without gathering.

    Uneven inputs: ``with Join([model, optimizer]):`` (``torch.distributed.algorithms.Join``, the
    model first), as with torch's ZeroRedundancyOptimizer: a rank that ran out of batches still
    steps its shard and sends it, each time the others step.

    Example:
        >>> model = BucketedDDP(net)          # or torch.nn.parallel.DistributedDataParallel(net)
        >>> opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        >>> # ZeRO-2 (BucketedDDP only): ShardedOptimizer(..., shard_gradients=True, lr=1e-3)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(
        self,
        params: ParamsT,
        optimizer_cls: type[torch.optim.Optimizer] | None = None,
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        optimizer_class: type[torch.optim.Optimizer] | None = None,
        shard_gradients: bool = False,
        **kwargs: Any,
    ) -> None:
        optimizer_cls = _optimizer_class(optimizer_cls, optimizer_class)
        _check_zero_flags(shard_gradients, parameters_as_bucket_view, overlap_with_ddp)
        self._set_process_group(process_group)
        self._ready = False  # add_param_group only collects groups until __init__ is done
        self._optimizer_cls = optimizer_cls
        super().__init__(_param_list(params), dict(kwargs))
        self._params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._index = {p: i for i, p in enumerate(self._params)}
        self._loads = [[0] * self.world_size, [0] * self.world_size]  # trainable, frozen bytes
        self._owners = [r for g in self.param_groups for r in self._assign(g["params"])]
        problem = self._build_local_optimizer(kwargs)
        self.shard_gradients = shard_gradients
        reducer, reducer_problem = (
            find_reducer(self._params, self._index, self._global_ranks)
            if shard_gradients
            else (None, None)
        )
        self._verify_construction(problem, reducer_problem, kwargs)
        # Built-in optimizers update each parameter on its own, so the step can go chunk by
        # chunk with each chunk's broadcast overlapping the next chunk's step.
        self._pipelined = optimizer_cls.__module__.startswith("torch.optim.")
        self._buckets: list[ParamBucket] = []
        self._rebuild_buckets()
        self._consolidated: tuple[int, State | None] | None = None
        if reducer is not None:
            reduce_to_owners(reducer, self._owners, self._index)
        Joinable.__init__(self)  # _join_config: outside a Join context
        self._ready = True

    def _set_process_group(self, process_group: dist.ProcessGroup | None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ShardedOptimizer: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() on every rank before constructing it"
            )
        check_process_group("ShardedOptimizer", process_group)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self._global_ranks = [
            dist.get_global_rank(self.process_group, r) for r in range(self.world_size)
        ]

    def _build_local_optimizer(self, kwargs: dict[str, Any]) -> Exception | None:
        """``self.optim``: ``optimizer_cls`` over this rank's shard of each group; or the
        exception saying why not (raised after the cross-rank check, so that every rank does)."""
        unshardable = _unshardable(self._optimizer_cls)
        if unshardable is not None:
            return TypeError(unshardable)
        try:
            self.optim = self._optimizer_cls(
                [self._local_group(g) for g in self.param_groups], **kwargs
            )
        except (TypeError, ValueError) as exc:
            return exc
        self.defaults = dict(self.optim.defaults)  # add_param_group: the same values
        self._pull_hyperparams()
        return None

    def _verify_construction(
        self, problem: Exception | None, reducer_problem: str | None, kwargs: dict[str, Any]
    ) -> None:
        """Compare the parameters, options and outcome across ranks, then raise any problem on
        every rank together. A rank whose optimizer_cls raised still takes part, so the others
        do not hang."""
        status = "ok" if problem is None else f"{type(problem).__name__}: {problem}"
        # the rule broken, not its rank-specific details (those go in the error)
        zero2 = f"{self.shard_gradients} {(reducer_problem or 'ok').split(';')[0]}"
        verify_same_across_ranks(
            "ShardedOptimizer",
            [
                *self._describe(0),
                ("constructing optimizer_cls", status),
                ("shard_gradients", zero2),
            ],
            self.process_group,
            what="the parameters, param groups or optimizer options",
        )
        unshardable = _unshardable(self._optimizer_cls)
        if unshardable is not None:
            raise TypeError(unshardable)
        if problem is not None:
            raise type(problem)(
                f"ShardedOptimizer: {self._optimizer_cls.__name__} rejected its arguments "
                f"{kwargs}: {problem}"
            ) from problem
        if reducer_problem is not None:
            raise ValueError(f"ShardedOptimizer: shard_gradients=True needs {reducer_problem}")

    # ----------------------------------------------------------------- partition and groups
    def _assign(self, params: list[torch.Tensor]) -> list[int]:
        sizes = [p.numel() * p.element_size() for p in params]
        return assign_owners(sizes, [p.requires_grad for p in params], self._loads)

    def _owned(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        return [p for p in params if self._owners[self._index[p]] == self.rank]

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        local = _hyper(group)
        local["params"] = self._owned(group["params"])
        return local

    def _describe(self, first_group: int) -> list[tuple[str, str]]:
        """What every rank must agree on: optimizer class, group options, parameter layout."""
        cls = self._optimizer_cls
        items = [("optimizer_cls", f"{cls.__module__}.{cls.__qualname__}")]
        named = []
        for gi in range(first_group, len(self.param_groups)):
            group = self.param_groups[gi]
            options = repr(sorted(_hyper(group).items()))
            items.append((f"param group {gi} options", re.sub(r" at 0x[0-9a-f]+", "", options)))
            devices = sorted({p.device.type for p in group["params"]})
            items.append((f"param group {gi} device types", repr(devices)))
            named += [(f"group {gi} param {j}", p) for j, p in enumerate(group["params"])]
        return items + describe_tensors(named, kind="parameter")

    def _pull_hyperparams(self) -> None:
        """Copy the local optimizer's hyperparameters (its defaults filled in) to ``param_groups``."""
        for group, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            group.update(_hyper(local))

    def _push_hyperparams(self) -> None:
        """Copy hyperparameters set on ``param_groups`` (e.g. by LR schedulers) to ``.optim``."""
        for group, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            local.update(_hyper(group))

    def _current_layout(self) -> list[tuple[bool, torch.dtype]]:
        return [(p.requires_grad, p.dtype) for p in self._params]

    @staticmethod
    def _layout_items(layout: list[tuple[bool, torch.dtype]]) -> list[tuple[str, str]]:
        return [
            (f"parameter {i}", f"requires_grad={rg} dtype={dt}")
            for i, (rg, dt) in enumerate(layout)
        ]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its parameters are sharded too.

        A collective once the optimizer is built: call it on every rank with the same group.
        Their gradients must be the same on every rank: a layer frozen when the model was wrapped
        by BucketedDDP (or torch DDP) and unfrozen later is not synchronized by the wrapper.
        """
        if not isinstance(param_group, dict):
            raise TypeError(
                f"ShardedOptimizer.add_param_group: param_group must be a dict, got "
                f"{type(param_group).__name__}"
            )
        params = param_group.get("params")
        if isinstance(params, Iterable) and not isinstance(params, (torch.Tensor, set)):
            param_group["params"] = params = list(params)
            tensors = [p[1] if isinstance(p, tuple) else p for p in params]
            if len({id(p) for p in tensors}) != len(tensors):
                raise ValueError(
                    f"ShardedOptimizer: param group {len(self.param_groups)} lists a parameter "
                    "more than once (pass tied parameters once)"
                )
            if self._ready and any(p in self._index for p in tensors):
                raise ValueError(
                    "ShardedOptimizer.add_param_group: some parameters are already in another "
                    "param group of this optimizer"
                )
        super().add_param_group(param_group)
        if not self._ready:
            return
        group = self.param_groups[-1]
        try:
            verify_same_across_ranks(
                "ShardedOptimizer.add_param_group",
                self._describe(len(self.param_groups) - 1),
                self.process_group,
                what="the added param group",
            )
        except RuntimeError:
            self.param_groups.pop()
            raise
        new = list(group["params"])
        self._index.update({p: len(self._params) + i for i, p in enumerate(new)})
        self._params += new
        self._owners += self._assign(new)
        self.optim.add_param_group(self._local_group(group))
        group.update(_hyper(self.optim.param_groups[-1]))  # anything the local one filled in
        self._rebuild_buckets()

    def _rebuild_buckets(self) -> None:
        self._layout = self._current_layout()
        self._layout_sig = signature(self._layout_items(self._layout))
        self._consolidated = None
        if self.world_size == 1:  # every parameter is this rank's: nothing to exchange
            return
        chunk_bytes = chunk_bytes_for(self._loads[0]) if self._pipelined else None
        self._buckets = build_buckets(self._params, self._owners, self._buckets, chunk_bytes)
        # Per chunk: this rank's parameters of it, per local param group (what .optim steps).
        mine = {p for b in self._buckets if b.owner == self.rank for p in b.params}
        chunk_of = {p: b.chunk for b in self._buckets for p in b.params}
        self._chunks: list[tuple[list[list[torch.Tensor]], list[ParamBucket]]] = []
        for c in sorted({b.chunk for b in self._buckets}):
            per_group = [
                [p for p in local["params"] if p in mine and chunk_of[p] == c]
                for local in self.optim.param_groups
            ]
            self._chunks.append((per_group, [b for b in self._buckets if b.chunk == c]))

    # ----------------------------------------------------------------- step
    def _check_buckets(self) -> None:
        """Rebuild the buckets if trainability or dtypes changed, or a view was replaced.

        Every step checks that every rank has the same layout (``requires_grad`` and dtype of
        each parameter) before the first collective that depends on it, since it decides which
        parameters are bucketed and broadcast: one all-reduce of two int64, whose signature is
        recomputed only when this rank's layout changed. A difference raises on every rank."""
        if self.world_size == 1:
            return
        layout = self._current_layout()
        changed = layout != self._layout
        sig = signature(self._layout_items(layout)) if changed else self._layout_sig
        what = "the all-reduce of the parameter layout signature (requires_grad and dtypes)"
        verify_signature(
            "ShardedOptimizer.step",
            sig,
            lambda: self._layout_items(layout),
            self.process_group,
            what="which parameters are trainable (requires_grad), or their dtypes,",
            guard=lambda fn: self._guard(what, fn),
        )
        if changed or not all(b.intact() for b in self._buckets):
            self._rebuild_buckets()

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        """Update this rank's shard with ``.optim``, then receive every other rank's shard.

        closure: re-evaluates the model and returns the loss; the local optimizer calls it as the
        plain one would (once per step for SGD/Adam, on every rank). kwargs go to
        ``.optim.step``. Returns what the local optimizer returns (the closure's loss).

        With a ``torch.optim`` optimizer, no closure and no kwargs, the shard is stepped chunk by
        chunk (``.optim.step()`` once per chunk, on that chunk's parameters), each chunk's
        broadcast starting as soon as it is stepped, so the exchange overlaps the step.
        """
        if self._join_config.enable:
            Join.notify_join_context(self)
            check_model_joins(self._params)
            self._guard(
                "the all-reduce of the hyperparameters (Join)",
                lambda: sync_hyperparameters(self.param_groups, self.process_group, False),
            )
        return self._step(closure, **kwargs)

    def _step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        self._consolidated = None
        self._push_hyperparams()
        # Optimizers with a closure-less step(self) still work when no closure is given.
        step_kwargs = kwargs if closure is None else {"closure": closure, **kwargs}
        if self.world_size == 1:
            return self.optim.step(**step_kwargs)
        self._check_buckets()
        group, ranks = self.process_group, self._global_ranks
        if step_kwargs or not self._pipelined or len(self._chunks) < 2:
            loss = self.optim.step(**step_kwargs)
            handles = broadcast_buckets(self._buckets, group, ranks)
        else:
            loss, handles = None, []
            for per_group, buckets in self._chunks:
                if any(per_group):
                    self._step_subset(per_group)
                handles += broadcast_buckets(buckets, group, ranks)
        for handle, bucket in zip(handles, self._buckets, strict=True):
            self._guard(
                f"the broadcast from rank {bucket.owner} of its updated parameters ("
                f"{len(bucket.params)} of dtype {bucket.buffer.dtype}, chunk {bucket.chunk})",
                handle.wait,
            )
        return loss

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; a failure is re-raised naming this rank and ``what`` (see ``_errors``)."""
        return guarded("ShardedOptimizer", what, self.process_group, fn)

    # ----------------------------------------------------------------- uneven inputs (Join)
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The ``Join`` hook: a joined rank steps its shard (with the gradients it has: the
        average of the others' when BucketedDDP shadows the backward) and sends it."""
        return OwnerJoinHook(main=self._join_shadow_step, post=self._join_done)

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _join_shadow_step(self) -> None:
        """Join's main hook on a joined rank: mirror one ``step()`` of the others, unless the
        BucketedDDP's shadowed forward did not synchronize (a ``no_sync()`` micro-batch)."""
        if shadow_skips_step(self._params):
            return
        self._guard(
            "the all-reduce of the hyperparameters (Join)",
            lambda: sync_hyperparameters(self.param_groups, self.process_group, True),
        )
        self._hooked_step()

    def _hooked_step(self) -> None:
        """``_step()`` between the step pre/post hooks, through torch's own
        ``Optimizer.profile_hook_step`` (what ``step()`` runs them with): a joined rank's shadow
        step is a step to them too (an EMA, a step counter), as torch's ZeroRedundancyOptimizer's
        join hook calls its ``step()``."""
        torch.optim.Optimizer.profile_hook_step(type(self)._step)(self)

    def _join_done(self, is_last_joiner: bool) -> None:
        """Join's post hook: back to the plain ``step()``."""
        self._join_config = disabled()

    def _step_subset(self, per_group: list[list[torch.Tensor]]) -> None:
        """``.optim.step()`` restricted to ``per_group[i]`` of each local param group."""
        groups = self.optim.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, per_group, strict=True):
                g["params"] = params
            self.optim.step()
        finally:
            for g, params in zip(groups, saved, strict=True):
                g["params"] = params

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over all of this optimizer's parameters, for sharded
        gradients: each rank takes the norm of its own parameters' gradients, one all-reduce
        combines them, and every gradient present is scaled. Call it on every rank (a
        collective), after the backward and before ``step()``. Returns the total norm (computed in
        float64, returned in the gradients' promoted dtype, as torch's).

        Needed with ``shard_gradients=True``, where each rank holds only its own gradients; with
        ZeRO-1 it gives the same result as ``torch.nn.utils.clip_grad_norm_``. ``foreach`` as
        torch's: the multi-tensor kernels (``None``: for CUDA gradients) or a loop.
        """
        owned = [p for p, r in zip(self._params, self._owners, strict=True) if r == self.rank]
        return clip_grad_norm(
            owned, self._params, max_norm, norm_type, error_if_nonfinite, self.process_group,
            foreach,
        )  # fmt: skip

    # ----------------------------------------------------------------- checkpoints
    def _packed_groups(self) -> list[dict[str, Any]]:
        """``param_groups`` with parameters replaced by global indices (the plain format)."""
        packed = []
        for group in self.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = [self._index[p] for p in group["params"]]
            packed.append(entry)
        return packed

    def _local_states(self) -> State:
        state = self.optim.state
        return {
            self._index[p]: state[p]
            for p in self._params
            if self._owners[self._index[p]] == self.rank and state.get(p)
        }

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (CPU tensors). Call on every rank.

        Then ``state_dict()`` on rank ``to`` returns it in the plain ``optimizer_cls`` format.
        """
        verify_same_across_ranks(
            "ShardedOptimizer.consolidate_state_dict",
            [("to", repr(to))],
            self.process_group,
            what="the argument `to`",
        )
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(
                f"ShardedOptimizer.consolidate_state_dict: to must be a rank in "
                f"[0, {self.world_size}) of the process group, got {to!r}"
            )
        self._push_hyperparams()
        merged = gather_states(self._local_states(), to, self.process_group, self._global_ranks)
        self._consolidated = (to, merged)

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state in the plain ``optimizer_cls.state_dict()`` format.

        Only on the rank given to the latest ``consolidate_state_dict`` (with no ``step``,
        ``add_param_group`` or load since). Tensors are on the CPU; a plain ``optimizer_cls``
        over the same parameters loads it (``load_state_dict`` moves them to the parameters).
        """
        if self._consolidated is None:
            raise RuntimeError(
                "ShardedOptimizer.state_dict: the optimizer state has not been consolidated on "
                f"this rank since the last step. Call consolidate_state_dict(to={self.rank}) on "
                "all ranks beforehand if you meant to save the global state, or save "
                "sharded_state_dict() on every rank (no gathering)"
            )
        to, merged = self._consolidated
        if merged is None:
            raise RuntimeError(
                f"ShardedOptimizer.state_dict: the state was consolidated to rank {to}, not this "
                f"rank ({self.rank}); call state_dict() on rank {to}, or consolidate_state_dict("
                f"to={self.rank}) on all ranks first"
            )
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = {
            "state": {i: dict(s) for i, s in merged.items()},
            "param_groups": self._packed_groups(),
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = post_hook(self, state_dict) or state_dict
        return state_dict

    def _load_local(self, state: Any, saved_groups: list[dict[str, Any]]) -> None:
        """Load this rank's part of a plain-format ``state``/``saved_groups`` into ``.optim``."""
        local_state, local_groups, j = {}, [], 0
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            indices = []
            for p in self._owned(group["params"]):
                i = self._index[p]
                if i in state:
                    local_state[j] = {
                        k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                        for k, v in state[i].items()
                    }
                indices.append(j)
                j += 1
            local_groups.append({**_hyper(saved), "params": indices})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        # What the local optimizer made of them (its __setstate__: AdamW keeps
        # decoupled_weight_decay=True under an Adam checkpoint, as a plain AdamW does)
        self._pull_hyperparams()
        self._consolidated = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain-format state dict (from ``state_dict()`` or a plain ``optimizer_cls``).

        Call on every rank with the same dict; each rank keeps only its shard. No collectives.
        The hooks of ``register_load_state_dict_pre_hook`` (which may return a replacement
        dict) and ``register_load_state_dict_post_hook`` run as in a plain optimizer.
        """
        caller = "ShardedOptimizer.load_state_dict"
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # as torch's: a pre-hook may edit the copy
            for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
                replaced = pre_hook(self, state_dict)
                state_dict = state_dict if replaced is None else replaced
        if isinstance(state_dict, dict) and "shard" in state_dict:
            raise ValueError(
                f"{caller}: this is one rank's shard from sharded_state_dict(); load it with "
                "load_sharded_state_dict()"
            )
        sizes = [len(g["params"]) for g in self.param_groups]
        state, groups = check_plain_format(caller, state_dict, sizes)
        self._load_local(state, groups)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _shard_layout(self) -> list[str]:
        return [f"{tuple(p.shape)} {p.dtype}" for p in self._params]

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard: no gathering, no collectives (save one file per rank).

        Format: the plain one restricted to this rank's state (``"state"`` keyed by global
        parameter index, all ``"param_groups"``), plus ``"shard"``: ``{"rank", "world_size",
        "owners" (owner rank of each parameter index), "params" (shape and dtype of each)}``.
        Like ``torch.optim.Optimizer.state_dict()``, it references the live state tensors.
        """
        return {
            "state": self._local_states(),
            "param_groups": self._packed_groups(),
            "shard": {
                "rank": self.rank,
                "world_size": self.world_size,
                "owners": list(self._owners),
                "params": self._shard_layout(),
            },
        }

    def _shard_problem(self, shard_dict: Any) -> tuple[str, str] | None:
        """What is wrong with ``shard_dict`` for this rank, as (the rule broken, without
        rank-specific values: compared across ranks; the message for this rank), or None."""
        if not isinstance(shard_dict, dict) or "shard" not in shard_dict:
            return _same("expected a dict from sharded_state_dict() (with a 'shard' entry)")
        meta = shard_dict["shard"]
        saved_world, saved_rank = meta.get("world_size"), meta.get("rank")
        if saved_world != self.world_size:
            return _same(
                f"this shard was saved at world size {saved_world}, this optimizer runs at "
                f"world size {self.world_size}; a sharded checkpoint loads only at the world "
                "size it was saved at: to change it, save the consolidated state "
                "(consolidate_state_dict(to=0) on every rank, state_dict() on rank 0) and "
                "load_state_dict() it on every rank"
            )
        if saved_rank != self.rank:
            return (
                "this shard was saved by another rank: each rank must load the shard it saved",
                f"this shard was saved by rank {saved_rank} of {saved_world}, this is rank "
                f"{self.rank}: each rank must load the shard it saved",
            )
        if meta.get("params") != self._shard_layout() or meta.get("owners") != self._owners:
            return _same(
                "the shard was saved for different parameters (shapes, dtypes, order or "
                "partition); build the optimizer over the same parameters and param groups"
            )
        try:
            state, _ = check_plain_format(
                "", shard_dict, [len(g["params"]) for g in self.param_groups]
            )
        except (TypeError, ValueError) as exc:
            return _same(str(exc).lstrip(": "))
        if any(self._owners[i] != self.rank for i in state):
            return _same("the shard holds state for parameters this rank does not own")
        return None

    def load_sharded_state_dict(self, shard_dict: dict[str, Any]) -> None:
        """Load this rank's shard saved by ``sharded_state_dict()``. Call on every rank.

        A collective (one small all-gather), so that a wrong file on any rank raises the same
        error on every rank instead of hanging the next step.
        """
        caller = "ShardedOptimizer.load_sharded_state_dict"
        problem = self._shard_problem(shard_dict)
        verify_same_across_ranks(
            caller,
            [("shard", problem[0] if problem else "ok")],
            self.process_group,
            what="the loaded shard",
        )
        if problem is not None:
            raise ValueError(f"{caller}: {problem[1]}")
        self._load_local(shard_dict["state"], shard_dict["param_groups"])
