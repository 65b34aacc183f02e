"""The background compile queue (``_precompile``): each build once, in order, a call that needs a
queued build takes it, one that needs the build in progress waits for it, failures recorded.
Kernels here are stand-ins whose ``warmup`` records the call (what the thread does is call it)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_flashsys.attention import _precompile


class _Kernel:
    """Records its warm-ups; ``gate`` (an Event), when set, holds each warm-up until released."""

    def __init__(self, name: str, gate: threading.Event | None = None, fail: bool = False):
        self.name, self.gate, self.fail = name, gate, fail
        self.calls: list[dict] = []
        self.started = threading.Event()

    def warmup(self, *args, grid, **meta):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail:
            raise RuntimeError(f"{self.name} does not compile")
        self.calls.append(meta)


def _fresh() -> list[tuple[str, object]]:
    """The module's state, empty (and a short quiet time)."""
    return [("_pending", type(_precompile._pending)()), ("_running", {}), ("_submitted", set()),
            ("_families", set()), ("errors", []), ("_thread", None), ("_stopping", False),
            ("_cond", threading.Condition()), ("_foreground", 0), ("_last_foreground", 0.0),
            ("QUIET_S", 0.05)]  # fmt: skip


@pytest.fixture
def queue(monkeypatch):
    """A fresh queue, on under the interpreter too (the thread only calls ``warmup``)."""
    monkeypatch.setattr(_precompile, "ENABLED", True)
    monkeypatch.setattr(_precompile, "interpreter_active", lambda: False)
    for name, value in _fresh():
        monkeypatch.setattr(_precompile, name, value)
    yield _precompile
    _settle()


def _settle() -> None:
    """Until the queue is empty and its thread has ended."""
    assert _precompile.wait(10)
    thread = _precompile._thread
    if thread is not None:
        thread.join(10)


def _job(kernel, **meta) -> _precompile.Job:
    return _precompile.Job(kernel, (torch.zeros(1, dtype=torch.float16), 3), meta, -1)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=12))
def test_each_build_compiles_once_in_the_order_queued(builds):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_precompile, "interpreter_active", lambda: False)
        mp.setattr(_precompile, "ENABLED", True)
        for name, value in _fresh():
            mp.setattr(_precompile, name, value)
        kernel = _Kernel("k")
        for b in builds:  # one submit per build, and all of them again
            _precompile.submit([_job(kernel, BLOCK=b)])
        _precompile.submit([_job(kernel, BLOCK=b) for b in builds])
        _settle()
        assert kernel.calls == [{"BLOCK": b} for b in dict.fromkeys(builds)]
        assert not _precompile.errors


def test_a_call_takes_a_queued_build_and_waits_for_one_in_progress(queue):
    gate = threading.Event()
    slow, other = _Kernel("slow", gate), _Kernel("other")
    queue.submit([_job(slow, A=1), _job(other, B=1), _job(other, B=2)])
    assert slow.started.wait(10)  # the thread is in slow's warm-up, the others queued
    queue.claim(other, {"B": 2}, (torch.zeros(2, dtype=torch.float16), 7))  # the caller takes it
    waited = []
    args = (torch.ones(3, dtype=torch.float16), 5)  # other values, the same kinds
    waiter = threading.Thread(target=lambda: (queue.claim(slow, {"A": 1}, args),
                                              waited.append(slow.calls[:])))  # fmt: skip
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # waiting for the build in progress
    gate.set()
    waiter.join(10)
    assert waited == [[{"A": 1}]]  # returned once it was compiled
    assert queue.wait(10)
    assert other.calls == [{"B": 1}]  # B=2 was left to the caller


def test_a_build_of_another_dtype_is_not_claimed(queue):
    gate = threading.Event()
    slow, kernel = _Kernel("slow", gate), _Kernel("k")
    queue.submit([_job(slow), _job(kernel, B=1)])
    assert slow.started.wait(10)
    queue.claim(kernel, {"B": 1}, (torch.zeros(1, dtype=torch.bfloat16), 3))  # not the queued one
    gate.set()
    assert queue.wait(10)
    assert kernel.calls == [{"B": 1}]


