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
    return rank


def test_harness_shows_the_stderr_of_a_rank_that_dies():
    with pytest.raises(RuntimeError, match="rank 1 aborts") as info:
        run_distributed(_abort, 2)
    assert "SIGABRT" in str(info.value)
