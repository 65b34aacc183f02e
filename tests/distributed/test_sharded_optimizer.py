"""ShardedOptimizer vs the plain optimizer on real gloo process groups (NCCL with 2+ GPUs).

Every spawned run batches many drawn configurations (see zero_cases.py), because spawning costs
seconds. The plain optimizer runs in each rank on an identical model and identical data, so
sharding must not change any parameter: the comparison is exact up to 1 ulp-scale tolerances.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tests.distributed.common import MODEL_FIELDS, spawning
from tests.distributed.harness import run_distributed
from tests.distributed.zero_cases import (
    hooks_and_loads,
    run_training_cases,
    run_training_cases_on_subgroup,
    run_with_ddp,
)
from tests.distributed.zero_errors import CASES, run_error_cases
from torch_flashsys import ShardedOptimizer

SPAWNING = spawning(4)

cases = st.fixed_dictionaries(
    {
        **MODEL_FIELDS,
        "float64": st.booleans(),
        "steps": st.integers(2, 4),
        "closure": st.booleans(),
        "scheduler": st.booleans(),
        "add_group": st.booleans(),
        "checkpoint": st.sampled_from([None, "consolidated", "sharded"]),
        "tiny_chunks": st.booleans(),
    }
)

_ALL_ON = {
    "seed": 7, "vocab": 9, "d": 6, "widths": [5, 3], "tied": True, "frozen": True,
    "float64": True, "scalar": True, "groups": 3, "steps": 4, "closure": True,
    "scheduler": True, "add_group": True, "tiny_chunks": True,
}  # fmt: skip
# Every optimizer and both checkpoint forms at least once, whatever hypothesis draws.
_EVERY_FEATURE = [
    dict(_ALL_ON, optimizer="adamw", checkpoint="consolidated"),
    dict(_ALL_ON, optimizer="sgd", checkpoint="sharded", closure=False, seed=8),
    dict(_ALL_ON, optimizer="adam", checkpoint="sharded", scheduler=False, seed=9),
    dict(_ALL_ON, optimizer="adam", checkpoint="consolidated", tied=False, groups=1, seed=10),
    dict(_ALL_ON, optimizer="adamw", checkpoint="consolidated", closure=False, seed=11),
]


def _tolerance(t: torch.Tensor) -> dict:
    return {"rtol": 1e-6, "atol": 1e-7} if t.dtype == torch.float32 else {"rtol": 1e-12, "atol": 0}


def _check_state_dicts_equal(ours: dict, plain: dict) -> None:
    """Our consolidated state dict is exactly the plain optimizer's (format and values)."""
    assert ours["param_groups"] == plain["param_groups"]
    assert sorted(ours["state"]) == sorted(plain["state"])
    for index, state in plain["state"].items():
        assert sorted(ours["state"][index]) == sorted(state), index
        for key, value in state.items():
            mine = ours["state"][index][key]
            assert type(mine) is type(value), (index, key)
            if isinstance(value, torch.Tensor):
                assert mine.dtype == value.dtype and mine.shape == value.shape, (index, key)
                torch.testing.assert_close(mine.cpu(), value.cpu(), **_tolerance(value))
            else:
                assert mine == value, (index, key)


def check_training(results: list[list[dict]], case_list: list[dict]) -> None:
    world = len(results)
    for c, case in enumerate(case_list):
        for rank in range(world):
            out = results[rank][c]
            where = f"case {c} {case} rank {rank}"
            # Same parameters as the plain optimizer, and the same on every rank.
            for ours, plain, first in zip(
                out["sharded"], out["plain"], results[0][c]["sharded"], strict=True
            ):
                torch.testing.assert_close(ours, plain, **_tolerance(plain), msg=where)
                assert torch.equal(ours, first), where
            assert [a for a, _ in out["losses"]] == pytest.approx([b for _, b in out["losses"]])
            # param_groups show the scheduler's learning rates.
            assert out["lr"] == pytest.approx(out["plain_lr"]), where
            # ~1/world of the state: at most an equal share of the parameter bytes plus the largest
            # parameter's, times the state per parameter byte.
            assert out["state_bytes"] <= out["state_bound"] * (1 + 1e-9), where
            # A few coalesced broadcasts per step (per dtype, owner and chunk), not one per param.
            assert max(out["broadcasts"]) <= out["max_broadcasts"], where
            several = any(results[r][c]["owned_trainable"] > 1 for r in range(world))
            if case.get("tiny_chunks") and not case["closure"] and several and world > 1:
                assert out["pipelined"], f"{where}: the chunked step did not run"
            if "consolidated" in out:
                _check_state_dicts_equal(out["consolidated"], out["plain_sd"])
                _check_state_dicts_equal(out["reloaded_plain_sd"], out["plain_sd"])
        # The state is split, not copied: the shares add up to the plain optimizer's.
        assert (
            sum(results[r][c]["state_bytes"] for r in range(world))
            == (results[0][c]["total_state_bytes"])
        )


