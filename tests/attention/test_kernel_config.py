"""Tile tables: what a launch picks with no autotuning, what ships, and the opt-in autotuner."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_flashsys.attention import _kernel_config as kc
from torch_flashsys.attention import _triton_bwd, _triton_fwd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNELS = {
    "fwd": (_triton_fwd.FWD_SHAPES, _triton_fwd._fwd_footprint),
    "dq": (_triton_bwd.DQ_SHAPES, _triton_bwd._dq_footprint),
    "dkdv": (_triton_bwd.DKDV_SHAPES, _triton_bwd._dkdv_footprint),
}
H100_SMEM = 232448  # bytes per block (sm90)


@contextlib.contextmanager
def fake_gpu(arch: str, smem: int = H100_SMEM):
    """A CUDA device of a chosen architecture and shared memory, without a GPU."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kc, "_arch", lambda index: arch)
        mp.setattr(kc, "shared_memory_bytes", lambda index: smem)
        yield torch.device("cuda", 0)


def _pick(kernel, device, head_dim, dtype=torch.bfloat16, precision="tf32", causal=True, n=4096):
    shapes, footprint = KERNELS[kernel]
    block_d = 1 << (head_dim - 1).bit_length()
    elem = torch.empty((), dtype=dtype).element_size()
    return kc.pick_tile(
        kernel, device, head_dim, block_d, elem, precision, causal, n, shapes, footprint
    )


def test_the_sm90_table_ships_with_provenance_and_covers_the_common_classes():
    path = os.path.join(os.path.dirname(kc.__file__), "tiles", "sm90.json")
    with open(path) as f:
        data = json.load(f)
    for field in ("device", "torch", "triton", "date", "command", "made_by"):
        assert data[field], field
    table = kc.load_table("sm90")
    for kernel in KERNELS:
        for dim in (64, 128):
            for causal in ("causal", "full"):
                prefix = f"{kernel}/{dim}/{causal}/"
                assert any(k.startswith(prefix) for k in table), prefix


def test_every_table_tile_is_a_valid_launch():
    for key, (bm, bn, warps, stages) in kc.load_table("sm90").items():
        kernel, dim, causal, length = key.split("/")
        assert kernel in KERNELS and int(dim) in (64, 128, 256) and causal in ("causal", "full")
        assert int(length) > 0, key
        for block in (bm, bn):
            assert block >= 16 and block & (block - 1) == 0, key
        assert warps in (4, 8) and 1 <= stages <= 6, key


@given(
    kernel=st.sampled_from(sorted(KERNELS)),
    head_dim=st.sampled_from([32, 64, 80, 128]),
    causal=st.booleans(),
    n=st.integers(1, 1 << 17),
)
def test_sm90_picks_the_entry_of_the_nearest_measured_length(kernel, head_dim, causal, n):
    table = kc.load_table("sm90")
    klass = kc.dim_class(head_dim)
    prefix = f"{kernel}/{klass}/{'causal' if causal else 'full'}/"
    lengths = [int(k[len(prefix) :]) for k in table if k.startswith(prefix)]
    nearest = min(lengths, key=lambda m: abs(math.log2(m / n)))
    with fake_gpu("sm90") as device:
        got = _pick(kernel, device, head_dim, causal=causal, n=n)
    assert got == tuple(table[prefix + str(nearest)])


def test_unknown_gpu_gets_the_first_fitting_default():
    for kernel, (shapes, footprint) in KERNELS.items():
        for head_dim in (64, 128, 256):
            with fake_gpu("sm75", smem=64 * 1024) as device:
                got = _pick(kernel, device, head_dim)
            fitting = [
                t for t in shapes[kc.dim_class(head_dim)]
                if 2 * footprint(t[0], t[1], head_dim, t[3]) <= 0.75 * 64 * 1024
            ]  # fmt: skip
            assert got == (fitting[0] if fitting else kc.FALLBACK_TILE)


def test_float32_ieee_takes_the_small_tiles_and_tf32_the_table_when_it_fits():
    for kernel in KERNELS:
        with fake_gpu("sm90") as device:
            assert _pick(kernel, device, 64, torch.float32, "ieee") == kc.IEEE_TILES[kernel]
            bm, bn, _, stages = _pick(kernel, device, 128, torch.float32, "tf32")
        footprint = KERNELS[kernel][1]
        assert 4 * footprint(bm, bn, 128, stages) <= 0.75 * H100_SMEM


