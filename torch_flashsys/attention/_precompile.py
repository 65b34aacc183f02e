"""The kernel builds a later call may need, compiled in the background after a first call.

The Hopper path picks its kernel builds by sequence length (the rules in ``_sm90``: the forward's
consumer warpgroups, query buffers and schedule; the fused or the portable backward, whose tile
comes from a table keyed on length). A process whose lengths cross one of those bounds stopped
for the compile of a build it had not used yet: 2.2-3.7 s at a first call at 700, 2049 or 8192
tokens after one at 2048 (H100, ``benchmarks/gpu_checks/new_lengths.py``, docs/benchmarks.md).
So after a kind of problem's first compile, the builds its other lengths take are queued here
and compiled one after another by one background thread (``JITFunction.warmup``: compile only).

What the thread does is compile: no launch, no allocation, no stream work, so a CUDA graph being
captured meanwhile is not disturbed. Its arguments are stand-ins (Triton's ``MockTensor``, with
the call's own integers and the descriptors' block shapes) that Triton specializes exactly as the
call's tensors (checked by a CPU test). A call that needs a build still queued takes it out of
the queue and compiles it itself; one that needs the build being compiled waits for it
(:func:`claim`). At interpreter exit the queue is dropped and the build in progress, if any, is
waited for (a compile cut off at exit could crash the exit). The compiles hold the GIL for part of
their time, so the caller's own Python runs slower while they go on (seconds, once per process).

``TORCH_FLASHSYS_PRECOMPILE=0`` (read at import) turns it off; so do the Triton interpreter and the
opt-in autotuner (whose warm-up would benchmark).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from torch_flashsys.attention._backend import interpreter_active

ENABLED = os.environ.get("TORCH_FLASHSYS_PRECOMPILE", "1") != "0"
QUIET_S = 1.0  # seconds without a compile of the caller's before the background compiles


class Job(NamedTuple):
    """One build to compile: ``kernel.warmup(*args, grid=grid, **meta)`` on device ``index``."""

    kernel: Any
    args: tuple
    meta: dict
    index: int


def job_key(kernel: Any, meta: dict, args: tuple) -> tuple:
    """What identifies a build for :func:`claim`: the kernel, its constexprs and launch options,
    and the dtypes of its tensor arguments (the rest of Triton's specialization is the same for
    every call of one kind of problem)."""
    dtypes = tuple(getattr(getattr(a, "base", a), "dtype", None) for a in args)
    return kernel, repr(sorted(meta.items())), dtypes


_cond = threading.Condition()
_pending: OrderedDict[tuple, Job] = OrderedDict()  # queued, oldest first
_running: dict[tuple, Job] = {}
_submitted: set[tuple] = set()  # every build ever queued (each once per process)
_families: set[tuple] = set()  # kinds of problems whose builds were queued (:func:`first`)
_thread: threading.Thread | None = None
_stopping = False
_foreground = 0  # the caller's compiles in progress (:func:`foreground`)
_last_foreground = 0.0  # when the last one ended (time.monotonic)
# What failed to compile (a call that needs it compiles it again and raises there).
errors: list[tuple[Job, BaseException]] = []


def mock(dtype: torch.dtype, shape: list[int]) -> Any:
    """A stand-in for a contiguous tensor of ``dtype`` and ``shape`` (Triton's ``MockTensor``:
    an aligned address, contiguous strides)."""
    from triton.runtime.jit import MockTensor

    return MockTensor(dtype, shape)


def first(family: tuple) -> bool:
    """True the first time ``family`` (a kind of problem) is asked about in this process, while
    precompiling is on: its builds are queued then, once."""
    if not ENABLED or family in _families:
        return False
    _families.add(family)
    return True


def stand_in(arg: Any) -> Any:
    """A warm-up argument for ``arg``: a tensor becomes a ``MockTensor`` of its dtype and shape
    (no memory kept alive), a TMA descriptor gets one as its base; anything else is kept."""
    if isinstance(arg, torch.Tensor):
        return mock(arg.dtype, list(arg.shape))
    base = getattr(arg, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(arg, "block_shape"):
        desc = object.__new__(type(arg))
        desc.__dict__.update(arg.__dict__, base=mock(base.dtype, list(base.shape)))
        return desc
    return arg


def usable(kernel: Any) -> bool:
    """Whether builds of ``kernel`` can be queued at all (the switch, no interpreter, not an
    autotuned kernel)."""
    return ENABLED and not interpreter_active() and not hasattr(kernel, "configs")


def submit(jobs: Iterable[Job]) -> None:
    """Queue the builds of ``jobs`` that were never queued in this process."""
    global _thread
    with _cond:
        for job in jobs:
            if not usable(job.kernel):
                continue
            key = job_key(job.kernel, job.meta, job.args)
            if key in _submitted:
                continue
            _submitted.add(key)
            _pending[key] = job
        if _pending and _thread is None and not _stopping:
            _thread = threading.Thread(target=_work, args=(_cond,), daemon=True,
                                       name="torch_flashsys-precompile")  # fmt: skip
            _thread.start()
        _cond.notify_all()


def _work(cond: threading.Condition) -> None:
    """The background thread: compile the queued builds in turn, each once the caller has not
    compiled anything for QUIET_S (:func:`foreground`), and end when none is left."""
    global _thread
    while True:
        with cond:
            while not _stopping and _pending:
                idle = time.monotonic() - _last_foreground
                if _foreground == 0 and idle >= QUIET_S:
                    break
                cond.wait(None if _foreground else QUIET_S - idle)
            if _stopping or not _pending:
                _thread = None
                cond.notify_all()
                return
            key, job = _pending.popitem(last=False)
            _running[key] = job
        try:
            with torch.cuda.device(job.index):
                _build_launcher(job.kernel.warmup(*job.args, grid=(1, 1, 1), **job.meta))
        except Exception as exc:  # the call that needs it compiles it and raises there
            errors.append((job, exc))
        finally:
            with cond:
                del _running[key]
                cond.notify_all()


def _build_launcher(compiled: Any) -> None:
    """Best effort: Triton builds a compiled kernel's C launcher (gcc, about 0.3 s, kept in its
    on-disk cache) at the kernel's first launch; building it here leaves that launch a cache hit.
    (``launcher_cls(src, metadata)``: Triton 3.6's API; another, or none, and nothing happens.)"""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # (the launch builds it then)
        pass


@contextlib.contextmanager
def foreground() -> Iterator[None]:
    """Around a caller's own compile (a new launch key): the background thread starts no build
    until QUIET_S after the last one ends, so that it does not slow the first call's compiles
    (one step's forward and backward follow each other within it)."""
    global _foreground, _last_foreground
    with _cond:
        _foreground += 1
    try:
        yield
    finally:
        with _cond:
            _foreground -= 1
            _last_foreground = time.monotonic()
            _cond.notify_all()


def claim(kernel: Any, meta: dict, args: tuple) -> None:
    """Before a call compiles a build: take it out of the queue if it is queued (the caller
    compiles it now), or wait until the background thread has compiled it."""
    if not _pending and not _running:
        return
    key = job_key(kernel, meta, args)
    with _cond:
        if _pending.pop(key, None) is None:
            _cond.wait_for(lambda: key not in _running)


def wait(timeout: float | None = None) -> bool:
    """Block until nothing is queued or being compiled (tests and benchmarks); False on timeout."""
    with _cond:
        return _cond.wait_for(lambda: not _pending and not _running, timeout)


@atexit.register
def _stop() -> None:
    """At exit: drop the queue, wait for the build in progress (a compile cut off at exit)."""
    global _stopping
    with _cond:
        _stopping = True
        _pending.clear()
        _cond.notify_all()
        _cond.wait_for(lambda: not _running, timeout=120)


def _after_fork_in_child() -> None:  # the thread does not exist in a forked child
    global _thread, _cond, _foreground
    _thread, _cond, _foreground = None, threading.Condition(), 0
    _pending.clear()
    _running.clear()
    _submitted.clear()
    _families.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