# Found by hypothesis: the never-used layer is the largest parameter, so the rank that owns it
# holds no state and the others more than an equal share of the state (not of the parameters).
_UNUSED_HEAVY = [
    {"seed": 0, "optimizer": "sgd", "vocab": 2, "d": 1, "widths": [], "tied": False,
     "frozen": False, "float64": True, "scalar": False, "groups": 1, "steps": 2, "closure": False,
     "scheduler": False, "add_group": False, "checkpoint": None, "tiny_chunks": False}
]  # fmt: skip


@SPAWNING
@given(world_size=st.integers(2, 4), case_list=st.lists(cases, min_size=2, max_size=4))
@example(world_size=3, case_list=_EVERY_FEATURE)
@example(world_size=3, case_list=_UNUSED_HEAVY)
def test_matches_plain_optimizer(tmp_path_factory, world_size, case_list):
    """Params after N steps == plain optimizer: tied, frozen, unused and 0-dim params, float32 +
    float64, several groups, closure, StepLR, add_param_group mid-training, both checkpoint forms
    (save, rebuild, load, continue == uninterrupted), state share, broadcast count."""
    tmpdir = str(tmp_path_factory.mktemp("ckpt"))
    results = run_distributed(run_training_cases, world_size, args=(case_list, tmpdir))
    check_training(results, case_list)


def test_matches_plain_optimizer_on_a_subgroup(tmp_path):
    """process_group=new_group([1, 2]) of a world of 3 (rank 0 outside it): group rank r is global
    rank r + 1, which the step's broadcasts and consolidate_state_dict must name (before, a
    mutation broadcasting from the group rank survived: the tests used only the world group and
    one-rank subgroups, where the two agree)."""
    cases = _EVERY_FEATURE[:2]  # a consolidated and a sharded checkpoint, chunked steps
    results = run_distributed(run_training_cases_on_subgroup, 3, args=(cases, str(tmp_path)))
    assert results[0] is None
    check_training(results[1:], cases)


@pytest.fixture(scope="module")
def ddp_results():
    case = dict(_ALL_ON, optimizer="adamw", float64=False, bucket_mb=0.0002)
    return run_distributed(run_with_ddp, 2, args=(case,))


@pytest.mark.parametrize("optimizer_first", [False, True])
@pytest.mark.parametrize("wrapper", ["bucketed", "torch"])
def test_composes_with_ddp(ddp_results, wrapper, optimizer_first):
    """BucketedDDP (or torch DDP) averages the gradients of per-rank batches, ShardedOptimizer
    shards the state: == one process with the plain optimizer on the whole batch (float64).
    Either may be built first."""
    results = [r[wrapper + " optimizer first" * optimizer_first] for r in ddp_results]
    for out in results:
        for ours, plain in zip(out["sharded"], out["plain"], strict=True):
            torch.testing.assert_close(ours, plain, rtol=1e-10, atol=1e-12)
        assert 0 < out["state_bytes"] < out["total_state_bytes"]
    assert sum(out["state_bytes"] for out in results) == results[0]["total_state_bytes"]


