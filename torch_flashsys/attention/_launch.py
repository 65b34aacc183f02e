"""Kernel launches with no Python work after the first call for a key.

``triton.autotune``'d kernels cost tens of microseconds of CPU per launch (argument binding,
specialization, the autotuner's key, the grid callback). A training step calls attention a few
times per layer, so at small and medium shapes that host time, not the GPU, sets the pace.

:class:`LaunchCache` keeps, per *launch key*, the compiled kernel the first call produced (after
autotuning) together with its grid and constexpr values; later calls with the same key call the
compiled kernel's launcher directly, the way ``JITFunction.run`` itself ends. The launch key must
determine everything Triton derives from the arguments: shapes, strides and flags (spelled out by
the callers), and the device and 16-byte alignment of every pointer (added here). Anything unusual
(the interpreter, launch hooks registered by a profiler such as proton, a Triton whose compiled
kernel lacks the launcher fields) takes Triton's normal path, which is always correct.
``TORCH_FLASHSYS_FAST_LAUNCH=0`` forces that path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import torch_flashsys.attention._precompile as _precompile
from torch_flashsys.attention._backend import interpreter_active

_MAX_ENTRIES = 4096  # distinct (shape, stride, flag) combinations kept per kernel


def fast_launch_allowed() -> bool:
    return os.environ.get("TORCH_FLASHSYS_FAST_LAUNCH", "1") != "0" and not interpreter_active()


def _hook_active(hook: Any) -> bool:
    """A launch hook that would do something: newer Tritons keep an always-present HookChain."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _knobs_runtime() -> Any:
    try:
        from triton import knobs

        return knobs.runtime
    except (ImportError, AttributeError):  # an older Triton: no knobs module, no hooks to honour
        return None


_RUNTIME = _knobs_runtime()


def launch_hooks_set() -> bool:
    """A profiler (e.g. proton) registered launch hooks: Triton's path calls them, ours would not."""
    if _RUNTIME is None:
        return False
    return _hook_active(_RUNTIME.launch_enter_hook) or _hook_active(_RUNTIME.launch_exit_hook)


def pointer_alignment(ptrs: Sequence[int]) -> bool | tuple[bool, ...]:
    """What Triton specializes a kernel on about these pointers, for a launch key: True when
    all are 16-byte aligned (the common case, one cheap pass), else each one's alignment."""
    bits = 0
    for p in ptrs:
        bits |= p
    return not bits & 15 or tuple(p % 16 == 0 for p in ptrs)


def _jit_function(kernel: Any) -> Any:
    """The ``JITFunction`` under an ``Autotuner`` (or the function itself)."""
    while not hasattr(kernel, "arg_names") or hasattr(kernel, "configs"):
        kernel = kernel.fn
    return kernel


class LaunchCache:
    """Launch one Triton kernel; repeat launches for a known key go straight to the compiled kernel.

    ``args`` are the kernel's runtime arguments, in the kernel's parameter order, and must be all
    parameters before the constexprs, the first ``n_tensors`` of them tensors; ``constexprs`` are
    the constexpr values the caller passes (the autotuned ones come from the chosen config).
    ``hits`` counts fast launches (for tests).
    """

    def __init__(self, kernel: Any, n_tensors: int) -> None:
        self.kernel = kernel
        self.n_tensors = n_tensors
        self._fn = _jit_function(kernel)
        self._entries: dict[tuple, tuple] = {}
        self.hits = 0

    def __call__(
        self,
        key: Hashable,
        grid: Callable[[dict], tuple[int, ...]],
        args: Sequence[Any],
        constexprs: dict[str, Any],
    ) -> None:
        first = args[0]
        if first.is_cuda:
            index = first.get_device()
            if index == torch.cuda.current_device():
                # The device (function handles are per device) and each pointer's 16-byte
                # alignment (Triton specializes on it) complete the caller's key.
                n = self.n_tensors
                ptrs = [a.data_ptr() for a in args[:n]]
                key = (key, index, pointer_alignment(ptrs))
                entry = self._entries.get(key)
                if entry is not None and not launch_hooks_set():
                    run, function, packed, (g0, g1, g2), tail = entry
                    stream = torch._C._cuda_getCurrentRawStream(index)
                    # the tensors as their addresses: the launcher's C code takes an integer
                    # as is (a tensor costs it a data_ptr() call and a cuPointerGetAttribute)
                    run(g0, g1, g2, stream, function, packed, None, None, None, *ptrs, *args[n:],
                        *tail)  # fmt: skip
                    self.hits += 1
                    return
                with _precompile.foreground():
                    _precompile.claim(self.kernel, constexprs, args)  # (queued or compiling?)
                    compiled = self.kernel[grid](*args, **constexprs)
                if fast_launch_allowed():
                    self._remember(key, compiled, grid, args, constexprs)
                return
            with torch.cuda.device(index):  # Triton launches on the current device
                self.kernel[grid](*args, **constexprs)
                return
        self.kernel[grid](*args, **constexprs)

    def _remember(self, key, compiled, grid, args, constexprs) -> None:
        config = getattr(self.kernel, "best_config", None)
        meta = dict(constexprs)
        if config is not None:
            meta.update(config.kwargs)
        names = self._fn.arg_names
        tail_names = names[len(args) :]
        if not all(n in meta for n in tail_names):
            return  # not the parameter layout this cache expects: keep Triton's path
        run = getattr(compiled, "run", None)
        function = getattr(compiled, "function", None)
        packed = getattr(compiled, "packed_metadata", None)
        if run is None or function is None or packed is None:
            return
        g = tuple(grid(meta))
        g = (g + (1, 1))[:3]
        remember(self._entries, key, (run, function, packed, g, tuple(meta[n] for n in tail_names)))


