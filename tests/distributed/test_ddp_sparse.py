"""BucketedDDP with sparse gradients (nn.Embedding / nn.EmbeddingBag, sparse=True) on real gloo
process groups (world sizes 2-4), against torch DDP and single-process training.

Bodies in tests/distributed/sparse_cases.py; one spawned run covers every model and option.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from tests.distributed import sparse_cases
from tests.distributed.harness import run_distributed
from tests.distributed.test_ddp import (
    ONE_RUN,
    SEEDS,
    WORLD_SIZES,
    assert_close_tree,
    assert_equal_tree,
)
from torch_flashsys.distributed._sparse import SparseReduction, sparse_gradient_params

SPARSE = "torch.sparse_coo"


def test_sparse_parameters_are_found_as_torch_ddp_finds_them():
    model = sparse_cases.SparseNet("tied")
    dense_emb = torch.nn.Embedding(3, 2)  # sparse=False: a dense parameter
    model.add_module("dense_emb", dense_emb)
    assert sparse_gradient_params(model) == {id(model.emb.weight), id(model.bag.weight)}


@pytest.mark.parametrize("world", WORLD_SIZES)
@given(seed=SEEDS)
@ONE_RUN
def test_sparse_gradients_match_torch_ddp_and_single_process(world, seed):
    """Sparse (and, tied to a dense use, dense) gradients: averaged like torch DDP's, sparse and
    coalesced where torch's are, ``None`` where no rank had one; bucket sizes 0 and None;
    no_sync accumulation; ZeRO-1 and ZeRO-2 (SGD with momentum) give single-process results."""
    runs = run_distributed(sparse_cases.equivalence, world, args=(seed,), timeout=240)
    torch_runs = run_distributed(sparse_cases.torch_reference, world, args=(seed,), timeout=120)
    for run, torch_run in zip(runs, torch_runs, strict=True):
        for key, res in torch_run.items():
            run[key]["torch"] = res
        assert all("torch" in res for key, res in run.items() if key.startswith("plain/"))
    single = runs[0]
    # F.embedding(sparse=True) on a plain parameter: not known as sparse, summed densely
    dense_sum = {k: v for k, v in single["functional"]["single"].items() if k != "layouts"}
    assert single["functional"]["single"]["layouts"]["table"] == SPARSE
    for rank, run in enumerate(runs):
        functional = run.pop("functional")
        for variant in ("ours", "ours_copying"):
            got = {k: v for k, v in functional[variant].items() if k != "layouts"}
            assert functional[variant]["layouts"]["table"] == "torch.strided", variant
            what = f"rank {rank} functional {variant}"
            assert_close_tree(got, dict(dense_sum, coalesced=True), what)
        for key, res in run.items():
            kind = key.split("/")[0]
            want = dict(single[key]["single"], coalesced=True)  # one process: not coalesced
            for variant in ("ours[0]", "ours[None]"):
                ours, what = res[variant], f"rank {rank} {key} {variant}"
                assert ours["coalesced"], f"{what}: sparse gradients not coalesced"
                if "torch" in res:  # torch DDP's are coalesced too
                    assert ours["layouts"] == res["torch"]["layouts"], what
                    assert_close_tree(ours, res["torch"], f"{what} vs torch DDP")
                assert_close_tree(ours, want, f"{what} vs single process")
                assert_equal_tree(
                    ours["params"], runs[0][key][variant]["params"], f"{what} replica"
                )
            layouts = res["ours[0]"]["layouts"]
            assert layouts["emb.weight"] == ("torch.strided" if kind == "tied" else SPARSE), (
                layouts
            )  # sparse + dense (tied head) accumulate to dense, as in one process
            assert layouts["bag.weight"] == SPARSE
            if kind == "unused":  # rank 0 uses it on even steps; the last step (2) is even
                assert layouts["rare.weight"] == SPARSE
            for sharded in ("zero1", "zero2"):
                assert_close_tree(
                    res[sharded]["params"], want["params"], f"rank {rank} {key} {sharded}"
                )


def test_sparse_reduction_unit_single_rank(monkeypatch):
    """The table logic without processes: nothing anywhere -> None; sizes of every rank used."""
    import torch.distributed as dist

    p = torch.nn.Parameter(torch.zeros(5, 2))
    reduction = SparseReduction([p], ["w"], lambda what, fn: fn())
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr("torch_flashsys.distributed._sparse.collective_device", lambda g: "cpu")

    def fake_all_gather(out, tensor, group=None, async_op=False):
        out[0].copy_(tensor)

        class Done:
            def wait(self):
                return True

        return Done() if async_op else None

    monkeypatch.setattr(dist, "all_gather", fake_all_gather)
    reduction.start(None, 1)
    reduction.finish()
    assert p.grad is None
    p.grad = torch.sparse_coo_tensor([[1, 3, 1]], torch.ones(3, 2), (5, 2), check_invariants=True)
    reduction.start(None, 2)
    reduction.finish()
    assert p.grad.is_sparse and p.grad.is_coalesced()
    torch.testing.assert_close(p.grad.to_dense()[:, 0], torch.tensor([0, 1.0, 0, 0.5, 0]))


@pytest.mark.gpu
def test_nccl_sparse_world_size_one():
    """NCCL has no sparse all-reduce (torch DDP cannot reduce sparse gradients there); ours
    all-gathers indices and values, so it runs: against one process on the GPU."""
    (run,) = run_distributed(sparse_cases.nccl_run, 1, args=(0,), backend="nccl", timeout=300)
    for key, res in run.items():
        assert res["ours"]["layouts"]["emb.weight"] == SPARSE, key
        assert_close_tree(res["ours"], dict(res["single"], coalesced=True), key)


@pytest.mark.multigpu
def test_nccl_sparse_two_gpus():
    runs = run_distributed(sparse_cases.nccl_run, 2, args=(1,), backend="nccl", timeout=300)
    for rank, run in enumerate(runs):
        for key, res in run.items():
            want = dict(runs[0][key]["single"], coalesced=True)  # one process: not coalesced
            assert_close_tree(res["ours"], want, f"rank {rank} {key}")
