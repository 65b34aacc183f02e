"""At interpreter exit, wait until the backend's threads have let go of our collectives' tensors.

gloo runs each collective on one of its worker threads, which keeps its reference to the Work
until just after it has woken the rank waiting for it. A Work holds the collective's tensors and
the thread-local state captured when it was launched, which inside a backward includes a Python
object (the ``contextvars`` context that ``torch.autograd.backward`` stashes). So when the worker
thread is the last to let go (it was descheduled right after waking the waiter, which dropped its
reference and went on), the destructor runs there and needs the GIL to release those Python
objects. If the interpreter has begun finalizing by then (the script returned), CPython ends a
thread that asks for the GIL with ``pthread_exit`` inside that ``noexcept`` destructor:
``std::terminate``, SIGABRT, "terminate called without an active exception" after all the work
is done. ``destroy_process_group()`` joins the worker threads only when no Python reference to
the group is left (BucketedDDP and ShardedOptimizer hold one), so it does not avoid it. torch DDP's works
go through the same code (its bucket tensors have no Python objects, but the captured state does).

BucketedDDP therefore hands each collective an alias of its buffer that nothing else holds
(:func:`alias`), drops it once the collective is waited for (:func:`handed_back`), and keeps only
a weak reference: the alias dies when the Work is destroyed, after the Work's other Python
objects (``ProcessGroupGloo::AsyncWork`` releases its captured state before its tensors). An
``atexit`` hook, which runs before finalization begins, waits (GIL released, at most
``_EXIT_WAIT_S``) until every such alias is gone, so no worker thread needs the GIL afterwards.

The same race hits any collective's Work whose last holder is a backend thread that has not run
since (the demo, whose last collectives are its own ``dist.all_reduce`` calls, aborted this way
once in 34 runs on a loaded 2-core machine, faulthandler showing the main thread already without
a Python frame and the abort on another thread, after ``destroy_process_group()``). So the hook
then also waits, on Linux, until no other thread of the process is runnable (``/proc`` state
``R``) on ``_QUIET_POLLS`` polls in a row, at most ``_QUIET_WAIT_S``: a backend thread that was
descheduled with a Work to release runs now, while the interpreter can still give it the GIL.
Idle threads sleep (state ``S``), so a normal exit costs a few milliseconds, and a process that
never used our distributed code nor has a process group at exit (e.g. one that imports the package
for attention only) does not wait.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref

import torch

_EXIT_WAIT_S = 5.0  # a descheduled worker thread needs milliseconds; never hold exit longer
_POLL_S = 0.001
_QUIET_POLLS = 3  # polls in a row with no other thread runnable
_QUIET_WAIT_S = 0.5  # a busy thread of the user's own never holds exit longer than this

_used = False  # set by mark_used(): BucketedDDP, ShardedOptimizer, context parallelism
_handed: list[weakref.ref] = []  # aliases of finished collectives, maybe still held by a backend
_prune_at = 64  # prune dead references when the list reaches this length (amortized O(1))


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object sharing ``tensor``'s memory, to hand to a collective."""
    return tensor.view(tensor.shape)


def handed_back(sent: torch.Tensor) -> None:
    """``sent`` (an :func:`alias`) went to a collective that has been waited for; the caller
    drops it now. Until the backend's thread destroys the Work, exit waits for it."""
    global _prune_at
    if len(_handed) >= _prune_at:
        _handed[:] = [ref for ref in _handed if ref() is not None]
        _prune_at = max(64, 2 * len(_handed))
    _handed.append(weakref.ref(sent))


def _held() -> bool:
    return any(ref() is not None for ref in _handed)


def _others_runnable(task_dir: str = "/proc/self/task") -> bool:
    """Whether a thread of this process other than the caller is running or waiting for a core."""
    me = threading.get_native_id()
    for tid in os.listdir(task_dir):
        if int(tid) == me:
            continue
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rindex(")") + 2] == "R":  # the state follows the "(name)" field
            return True
    return False


def mark_used() -> None:
    """This process runs our distributed code: the exit hook waits for quiet threads."""
    global _used
    _used = True


def _distributed_used() -> bool:
    return _used or (torch.distributed.is_available() and torch.distributed.is_initialized())


def _wait_for_quiet_threads() -> None:
    if not os.path.isdir("/proc/self/task") or not _distributed_used():
        return
    deadline, quiet = time.monotonic() + _QUIET_WAIT_S, 0
    while quiet < _QUIET_POLLS and time.monotonic() < deadline:
        quiet = 0 if _others_runnable() else quiet + 1
        time.sleep(_POLL_S)


@atexit.register
def _wait_for_backend_threads() -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    while _held() and time.monotonic() < deadline:
        time.sleep(_POLL_S)  # releases the GIL: the worker thread can finish its destructor
    _wait_for_quiet_threads()
