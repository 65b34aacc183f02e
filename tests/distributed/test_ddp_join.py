"""Uneven inputs: BucketedDDP.join() and Join([BucketedDDP, ShardedOptimizer]) against torch DDP's
join() (and torch DDP + ZeroRedundancyOptimizer) on real gloo process groups, world sizes 2-4.

Bodies in tests/distributed/join_cases.py; one spawned run covers every configuration.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from tests.distributed import join_cases
from tests.distributed.harness import run_distributed
from tests.distributed.test_ddp import (
    ONE_RUN,
    SEEDS,
    WORLD_SIZES,
    assert_close_tree,
    assert_equal_tree,
)


@pytest.mark.parametrize("world", WORLD_SIZES)
@given(seed=SEEDS)
@ONE_RUN
def test_uneven_inputs_match_torch_ddp_join(world, seed):
    runs = run_distributed(join_cases.uneven, world, args=(seed,), timeout=300)
    counts = [join_cases.batches_of(seed, r, world) for r in range(world)]
    assert len(set(counts)) > 1, counts  # the inputs are uneven
    pairs = [  # (ours, the torch run it must equal)
        *[(f"divide={d}/ours[{bs}]", f"divide={d}/torch") for d in (True, False) for bs in (0, None)],
        ("sharded/ours_zero1", "divide=True/torch"),
        ("sharded/ours_zero2", "divide=True/torch"),
        ("schedule/ours_zero1", "schedule/torch"),
        ("schedule/ours_tensor_lr", "schedule/torch"),
        ("zero/ours_behind_torch_ddp", "zero/torch"),
        ("no_sync/ours", "no_sync/torch"),
        ("no_sync/ours_zero2", "no_sync/torch"),
        ("hook/ours", "hook/torch"),
        ("avg/ours", "divide=False/torch"),
        ("sparse/ours", "sparse/single"),
    ]  # fmt: skip
    for rank, run in enumerate(runs):
        for ours, theirs in pairs:
            what = f"rank {rank} {ours} (batches per rank {counts})"
            assert_close_tree(run[ours], run[theirs], f"{what} vs {theirs}")
            assert_equal_tree(run[ours], runs[0][ours], f"{what} vs rank 0")  # replicas agree
        # The AVG path ran while every rank trained, and then the sum was divided by the ranks
        # left (the rank training longest, after the others joined; before, a mutation that
        # let AVG divide by the world size there survived: gloo has no AVG).
        ops = run["avg/ops"]
        assert "avg" in ops, f"rank {rank}: ReduceOp.AVG never used: {ops}"
        if counts[rank] == max(counts):
            assert "sum" in ops, f"rank {rank}: ranks joined, yet no SUM: {ops}"
        # Every rank passes the same op to each all-reduce: a joined rank's zeros go with the
        # SUM of the ranks still training (before, it passed AVG to the same NCCL collective).
        assert ops == runs[0]["avg/ops"], f"rank {rank}: ops {ops} != rank 0's {runs[0]['avg/ops']}"
        assert run["early/ours"] == run["early/torch"] != "no error", rank
        assert run["probe"] == world, "ranks out of step after throw_on_early_termination"
        assert run["disabled_calls"] == 0, "join(enable=False) communicated"
        assert "the model must be the first joinable" in run["wrong_order"], run["wrong_order"]
        assert "must join too, first" in run["model_left_out"], run["model_left_out"]
        assert run["bad_arguments"] == [
            "TypeError: BucketedDDP.join: divide_by_initial_world_size must be a bool, got int",
            "TypeError: BucketedDDP.join: enable must be a bool, got str",
            "TypeError: BucketedDDP.join_hook: divide_by_initial_world_size must be a bool, got "
            "NoneType",
            "ValueError: BucketedDDP.join: divide_by_initial_world_size differs across ranks (1 "
            f"of {world} ranks passed True); pass the same value on every rank",
        ], run["bad_arguments"]
    # The divisor matters: dividing by the ranks still training differs from the world size.
    for key in ("params",):
        a, b = runs[0]["divide=True/torch"][key], runs[0]["divide=False/torch"][key]
        assert any((a[n] - b[n]).abs().max() > 1e-9 for n in a), "divide has no effect?"


def _check_nccl(runs: list[dict]) -> None:
    for rank, run in enumerate(runs):
        for ours, theirs in (("ours", "torch"), ("zero1", "torch"), ("zero2", "torch")):
            assert_close_tree(run[ours], run[theirs], f"rank {rank} {ours}")
        assert_close_tree(run["hook/ours"], run["hook/torch"], f"rank {rank} hook")


@pytest.mark.gpu
def test_nccl_join_world_size_one():
    """One GPU, NCCL: the join protocol's collectives on CUDA tensors (join_device)."""
    _check_nccl(run_distributed(join_cases.nccl_uneven, 1, args=(0,), backend="nccl", timeout=300))


@pytest.mark.multigpu
def test_nccl_join_uneven_two_gpus():
    runs = run_distributed(join_cases.nccl_uneven, 2, args=(1,), backend="nccl", timeout=300)
    _check_nccl(runs)