# (case, expected per rank: exception type or None, message pattern). Mismatches across ranks
# must raise on every rank (no hang).
ERRORS = {
    "params: not tensors": (TypeError, "optimizer can only optimize Tensors"),
    "params: a single tensor": (TypeError, "iterable of Tensors or dicts"),
    "params: empty": (ValueError, "ShardedOptimizer: params is empty"),
    "params: listed twice": (ValueError, "lists a parameter more than once"),
    "params: in two groups": (ValueError, "more than one parameter group"),
    "optimizer_cls: an instance": (TypeError, "optimizer_cls must be a torch.optim.Optimizer sub"),
    "optimizer_cls: a function": (TypeError, "optimizer_cls must be a torch.optim.Optimizer sub"),
    "optimizer_cls: bad value": (ValueError, "SGD rejected its arguments .*Invalid learning rate"),
    "optimizer_cls: unknown option": (TypeError, "SGD rejected its arguments.*betas"),
    "optimizer_cls: LBFGS": (TypeError, "optimizer_cls LBFGS cannot be sharded: .*whole param"),
    "optimizer_cls: step requires a closure": (TypeError, "_NeedsClosure cannot be sharded"),
    "process_group: wrong type": (TypeError, "process_group must be a .*ProcessGroup"),
    "process_group: not a member": ([None, ValueError], "rank 1\\) is not a member of process_g"),
    "process_group: positional, wrong type": (TypeError, "process_group must be a .*ProcessGroup"),
    "optimizer_class: with optimizer_cls too": (
        TypeError,
        "optimizer_class is ZeroRedundancyOptimizer's name for optimizer_cls; pass one of them",
    ),
    "optimizer_class: neither name": (
        TypeError,
        "missing the optimizer class: pass optimizer_cls \\(or ZeroRedundancyOptimizer's name",
    ),
    "optimizer_class: an instance": (TypeError, "optimizer_class must be a torch.optim.Optimizer"),
    "overlap_with_ddp: True": (NotImplementedError, "overlap_with_ddp=True is not supported"),
    "parameters_as_bucket_view: not a bool": (
        TypeError,
        "parameters_as_bucket_view must be a bool, got str",
    ),
    "ranks: shapes differ": (RuntimeError, "differs across ranks.*shape=\\(3, 4\\)"),
    "ranks: optimizer_cls rejects on one rank": (RuntimeError, "differs across ranks.*lr"),
    "ranks: lr differs": (RuntimeError, "differs across ranks.*param group 0 options"),
    "ranks: optimizer_cls differs": (RuntimeError, "differs across ranks.*Adam"),
    "ranks: LBFGS on one rank": (RuntimeError, "differs across ranks.*LBFGS"),
    "add_param_group: differs across ranks": (RuntimeError, "add_param_group: the added param"),
    "add_param_group: parameter already present": (ValueError, "already in another param group"),
    "add_param_group: not a dict": (TypeError, "param_group must be a dict, got list"),
    "state_dict: before consolidate": (RuntimeError, "not been consolidated.*consolidate_state"),
    "state_dict: on another rank": ([None, RuntimeError], "consolidated to rank 0, not this rank"),
    "state_dict: after a step": (RuntimeError, "not been consolidated on this rank since the last"),
    "consolidate_state_dict: to out of range": (ValueError, "to must be a rank in \\[0, 2\\)"),
    "consolidate_state_dict: to differs across ranks": (RuntimeError, "argument `to` differs"),
    "load_state_dict: groups differ": (ValueError, "2 group\\(s\\) of sizes \\[1, 1\\].* 1 of"),
    "load_state_dict: not a state dict": (TypeError, "expected a dict with 'state' and 'param_g"),
    "load_state_dict: given a shard": (ValueError, "load it with load_sharded_state_dict"),
    "load_sharded_state_dict: another rank's shard": (
        ValueError,
        "^ValueError: ShardedOptimizer.load_sharded_state_dict: this shard was saved by rank "
        "[01] of 2, this is rank [01]: each rank must load the shard it saved",
    ),
    "load_sharded_state_dict: another world size": (
        ValueError,
        "^ValueError: ShardedOptimizer.load_sharded_state_dict: this shard was saved at world "
        "size 1, this optimizer runs at world size 2",
    ),
    "load_sharded_state_dict: another model's shard": (ValueError, "saved for different param"),
    "shard_gradients: not a bool": (TypeError, "shard_gradients must be a bool, got str"),
    "shard_gradients: no BucketedDDP": (ValueError, "shard_gradients=True needs .*found none"),
    "shard_gradients: torch DDP": (ValueError, "wrapped by one BucketedDDP.*found none"),
    "shard_gradients: a BucketedDDP parameter not in the optimizer": (
        ValueError,
        "every parameter of the BucketedDDP in the optimizer; 'bias' is not",
    ),
    "shard_gradients: another process group": (ValueError, "use the same process group"),
    "shard_gradients: differs across ranks": (RuntimeError, "differs across ranks.*shard_grad"),
}


