"""BucketedDDP: data parallelism with bucketed, overlapped gradient all-reduce."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils._pytree import tree_map_only

from torch_flashsys.distributed._buckets import broadcast_coalesced
from torch_flashsys.distributed._comm_hook import hook_name, hook_problem
from torch_flashsys.distributed._ddp_args import (
    COMPRESSION,
    DEFAULT_BUCKET_MB,
    Options,
    Problem,
    resolve,
)
from torch_flashsys.distributed._join import (
    GroupJoinable,
    JoinState,
    OwnerJoinHook,
    disabled,
    exchange_join_state,
    last_joiner,
)
from torch_flashsys.distributed._reducer import GradientReducer, reducer_of, remove_hooks
from torch_flashsys.distributed._sparse import sparse_gradient_params
from torch_flashsys.distributed._verify import (
    check_bools,
    check_process_group,
    describe_tensors,
    verify_same_across_ranks,
)


def _double_wrap_problem(
    module: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]]
) -> Problem | None:
    """Why wrapping ``module`` would synchronize some gradient twice, or None: it is, or holds, a
    data-parallel wrapper, or a parameter of it is already synchronized by another live
    BucketedDDP (the same module wrapped twice, shared parameters). Averaging twice does not give
    the average: the wrappers' gradient buffers interfere (e.g. exactly half the true average),
    and the ranks agree, so nothing else would show it."""
    for name, sub in module.named_modules():
        if isinstance(sub, (BucketedDDP, TorchDDP)):
            kind = type(sub).__name__
            where = "module is already" if not name else f"submodule {name!r} is"
            message = (
                f"BucketedDDP: {where} a {kind}; its parameters would be synchronized twice, "
                "which gives wrong gradients; wrap the model itself once (for a wrapper w, its "
                "model is w.module), with no data-parallel wrapper inside"
            )
            return Problem(RuntimeError, message, message)
    for name, p in named:
        if reducer_of(p) is not None:
            message = (
                f"BucketedDDP: parameter {name!r} is already synchronized by another BucketedDDP "
                "(the same module wrapped twice, or modules that share parameters); a gradient "
                "averaged by two wrappers is wrong: use the existing wrapper, or delete it first"
            )
            return Problem(RuntimeError, message, message)
    return None


def _ignore_problem(module: torch.nn.Module) -> Problem | None:
    """torch DDP's private ``DDP._set_params_and_buffers_to_ignore_for_model(module, names)``
    sets ``module._ddp_params_and_buffers_to_ignore``; torch DDP then neither synchronizes nor
    broadcasts those. Not supported here: refused rather than silently synchronized."""
    names = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
    if names is None:
        return None
    shown = sorted(map(str, names))
    more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
    rule = (
        "BucketedDDP: module._ddp_params_and_buffers_to_ignore is set "
        "(DistributedDataParallel._set_params_and_buffers_to_ignore_for_model); ignoring "
        "parameters and buffers is not supported: they would be synchronized and broadcast. "
        "Wrap only the submodule to synchronize, or delete the attribute"
    )
    message = rule.replace("is set (", f"is set ({shown[:5]}{more}; ", 1)
    return Problem(NotImplementedError, message, rule)


def _graph_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output (nested in tuples, lists, dicts, dataclasses such as
    Hugging Face's ModelOutput) that a backward can pass through: those with a ``grad_fn``
    (a parameter or input returned as is is not marked)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [output]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None:
                found.append(obj)
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
    return found


def _outside_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly when ``torch.compile`` traces a caller (``torch.compile(BucketedDDP(m))``):
    the wrapper's bookkeeping (locks, collectives, hooks on the outputs, Python state) stays out
    of the graph, Dynamo breaks the graph around it as around torch DDP's, and its guards do not
    depend on the wrapper's state (``no_sync()``, buffer broadcasts): no recompile when that
    changes. Outside compilation ``fn`` is called as is (torch._dynamo is imported only by a
    compile, about 1 s)."""
    skipped = torch._disable_dynamo(fn, recursive=True)  # imports torch._dynamo when first called

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return skipped(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def _check_can_wrap(module: Any, process_group: Any) -> None:
    """The checks that need no collective: a module, an initialized torch.distributed, a group
    this process belongs to."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"BucketedDDP: module must be a torch.nn.Module, got {type(module)}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "BucketedDDP: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (torchrun sets its environment)"
        )
    check_process_group("BucketedDDP", process_group)


class _TorchDDPGuard:
    """Forward pre-hook on the wrapped module: refuses to run inside a torch DDP forward that
    synchronizes the same parameters (``DDP(BucketedDDP(m))``, or ``DDP(m)`` beside
    ``BucketedDDP(m)``), which torch DDP's constructor cannot be stopped from building. Holds
    the wrapper's check weakly; a copied or pickled module gets a guard that does nothing."""

    def __init__(self, refuse: weakref.WeakMethod) -> None:
        self.refuse = refuse  # the wrapper's: raises if a torch DDP shares its parameters

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        active = TorchDDP._active_ddp_module  # set during a torch DDP forward
        if active is not None and (refuse := self.refuse()) is not None:
            refuse(active)

    def __reduce__(self) -> tuple:
        return (_noop_hook, ())  # unpickled (or deep-copied) as the no-op hook


def _ignore(*args: Any) -> None:
    return None


def _noop_hook() -> Callable[..., None]:
    return _ignore


class BucketedDDP(torch.nn.Module, GroupJoinable):
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
            Parameters and buffers are then broadcast from the group's rank 0. Wrap a module
            once: a module that is or holds a BucketedDDP or torch DDP, or whose parameters a
            live BucketedDDP already synchronizes, raises ``RuntimeError`` (as does running it
            inside a torch DDP forward over the same parameters).
        bucket_size_mb: gradient MiB at which a bucket closes (torch DDP's ``bucket_cap_mb``
            rule: a bucket takes parameters until it holds at least this much); ``None``: one
            bucket per dtype; ``0``: one parameter per bucket.
        process_group: group to average over (default: the whole world).
        broadcast_buffers: broadcast buffers (e.g. BatchNorm statistics) from rank 0 at
            construction and at the start of each forward that follows a synchronizing forward,
            as torch DDP does; ``False``: buffers stay rank-local (never broadcast); ``None``
            (torch 2.13's default): ``True``.
        grad_compression: ``"bf16"`` / ``"fp16"``: all-reduce a low-precision copy of each bucket
            and write the average back (torch DDP's compression hooks); ``None``: full precision.

    torch DDP's other constructor arguments are accepted, so that its calls swap unchanged
    (docs/migration.md lists each): ``device_ids`` (``None``, or ``[the device holding the
    module]``: inputs are then moved there before the forward, as torch DDP does),
    ``output_device`` (``None`` or that device), ``init_sync`` (``False``: nothing is broadcast
    at construction; the cross-rank check still runs), ``bucket_cap_mb`` (``bucket_size_mb``
    under torch's name; ``None``: 25), ``forward_sync_buffers`` (torch 2.13: whether forwards
    and ``join()`` broadcast buffers; construction then always does). ``dim``,
    ``find_unused_parameters``, ``check_reduction``, ``gradient_as_bucket_view``,
    ``static_graph``, ``skip_all_reduce_unused_params`` and ``batched_grad_copy`` change
    nothing here (``_ddp_args.NO_OPS`` says why); ``delay_all_reduce_named_params``,
    ``param_to_hook_all_reduce``, ``mixed_precision``, ``device_mesh`` and
    ``bucket_cap_mb_list`` raise ``NotImplementedError`` unless ``None``. Pass them by keyword
    (the second positional argument is ``bucket_size_mb``, torch's is ``device_ids``).

    Each ``param.grad`` is a view into its bucket's flat buffer (no extra gradient memory); a
    forward that finds every ``grad`` ``None`` (after ``zero_grad()``) frees those buffers for
    the activations, and the backward allocates them again (docs/ddp.md). The
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
        bucket_size_mb: float | None = DEFAULT_BUCKET_MB,
        *,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool | None = True,
        grad_compression: str | None = None,
        # torch DDP's other arguments (see the class docstring)
        device_ids: Sequence[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
        init_sync: bool = True,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Any = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        super().__init__()
        _check_can_wrap(module, process_group)
        torch_args = {
            "device_ids": device_ids,
            "output_device": output_device,
            "dim": dim,
            "broadcast_buffers": broadcast_buffers,
            "init_sync": init_sync,
            "bucket_cap_mb": bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters,
            "check_reduction": check_reduction,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "delay_all_reduce_named_params": delay_all_reduce_named_params,
            "param_to_hook_all_reduce": param_to_hook_all_reduce,
            "mixed_precision": mixed_precision,
            "device_mesh": device_mesh,
            "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
            "bucket_cap_mb_list": bucket_cap_mb_list,
            "batched_grad_copy": batched_grad_copy,
            "forward_sync_buffers": forward_sync_buffers,
        }
        options, problem = resolve(module, bucket_size_mb, grad_compression, torch_args)
        self.module = module
        self.process_group = process_group
        self.bucket_size_mb = options.bucket_size_mb
        self.broadcast_buffers = options.forward_buffers  # torch DDP's forward_sync_buffers
        self.grad_compression = grad_compression
        self._input_device = options.input_device
        self._world = dist.get_world_size(process_group)
        self._group = process_group if process_group is not None else dist.group.WORLD
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        self._reducer = self._build_reducer(options, problem)
        self._no_sync = False  # inside no_sync()
        self._sync_buffers_next = True  # torch DDP's require_forward_param_sync
        self._divide_by_initial = True  # join(): divide by the world size, not the ranks left
        self._install_torch_ddp_guard()
        Joinable.__init__(self)  # _join_config: outside a Join context

    def _build_reducer(self, options: Options, problem: Problem | None) -> GradientReducer:
        """Check the module across ranks (raising any argument ``problem`` on every rank
        together), broadcast it (``init_sync``), and build the reducer of its trainable
        parameters."""
        named = list(self.module.named_parameters())
        problem = (
            problem or _ignore_problem(self.module) or _double_wrap_problem(self.module, named)
        )
        sparse_ids = sparse_gradient_params(self.module)
        self._verify_and_sync(named, sparse_ids, options, problem)
        return self._new_reducer(named, sparse_ids)

    def _new_reducer(
        self, named: list[tuple[str, torch.nn.Parameter]], sparse_ids: set[int]
    ) -> GradientReducer:
        """The reducer of the trainable ones of ``named`` (no collective)."""
        trainable = [(name, p) for name, p in named if p.requires_grad]
        compression = self.grad_compression
        return GradientReducer(
            [p for _, p in trainable],
            [name for name, _ in trainable],
            [id(p) in sparse_ids for _, p in trainable],
            None if self.bucket_size_mb is None else int(self.bucket_size_mb * 2**20),
            self.process_group,
            COMPRESSION.get(compression) if compression else None,
        )

    # Copies (copy.deepcopy, pickle, torch.optim.swa_utils.AveragedModel), as torch DDP: the
    # process group and the reducer are not copied; the copy gets a reducer of its own over the
    # copied module's parameters, on the default process group.

    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not None:
            raise RuntimeError(
                "BucketedDDP: only a wrapper over the default process group can be copied or "
                "pickled (as torch DDP: the copy is rebuilt on the default group); this one has "
                f"process_group={self.process_group!r}; copy its .module instead"
            )
        state = dict(self.__dict__)
        for key in ("process_group", "_group", "_reducer", "_torch_ddp_ok"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The copy: the wrapper's settings, the copied module, a new reducer (no collective:
        a copy may be made on one rank only; the module is not checked across ranks or
        broadcast again), the default process group. A communication hook, ZeRO-2 sharding
        and the Join state are not copied (torch DDP's copy drops its hook too)."""
        super().__setstate__(state)
        self.process_group = None
        self._group = dist.group.WORLD
        self._reducer = self._new_reducer(
            list(self.module.named_parameters()), sparse_gradient_params(self.module)
        )
        self._install_torch_ddp_guard()

    def _install_torch_ddp_guard(self) -> None:
        """The forward pre-hook that refuses a torch DDP over the same parameters; it goes with
        this wrapper."""
        self._torch_ddp_ok: weakref.WeakSet = weakref.WeakSet()  # torch DDPs seen not to overlap
        guard = _TorchDDPGuard(weakref.WeakMethod(self._refuse_torch_ddp))
        weakref.finalize(self, remove_hooks, [self.module.register_forward_pre_hook(guard)])

    @property
    def _prepoint(self) -> bool:
        """Whether grads are pointed at their bucket views before the backward accumulates into
        them; ``False`` takes the copy path (benchmarks/ddp.py and the tests compare the two)."""
        return self._reducer.prepoint

    @_prepoint.setter
    def _prepoint(self, value: bool) -> None:
        self._reducer.prepoint = value

    @property
    def _join_config(self) -> _JoinConfig:
        """Torch's ``Joinable`` protocol: set by ``Join``. Kept by the reducer, whose ZeRO-2
        optimizer's join hook must know whether this wrapper joins too."""
        return self._reducer.join_config

    @_join_config.setter
    def _join_config(self, config: _JoinConfig) -> None:
        self._reducer.join_config = config

    def _verify_and_sync(
        self,
        named: list[tuple[str, torch.nn.Parameter]],
        sparse_ids: set[int],
        options: Options,
        problem: Problem | None,
    ) -> None:
        """The cross-rank check, then (``init_sync``) rank 0's parameters and buffers to all.

        Argument problems go through the check too, as rules without rank-specific values
        (``device_ids=[rank]``): every rank then raises together instead of leaving the others
        hanging in the first collective."""
        module = self.module
        items = [("argument check", problem.rule if problem else "ok")]  # first: named first
        items += describe_tensors(named)
        if options.init_buffers or options.forward_buffers:  # broadcast: they must match too
            items += describe_tensors(module.named_buffers(), kind="buffer")

        def value(option: Any) -> str:  # with a problem the rule speaks for the options
            return repr(option) if problem is None else "see the argument check"

        items += [
            ("option bucket_size_mb", value(options.bucket_size_mb)),
            ("option init_sync", value(options.init_sync)),
            ("option buffers broadcast at construction", value(options.init_buffers)),
            ("option buffers broadcast before forwards", value(options.forward_buffers)),
            ("option grad_compression", value(self.grad_compression)),
            (
                "parameters with sparse gradients (nn.Embedding(sparse=True))",
                repr([i for i, (_, p) in enumerate(named) if id(p) in sparse_ids]),
            ),
        ]
        verify_same_across_ranks(
            "BucketedDDP", items, self.process_group, what="the wrapped module"
        )
        if problem:
            raise problem.kind(problem.message)
        if not any(p.requires_grad for _, p in named):  # same on every rank: verified above
            raise ValueError(
                "BucketedDDP: module has no parameter that requires a gradient; "
                "there is nothing to synchronize"
            )
        if options.init_sync:  # as torch DDP: broadcast_buffers=False leaves buffers rank-local
            states = [p.detach() for _, p in named]
            states += list(module.buffers()) if options.init_buffers else []
            broadcast_coalesced(states, self._src, self.process_group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call ``self.module(*inputs, **kwargs)`` (after broadcasting buffers, see the class).

        Under ``torch.compile`` of the wrapper only the module's call is traced; the wrapper's
        bookkeeping before and after it runs eagerly (:func:`_outside_graph`)."""
        inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        self._post_forward(output)
        return output

    @_outside_graph
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Before the module's forward: finish or refuse an unfinished backward, release idle
        buckets, move the inputs (``device_ids``), broadcast buffers, take the no_sync state."""
        reducer = self._reducer
        if reducer.bw.in_backward:
            reducer.unfinished_backward()
        reducer.release_idle()  # every grad None: the buckets' memory goes to the activations
        if self._input_device is not None:  # device_ids given: torch DDP moves the inputs
            inputs, kwargs = tree_map_only(
                torch.Tensor, lambda t: t.to(self._input_device), (inputs, kwargs)
            )
        if self._join_config.enable:
            self._join_forward()
        elif self._sync_buffers_next and self.broadcast_buffers and self._world > 1:
            self._broadcast_buffers(self._src)
        reducer.grad_sync = not self._no_sync
        self._sync_buffers_next = torch.is_grad_enabled() and reducer.grad_sync
        return inputs, kwargs

    @_outside_graph
    def _post_forward(self, output: Any) -> None:
        """After the module's forward: a backward through ``output`` synchronizes (see
        docs/ddp.md, "Which backwards synchronize")."""
        reducer = self._reducer
        if torch.is_grad_enabled():  # a forward without grad leaves the backward rule alone
            reducer.pending_sync = reducer.grad_sync
            if reducer.grad_sync:
                reducer.mark_outputs(_graph_tensors(output))

    def _refuse_torch_ddp(self, active: TorchDDP) -> None:
        """Raise if the torch DDP whose forward is running synchronizes our parameters too."""
        if active in self._torch_ddp_ok:
            return
        reducer = self._reducer
        ours = {id(p): name for p, name in zip(reducer.params, reducer.names, strict=True)}
        shared = [ours[id(p)] for p in active.parameters() if id(p) in ours]
        if not shared:
            self._torch_ddp_ok.add(active)
            return
        more = f" and {len(shared) - 3} more" if len(shared) > 3 else ""
        raise RuntimeError(
            "BucketedDDP: the wrapped module ran inside torch.nn.parallel.DistributedDataParallel, "
            f"which synchronizes the same parameters ({', '.join(map(repr, shared[:3]))}{more}): "
            "every gradient would be averaged by both wrappers, which gives wrong gradients; use "
            "one of the two"
        )

    def _broadcast_buffers(self, src: int) -> None:
        """Overwrite the buffers with global rank ``src``'s."""
        buffers = list(self.module.buffers())
        if buffers:
            with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                self._reducer.guard(
                    f"the broadcast of the buffers from global rank {src}",
                    lambda: broadcast_coalesced(buffers, src, self.process_group),
                )

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

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's attribute: whether the backwards of the next forwards synchronize
        (``False`` inside :meth:`no_sync`, which sets it). Settable, as in torch DDP: ``False``
        until set back to ``True`` is ``no_sync()`` without the context manager."""
        return not self._no_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(
                f"BucketedDDP.require_backward_grad_sync must be a bool, got {type(value).__name__}"
            )
        self._no_sync = not value

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
        caller, reducer = "BucketedDDP.register_comm_hook", self._reducer
        if reducer.comm_hook is not None:
            raise RuntimeError(
                f"{caller}: a communication hook is already registered "
                f"({hook_name(reducer.comm_hook[1])}); it can be registered only once"
            )
        if reducer.comm_checked:
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
        if reducer.owners is not None:
            raise ValueError(
                f"{caller}: not supported with ZeRO-2 (ShardedOptimizer(..., "
                "shard_gradients=True)), whose buckets are reduced to their owner ranks"
            )
        problem = hook_problem(hook, state, self._group)
        if problem is not None:
            raise problem[0](problem[1])
        reducer.comm_hook = (state, hook)

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
        check_bools(
            "BucketedDDP.join",
            {
                "divide_by_initial_world_size": divide_by_initial_world_size,
                "enable": enable,
                "throw_on_early_termination": throw_on_early_termination,
            },
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
        check_bools("BucketedDDP.join_hook", {"divide_by_initial_world_size": divide})
        self._divide_by_initial = divide
        return OwnerJoinHook(main=self._join_shadow, post=self._join_final_sync)

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self._group

    def finish_gradient_synchronization(self) -> None:
        """Wait until every bucket's reduction has finished and ``param.grad`` holds the average.

        The end of each synchronizing backward already does this (a callback queued on the
        autograd engine), so after ``loss.backward()`` this is a no-op; it is for code that needs
        the gradients before the backward call returns, or wants the wait explicit.
        """
        self._reducer.finish()

    def extra_repr(self) -> str:
        reducer = self._reducer
        hook = None if reducer.comm_hook is None else hook_name(reducer.comm_hook[1])
        return (
            f"bucket_size_mb={self.bucket_size_mb}, buckets={len(reducer.buckets)}, "
            f"world_size={self._world}, grad_compression={self.grad_compression}, "
            f"shard_gradients={reducer.owners is not None}, "
            f"sparse_params={sum(reducer.is_sparse)}, comm_hook={hook}"
        )

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
        self._reducer.divisor = self._join_divisor(state)
        if state.broadcast_buffers:
            self._broadcast_buffers(self._global_rank(state.source))

    def _join_exchange(self, sync: bool, bcast: bool, joined: bool) -> JoinState:
        what = "the all-reduce of the join state (Join / BucketedDDP.join)"
        return exchange_join_state(
            self._group,
            sync,
            bcast,
            joined,
            self._divide_by_initial,
            guard=lambda fn: self._reducer.guard(what, fn),
        )

    def _join_divisor(self, state: JoinState) -> int:
        """What this iteration's gradients are divided by under ``join()``: the world size, or
        (``divide_by_initial_world_size=False``) the ranks still training."""
        return self._world if self._divide_by_initial else state.active

    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def _join_shadow(self) -> None:
        """Join's main hook on a joined rank: mirror one forward and backward of the others."""
        state = self._join_exchange(False, False, joined=True)
        if state.broadcast_buffers:
            self._broadcast_buffers(self._global_rank(state.source))
        self._sync_buffers_next = self._reducer.join_synced = state.sync
        if state.sync:
            # The divisor of the ranks still training: its zeros change nothing, but every rank
            # must pass the same op to each collective (ReduceOp.AVG only at the world size).
            self._reducer.divisor = self._join_divisor(state)
            self._reducer.shadow_backward()

    def _join_final_sync(self, is_last_joiner: bool) -> None:
        """Join's post hook: every rank takes the model of the highest last-joining rank."""
        src = self._reducer.guard(
            "the agreement on the last joined rank (Join)",
            lambda: last_joiner(self._group, is_last_joiner),
        )
        states = [p.detach() for p in self.module.parameters()]
        if self.broadcast_buffers:
            states += list(self.module.buffers())
        self._reducer.guard(
            f"the broadcast of the final model from rank {src} (Join)",
            lambda: broadcast_coalesced(states, self._global_rank(src), self.process_group),
        )
        self._join_config = disabled()  # back to the plain forward
        self._reducer.divisor = self._world
