"""BucketedDDP against single-process full-batch training and torch DDP (real gloo processes).

Each distributed test spawns one run that loops over many configurations (spawning costs seconds);
the models, data and per-rank bodies live in tests/distributed/ddp_cases.py.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from tests.distributed import ddp_cases
from tests.distributed.harness import run_distributed
from torch_flashsys.distributed import BucketedDDP
from torch_flashsys.distributed._buckets import Bucket, assign_buckets

# One example per distributed test (each spawns processes); no shrinking of a random seed.
ONE_RUN = settings(max_examples=1, deadline=None, phases=[Phase.reuse, Phase.generate])
SEEDS = st.integers(0, 2**31 - 1)
# Every world size the equivalence tests of issue 16 cover, each on every run (a random one
# per run would leave a failure at one size to a later run).
WORLD_SIZES = [2, 3, 4]


def assert_close_tree(got: Any, want: Any, what: str, **tol: float) -> None:
    """Recursively compare dicts of tensors (``None`` must match ``None``: unused parameters)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), f"{what}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_close_tree(got[key], want[key], f"{what}/{key}", **tol)
    elif want is None or got is None:
        assert got is None and want is None, f"{what}: {got!r} vs {want!r} (None = no gradient)"
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}", **tol)
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def assert_equal_tree(got: Any, want: Any, what: str) -> None:
    assert_close_tree(got, want, what, rtol=0.0, atol=0.0)


# ---------------------------------------------------------------- bucket assignment (no processes)

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from(DTYPES)), min_size=1, max_size=25
    ),
    limit=st.one_of(st.none(), st.just(0), st.integers(1, 400)),
)
@settings(max_examples=200, deadline=None)
def test_bucket_assignment_invariants(shapes, limit):
    params = [torch.empty(n, dtype=dt, device="meta") for n, dt in shapes]
    nbytes = [p.numel() * p.element_size() for p in params]
    buckets = assign_buckets(params, limit)
    assert sorted(i for b in buckets for i in b) == list(range(len(params)))  # each exactly once
    for b in buckets:
        assert len({params[i].dtype for i in b}) == 1, "one dtype per bucket"
        if limit is not None and len(b) > 1:  # soft cap (torch DDP's): closes once it is reached
            assert limit > 0 and sum(nbytes[i] for i in b[:-1]) < limit, "bucket past the limit"
    for dt in {p.dtype for p in params}:
        same = [b for b in buckets if params[b[0]].dtype == dt]
        flat = [i for b in same for i in b]
        assert flat == sorted(flat, reverse=True), "reverse registration order"
        if limit is None:
            assert len(same) == 1
        elif limit > 0:  # greedy: a bucket closes only when it holds at least the limit
            for a, _ in itertools.pairwise(same):
                assert sum(nbytes[i] for i in a) >= limit
    lasts = [b[-1] for b in buckets]
    assert lasts == sorted(lasts, reverse=True), "launch order: last gradient ready first"


def test_bucket_views_adopt_existing_grads():
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    params[0].grad = torch.randn(3, 4)
    before = params[0].grad.clone()
    bucket = Bucket(params, ["a", "b"])
    bucket.bind(torch.zeros(bucket.size))
    assert params[1].grad is None
    torch.testing.assert_close(params[0].grad, before, rtol=0, atol=0)
    assert params[0].grad.data_ptr() == bucket.buffer.data_ptr()  # a view into the flat buffer
    params[1].grad = torch.ones(5)  # e.g. AccumulateGrad after zero_grad(set_to_none=True)
    bucket.adopt_grad(1)
    assert params[1].grad.data_ptr() == bucket.views[1].data_ptr()
    assert bucket.buffer[12:17].eq(1).all()


