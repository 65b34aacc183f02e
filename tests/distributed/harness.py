"""Run a function on N real gloo processes (forked from a fork server, below); collect the results.

Usage::

    def body(rank, world_size, *args):   # module-level function (it is pickled by name)
        ...  # torch.distributed is initialised (gloo) when body runs
        return {"params": [...]}        # anything torch.save can write

    results = run_distributed(body, world_size=2, args=(...,))   # list, one entry per rank

A rank that raises makes run_distributed raise with that rank's traceback; a run that does not
finish within ``timeout`` seconds (a hang) is killed and reported, so tests never hang.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_flashsys._ports import free_port

# Ranks start from a fork server that has imported torch, the library and the test helpers once
# (``multiprocessing``'s forkserver), not as fresh interpreters (``spawn``): a rank then starts in a
# fraction of a second instead of the seconds an import of torch takes on a 2-core machine, which
# had been most of the distributed tests' time. The server is one fresh interpreter per test
# process, started with its environment on first use; a rank is a fork of it (no state of the test
# process, no CUDA context), and unpickles its function by name as under ``spawn``.
START_METHOD = "forkserver"
PRELOAD = ["torch", "torch.distributed", "torch_flashsys", "hypothesis", "pytest",
           "tests.distributed.harness"]  # fmt: skip
mp.set_forkserver_preload(PRELOAD)


def _entry(rank, fn, world_size, port, out_dir, args, backend):
    # The rank's stderr goes to a file the parent shows when the process dies (an abort at exit
    # prints only there: "terminate called ...", "Fatal Python error: ...").
    err = os.open(os.path.join(out_dir, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(err, 2)
    # A fatal signal (SIGABRT from a heap check, SIGSEGV) prints every thread's Python stack
    # there too: where it died, the body or the teardown after it.
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException as exc:  # reported to the parent, which raises
        torch.save(
            {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is on disk: end as a forked multiprocessing child does, without the interpreter's
    # finalization. What a rank does at exit is tested by test_exit.py with real interpreters (as
    # torchrun starts them); here, an abort while tearing down the interpreter after the result was
    # written (SIGABRT, once in CI on
    # 2026-11-24; not reproduced in 40 reruns of that test's case nor in 24 demo runs) would fail whichever test
    # happened to spawn that process, for a reason that test does not check.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stderr_tails(out_dir: str, chars: int = 6000) -> str:
    tails = []
    for name in sorted(n for n in os.listdir(out_dir) if n.endswith(".err")):
        with open(os.path.join(out_dir, name), errors="replace") as f:
            tails.append(f"--- {name}\n{f.read()[-chars:]}")
    return "\n".join(tails)


class RankError(RuntimeError):
    """Raised in the parent when a rank raised; ``errors`` maps rank -> 'Type: message'."""

    def __init__(self, errors: dict[int, str], tracebacks: dict[int, str]):
        self.errors = errors
        first = min(errors)
        super().__init__(f"rank(s) {sorted(errors)} raised; rank {first}:\n{tracebacks[first]}")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), out_dir, args, backend),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise TimeoutError(f"distributed run of {fn.__name__} hung (> {timeout} s)")
        except mp.ProcessExitedException as exc:
            done = [r for r in range(world_size) if os.path.exists(f"{out_dir}/rank{r}.pt")]
            raise RuntimeError(
                f"{exc} (ranks that had written their result: {done}); stderr of "
                f"the ranks:\n{_stderr_tails(out_dir)}"
            ) from exc
        results, errors, tbs = [], {}, {}
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors[rank], tbs[rank] = "no result written", "(process died)"
                continue
            rec = torch.load(path, weights_only=False)
            if "error" in rec:
                errors[rank], tbs[rank] = rec["error"], rec["tb"]
            results.append(rec.get("ok"))
        if errors:
            raise RankError(errors, tbs)
        return results
