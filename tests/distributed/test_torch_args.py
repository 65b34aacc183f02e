"""torch's own constructor calls work on BucketedDDP and ShardedOptimizer (gloo, 2 processes).

A call written for ``DistributedDataParallel`` / ``ZeroRedundancyOptimizer`` swaps as it is:
every argument torch accepts is honoured with torch's meaning, a documented no-op, or an error
that names it (the constructor error tables in test_ddp.py and test_sharded_optimizer.py). Here:
the accepted ones train exactly as our own names do, and as torch does.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given

from tests.distributed import torch_args_cases
from tests.distributed.harness import run_distributed
from tests.distributed.test_ddp import ONE_RUN, SEEDS, assert_close_tree, assert_equal_tree

WORLD = 2


@pytest.fixture(scope="module")
def ddp_runs() -> list[dict]:
    """One spawn for every DDP check (each costs seconds), on fresh random models and data."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"ddp_runs seed: {seed}")  # shown with a failure, to reproduce it
    return run_distributed(torch_args_cases.ddp_names, WORLD, args=(seed,), timeout=240)


def test_torch_ddp_call_trains_as_ours_and_torch(ddp_runs):
    for rank, run in enumerate(ddp_runs):
        for kind in ("branches", "norm", "mixed", "tied"):
            what = f"rank {rank} {kind}"
            theirs = run[f"call/{kind}/ours_torch_call"]
            ours = run[f"call/{kind}/ours"]
            assert theirs.pop("views") and ours.pop("views"), f"{what}: grads not bucket views"
            assert_equal_tree(theirs, ours, f"{what}: torch's call vs our names")
            assert_close_tree(theirs, run[f"call/{kind}/torch"], f"{what}: vs torch DDP")


def test_init_sync_false_keeps_rank_local_values(ddp_runs):
    for rank, run in enumerate(ddp_runs):
        for kind in ("norm", "tied"):
            what = f"rank {rank} {kind} init_sync=False"
            # Nothing broadcast at construction: this rank's own initial parameters and buffers.
            assert_equal_tree(run[f"nosync/{kind}/constructed"], run[f"nosync/{kind}/local"], what)
            ours = run[f"nosync/{kind}/ours"]
            assert ours.pop("views"), what
            assert_close_tree(ours, run[f"nosync/{kind}/torch"], f"{what} vs torch DDP")
    # The models really start apart (else the check above could not fail).
    first, second = (r["nosync/tied/local"]["params"] for r in ddp_runs)
    assert any(not torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("variant", ["forward_sync_off", "none"])
def test_buffer_options_have_torchs_meaning(ddp_runs, variant):
    for rank, run in enumerate(ddp_runs):
        ours = run[f"buffers/{variant}/ours"]
        assert ours.pop("views")
        assert_close_tree(ours, run[f"buffers/{variant}/torch"], f"rank {rank} {variant}")
    # Rank-local buffers after training with forward_sync_buffers=False (the option matters).
    if variant == "forward_sync_off":
        a, b = (r["buffers/forward_sync_off/ours"]["buffers"] for r in ddp_runs)
        assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())


def test_process_group_not_a_member(ddp_runs):
    assert ddp_runs[0]["non_member"] is None  # rank 0 is the group
    got = ddp_runs[1]["non_member"]
    assert got is not None and got.startswith("ValueError: BucketedDDP: "), got
    assert "global rank 1) is not a member of process_group" in got, got


@given(seed=SEEDS)
@ONE_RUN
def test_zero_redundancy_optimizer_calls(seed):
    for rank, run in enumerate(run_distributed(torch_args_cases.zero_names, WORLD, args=(seed,))):
        for name in torch_args_cases.ZERO_CALLS:
            what = f"rank {rank} ZeroRedundancyOptimizer call {name!r}"
            assert_equal_tree(run[f"{name}/ours"], run["ours"], f"{what} vs our names")
            assert_close_tree(run[f"{name}/ours"], run[f"{name}/torch"], f"{what} vs torch")