def test_errors_without_process_group():
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match=r"BucketedDDP: module must be a torch\.nn\.Module"):
        BucketedDDP("model")
    with pytest.raises(RuntimeError, match=r"BucketedDDP: torch\.distributed is not initialized"):
        BucketedDDP(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- training equivalence


@pytest.mark.parametrize("world", [2, 3])
@given(seed=SEEDS, small=st.floats(0.0002, 0.002))
@ONE_RUN
def test_matches_single_process_and_torch_ddp(world, seed, small):
    """Tied, frozen, unused-branch, BatchNorm and mixed-dtype models; bucket None / 0 / small /
    default; 3 AdamW steps (weight decay: a zero gradient and no gradient differ)."""
    sizes = [None, 0, small, 25.0]
    runs = run_distributed(ddp_cases.equivalence, world, args=(seed, sizes), timeout=240)
    single = runs[0]
    for rank, run in enumerate(runs):
        for kind, res in run.items():
            for bs in sizes:
                ours = res[f"ours[{bs}]"]
                what = f"rank {rank} {kind} bucket_size_mb={bs}"
                assert ours.pop("views"), f"{what}: param.grad is not a view into a bucket"
                # "mixed" passes float64 gradients through a float32 layer: float32 tolerances
                # (float64's drew a 1.1e-7 difference from one process, 3 ranks, once)
                tol = {"rtol": 1e-5, "atol": 1e-6} if kind == "mixed" else {}
                assert_close_tree(ours, res["torch"], f"{what} vs torch DDP", **tol)
                if "single" in single[kind]:
                    assert_close_tree(
                        ours, single[kind]["single"], f"{what} vs single process", **tol
                    )
                replica = {k: v for k, v in ours.items() if k != "buffers"}  # buffers: per rank
                want = {k: v for k, v in runs[0][kind][f"ours[{bs}]"].items() if k != "buffers"}
                assert_equal_tree(replica, want, f"{what} vs rank 0")
            if kind == "norm":
                res["ours[no_bcast]"].pop("views")
                assert_close_tree(res["ours[no_bcast]"], res["torch[no_bcast]"], f"{kind} no bcast")
        assert run["branches"]["torch"]["grads"]["never.weight"] is None  # the harness itself


@given(seed=SEEDS)
@ONE_RUN
def test_no_sync_compression_finish_subgroups(seed):
    world = 3
    runs = run_distributed(ddp_cases.behaviours, world, args=(seed,), timeout=240)
    single = runs[0]
    for rank, run in enumerate(runs):
        for key in [k for k in run if k.startswith("no_sync/")]:
            res = run[key]
            want = res["torch"] if "torch" in res else single[key]["single"]
            for variant in ("ours[0]", "ours[None]", "ours[every]"):
                got = res[variant]
                assert got.pop("views"), f"rank {rank} {key} {variant}: grads are not bucket views"
                assert_close_tree(got, want, f"rank {rank} {key} {variant}")

        plain = run["compress/plain"]
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            ours, theirs = run[f"compress/ours_{name}"], run[f"compress/torch_{name}"]
            eps = torch.finfo(dtype).eps
            for param, g in plain.items():
                scale = g.abs().max().item()
                # Same algorithm as torch's hook: equal up to a couple of low-precision roundings;
                # against full precision: within (world + 1) roundings of the largest value.
                assert (ours[param] - theirs[param]).abs().max() <= 2 * eps * scale, (name, param)
                assert (ours[param] - g).abs().max() <= (world + 1) * eps * scale, (name, param)
                # The average came back from a low-precision buffer: every value fits the dtype.
                assert torch.equal(ours[param], ours[param].to(dtype).to(g.dtype)), (name, param)

        assert run["finish/unchanged"], "finish_gradient_synchronization changed synced grads"
        assert run["finish/probe"] == sum(range(1, world + 1)), "stray collective from finish()"
        assert run["hook_calls_for_twice_used_param"] == 2, "one post-accumulate hook per backward"

        assert run["comm/no_sync"] == 0, "no_sync() communicated"
        n_trainable = 4  # Frozen: a.weight, a.bias, c.weight, c.bias; bucket_size_mb=0
        assert run["comm/sync"] == run["comm/buckets"] == n_trainable, "one all-reduce per bucket"
        assert run["comm/launched_in_hooks"] == n_trainable, "not launched during backward"

        assert run["dropped/collected"], "a dropped BucketedDDP stayed alive"
        assert run["dropped/probe"] == sum(range(1, world + 1)), "hooks of a dropped wrapper ran"

        keys = run["keys"]
        assert keys["module"] == keys["plain"]
        assert keys["ours"] == keys["torch"] == [f"module.{k}" for k in keys["plain"]]

        assert run["subgroup/ours"].pop("views")
        assert_close_tree(run["subgroup/ours"], run["subgroup/single"], f"rank {rank} subgroup")
    assert_equal_tree(runs[1]["subgroup/ours"], runs[2]["subgroup/ours"], "subgroup replicas")


# ---------------------------------------------------------------- constructor errors


@pytest.fixture(scope="module")
def error_runs() -> list[dict[str, str]]:
    names = list(ddp_cases.ERROR_CASES)
    return run_distributed(ddp_cases.constructor_errors, 3, args=(names,), timeout=120)


@pytest.mark.parametrize("case", list(ddp_cases.ERROR_CASES))
def test_constructor_error_table(error_runs, case):
    _, error, text = ddp_cases.ERROR_CASES[case]
    for rank, run in enumerate(error_runs):
        got = run[case]
        assert got.startswith(f"{error.__name__}: BucketedDDP: "), f"rank {rank}: {got}"
        assert text in got, f"rank {rank}: expected {text!r} in {got!r}"
        assert run["probe"] == str(float(len(error_runs))), "ranks out of step after the errors"


# ---------------------------------------------------------------- NCCL (2 GPUs)


@pytest.mark.multigpu
@given(seed=SEEDS)
@ONE_RUN
def test_nccl_matches_torch_ddp(seed):
    runs = run_distributed(ddp_cases.nccl_equivalence, 2, args=(seed,), backend="nccl", timeout=300)
    for rank, run in enumerate(runs):
        for key in [k for k in run if "/ours[" in k]:
            kind = key.split("/")[0]
            assert run[key].pop("views"), f"rank {rank} {key}: grads are not bucket views"
            assert_close_tree(run[key], run[f"{kind}/torch"], f"rank {rank} {key}")
            assert_equal_tree(run[key], runs[0][key], f"rank {rank} {key} vs rank 0")
        eps = torch.finfo(torch.bfloat16).eps
        for param, g in run["compress/torch_bf16"].items():
            diff = (run["compress/ours_bf16"][param] - g).abs().max().item()
            assert diff <= 2 * eps * g.abs().max().item(), (rank, param)
            got = run["compress/ours_bf16"][param]
            assert torch.equal(got, got.bfloat16().to(got.dtype)), (rank, param)


# ---------------------------------------------------------------- the default loop (issue 18)


@given(world=st.integers(2, 4), seed=SEEDS, bucket_mb=st.sampled_from([None, 0, 0.0005, 25.0]))
@ONE_RUN
def test_default_loop_matches_single_process_without_copies(world, seed, bucket_mb):
    """backward; step; zero_grad() and five other placements of zero_grad (LOOP_PATTERNS), on
    tied, frozen, unused-branch and mixed-dtype models: equal to one process on the full batch
    and to torch DDP; param.grad stays a bucket view; and after the first step no gradient is
    copied into the buckets (AccumulateGrad adds into the views), except the first parameter
    of each backward, whose gradient arrives before BucketedDDP can point it. no_sync
    accumulation also with the buckets' memory kept between steps (release_between_steps=False)
    and with zero gradients already there at the first forward."""
    runs = run_distributed(ddp_cases.default_loop, world, args=(seed, bucket_mb), timeout=300)
    check_default_loop(runs, bucket_mb)


def check_default_loop(runs: list[dict], bucket_mb: float | None) -> None:
    for rank, run in enumerate(runs):
        for key, res in run.items():
            what = f"rank {rank} {key} bucket_size_mb={bucket_mb}"
            ours, pattern = res["ours"], key.split("/")[1]
            views = ours.pop("views")  # "manual" ends with the grads the user put there
            assert views or pattern == "manual", f"{what}: param.grad is not a bucket view"
            copies = ours.pop("copies")
            # the buckets' memory is freed by the forward after a step that left every grad None
            freed = pattern in ("default", "no_sync", "before")
            released = ours.pop("released")
            assert released[1:] == [freed] * (len(released) - 1), f"{what}: released {released}"
            # "mixed" passes float64 gradients through a float32 layer: float32 tolerances
            tol = {"rtol": 1e-5, "atol": 1e-6} if key.startswith("mixed") else {}
            assert_close_tree(ours, res["torch"], f"{what} vs torch DDP", **tol)
            assert_close_tree(ours, runs[0][key]["single"], f"{what} vs single process", **tol)
            # Per backward after the first step (the first one adopts whatever was there).
            later = copies[2:] if pattern == "no_sync" else copies[1:]
            if pattern == "zeros":
                assert max(later) == 0, f"{what}: grads already views, yet copies {copies}"
            elif pattern == "manual":  # the replaced grads are copied in, nothing else
                replaced = sum(g is not None for g in list(res["torch"]["grads"].values())[::2])
                assert max(later) <= replaced + 1, f"{what}: copies {copies}"
            else:
                assert max(later) <= 1, f"{what}: copies into the buckets {copies}"
            # Accumulation with the buckets' memory kept between steps, or with gradients
            # already there at the first forward: the synchronizing backward must keep what the
            # no_sync micro-batch accumulated in the buckets (before, a mutation that zeroed it
            # survived: these backwards start from the shared storage, the others do not).
            for variant, theirs, single, kept in (
                ("ours_keep", "torch", "single", [False] * len(released)),
                ("ours_warm", "torch_warm", "single_warm", [False] + [True] * (len(released) - 1)),
            ):
                if variant not in res:
                    continue
                got = res[variant]
                where = f"{what} {variant}"
                assert got.pop("views"), f"{where}: param.grad is not a bucket view"
                assert max(got.pop("copies")[2:]) <= 1, f"{where}: copies into the buckets"
                assert got.pop("released") == kept, f"{where}: released"
                assert_close_tree(got, res[theirs], f"{where} vs {theirs}", **tol)
                assert_close_tree(got, runs[0][key][single], f"{where} vs {single}", **tol)
            if "ours_copying" in res:  # the control: without pointing, every gradient is copied
                control = res["ours_copying"]
                control.pop("views")
                control.pop("released")
                # every model here has >= 2 parameters with a gradient in every backward
                assert min(control.pop("copies")[1:]) >= 2, f"{what}: control"
                assert_close_tree(control, res["torch"], f"{what} copy path vs torch DDP", **tol)


@pytest.mark.gpu
def test_nccl_world_size_one():
    """One GPU, NCCL: BucketedDDP against torch DDP (bucket sizes, compression) and the loop
    people run (copies into the buckets counted on CUDA's autograd thread)."""
    (run,) = run_distributed(ddp_cases.nccl_equivalence, 1, args=(0,), backend="nccl", timeout=300)
    for key in [k for k in run if "/ours[" in k]:
        assert run[key].pop("views"), f"{key}: grads are not bucket views"
        assert_close_tree(run[key], run[f"{key.split('/')[0]}/torch"], key)
    runs = run_distributed(ddp_cases.default_loop, 1, args=(1, 25.0), backend="nccl", timeout=300)
    check_default_loop(runs, 25.0)


# ------------------------------------------------- gradient memory between steps (issue 30)


@pytest.mark.parametrize("world", [1, 2])
def test_forward_after_zero_grad_frees_the_buckets(world):
    """After zero_grad() (every grad None) BucketedDDP's forward frees the kept buckets'
    memory, so the activations can use it, and the backward gives the buckets buffers again;
    grads zeroed in place (set_to_none=False) keep theirs."""
    for rank, out in enumerate(run_distributed(ddp_cases.release_between_steps, world)):
        assert out == {
            "had_buffers": True,
            "freed_by_forward": True,
            "none_left": True,
            "views_after_backward": True,
            "zeroed_views_kept": True,
        }, f"rank {rank}: {out}"


@given(
    world=st.integers(2, 3),
    seed=SEEDS,
    bucket_mb=st.sampled_from([None, 0, 0.0005, 25.0]),
    patterns=st.lists(st.sampled_from(ddp_cases.LOOP_PATTERNS), min_size=4, max_size=6),
)
@ONE_RUN
def test_loop_patterns_mixed_across_steps_match_torch_ddp(world, seed, bucket_mb, patterns):
    """A different zero_grad placement, accumulation or hand-set grads at every step, so the
    buckets move between shared storage, released buffers, buffers allocated during the
    backward and buffers kept by views: equal to one process and to torch DDP throughout; the
    forward finds the buffers released exactly when the step before ended with every grad None."""
    runs = run_distributed(ddp_cases.mixed_loop, world, args=(seed, bucket_mb, patterns))
    for rank, run in enumerate(runs):
        for kind, res in run.items():
            what = f"rank {rank} {kind} {patterns} bucket_size_mb={bucket_mb}"
            ours = res["ours"]
            ours.pop("copies")
            views, released = ours.pop("views"), ours.pop("released")
            assert views or patterns[-1] == "manual", f"{what}: param.grad is not a bucket view"
            tol = {"rtol": 1e-5, "atol": 1e-6} if kind == "mixed" else {}
            assert_close_tree(ours, res["torch"], f"{what} vs torch DDP", **tol)
            assert_close_tree(ours, runs[0][kind]["single"], f"{what} vs single process", **tol)
            # the step before left every grad None: default / no_sync end with zero_grad(), and
            # "before" / "between" zero_grad() themselves before the forward of their step
            for step in range(1, len(patterns)):
                freed = patterns[step - 1] in ("default", "no_sync") or patterns[step] == "before"
                assert released[step] == freed, f"{what}: step {step} released {released}"


# ------------------------------------------- backwards that do not go through the wrapper


@given(seed=SEEDS)
@ONE_RUN
def test_backwards_outside_the_wrapper_stay_local(seed):
    """A backward through ``.module`` (a diagnostic on rank 0 alone, before the first forward and
    between steps; a weight penalty on every rank after the synchronizing backward) accumulates
    locally and communicates nothing, as under torch DDP: gradients, diagnostics and parameters
    equal torch DDP's on every rank (before, rank 0's diagnostic paired its all-reduces with
    rank 1's training backward: silently different weights)."""
    runs = run_distributed(ddp_cases.local_backwards, 2, args=(seed,), timeout=60)
    for rank, run in enumerate(runs):
        ours, theirs = run["ours"], run["torch"]
        what = f"rank {rank}"
        assert ours["probe_collectives"] == ([0, 0] if rank == 0 else []), what
        assert len(ours["probe"]) == len(theirs["probe"]), what
        for got, want in zip(ours["probe"], theirs["probe"], strict=True):
            assert_close_tree(got, want, f"{what} diagnostic gradients")
        for step, (got, want) in enumerate(zip(ours["grads"], theirs["grads"], strict=True)):
            assert_close_tree(got, want, f"{what} step {step} gradients")
        assert_close_tree(ours["params"], theirs["params"], f"{what} parameters")
    assert_equal_tree(runs[0]["ours"]["params"], runs[1]["ours"]["params"], "replicas")


@given(
    seed=SEEDS,
    patterns=st.lists(st.sampled_from(ddp_cases.GRAPH_PATTERNS), min_size=3, max_size=5),
)
@example(seed=0, patterns=list(ddp_cases.GRAPH_PATTERNS))
@settings(max_examples=1, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
def test_backward_patterns_of_the_wrapper_synchronize(seed, patterns):
    """The backwards that do go through the wrapper's forward still synchronize: two backwards
    of one forward (retain_graph), two forwards in one backward, a gradient penalty through
    autograd.grad(create_graph=True), non-reentrant activation checkpointing, a loss the forward
    keeps in an attribute instead of returning it (alone, or reaching some parameters before the
    output does): equal to one process on the whole batch at every step."""
    runs = run_distributed(ddp_cases.graph_patterns, 2, args=(seed, patterns), timeout=60)
    single = runs[0]["single"]
    for rank, run in enumerate(runs):
        ours = run["ours"]
        for step, (got, want) in enumerate(zip(ours["grads"], single["grads"], strict=True)):
            assert_close_tree(got, want, f"rank {rank} step {step} ({patterns[step]}) gradients")
        assert_close_tree(ours["params"], single["params"], f"rank {rank} {patterns} parameters")


# ------------------------------------------------------------------------- copies


@given(seed=SEEDS)
@ONE_RUN
def test_deepcopy_and_averaged_model(seed):
    """copy.deepcopy of a wrapper is a wrapper over a deep copy of the module (its own
    parameters) that trains as torch DDP's copy does, leaving the original alone;
    torch.optim.swa_utils.AveragedModel takes a wrapper; a wrapper over a group other than the
    default one cannot be copied (as torch DDP: the copy is rebuilt on the default group)."""
    runs = run_distributed(ddp_cases.copies, 2, args=(seed,), timeout=60)
    for rank, run in enumerate(runs):
        what = f"rank {rank}"
        for kind in ("torch", "ours"):
            assert run[f"{kind}/separate"], f"{what} {kind}: the copy shares parameters"
            assert run[f"{kind}/original_unchanged"], f"{what} {kind}: training the copy moved it"
            assert_close_tree(run[f"{kind}/averaged"], run[f"{kind}/averaged_want"], what)
        assert_close_tree(run["ours/params"], run["torch/params"], f"{what} trained copy")
        assert run["subgroup"].startswith(
            "RuntimeError: BucketedDDP: only a wrapper over the default process group"
        ), run["subgroup"]
    assert_equal_tree(runs[0]["ours/params"], runs[1]["ours/params"], "replicas of the copy")


@given(seed=SEEDS)
@ONE_RUN
def test_require_backward_grad_sync(seed):
    """Setting require_backward_grad_sync (torch DDP's attribute, the state no_sync() toggles)
    to False makes the next forward's backward local, True synchronizing again: gradients equal
    torch DDP's; it reads False inside no_sync(); a non-bool raises TypeError."""
    runs = run_distributed(ddp_cases.require_backward_grad_sync, 2, args=(seed,), timeout=60)
    for rank, run in enumerate(runs):
        what = f"rank {rank}"
        assert run["ours/read"] == run["torch/read"] == [True, False, True], what
        assert_close_tree(run["ours/local"], run["torch/local"], f"{what} local backward")
        assert_close_tree(run["ours/synced"], run["torch/synced"], f"{what} synchronized")
        assert run["non_bool"] == (
            "TypeError: BucketedDDP.require_backward_grad_sync must be a bool, got int"
        ), run["non_bool"]