def test_a_tiny_shared_memory_falls_back_to_the_smallest_tile():
    with fake_gpu("sm90", smem=1024) as device:
        assert _pick("fwd", device, 128, torch.float32) == kc.FALLBACK_TILE


def test_cpu_tensors_take_the_interpreter_tile():
    assert _pick("dq", torch.device("cpu"), 64) == kc.INTERPRETER_TILE


def test_a_launch_plan_carries_the_picked_tile():
    q = torch.randn(1, 2, 40, 16)
    out, _ = _triton_fwd.attention_forward(q, q, q, 0.25, _plain())
    plan = next(iter(_triton_fwd._PLANS.values()))
    assert kc.tile_meta(kc.INTERPRETER_TILE).items() <= plan.constexprs.items()
    assert out.shape == q.shape


def _plain():
    from torch_flashsys.attention._extras import PLAIN

    return PLAIN


_SHOW_KERNELS = textwrap.dedent(
    """
    import json
    from torch_flashsys.attention import _triton_bwd, _triton_fwd, _triton_common
    kernels = (_triton_fwd._attn_fwd_tuned, _triton_bwd._attn_bwd_dq_tuned,
               _triton_bwd._attn_bwd_dkdv_tuned)
    print(json.dumps({"autotune": _triton_common.AUTOTUNE,
                      "types": [type(k).__name__ for k in kernels],
                      "cached": [getattr(k, "cache_results", None) for k in kernels]}))
    """
)


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_autotuning_is_opt_in_and_cached_on_disk(setting):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FLASHSYS_AUTOTUNE"}
    env["TRITON_INTERPRET"] = "0"  # the interpreter never autotunes; import without a GPU
    if setting is not None:
        env["TORCH_FLASHSYS_AUTOTUNE"] = setting
    done = subprocess.run(
        [sys.executable, "-c", _SHOW_KERNELS], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    if setting == "1":
        assert shown["autotune"] and shown["types"] == ["Autotuner"] * 3
        assert shown["cached"] == [True] * 3
    else:
        assert not shown["autotune"] and shown["types"] == ["JITFunction"] * 3


_TUNE_ONCE = textwrap.dedent(
    """
    import json, torch
    from torch_flashsys import flash_attention
    from torch_flashsys.attention import _triton_bwd, _triton_fwd
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g,
                           requires_grad=True) for _ in range(3))
    out = flash_attention(q, k, v, is_causal=True)
    out.sum().backward()
    kernels = (_triton_fwd._attn_fwd_tuned, _triton_bwd._attn_bwd_dq_tuned,
               _triton_bwd._attn_bwd_dkdv_tuned)
    print(json.dumps({"benchmarked": [hasattr(k, "bench_time") for k in kernels],
                      "sums": [float(t.double().sum()) for t in (out, q.grad, k.grad, v.grad)]}))
    """
)


@pytest.mark.gpu
def test_opt_in_autotuning_tunes_once_then_reads_the_disk_cache(tmp_path):
    # The portable kernels' autotuner (the Hopper forward has one fixed configuration: off).
    env = {**os.environ, "TORCH_FLASHSYS_AUTOTUNE": "1", "TRITON_CACHE_DIR": str(tmp_path),
           "TORCH_FLASHSYS_SM90": "0"}  # fmt: skip
    runs = []
    for _ in range(2):  # two processes sharing one Triton cache directory
        done = subprocess.run(
            [sys.executable, "-c", _TUNE_ONCE], env=env, capture_output=True, text=True,
            timeout=400,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["benchmarked"] == [True] * 3  # several configs fit an H100: it tuned
    assert runs[1]["benchmarked"] == [False] * 3  # the second process read the results
    assert runs[0]["sums"] == runs[1]["sums"]
    assert list(tmp_path.rglob("*.autotune.json"))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_modified_kernels_take_a_table_tile_only_if_it_fits(kernel):
    """The sweep timed the plain kernels; dropout or a mask needs more shared memory (a d 128
    dropout kernel with the table's tile asked for 240 KiB of 227), so their tile must pass the
    estimate: the table's if it does, else the first fitting default."""
    shapes, footprint = KERNELS[kernel]
    fits = lambda t: 2 * footprint(t[0], t[1], 128, t[3]) <= 0.75 * H100_SMEM
    for causal in (False, True):
        with fake_gpu("sm90") as device:
            plain = _pick(kernel, device, 128, causal=causal, n=1024)
            got = kc.pick_tile(
                kernel, device, 128, 128, 2, "tf32", causal, 1024, shapes, footprint, False
            )
        want = plain if fits(plain) else next(t for t in shapes[128] if fits(t))
        assert got == want and fits(got)


def test_the_committed_table_is_what_the_committed_sweep_gives():
    """tiles/sm90.json == build_table(docs/data/attention_tune_h100.csv): the table is reproducible
    from the sweep it names (``tune_attention.py --from-csv``)."""
    import csv
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with open(root / "docs/data/attention_tune_h100.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    shipped = json.loads((root / "torch_flashsys/attention/tiles/sm90.json").read_text())
    assert kc.build_table(rows) == shipped["tiles"]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_every_head_dim_class_has_measured_sm90_tiles(head_dim, causal):
    """Each kernel at each head-dim class the Triton kernels take (16..256) finds a measured tile
    in the sm90 table at every length: a class without entries ran the lists' first tiles, never
    timed there (at head dim 256 they spill registers; fwd+bwd 3.5-3.9x cuDNN's on an H100)."""
    table = kc.load_table("sm90")
    for kernel in ("fwd", "dq", "dkdv"):
        for n in (512, 1024, 3000, 8192, 32768):
            key = kc.table_key(kernel, head_dim, causal, n)
            lengths = kc._table_lengths("sm90", kernel, kc.dim_class(head_dim), causal)
            assert lengths, f"no sm90 tiles for {kernel} at head dim {head_dim} (causal={causal})"
            near = kc.table_key(kernel, head_dim, causal, kc.nearest_length(lengths, n))
            assert near in table, (key, near)


@given(
    times=st.lists(st.floats(0.5, 2.0), min_size=6, max_size=6),
    faster=st.floats(0.5, 0.999),
    tolerance=st.sampled_from([1.0, 1.03, 1.2]),
)
def test_a_length_keeps_its_own_tile_only_where_it_beats_the_compromise(times, faster, tolerance):
    """One config per group (best geometric mean over the lengths); a length takes its own fastest
    only where that is more than ``tolerance`` faster; failed and warp-specialized rows count not."""
    seqs = (1024, 4096, 16384)
    a, b = dict(zip(seqs, times[:3], strict=True)), dict(zip(seqs, times[3:], strict=True))
    rows = [
        {"kernel": "dq", "dim": 128, "causal": "True", "seq": s, "config": cfg, "ms": ms[s]}
        for cfg, ms in (("64x64x4x3", a), ("128x32x8x2", b))
        for s in seqs
    ]
    rows += [  # ignored: a failure, a warp-specialized variant
        {"kernel": "dq", "dim": 128, "causal": "True", "seq": 4096, "config": "16x16x4x1",
         "ms": 1e-3, "error": "OutOfResources"},
        {"kernel": "dq", "dim": 128, "causal": "True", "seq": 4096, "config": "16x16x4x2",
         "ms": 1e-3, "ws": "True"},
    ]  # fmt: skip
    table = kc.build_table(rows, tolerance)
    geo = {c: sum(math.log(m[s]) for s in seqs) for c, m in (("64x64x4x3", a), ("128x32x8x2", b))}
    compromise = min(geo, key=geo.get)
    ms = {"64x64x4x3": a, "128x32x8x2": b}
    for s in seqs:
        fastest = min(ms, key=lambda c, s=s: ms[c][s])
        want = compromise if ms[compromise][s] <= tolerance * ms[fastest][s] else fastest
        assert table[kc.table_key("dq", 128, True, s)] == [int(x) for x in want.split("x")]
    assert len(table) == len(seqs)


@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_new_backward_compiles_its_two_kernels_together(setting):
    """A backward with a new launch key compiles the dQ and dK/dV kernels at once, in threads,
    before launching them (``_launch.compile_together``); ``TORCH_FLASHSYS_PARALLEL_COMPILE=0``
    leaves each to its launch. Compiled for sm90 without a GPU (the interpreter compiles nothing):
    counts the compiles during ``compile_together`` and during the launches' warm-up after it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TORCH_FLASHSYS_PARALLEL_COMPILE"] = setting
    done = subprocess.run(
        [sys.executable, "-m", "tests.attention.sm90_offline", "backward"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    expected = "2, 0" if setting == "1" else "0, 2"
    assert f"backward kernels compiled together, after: {expected}" in done.stdout, done.stdout