def test_a_failed_build_is_recorded_and_the_queue_goes_on(queue):
    bad, good = _Kernel("bad", fail=True), _Kernel("good")
    queue.submit([_job(bad, X=1), _job(good, X=2)])
    assert queue.wait(10)
    assert [type(e) for _, e in queue.errors] == [RuntimeError]
    assert good.calls == [{"X": 2}]


def test_nothing_is_queued_when_off_or_for_an_autotuned_kernel(queue, monkeypatch):
    tuned = _Kernel("tuned")
    tuned.configs = [object()]  # what triton.autotune's wrapper has
    queue.submit([_job(tuned)])
    monkeypatch.setattr(_precompile, "ENABLED", False)
    plain = _Kernel("plain")
    queue.submit([_job(plain)])
    assert queue.wait(10)
    assert tuned.calls == [] and plain.calls == [] and queue._thread is None
    assert not queue.first(("family",))


def test_a_family_is_first_once(queue):
    assert queue.first(("forward", 64, True))
    assert not queue.first(("forward", 64, True))
    assert queue.first(("forward", 64, False))


def test_stand_ins_keep_no_memory_and_specialize_like_the_tensors():
    """A tensor becomes a MockTensor of its dtype and shape (address 0: aligned); a descriptor
    keeps its block shape and layout with such a base; anything else is kept as is."""
    from triton.runtime.jit import MockTensor

    t = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    m = _precompile.stand_in(t)
    assert isinstance(m, MockTensor) and m.dtype == t.dtype and list(m.shape) == [2, 3, 64]
    assert m.data_ptr() % 16 == 0

    class Desc:
        def __init__(self, base):
            self.base, self.block_shape, self.layout = base, [1, 64], "swizzled"

    d = _precompile.stand_in(Desc(t))
    assert isinstance(d.base, MockTensor) and d.block_shape == [1, 64] and d.layout == "swizzled"
    assert _precompile.stand_in(7) == 7 and _precompile.stand_in(None) is None


def test_nothing_compiles_in_the_background_while_the_caller_compiles(queue):
    """Builds queued during a caller's compile (a first call's forward, before its backward)
    start only QUIET_S after the caller's last compile has ended."""
    kernel = _Kernel("k")
    with queue.foreground():
        queue.submit([_job(kernel, A=1)])
        time.sleep(0.3)
        assert not kernel.started.is_set()
        with queue.foreground():  # nested (compile_together's launches)
            pass
        time.sleep(0.2)
        assert not kernel.started.is_set()
    ended = time.monotonic()
    assert kernel.started.wait(10)
    assert time.monotonic() - ended >= queue.QUIET_S * 0.9
    _settle()
    assert kernel.calls == [{"A": 1}]


_EXIT_SCRIPT = """
import threading, time
from torch_flashsys.attention import _precompile
_precompile.interpreter_active = lambda: False
_precompile.ENABLED, _precompile.QUIET_S = True, 0.0
started = threading.Event()
class Slow:
    def warmup(self, *args, grid, **meta):
        started.set()
        time.sleep(2.0)
kernel = Slow()
_precompile.submit([_precompile.Job(kernel, (), {"N": n}, -1) for n in range(5)])
assert started.wait(10)
print("exiting", flush=True)
"""


def test_exit_waits_for_the_build_in_progress_only():
    """A process that exits while builds are queued waits for the one being compiled (a compile
    cut off at exit could crash it), not for the rest of the queue: about 2 s here (and the
    interpreter's teardown), not 10."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    line = proc.stdout.readline()  # printed once the first build is under way
    start = time.monotonic()
    proc.wait(60)
    took = time.monotonic() - start
    assert proc.returncode == 0 and line.startswith("exiting"), proc.stderr.read()[-2000:]
    assert took < 7.0, took  # the build in progress (2 s), not the four queued behind it
