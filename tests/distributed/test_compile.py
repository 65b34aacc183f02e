"""BucketedDDP under torch.compile (real gloo processes): ``torch.compile(BucketedDDP(m))`` and
``BucketedDDP(torch.compile(m))``, with ShardedOptimizer (ZeRO-1/2), ``no_sync()`` and forwards
under ``torch.no_grad()``, against one float64 process on the whole batch; the graphs compiled
against torch DDP's. Bodies and models: tests/distributed/compile_cases.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from tests.distributed import compile_cases
from tests.distributed.harness import run_distributed
from tests.distributed.test_ddp import ONE_RUN, SEEDS, assert_close_tree

TOL = {"rtol": 1e-9, "atol": 1e-9}  # float64; AdamW's first steps divide by tiny moments

# (a) the wrapper compiled, (b) the model compiled inside it, (c) ZeRO-1/2, (d) no_sync / no_grad
# forwards; torch DDP compiled the same way for the graph counts.
AOT_CASES = [
    {"model": "mlp", "wrap": "ours", "compile": "outer", "pattern": "plain", "opt": "plain"},
    {"model": "attn", "wrap": "ours", "compile": "outer", "pattern": "no_sync", "opt": "plain"},
    {"model": "mlp", "wrap": "ours", "compile": "outer", "pattern": "no_grad", "opt": "zero2"},
    {"model": "attn", "wrap": "ours", "compile": "outer", "pattern": "no_grad", "opt": "zero1"},
    {"model": "mlp", "wrap": "ours", "compile": "outer", "pattern": "no_sync", "opt": "zero2"},
    {"model": "attn", "wrap": "ours", "compile": "inner", "pattern": "plain", "opt": "zero2"},
    {"model": "mlp", "wrap": "ours", "compile": "inner", "pattern": "no_sync", "opt": "zero1"},
    {"model": "norm", "wrap": "ours", "compile": "outer", "pattern": "no_grad", "opt": "plain"},
    {"model": "norm", "wrap": "ours", "compile": "none", "pattern": "no_grad", "opt": "plain"},
    {"model": "mlp", "wrap": "torch", "compile": "outer", "pattern": "no_sync", "opt": "plain"},
    {"model": "mlp", "wrap": "torch", "compile": "outer", "pattern": "no_grad", "opt": "plain"},
]
INDUCTOR_CASES = [
    {"model": "mlp", "wrap": "ours", "compile": "outer", "pattern": "no_sync", "opt": "zero2"},
    {"model": "mlp", "wrap": "ours", "compile": "inner", "pattern": "plain", "opt": "zero1"},
]


def _check_training(case: dict, runs: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Every rank's gradients before each step and parameters after it equal the reference's;
    under ZeRO-2 a rank holds the gradients it owns (the others are ``None``), every one of
    them on some rank."""
    for step in range(compile_cases.STEPS):
        want = reference["grads"][step]
        held = set()
        for rank, run in enumerate(runs):
            got = run["grads"][step]
            what = f"{case} rank {rank} step {step}"
            if case["opt"] == "zero2":
                held |= {n for n, g in got.items() if g is not None}
                got = {n: g for n, g in got.items() if g is not None}
                assert_close_tree(got, {n: want[n] for n in got}, f"{what} gradients", **TOL)
            else:
                assert_close_tree(got, want, f"{what} gradients", **TOL)
            assert_close_tree(run["params"][step], reference["params"][step], what, **TOL)
        if case["opt"] == "zero2":
            assert held == {n for n, g in want.items() if g is not None}, f"{case} step {step}"
    assert runs[0]["grads"][0]["unused.weight"] is None, "an unused parameter got a gradient"


def _check_graphs(case: dict, runs: list[dict[str, Any]]) -> None:
    """The graphs torch DDP's compile gives (measured): one per grad mode the model runs in, no
    recompile when no_sync() or the wrapper's state changes; each holds the whole forward."""
    want = 2 if case["pattern"] == "no_grad" else 1
    for rank, run in enumerate(runs):
        assert run["frames"] == want, f"{case} rank {rank}: {run['frames']} graphs compiled"
        assert run["ops"] == want * runs[0]["ops"] // runs[0]["frames"] > 0, case
        if case["compile"] == "inner":  # the model alone is traced: whole, no break
            assert run["graph_breaks"] == 0, f"{case} rank {rank}: {run['graph_breaks']} breaks"


def _check_cases(todo: list[dict], results: list[list[dict[str, Any]]]) -> None:
    by_case = [[results[r][i] for r in range(len(results))] for i in range(len(todo))]
    eager_norm = None
    for case, runs in zip(todo, by_case, strict=True):
        if case["compile"] != "none":
            _check_graphs(case, runs)
        if case["model"] != "norm":
            _check_training(case, runs, runs[0]["reference"])
        elif case["compile"] == "none":
            eager_norm = runs
    norm = [runs for case, runs in zip(todo, by_case, strict=True) if case["model"] == "norm"]
    for compiled in norm[:-1] if eager_norm is not None else []:  # against the eager wrapper
        for rank, (got, want) in enumerate(zip(compiled, eager_norm, strict=True)):
            assert_close_tree(got["buffers"], want["buffers"], f"norm rank {rank} buffers", **TOL)
            for step, params in enumerate(got["params"]):
                assert_close_tree(params, want["params"][step], f"norm rank {rank} {step}", **TOL)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@given(seed=SEEDS)
@ONE_RUN
def test_compiled_wrapper_and_model_match_single_process(backend, seed):
    todo = [dict(case, backend=backend) for case in (AOT_CASES if backend == "aot_eager"
                                                     else INDUCTOR_CASES)]  # fmt: skip
    results = run_distributed(compile_cases.cases, 2, args=(seed, todo), timeout=240)
    _check_cases(todo, results)


@given(seed=SEEDS)
@ONE_RUN
def test_compiled_wrapper_backward_rules(seed):
    """Two backwards of one forward, two forwards in one loss, a loss kept by the forward (alone
    or first): each synchronizes, as in eager (docs/ddp.md). fullgraph=True over the wrapper
    raises, naming the function Dynamo skips; over the model inside it, it compiles."""
    runs = run_distributed(compile_cases.graph_patterns, 2, args=(seed, "aot_eager"), timeout=240)
    single = runs[0]["single"]
    for rank, run in enumerate(runs):
        for pattern, got, want in zip(compile_cases.PATTERNS, run["ours"], single, strict=True):
            assert_close_tree(got, want, f"rank {rank} {pattern} gradients", **TOL)
        assert "BucketedDDP._pre_forward" in run["fullgraph"], run["fullgraph"]
        assert run["inner_fullgraph"] == "no error", run["inner_fullgraph"]
