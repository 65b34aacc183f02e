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
