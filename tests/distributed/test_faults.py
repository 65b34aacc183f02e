"""Fault tests: a rank that raises, is killed (SIGKILL) or hangs in the middle of a forward, a
backward, a bucket all-reduce or ShardedOptimizer.step() makes every process exit non-zero, the
others within the process group's timeout, with errors that name their rank and the collective.

Each scenario runs tests/distributed/fault_worker.py on ``world`` real gloo processes (rank 1
fails at its second step) under a hard bound: a process still alive when it expires is killed
and the test fails (only the hanging rank of a "hang" scenario is expected to need killing).
The processes are forked from a forkserver that has already imported torch (each saves the ~5 s
of importing torch and building an optimizer on 2 cores); ``test_script_exit_status`` runs one
scenario as plain ``python -m`` scripts, as torchrun would start them.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import fault_worker
from torch_flashsys._ports import free_port

PG_TIMEOUT_S = 5.0  # init_process_group(timeout=...) in the workers
SLACK_S = 3.0  # failure detection to exit, on a busy machine
BOUND_S = 60.0  # a whole scenario, start-up included: past it the test kills and fails
ROOT = Path(__file__).resolve().parents[2]
FAILING = fault_worker.FAILING_RANK

_CONTEXT: multiprocessing.context.BaseContext | None = None


def _context() -> multiprocessing.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(
            ["torch", "torch._dynamo", "tests.distributed.fault_worker"]
        )
    return _CONTEXT


def _times(text: str, word: str) -> list[float]:
    return [float(t) for t in re.findall(rf"{word}(?: [a-z_]+)? at ([0-9.]+)", text)]


def _check(
    point: str,
    mode: str,
    world: int,
    codes: dict,
    logs: dict,
    killed: list,
    timeout_s: float = PG_TIMEOUT_S,
) -> None:
    """Every rank exited non-zero, survivors within the timeout of the failure, with errors
    naming their rank and the collective."""
    assert killed == ([FAILING] if mode == "hang" else []), f"had to kill ranks {killed}\n{logs}"
    assert all(code != 0 for code in codes.values()), f"exit statuses {codes}\n{logs}"
    (injected,) = _times(logs[FAILING], "injected")
    if mode == "raise":
        assert f"injected failure on rank {FAILING} in {point}" in logs[FAILING], logs[FAILING]
    if mode == "raise_caught":  # the next forward refuses to go on with unmatched collectives
        assert "caught the injected failure" in logs[FAILING], logs[FAILING]
        assert "the previous backward did not finish" in logs[FAILING], logs[FAILING]
    for rank in (r for r in range(world) if r != FAILING):
        log = logs[rank]
        assert "finished" not in log, f"rank {rank} finished as if nothing happened:\n{log}"
        (failed,) = _times(log, "failed")
        assert failed - injected <= timeout_s + SLACK_S, (failed - injected, log)
        caller = "ShardedOptimizer" if point == "step" else "BucketedDDP"
        collective = "the broadcast from rank" if point == "step" else "gradient bucket"
        pattern = rf"{caller}: rank {rank} of {world}: [^\n]*{collective}[^\n]* failed: "
        assert re.search(pattern, log), f"rank {rank}: no error naming it and the collective\n{log}"
        if mode == "hang":
            assert re.search(r"(?i)time ?out|timed out", log), log


SCENARIOS = [  # (where rank 1 fails, how, world size)
    ("forward", "raise", 3),
    ("forward", "kill", 2),
    ("backward", "raise", 2),
    ("backward", "kill", 3),
    ("allreduce", "raise", 2),
    ("allreduce", "kill", 2),
    ("step", "raise", 2),
    ("step", "kill", 3),
    ("forward", "hang", 2),
    ("backward", "raise_caught", 2),
]


@pytest.mark.parametrize(("point", "mode", "world"), SCENARIOS)
def test_failing_rank_stops_every_rank(point, mode, world, tmp_path):
    ctx, port = _context(), free_port()
    logs_at = {r: tmp_path / f"rank{r}.log" for r in range(world)}
    procs = {
        r: ctx.Process(
            target=fault_worker.run_rank,
            args=(point, mode, r, world, port, PG_TIMEOUT_S, str(logs_at[r])),
        )
        for r in range(world)
    }
    deadline = time.monotonic() + BOUND_S
    for p in procs.values():
        p.start()
    for r, p in procs.items():
        if r != FAILING or mode != "hang":
            p.join(max(0.0, deadline - time.monotonic()))
    killed = [r for r, p in procs.items() if p.is_alive()]
    for r in killed:
        procs[r].kill()
        procs[r].join()
    logs = {r: path.read_text() if path.exists() else "" for r, path in logs_at.items()}
    _check(point, mode, world, {r: p.exitcode for r, p in procs.items()}, logs, killed)


def test_script_exit_status(tmp_path):
    """The same through `python -m tests.distributed.fault_worker` scripts: the exit status a
    launcher (torchrun) sees is non-zero on every rank. (A longer process-group timeout: each
    script imports torch on its own, so the ranks may reach their first collective seconds
    apart on a busy machine; a raising rank makes the others fail at once anyway.)"""
    point, mode, world, port, timeout_s = "backward", "raise", 2, free_port(), 20.0
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env["OMP_NUM_THREADS"] = "1"
    logs_at = {r: tmp_path / f"rank{r}.log" for r in range(world)}
    procs = {}
    for r in range(world):
        with open(logs_at[r], "w") as log:
            args = [point, mode, str(r), str(world), str(port), str(timeout_s)]
            procs[r] = subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.fault_worker", *args],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    deadline, killed = time.monotonic() + BOUND_S, []
    for r, p in procs.items():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed.append(r)
    logs = {r: path.read_text() for r, path in logs_at.items()}
    codes = {r: p.returncode for r, p in procs.items()}
    _check(point, mode, world, codes, logs, killed, timeout_s)
