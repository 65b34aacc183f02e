"""BucketedDDP.register_comm_hook with torch's hooks (allreduce, fp16/bf16 compression, PowerSGD,
fp16_compress_wrapper(PowerSGD)) against torch DDP with the same hook and state, on gloo, world
sizes 2-4. (torch 2.13's batched_powerSGD_hook fails its own assertion under torch DDP too.)

Bodies in tests/distributed/hook_cases.py; one spawned run covers every hook and the errors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from tests.distributed import hook_cases
from tests.distributed.harness import run_distributed
from tests.distributed.test_ddp import (
    ONE_RUN,
    SEEDS,
    WORLD_SIZES,
    assert_close_tree,
    assert_equal_tree,
)
from torch_flashsys.distributed._comm_hook import GradBucket

# (error type, text) expected for each misuse in hook_cases.errors
ERRORS = {
    "twice": ("RuntimeError", "can be registered only once"),
    "compression": ("ValueError", "grad_compression='bf16'; the two are exclusive"),
    "not_callable": ("TypeError", "hook must be callable, got str"),
    "arity": ("TypeError", "two positional arguments (state, bucket)"),
    "after_backward": ("RuntimeError", "before the first synchronizing backward"),
    "zero2_after": ("ValueError", "not supported with ZeRO-2"),
    "zero2_before": ("ValueError", "without a communication hook"),
    "subgroup_none": ("ValueError", "reduces over a subgroup"),
    "other_group": ("ValueError", "the state's process group is not the BucketedDDP's"),
    "mismatch": ("RuntimeError", "the communication hook differs across ranks"),
}


def assert_hook_result(
    got: dict, want: dict, hook: str, what: str, world: int, sensitivity: dict | None = None
) -> None:
    """Same algorithm on the same inputs: equal up to float64 summation order. Through 16-bit
    values (one step, ``want["spread"]`` from the harness): the ranks' 16-bit terms
    ``c_r = g_r / world`` are summed in the 16-bit type in an order that depends on the
    buckets' sizes (gloo's ring chunks); two orders of ``world`` terms differ by at most
    ``2 (world - 1)`` roundings of partial sums, each at most ``eps / 2 * sum_r |c_r|``, and a
    float64 ulp of difference in ``g_r`` can flip its rounding (``eps * |c_r|``). So each
    gradient element within ``world * eps * sum_r |c_r|``, each parameter within ``LR`` times
    that (one SGD step) and float64's rounding. Otherwise (PowerSGD's several steps), within
    three roundings of each tensor's largest value.

    ``sensitivity`` (fp16 PowerSGD over five steps): rounding differences of the inputs grow
    through PowerSGD's orthogonalizations (torch's own fp16 run differs from its float64 run by
    as much as compression changes the result); the two wrappers' runs, whose float64 sums
    differ in their last bits (the bucket layouts of the first step), must stay within half of
    that per tensor (1/500 to 1/20 of it measured; a hook that skipped the fp16 wrapper, the
    error feedback or the decompression would differ by about all of it)."""
    low = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp16_powerSGD": torch.float16}
    if sensitivity is not None:
        for part in ("params", "grads"):
            for name, w in want[part].items():
                diff = (got[part][name] - w).abs().max().item()
                bound = 0.5 * (sensitivity[part][name] - w).abs().max().item()
                assert diff <= bound, f"{what} {part}/{name}: differs by {diff} > {bound}"
        return
    if hook not in low:
        assert_close_tree(got, want, f"{what} vs torch DDP", rtol=1e-9, atol=1e-12)
        return
    eps = torch.finfo(low[hook]).eps
    for part in ("params", "grads"):
        for name, w in want[part].items():
            g = got[part][name]
            assert (g is None) == (w is None), f"{what} {part}/{name}: {g} vs {w}"
            if w is None:
                continue
            if "spread" in want:
                bound = world * eps * want["spread"][name]
                if part == "params":
                    bound = hook_cases.LR * bound + 1e-12 * (1 + w.abs())
                over = ((g - w).abs() - bound).max().item()
                assert over <= 0, f"{what} {part}/{name}: over its rounding bound by {over}"
            else:
                bound = 3 * eps * w.abs().max().item()
                diff = (g - w).abs().max().item()
                assert diff <= bound, f"{what} {part}/{name}: differs by {diff} > {bound}"


@pytest.mark.parametrize("world", WORLD_SIZES)
@given(seed=SEEDS)
@ONE_RUN
def test_torch_hooks_match_torch_ddp(world, seed):
    runs = run_distributed(hook_cases.equivalence, world, args=(seed,), timeout=300)
    for rank, run in enumerate(runs):
        errors = run.pop("errors")
        plain = run.pop("plain/mlp")
        for key in [k for k in run if "/ours[" in k]:
            base = key.rsplit("/", 1)[0]
            what = f"rank {rank} {key}"
            hook = key.split("/")[0]
            # fp16 PowerSGD: against the sensitivity to rounding of torch's own run (its float64
            # run: the same algorithm without the fp16 wrapper)
            f64 = run["powerSGD/mlp/torch"] if hook == "fp16_powerSGD" else None
            assert_hook_result(run[key], run[f"{base}/torch"], hook, what, world, f64)
            assert_equal_tree(run[key], runs[0][key], f"{what} vs rank 0")
        for name in ("powerSGD", "fp16_powerSGD"):  # compression did happen (and is lossy)
            got = run[f"{name}/mlp/ours[None]"]["grads"]["b.weight"]
            assert not torch.allclose(got, plain["grads"]["b.weight"]), name
        for case, (error, text) in ERRORS.items():
            assert errors[case].startswith(f"{error}: "), (rank, case, errors[case])
            assert text in errors[case], (rank, case, errors[case])
        assert errors["unfinished_no_sync"] == "ValueError: injected in backward / then: no error"
        assert errors["unfinished_sync"].startswith(
            "ValueError: injected in backward / then: "
            "RuntimeError: BucketedDDP: the previous backward did not finish"
        )
        assert errors["after_mismatch"] == "no error", errors["after_mismatch"]
        assert errors["probe"] == str(float(world))


def test_grad_bucket_contract():
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    buffer = torch.arange(10.0)
    bucket = GradBucket(buffer, params, [6, 4], index=1, count=2)
    assert bucket.index() == 1 and bucket.is_last()
    assert bucket.buffer() is buffer and bucket.parameters() == params
    grads = bucket.gradients()
    assert [g.shape for g in grads] == [(2, 3), (4,)]
    assert grads[1].data_ptr() == buffer[6:].data_ptr()  # views: a hook may write through them
    half = buffer.half()
    bucket.set_buffer(half)
    assert bucket.buffer() is half and bucket.gradients()[0].dtype == torch.float16
    with pytest.raises(ValueError, match=r"GradBucket\.set_buffer: buffer must be a tensor of 10"):
        bucket.set_buffer(torch.zeros(3))


@pytest.mark.gpu
def test_nccl_hooks_world_size_one():
    """NCCL, one GPU: every hook (bf16 as torch itself accepts it with NCCL) vs torch DDP."""
    (run,) = run_distributed(hook_cases.nccl_run, 1, args=(0,), backend="nccl", timeout=300)
    for key in [k for k in run if k.endswith("/ours")]:
        hook = key.split("/")[0]
        assert_hook_result(run[key], run[key.replace("/ours", "/torch")], hook, key, 1)


@pytest.mark.multigpu
def test_nccl_hooks_two_gpus():
    runs = run_distributed(hook_cases.nccl_run, 2, args=(1,), backend="nccl", timeout=300)
    for rank, run in enumerate(runs):
        for key in [k for k in run if k.endswith("/ours")]:
            hook = key.split("/")[0]
            assert_hook_result(
                run[key], run[key.replace("/ours", "/torch")], hook, f"{rank} {key}", 2
            )