def _async_compile_mode() -> Any:
    try:
        from triton.runtime import _async_compile

        return _async_compile
    except ImportError:  # a Triton without it: kernels compile one by one, as they are launched
        return None


_ASYNC = _async_compile_mode()


def compile_together(launches: Sequence[tuple[LaunchCache, Callable, Sequence[Any], dict]]) -> None:
    """Compile the kernels of launches about to be made at once, in threads (Triton's
    ``AsyncCompileMode``), so that one kernel's ptxas and LLVM steps (which release the GIL)
    overlap another's front end; the launches then find them compiled. ``launches``: ``(cache,
    grid, args, constexprs)`` as the :class:`LaunchCache` calls will get them.

    Best effort, for first calls only: nothing happens (each launch compiles its kernel itself)
    with ``TORCH_FLASHSYS_PARALLEL_COMPILE=0``, under the interpreter or the opt-in autotuner, on a
    Triton without the API, or while another asynchronous compile mode (e.g. Inductor's) is active.
    """
    if _ASYNC is None or os.environ.get("TORCH_FLASHSYS_PARALLEL_COMPILE", "1") == "0":
        return
    if interpreter_active() or _ASYNC.active_mode.get() is not None:
        return
    if any(hasattr(cache.kernel, "configs") for cache, *_ in launches):
        return  # the autotuner's warm-up would compile every config
    pool = ThreadPoolExecutor(len(launches), thread_name_prefix="torch_flashsys-compile")
    with _precompile.foreground(), pool, _ASYNC.AsyncCompileMode(pool):  # leaving: compiled
        for cache, grid, args, constexprs in launches:
            _precompile.claim(cache.kernel, constexprs, args)
            cache.kernel.warmup(*args, grid=grid, **constexprs)


class Plan:
    """What a launch wrapper computes once per launch key: the grid callback, the integer
    arguments the key determines and the constexprs. Hashes by identity, so a plan is a cheap
    :class:`LaunchCache` key (the wrapper's own key, shapes and strides, is hashed once per call)."""

    __slots__ = ("constexprs", "grid", "ints")

    def __init__(self, grid: Callable[[dict], tuple[int, ...]], ints: tuple, constexprs: dict):
        self.grid, self.ints, self.constexprs = grid, ints, constexprs


def remember(cache: dict, key: tuple, value: Any) -> None:
    """``cache[key] = value``, dropping the oldest entry past ``_MAX_ENTRIES`` (bounded memory)."""
    if len(cache) >= _MAX_ENTRIES:
        cache.pop(next(iter(cache)))
    cache[key] = value


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for ``dtype``, read from PyTorch's setting at call time.

    float32 follows ``torch.backends.cuda.matmul.allow_tf32`` /
    ``torch.set_float32_matmul_precision`` / ``torch.backends.cuda.matmul.fp32_precision``: full
    precision ("ieee") unless the user allowed TF32. 16-bit inputs ignore the setting.
    """
    if dtype != torch.float32:
        return "tf32"
    try:
        allowed = torch._C._get_cublas_allow_tf32()
    except RuntimeError:  # only the new fp32_precision API was used; the legacy getter refuses
        allowed = torch.backends.cuda.matmul.fp32_precision == "tf32"
    return "tf32" if allowed else "ieee"
