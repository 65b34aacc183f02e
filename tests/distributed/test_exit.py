"""A process that used BucketedDDP or ShardedOptimizer and returns without cleaning up exits with 0.

Without the wait in ``torch_flashsys/distributed/_release.py``, such a gloo job aborted after its
work was done (SIGABRT, "terminate called without an active exception") in about 1 of 10 jobs on
a 2-core machine: a gloo worker thread that held the last reference to a finished all-reduce
needed the GIL to destroy it while the interpreter was finalizing. The race depends on the
scheduler, so the test runs many short jobs (real interpreters, as torchrun starts them: a
forked child skips finalization) and requires every one to exit with 0, which the fix makes
certain rather than likely. torch DDP has the same race; its jobs run beside ours for the
comparison in the message, not asserted on (its exits are torch's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_flashsys._ports import free_port

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
JOBS = {
    "ours": 12,
    "sharded": 6,
    "torch": 1,  # for the message only (torch's exits are not asserted on): a glimpse suffices
}  # old code: each ours job aborted with probability ~0.1, so 18 jobs catch it 85% of the time
# (24 caught it 92% of the time, but 26 jobs took 194 s of a 16-minute CI test run on 2 cores)
PARALLEL = 2  # jobs at a time (a busy machine is where the race shows)
BOUND_S = 90.0  # a rank still running this long after its batch started is killed (counted)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def _start(wrapper: str, log_dir: Path, job: int) -> list[subprocess.Popen]:
    port, procs = free_port(), []
    for rank in range(WORLD):
        with open(log_dir / f"{wrapper}{job}.rank{rank}.log", "w") as log:
            args = [sys.executable, "-m", "tests.distributed.exit_worker", wrapper, str(rank)]
            procs.append(
                subprocess.Popen(
                    [*args, str(WORLD), str(port)],
                    cwd=ROOT,
                    env=_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _exit_codes(wrapper: str, jobs: int, log_dir: Path) -> list[int]:
    """Exit codes of every rank of ``jobs`` jobs (-9: killed as hung)."""
    codes = []
    for first in range(0, jobs, PARALLEL):
        batch = [_start(wrapper, log_dir, job) for job in range(first, min(jobs, first + PARALLEL))]
        deadline = time.monotonic() + BOUND_S
        for proc in (p for procs in batch for p in procs):
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes.append(-9)
    return codes


def test_exit_without_destroy_process_group_is_clean(tmp_path):
    codes = {wrapper: _exit_codes(wrapper, jobs, tmp_path) for wrapper, jobs in JOBS.items()}
    failed = {wrapper: [c for c in cs if c != 0] for wrapper, cs in codes.items()}
    summary = ", ".join(
        f"{wrapper}: {len(failed[wrapper])} of {len(cs)} processes non-zero {failed[wrapper]}"
        for wrapper, cs in codes.items()
    )
    logs = {path.name: path.read_text()[-300:] for path in sorted(tmp_path.glob("*.log"))}
    bad_logs = {name: text for name, text in logs.items() if text.strip()}
    assert not failed["ours"] and not failed["sharded"], f"{summary}\n{bad_logs}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_exit_waits_for_runnable_threads_but_not_forever(monkeypatch):
    """The exit hook's second wait: while another thread is runnable it polls on, bounded."""
    import threading

    from torch_flashsys.distributed import _release

    monkeypatch.setattr(_release, "_used", True)  # as after a wrapper was built
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))  # runnable: it computes (and takes turns at the GIL)

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        time.sleep(0.05)
        assert _release._others_runnable()
        start = time.monotonic()
        _release._wait_for_quiet_threads()
        waited = time.monotonic() - start
        assert _release._QUIET_WAIT_S * 0.9 <= waited < _release._QUIET_WAIT_S + 1.0
    finally:
        stop.set()
        worker.join()
    time.sleep(0.05)
    start = time.monotonic()
    _release._wait_for_quiet_threads()  # nothing runnable: three quick polls
    assert time.monotonic() - start < _release._QUIET_WAIT_S


def test_only_processes_that_use_the_distributed_code_wait_at_exit():
    """Importing the package (for attention, say) adds no exit wait; a wrapper's group check does."""
    code = (
        "import torch_flashsys\n"
        "from torch_flashsys.distributed import _release, _verify\n"
        "print(_release._distributed_used())\n"
        "_verify.check_process_group('BucketedDDP', None)\n"
        "print(_release._distributed_used())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, check=True,
                          capture_output=True, text=True)  # fmt: skip
    assert done.stdout.split() == ["False", "True"]
