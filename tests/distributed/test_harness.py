import re

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_harness_runs_gloo_collectives():
    world = 2
    assert run_distributed(_sum_ranks, world) == [float(sum(range(world)))] * world


def _abort(rank, world_size):
    import os
    import sys

    if rank == 1:
        sys.stderr.write(f"rank {rank} aborts\n")
        sys.stderr.flush()
        os.abort()
    # Rank 0 waits for rank 1: returning at once, its exit could close the connections while
    # rank 1 is still inside init_process_group, which then raises instead of reaching the abort
    # (seen once in CI).
    dist.barrier()
    return rank


def test_harness_shows_the_stderr_of_a_rank_that_dies():
    with pytest.raises(RuntimeError, match="rank 1 aborts") as info:
        run_distributed(_abort, 2)
    assert "SIGABRT" in str(info.value)


def _abort_in_body(rank, world_size):
    """Rank 1 aborts (as glibc does on a corrupted heap); the other waits for it."""
    import os

    if rank == 1:
        os.abort()
    dist.barrier()


def test_harness_reports_where_a_rank_died_and_which_had_written_results():
    """A rank killed by a signal: every thread's Python stack (faulthandler) in its stderr, and
    which ranks had written their result, so that a rare crash in CI says whether it came in
    the body or in the teardown after it."""
    with pytest.raises(RuntimeError) as info:
        run_distributed(_abort_in_body, 2, timeout=60)
    text = str(info.value)
    assert "process 1 terminated with signal SIGABRT" in text, text
    # rank 1 never wrote; rank 0 may have (its barrier's error, once rank 1's end closed the
    # connection) before the harness saw rank 1 die: [0] came once in a stress run
    assert re.search(r"ranks that had written their result: \[(0)?\]", text), text
    assert "Fatal Python error: Aborted" in text and "_abort_in_body" in text, text


def test_rendezvous_ports_are_outside_the_ephemeral_range():
    """A rendezvous port from bind(0) is an ephemeral one, the range the local ends of other
    processes' connections come from: one of those could take it before rank 0 listens (the
    EADDRINUSE of a test-suite run). ``free_port``, which the harness, the demo and the
    benchmarks use, picks free ports outside that range."""
    import socket

    from torch_flashsys._ports import ephemeral_range, free_port

    lo, hi = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not lo <= port <= hi, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when returned
