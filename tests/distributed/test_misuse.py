"""Misuses that used to give silently wrong results or hang (bodies in misuse_cases.py):
wrapping a module twice, requires_grad changed on one rank, GradScaler with ZeRO-2. Each must
raise on every rank naming the problem, or (GradScaler) behave as with ZeRO-1."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import misuse_cases
from tests.distributed.harness import run_distributed

BOUND_S = 90.0  # a whole run, spawning included: a hang fails the test instead of the suite


@pytest.fixture(scope="module")
def double_wrap_runs() -> list[dict]:
    return run_distributed(misuse_cases.double_wrap_errors, 2, timeout=BOUND_S)


_EXPECTED = {
    "BucketedDDP(BucketedDDP(m))": "module is already a BucketedDDP",
    "BucketedDDP(m) twice": "parameter '0.weight' is already synchronized by another BucketedDDP",
    "two BucketedDDP sharing a parameter": "'0.weight' is already synchronized by another Buck",
    "BucketedDDP around a model holding a BucketedDDP": "submodule '2' is a BucketedDDP",
    "BucketedDDP(DDP(m))": "module is already a DistributedDataParallel",
    "BucketedDDP around a model holding a DDP": "submodule '0' is a DistributedDataParallel",
    "DDP(BucketedDDP(m))": "ran inside torch.nn.parallel.DistributedDataParallel",
    "DDP(m) beside BucketedDDP(m)": "ran inside torch.nn.parallel.DistributedDataParallel",
    "rewrap after the first wrapper is gone": None,
}


def test_double_wrap_table_is_complete():
    assert set(_EXPECTED) == set(misuse_cases.DOUBLE_WRAP)


@pytest.mark.parametrize("case", list(_EXPECTED))
def test_double_wrap_raises(double_wrap_runs, case):
    """Every way of synchronizing a gradient twice raises on every rank, naming what is wrapped
    (before: silently scaled gradients, e.g. exactly 0.5x the average)."""
    for rank, run in enumerate(double_wrap_runs):
        got, text = run[case], _EXPECTED[case]
        if text is None:
            assert got == "no error", f"rank {rank}: {got}"
        else:
            assert got.startswith("RuntimeError: BucketedDDP: "), f"rank {rank}: {got}"
            assert text in got, f"rank {rank}: expected {text!r} in {got!r}"
        assert run["probe"] == float(len(double_wrap_runs)), "ranks out of step"


@pytest.mark.parametrize("world, frozen", [(2, [2]), (3, [0, 3])])
def test_requires_grad_changed_on_one_rank(world, frozen):
    """requires_grad_(False) on the last rank only: step() raises the same error on every rank,
    naming the parameter and the ranks (before: a hang, or a raw gloo timeout); the same change
    on every rank is fine and matches the plain optimizer."""
    runs = run_distributed(
        misuse_cases.requires_grad_one_rank, world, args=(frozen,), timeout=BOUND_S
    )
    last = world - 1
    for rank, run in enumerate(runs):
        got = run["one rank"]
        assert got.startswith("RuntimeError: ShardedOptimizer.step: "), f"rank {rank}: {got}"
        assert f"parameter {frozen[0]} " in got and "requires_grad" in got, got
        assert f"rank {last}: parameter {frozen[0]} requires_grad=False" in got, got
        assert f"rank 0: parameter {frozen[0]} requires_grad=True" in got, got
        for ours, plain in zip(run["params"], run["plain"], strict=True):
            torch.testing.assert_close(ours, plain, rtol=1e-12, atol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_grad_scaler_overflow_with_zero2(world):
    """GradScaler with ZeRO-2, an inf in one layer's gradient (injected on the last rank; the
    owner of parameter 0 is another rank): every rank skips the step and backs off the scale
    together, as ZeRO-1 and one process do (before: ranks disagreed on the scale, then hung)."""
    overflows = {1: 0, 3: 2}  # step -> parameter whose gradient overflows
    runs = run_distributed(
        misuse_cases.grad_scaler_overflow, world, args=(overflows,), timeout=BOUND_S
    )
    assert runs[0]["zero2"]["owners"][0] != world - 1, "the overflow must reach another owner"
    for rank, run in enumerate(runs):
        single = run["single"]
        assert single["scales"] == [2.0**10, 2.0**9, 2.0**9, 2.0**8]  # the reference skipped
        for kind in ("zero2", "zero1"):
            assert run[kind]["scales"] == single["scales"], f"rank {rank} {kind}"
            for step, (got, want) in enumerate(
                zip(run[kind]["params"], single["params"], strict=True)
            ):
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(
                        g, w, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {kind} step {step}"
                    )
                assert all(
                    torch.equal(a, b)
                    for a, b in zip(got, runs[0][kind]["params"][step], strict=True)
                ), f"rank {rank} {kind} step {step}: replicas differ"
