"""Context-parallel attention (ring and Ulysses) on real gloo processes, against single-process
flash_attention on the whole sequence; the layout helpers; DDP x CP against single-process training;
bad inputs raise on every rank without hanging. Bodies in tests/distributed/cp_cases.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.distributed import cp_cases
from tests.distributed.harness import run_distributed
from tests.distributed.test_ddp import ONE_RUN, SEEDS, WORLD_SIZES, assert_close_tree
from torch_flashsys.distributed._cp_layout import ring_flops

TIMEOUT = 120.0  # a hang is reported after this long instead of blocking the suite


@st.composite
def cases(draw, world: int) -> cp_cases.Case:
    mode = draw(st.sampled_from(["ring", "ulysses"]))
    layout = draw(st.sampled_from(["zigzag", "contiguous"]))
    kv_heads = draw(st.integers(1, 2)) * (world if mode == "ulysses" else 1)
    group = draw(st.sampled_from([1, 1, 2, 3]))  # GQA when > 1
    return cp_cases.Case(
        seed=draw(SEEDS),
        batch=draw(st.integers(1, 2)),
        heads=kv_heads * group,
        kv_heads=kv_heads,
        chunk=draw(st.integers(1, 5)),
        head_dim=draw(st.sampled_from([4, 8, 16])),
        head_dim_v=draw(st.sampled_from([4, 8])),
        causal=draw(st.booleans()),
        mode=mode,
        layout=layout,
        scale=draw(st.sampled_from([None, 0.3])),
    )


def _every_combination(world: int) -> list[cp_cases.Case]:
    """Both modes x layouts x causal, GQA, always present (hypothesis adds random ones)."""
    out = []
    for mode in ("ring", "ulysses"):
        for layout in ("zigzag", "contiguous"):
            for causal in (False, True):
                kv = world if mode == "ulysses" else 1
                out.append(cp_cases.Case(len(out), 2, 2 * kv, kv, 2, 8, 8, causal, mode, layout,
                                         None))  # fmt: skip
    return out


@pytest.mark.parametrize("world", WORLD_SIZES)
@given(data=st.data())
@ONE_RUN
def test_matches_flash_attention_on_the_whole_sequence(world, data):
    random = data.draw(st.lists(cases(world), min_size=4, max_size=8))
    results = run_distributed(
        cp_cases.equivalence, world, (_every_combination(world) + random,), timeout=TIMEOUT
    )
    # zigzag causal ring: every rank computes the same number of scores (counted as it ran)
    per_rank = [[n for layout, _, n in r["flops"] if layout == "zigzag"] for r in results]
    for counts in zip(*per_rank, strict=True):
        mean = sum(counts) / world
        assert all(abs(n - mean) <= 0.05 * mean for n in counts), f"unbalanced: {counts}"
    for r in results:
        for layout, per in r["helpers"].items():
            chunks = world * (2 if layout == "zigzag" else 1)
            assert len(per) == 5 * chunks // world
    everything = sorted(p for r in results for p in r["helpers"]["zigzag"])
    assert everything == list(range(10 * world)), "positions are a partition of the sequence"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("seq_per_rank", [2, 64, 4096])
def test_zigzag_causal_flops_balanced_and_contiguous_not(world, seq_per_rank):
    """Counting the ring plan: zigzag within 5% of the mean on every rank; contiguous is not."""
    zig = [ring_flops(r, world, "zigzag", True, seq_per_rank, 64) for r in range(world)]
    mean = sum(zig) / world
    assert all(abs(f - mean) <= 0.05 * mean for f in zig), zig
    contiguous = [ring_flops(r, world, "contiguous", True, seq_per_rank, 64) for r in range(world)]
    assert max(contiguous) > 1.5 * min(contiguous)  # the imbalance zigzag removes
    full = world * seq_per_rank
    assert sum(zig) == sum(contiguous) == 4 * 64 * full * (full + 1) // 2  # the causal total


def test_bad_inputs_raise_on_every_rank():
    results = run_distributed(cp_cases.bad_inputs, 2, timeout=TIMEOUT)
    expected = {
        "ulysses_heads": "ValueError: context_parallel_attention: mode='ulysses' needs heads (3)",
        "ulysses_kv_heads": "ValueError: context_parallel_attention: mode='ulysses' needs heads",
        "odd_zigzag": "ValueError: context_parallel_attention: layout='zigzag' shards",
        "odd_zigzag_ulysses": "ValueError: context_parallel_attention: layout='zigzag' shards",
        "mismatched_shards": "RuntimeError: context_parallel_attention: the attention call "
        "differs across ranks",
        "mismatched_mode": "RuntimeError: context_parallel_attention: the attention call differs",
        "not_a_tensor_on_one_rank": "RuntimeError: context_parallel_attention: the attention",
        "kv_length": "ValueError: context_parallel_attention: query, key and value shards must",
        "gqa_flag": "ValueError: context_parallel_attention: query has 4 heads and key/value 1",
        "shard_length": "ValueError: shard_sequence: the sequence length must be a multiple of 4",
        "bad_mode": "ValueError: context_parallel_attention: mode must be one of",
        "gather_mismatch": "RuntimeError: gather_sequence: the call differs across ranks",
        "gather_dim_mismatch": "RuntimeError: gather_sequence: the call differs across ranks",
        "gather_layout_mismatch": "RuntimeError: gather_sequence: the call differs across ranks",
        "gather_negative_dim": "no error",  # the same dim
        "sdpa_mask": "NotImplementedError: context_parallel_sdpa: scaled_dot_product_attention",
        "after_errors_still_works": "no error",
        "requires_grad_one_rank": "RuntimeError: context_parallel_attention: the attention call "
        "differs across ranks",
        "head_dim_zero": "no error",
        "shard_dim": "IndexError: shard_sequence: dim must be an int in [-2, 1]",
        "position_ids_length": "ValueError: shard_position_ids: the sequence length must be",
        "gather_odd_zigzag": "ValueError: gather_sequence: a shard of layout='zigzag' holds 2",
        "not_a_member": None,  # rank 0: a member (no error); rank 1: below
        "autocast_mixed_dtypes": "no error",
    }
    for rank, errors in enumerate(results):
        assert errors.keys() == expected.keys()
        member = {0: "no error", 1: "ValueError: context_parallel_attention: this process "
                  "(global rank 1) is not a member of group"}  # fmt: skip
        for name, start in {**expected, "not_a_member": member[rank]}.items():
            assert errors[name].startswith(start), f"rank {rank} {name}: {errors[name]}"
    assert "rank 0: query shape=(1, 2, 4, 8)" in results[1]["mismatched_shards"]
    assert "rank 1: query shape=(1, 2, 6, 8)" in results[0]["mismatched_shards"]


def test_double_backward_is_exact_through_ulysses_and_refused_through_the_ring():
    """A gradient penalty (create_graph=True) through the attention: Ulysses's all-to-alls are
    differentiable, so its double backward is flash_attention's, against one process (float64);
    the ring has none and its second backward raises on every rank. (Both gave silently wrong
    input gradients before: the exchanged gradients were not recorded by autograd.)"""
    for rank, r in enumerate(run_distributed(cp_cases.double_backward, 2, timeout=TIMEOUT)):
        assert r["ulysses"] == "no error", (rank, r["ulysses"])
        assert r["ulysses error"] < 1e-10, (rank, r["ulysses error"])
        assert r["ring"].startswith(
            "RuntimeError: context_parallel_attention: mode='ring' has no double backward"
        ), (rank, r["ring"])


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_the_reference_lms_flash_attention_runs_context_parallel(mode):
    """The reference LM's default attention ("flash", which calls flash_attention, not SDPA)
    inside context_parallel_sdpa attends over the whole sequence (it attended to each rank's
    shard only, silently): loss and gradients equal one process's on the whole sequence;
    "naive" attention there raises, naming the choice."""
    for rank, r in enumerate(run_distributed(cp_cases.reference_lm, 2, (mode,), timeout=TIMEOUT)):
        assert abs(r["loss"] - r["want"]) < 1e-12, (rank, r["loss"], r["want"])
        assert_close_tree(r["grads"], r["want_grads"], f"rank {rank}", rtol=1e-9, atol=1e-12)
        assert r["naive"].startswith("NotImplementedError: causal_attention: attention='naive'")


@given(seed=SEEDS, mode=st.sampled_from(["ring", "ulysses"]))
@ONE_RUN
def test_ddp_x_context_parallel_matches_single_process_training(seed, mode):
    """2 data-parallel replicas x 2 context-parallel ranks (4 processes), the reference LM with
    sharded tokens, targets and position ids under context_parallel_sdpa, BucketedDDP over all
    four ranks; the gradients and two SGD steps == one process training on the whole batch."""
    results = run_distributed(cp_cases.ddp_x_cp, 4, (seed, mode, 2), timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert_close_tree(r["got"], r["want"], f"rank {rank}", rtol=1e-9, atol=1e-12)
    head = [r["got"]["params"]["lm.lm_head.weight"] for r in results]
    assert all(torch.equal(h, head[0]) for h in head), "replicas diverged"


def test_dtensor_head_sharded_inputs_match_the_plain_call():
    results = run_distributed(cp_cases.dtensor_heads, 2, timeout=TIMEOUT)
    expected = {
        "sequence_sharded": "ValueError: flash_attention: DTensor inputs must be sharded on the "
        "head dimension (Shard(1))",
        "mixed": "ValueError: flash_attention: query is a DTensor, so key and value must be",
        "uneven_heads": "ValueError: flash_attention: the 3 heads of query do not divide evenly",
        "mask": "NotImplementedError: flash_attention: with DTensor inputs, attn_mask is not",
        # raised from torch's DTensor dispatch of the ring's first send before
        "context_parallel": "TypeError: context_parallel_attention: query is a DTensor",
    }
    for rank, errors in enumerate(results):
        for name, start in expected.items():
            assert errors[name].startswith(start), f"rank {rank} {name}: {errors[name]}"


@pytest.mark.gpu
def test_world_size_one_is_flash_attention_on_cuda():
    """One rank (NCCL): exactly flash_attention with the Triton kernels, no copy."""
    results = run_distributed(_cuda_world_one, 1, timeout=TIMEOUT, backend="nccl")
    assert results == [True]


def _cuda_world_one(rank: int, world: int) -> bool:
    q = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16)
    from torch_flashsys import flash_attention
    from torch_flashsys.distributed import context_parallel_attention

    got = context_parallel_attention(q, q, q, is_causal=True)
    return bool(torch.equal(got, flash_attention(q, q, q, is_causal=True)))


@pytest.mark.multigpu
def test_nccl_ring_and_ulysses_on_two_gpus():
    results = run_distributed(cp_cases.nccl_equivalence, 2, timeout=TIMEOUT, backend="nccl")
    assert results[0].keys() == results[1].keys() and len(results[0]) == 32


def test_torch_attention_modules_attend_over_the_whole_sequence_or_raise():
    """nn.MultiheadAttention with need_weights=True (its default) computes its weights itself,
    and its and nn.TransformerEncoderLayer's fused inference fast path skips SDPA: both attended
    to each rank's shard only, silently (differences of 0.3-0.6). Now the first raises on every
    rank and context_parallel_sdpa turns the fast path off (restored on exit)."""
    for rank, r in enumerate(run_distributed(cp_cases.torch_attention_modules, 2, timeout=TIMEOUT)):
        assert r["mha need_weights"].startswith(
            "NotImplementedError: context_parallel_sdpa: nn.MultiheadAttention with need_weights"
        ), (rank, r["mha need_weights"])
        for name in ("mha causal need_weights=False", "mha fast path (eval, no_grad)",
                     "encoder layer fast path (eval, no_grad)"):  # fmt: skip
            assert isinstance(r[name], float) and r[name] < 1e-12, (rank, name, r[name])
        assert r["restored"], rank


def test_flash_attention_module_runs_context_parallel():
    """torch_flashsys.FlashAttention (replace_attention's module) calls flash_attention, which
    the SDPA router cannot see: inside context_parallel_sdpa it attended to each rank's shard
    only, silently (0.4-0.7 off). It now goes through the router: output and input gradient equal
    one process's on the whole sequence; a mask raises as the router does, a KV cache raises."""
    for rank, r in enumerate(run_distributed(cp_cases.flash_attention_module, 2, timeout=TIMEOUT)):
        for name in ("seq-first", "batch-first causal", "gqa causal"):
            assert isinstance(r[name], float) and r[name] < 1e-12, (rank, name, r[name])
        assert r["padding mask"].startswith(
            "NotImplementedError: context_parallel_sdpa: scaled_dot_product_attention"
        ), (rank, r["padding mask"])
        assert r["kv cache"].startswith(
            "NotImplementedError: FlashAttention: kv_cache inside context_parallel_sdpa"
        ), (rank, r["kv cache"])