@pytest.fixture(scope="module")
def error_results(tmp_path_factory):
    return run_distributed(run_error_cases, 2, args=(str(tmp_path_factory.mktemp("err")),))


def test_error_table_is_complete():
    assert set(ERRORS) == set(CASES)


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(error_results, case):
    expected, pattern = ERRORS[case]
    per_rank = expected if isinstance(expected, list) else [expected] * len(error_results)
    for rank, (raised, want) in enumerate(
        zip((r[case] for r in error_results), per_rank, strict=True)
    ):
        if want is None:
            assert raised is None, (case, rank, raised)
        else:
            assert raised is not None, (case, rank, "did not raise")
            assert raised.startswith(f"{want.__name__}: "), (case, rank, raised)
            assert re.search(pattern, raised, re.S), (case, rank, raised)


def test_needs_initialized_process_group():
    with pytest.raises(RuntimeError, match=r"ShardedOptimizer: torch\.distributed is not init"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=0.1)


@pytest.mark.multigpu
def test_composes_with_ddp_nccl():
    """BucketedDDP and torch DDP + ShardedOptimizer on CUDA with NCCL (2 GPUs)."""
    case = dict(_ALL_ON, optimizer="adam", float64=False, bucket_mb=0.0002)
    for results in map(dict.values, run_distributed(run_with_ddp, 2, args=(case,), backend="nccl")):
        for out in results:
            for ours, plain in zip(out["sharded"], out["plain"], strict=True):
                torch.testing.assert_close(ours, plain, rtol=1e-10, atol=1e-12)


@pytest.mark.multigpu
def test_matches_plain_optimizer_nccl(tmp_path):
    """The same checks on CUDA with NCCL (2 GPUs)."""
    results = run_distributed(
        run_training_cases, 2, args=(_EVERY_FEATURE, str(tmp_path)), backend="nccl"
    )
    check_training(results, _EVERY_FEATURE)


@pytest.mark.gpu
def test_matches_plain_optimizer_nccl_one_gpu(tmp_path):
    """Every feature on one GPU with NCCL (world size 1: the optimizer's step, nothing else)."""
    results = run_distributed(
        run_training_cases, 1, args=(_EVERY_FEATURE, str(tmp_path)), backend="nccl"
    )
    check_training(results, _EVERY_FEATURE)


def test_hooks_and_loads_keep_the_plain_optimizers_contract():
    """load_state_dict runs its pre hooks (a replacement dict is what loads) and post hooks; an
    Adam checkpoint loaded into AdamW keeps AdamW's decoupled weight decay (the plain AdamW's
    __setstate__ rule; ShardedOptimizer copied the checkpoint's False back and trained as Adam);
    under Join a joined rank's shadow steps run the step hooks, as torch ZeRO's join hook's
    step() does (each failed before)."""
    results = run_distributed(hooks_and_loads, 2, timeout=120)
    for rank, r in enumerate(results):
        for key in ("load hooks", "lr", "decoupled"):
            assert r[f"ours/{key}"] == r[f"plain/{key}"], (rank, key, r[f"ours/{key}"])
        assert r["plain/load hooks"] == ["pre", "post"] and r["plain/lr"] == 0.123
        assert r["plain/decoupled"] is True
        assert r["join step hooks"] == [4, 4], (rank, r["join step hooks"])
