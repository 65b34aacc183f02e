"""The Hopper fast path (a warp-specialized Gluon forward on sm90): which calls take it, that it
compiles with the installed Triton, and (on an H100/H200) that it matches float64."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.attention.cases import Case, cases, check_against_reference, triton_run
from tests.reference import attention_reference
from torch_flashsys import flash_attention
from torch_flashsys.attention import _sm90
from torch_flashsys.attention._extras import CAUSAL, PLAIN, Extras

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _on_sm90() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and _sm90.enabled()
    )


@contextmanager
def _counting_sm90_calls():
    """Count the calls that reach the Hopper kernel, every length allowed."""
    with (
        mock.patch.object(_sm90, "forward", wraps=_sm90.forward) as spy,
        mock.patch.object(_sm90, "MIN_SEQ_K", 1),
    ):
        yield spy


@pytest.mark.parametrize(
    ("seq", "d", "causal", "persistent", "dynamic"),
    [(1024, 64, True, None, True), (1025, 64, True, None, True), (16384, 64, True, None, True),
     (2048, 128, True, None, True), (4096, 128, True, None, False), (2048, 64, False, None, False),
     (2048, 64, True, True, False), (2048, 128, True, False, False), (128, 128, True, None, True),
     (1024, 64, False, None, False)],
)  # fmt: skip
def test_the_forward_takes_its_tiles_from_a_counter_where_it_measured_faster(seq, d, causal,
                                                                               persistent,
                                                                               dynamic):  # fmt: skip
    """The dynamic schedule (H100, ``benchmarks/sm90_fwd.py``, docs/benchmarks.md): causal
    problems, at head dim 128 only up to 2048 rows (1.02-1.06x the time of one program per tile
    at 4096); never without a causal mask or when the caller forces a grid."""
    q = torch.empty(1, 2, seq, d, device="meta")
    assert _sm90.dynamic_schedule(q, causal, persistent) is dynamic


@pytest.mark.parametrize(
    ("seq", "d", "causal", "buffers"),
    [(1024, 64, True, 2), (16384, 64, True, 2), (2048, 64, False, 2), (2049, 64, False, 1),
     (4096, 64, False, 1), (1, 128, True, 2), (2048, 128, True, 2), (4096, 128, True, 1),
     (2048, 128, False, 2), (16384, 128, False, 1)],
)  # fmt: skip
def test_the_forward_double_buffers_queries_where_it_measured_faster(seq, d, causal, buffers):
    """Two query buffers per warpgroup (H100, ``benchmarks/sm90_fwd.py``, docs/benchmarks.md):
    head dim 64 causal at every length, the others up to 2048 rows (1.00-1.02x the time of one
    buffer from 4096)."""
    q = torch.empty(1, 2, seq, d, device="meta")
    assert _sm90.query_buffers(q, causal) == buffers
    assert _sm90.constexprs(d, causal, qbuf=buffers)["QBUF"] == buffers


@pytest.mark.parametrize(
    ("seq", "d", "causal", "consumers"),
    [(4096, 64, False, 3), (16384, 64, False, 3), (2049, 64, False, 3), (2048, 64, False, 2),
     (16384, 64, True, 3), (8192, 64, True, 3), (8191, 64, True, 2), (4096, 64, True, 2),
     (16384, 128, False, 2), (16384, 128, True, 2)],
)  # fmt: skip
def test_the_forward_takes_three_consumers_where_it_measured_faster(seq, d, causal, consumers):
    """Three consumer warpgroups (H100, ``benchmarks/sm90_fwd.py``, ``gpu_checks/rule_ab.py``,
    docs/benchmarks.md): head dim 64 without a causal mask over 2048 rows (0.87-0.98x the time
    of two; 0.99x at 2048, 1.03x at 1024); causal from 8192 rows (0.91-0.99x; 1.00x at 4096,
    1.03-1.19x shorter); never at head dim 128. The launch follows: 192-row tiles, the register
    split of three consumers."""
    q = torch.empty(2, 3, seq, d, device="meta")
    assert _sm90.forward_consumers(q, causal) == consumers
    meta = _sm90.constexprs(d, causal, consumers=consumers)
    assert (meta["CONSUMERS"], meta["CONSUMER_REGS"]) == (consumers, _sm90.FWD_REGS[consumers][1])
    assert _sm90.launch_options(consumers)["maxnreg"] == _sm90.FWD_REGS[consumers][0]
    tiles = -(-seq // (64 * consumers)) * 2 * 3  # one program per tile (the grid forced)
    assert _sm90.forward_grid(q, causal, persistent=False, consumers=consumers)[0] == tiles


@pytest.mark.parametrize(("d", "causal", "pinned"),
                         [(128, False, True), (128, True, False), (64, False, False),
                          (64, True, False)])  # fmt: skip
def test_the_forward_pins_its_product_wait_where_it_measured_faster(d, causal, pinned):
    """The forward's PIN_WAIT (H100, ``benchmarks/sm90_fwd.py``, docs/benchmarks.md): head dim
    128 without a causal mask (0.965-0.996x the kernel time); causal and head dim 64 unpinned
    (0.98-1.14x pinned). The backward's stays off."""
    assert _sm90.constexprs(d, causal)["PIN_WAIT"] is pinned
    assert _sm90.BWD_PIN_WAIT is False


@pytest.mark.parametrize(("d", "causal", "tree"),
                         [(128, False, True), (128, True, True), (64, False, False),
                          (64, True, True)])  # fmt: skip
def test_the_forward_takes_row_maxima_as_trees_where_it_measured_faster(d, causal, tree):
    """The forward's TREE_MAX (H100, ``benchmarks/sm90_fwd.py``, docs/benchmarks.md): on at head
    dim 128 and head dim 64 causal (0.96-1.00x the kernel time); off at head dim 64 without a
    causal mask (1.01x)."""
    assert _sm90.constexprs(d, causal)["TREE_MAX"] is tree


@contextmanager
def _fresh_plans():
    """Empty launch tables for the Hopper kernels, so that each call of a launch key compiles
    the build the module's switches now choose (a kept launch keeps the build of its first
    call); yields the constexprs of every forward and fused backward launched through the JIT
    meanwhile. The builds made meanwhile are dropped after, so no later test launches them."""
    built: list[dict] = []
    real = _sm90._launch_planned

    def launch(kernel, plans, key, index, values, args, plan):
        def recorded():
            grid, meta = plan()
            built.append(meta)
            return grid, meta

        return real(kernel, plans, key, index, values, args, recorded)

    _sm90.forget_launches()
    try:
        with mock.patch.object(_sm90, "_launch_planned", launch):
            yield built
    finally:
        _sm90.forget_launches()


def test_forget_launches_empties_every_launch_table(monkeypatch):
    """Every table of kept launches (forward, dK/dV, preprocessing, fused backward, the kept
    backwards) is emptied,
    the tables themselves kept (the launch functions read them by name)."""
    tables = ("_PLANS", "_BWD_PLANS", "_PREP_PLANS", "_FUSED_PLANS", "_KEPT")
    for name in tables:
        monkeypatch.setattr(_sm90, name, {("key", name): object()})
    before = [getattr(_sm90, name) for name in tables]
    _sm90.forget_launches()
    assert [getattr(_sm90, name) for name in tables] == [{}] * len(tables)
    assert all(getattr(_sm90, n) is t for n, t in zip(tables, before, strict=True))


class _Recorder:
    """A stand-in planned launch: records each call's values, then runs ``effect`` on them."""

    def __init__(self, effect) -> None:
        self.calls: list[tuple] = []
        self.effect = effect

    def __call__(self, stream: int, values: tuple) -> None:
        self.calls.append((stream, values))
        self.effect(values)


def test_a_kept_backward_runs_only_where_the_switches_and_rules_still_send_it(monkeypatch):
    """kept_backward gives a problem's kept backward only for its own key (shapes, strides,
    dtypes, mask, device, alignment) and only while the switches and the length rule send the
    problem to the fused kernel, without dLSE, ordered sums or launch hooks; the kept backward
    allocates the buffers and passes the two launches what backward_prep and the fused kernel
    take. CUDA stood in on CPU (device -1)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(_sm90, "ENABLED", True)
    monkeypatch.setattr(_sm90, "FUSED_ENABLED", True)
    monkeypatch.setattr(_sm90, "FUSED_ALL", False)
    monkeypatch.setattr(_sm90, "FUSED_SEQ_Q", {(True, True): (256, 4096)})
    monkeypatch.setattr(_sm90, "_KEPT", {})
    q, dout = (torch.randn(2, 8, 512, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 512, 64, dtype=torch.bfloat16) for _ in range(2))
    out, lse = torch.randn_like(q), torch.randn(2, 8, 512)
    args = (dout, q, k, v, out, lse, None, 0.125, CAUSAL)
    assert _sm90.kept_backward(*args) is None  # nothing kept yet
    prep = _Recorder(lambda values: values[4].zero_())  # (the kernel zeroes the dQ sums)
    fused = _Recorder(lambda values: values[8].add_(1.5))  # (and the fused kernel adds to them)
    kept = _sm90._KeptBackward(prep, fused, -1, False)
    _sm90._KEPT[_sm90._kept_key(dout, q, k, v, out, lse, True)] = kept
    assert _sm90.kept_backward(*args) is kept
    dq, dk, dv = _sm90.backward(*args[:-1], True, kept=kept)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == q.dtype and dk.stride() == k.stride()
    ((stream, (o, do, rows, delta, acc, counts)),) = prep.calls
    assert stream == 7 and (o, do, rows) == (out, dout, lse) and counts is acc
    assert acc.dtype == torch.float32 and acc.shape == q.shape and delta.shape == lse.shape
    ((_, values),) = fused.calls
    assert values[:5] == (q, k, v, dout, lse) and values[5] is delta and values[8] is acc
    assert values[-2:] == (0.125 * _sm90.LOG2E, 0.125)
    assert torch.equal(dq, torch.full_like(q, 1.5))  # the sums converted after the kernels
    misaligned = torch.empty(dout.numel() + 1, dtype=dout.dtype)[1:].view_as(dout)
    others = [
        (dout, q, k, v, out, lse, torch.zeros_like(lse), 0.125, CAUSAL),  # dLSE
        (dout, q, k, v, out, lse, None, 0.125, PLAIN),  # another mask
        (dout.transpose(1, 2).contiguous().transpose(1, 2), q, k, v, out, lse, None, 0.125,
         CAUSAL),  # dO in another layout
        (dout, q[:, :, :256], k[:, :, :256], v[:, :, :256], out[:, :, :256], lse[:, :, :256],
         None, 0.125, CAUSAL),  # other shapes
        (dout.half(), q, k, v, out, lse, None, 0.125, CAUSAL),  # dO of another dtype
        (dout, q, k, v, out, lse, None, -0.125, CAUSAL),  # a negative scale
        (misaligned, q, k, v, out, lse, None, 0.125, CAUSAL),  # dO not 16-byte aligned
    ]  # fmt: skip
    for other in others:
        assert _sm90.kept_backward(*other) is None
    for name, value in [
        ("ENABLED", False),
        ("FUSED_ENABLED", False),
        ("FUSED_SEQ_Q", {(True, True): (1024, 4096)}),
        ("MIN_SEQ_K", 1024),
    ]:
        with mock.patch.object(_sm90, name, value):
            assert _sm90.kept_backward(*args) is None, name
    with _deterministic_algorithms():
        assert _sm90.kept_backward(*args) is None
    with mock.patch.object(torch.cuda, "current_device", lambda: 0):  # another device current
        assert _sm90.kept_backward(*args) is None
    with mock.patch.object(_sm90, "launch_hooks_set", lambda: True):  # a profiler's hooks
        assert _sm90.kept_backward(*args) is None
    assert _sm90.kept_backward(*args) is kept  # (each refusal above for its own reason)


def test_the_dynamic_schedule_keeps_one_counter_per_device_and_stream(monkeypatch):
    """The counter the forward's dynamic schedule takes (the kernel leaves it at zero): one per
    (device, stream), kept; a fresh zeroed one per call while the stream is being captured into
    a CUDA graph or when the tensors are not on the current device (whose capture state is the
    only one PyTorch reports). CUDA stood in on CPU."""
    state = {"device": 0, "stream": 100, "capturing": False}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["device"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda index: state["stream"] + index, raising=False)  # fmt: skip
    monkeypatch.setattr(_sm90, "_COUNTERS", {})
    q = torch.empty(1, 2, 8, 64)
    first = _sm90.schedule_counter(q, 0)
    assert first.dtype == torch.int32 and first.tolist() == [0]
    assert _sm90.schedule_counter(q, 0) is first
    state["stream"] = 200
    other = _sm90.schedule_counter(q, 0)
    assert other is not first and _sm90.schedule_counter(q, 0) is other
    state["capturing"] = True
    fresh = [_sm90.schedule_counter(q, 0) for _ in range(2)]
    assert fresh[0] is not fresh[1] and all(c is not other for c in fresh)
    state["capturing"] = False
    off = [_sm90.schedule_counter(q, 1) for _ in range(2)]  # tensors on device 1, current 0
    assert off[0] is not off[1] and (1, 201) not in _sm90._COUNTERS


def test_only_plain_and_causal_problems_of_two_byte_dtypes_qualify():
    """The rule's problem part, with the switch on and a Hopper device stood in: plain and causal
    16-bit problems of head dim 64/128 qualify; other score modifications, dtypes, head dims and
    scales, and tensors off the GPU, take the portable kernels."""
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    wide = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    masked = Extras(mask=torch.ones(1, 2, 8, 8, dtype=torch.bool))
    with mock.patch.object(_sm90, "ENABLED", True):
        assert not _sm90.forward_takes(q, q, q, 0.1, PLAIN)  # a CPU tensor
        with (
            mock.patch.object(_sm90, "_is_sm90", return_value=True),
            mock.patch.object(torch.Tensor, "is_cuda", new=True),
        ):
            assert _sm90.forward_takes(q, q, q, 0.1, PLAIN)
            assert _sm90.forward_takes(q, q[:, :1], q[:, :1], 0.1, CAUSAL)  # GQA
            for args in (
                (q, q, q, 0.1, masked),
                (q, q, q, 0.1, Extras(left=4, right=0)),
                (q, q, q, 0.1, Extras(softcap=5.0)),
                (q, q, q, -0.1, CAUSAL),
                (q.float(), q.float(), q.float(), 0.1, PLAIN),
                (q[..., :40], q[..., :40], q[..., :40], 0.1, PLAIN),  # a head dim not served
                (wide[..., ::2], wide[..., ::2], wide[..., ::2], 0.1, PLAIN),  # strided head dim
            ):
                assert not _sm90.forward_takes(*args)


PADDED_CANDIDATES = (32, 48, 80, 96, 112)  # head dims the padded forward was measured at


def test_padded_head_dims_take_the_next_kernels():
    """With a head dim in FWD_PADDED_DIMS the forward runs the kernel of the next head dim it has
    (64 up to 64, else 128; every length rule keyed by that one), its descriptors' blocks that
    wide over the narrower tensors (whose own shape the descriptors keep, so TMA reads the
    missing columns as zeros and clips them from the store); with one in BWD_PADDED_DIMS the
    fused backward of that kernel too, where its rules say (not under deterministic
    algorithms); the opt-in Hopper dK/dV kernel keeps its own head dims."""
    assert [_sm90.kernel_dim(d) for d in (32, 48, 64, 80, 96, 112, 128)] == [
        64, 64, 64, 128, 128, 128, 128]  # fmt: skip
    q = torch.zeros(1, 2, 8, 96, dtype=torch.bfloat16)
    with (
        mock.patch.object(_sm90, "ENABLED", True),
        mock.patch.object(_sm90, "BWD_ENABLED", True),
        mock.patch.object(_sm90, "FUSED_ENABLED", True),
        mock.patch.object(_sm90, "FUSED_ALL", True),
        mock.patch.object(_sm90, "_is_sm90", return_value=True),
        mock.patch.object(torch.Tensor, "is_cuda", new=True),
    ):
        with mock.patch.object(_sm90, "FWD_PADDED_DIMS", frozenset()):
            assert not _sm90.forward_takes(q, q, q, 0.1, CAUSAL)
        with (mock.patch.object(_sm90, "FWD_PADDED_DIMS", frozenset({96})),
              mock.patch.object(_sm90, "BWD_PADDED_DIMS", frozenset())):  # fmt: skip
            assert _sm90.forward_takes(q, q, q, 0.1, CAUSAL)
            assert _sm90.forward_takes(q, q[:, :1], q[:, :1], 0.1, PLAIN)  # GQA
            assert not _sm90.backward_takes(q, q, q, q, 0.1, CAUSAL)
            assert not _sm90.fused_takes(q, q, q, q, 0.1, CAUSAL)
            assert not _sm90.forward_takes(q, q[..., :80], q[..., :80], 0.1, PLAIN)
        with (mock.patch.object(_sm90, "FWD_PADDED_DIMS", frozenset({96})),
              mock.patch.object(_sm90, "BWD_PADDED_DIMS", frozenset({96}))):  # fmt: skip
            assert _sm90.fused_takes(q, q, q, q, 0.1, CAUSAL)
            assert not _sm90.backward_takes(q, q, q, q, 0.1, CAUSAL)
            with _deterministic_algorithms():
                assert not _sm90.fused_takes(q, q, q, q, 0.1, CAUSAL)
        for d in (64, 128):  # the kernels' own head dims: the rules unchanged
            t = torch.zeros(1, 2, 8, d, dtype=torch.bfloat16)
            assert _sm90.forward_takes(t, t, t, 0.1, CAUSAL)
            assert _sm90.fused_takes(t, t, t, t, 0.1, CAUSAL)
    long_q = _sm90.with_length(q, 1 << 20)
    assert _sm90.forward_meta(long_q, True, False) == _sm90.forward_meta(
        _sm90.with_length(torch.zeros(1, 2, 8, 128), 1 << 20), True, False)  # fmt: skip


@pytest.mark.parametrize(("d", "padded"), [(32, False), (40, False), (48, True), (56, False),
                                           (72, False), (80, True), (96, True), (112, True),
                                           (120, False)])  # fmt: skip
def test_the_forward_pads_the_head_dims_where_it_measured_faster(d, padded):
    """FWD_PADDED_DIMS (H100, ``gpu_checks/rule_ab.py --studies padded``, docs/benchmarks.md): the
    forward of head dims 48, 80, 96 and 112 on the next kernel took 0.59-0.79x the portable
    forward's time; at 32, which the portable kernel does not pad, 1.04x; the others were not
    measured and stay portable. BWD_PADDED_DIMS, the same head dims: where the fused rules send
    them, fwd+bwd took 0.75-0.89x the time with the portable backward at 4096-8192 tokens, a tie
    at 2048 causal tokens (call 6 of the twenty-fifth session)."""
    q = torch.zeros(1, 2, 8, d, dtype=torch.float16)
    with (
        mock.patch.object(_sm90, "ENABLED", True),
        mock.patch.object(_sm90, "_is_sm90", return_value=True),
        mock.patch.object(torch.Tensor, "is_cuda", new=True),
    ):
        assert _sm90.forward_takes(q, q, q, 0.1, CAUSAL) is padded
    assert (d in _sm90.BWD_PADDED_DIMS) is padded


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
@pytest.mark.parametrize("d", [48, 96])
def test_the_padded_backward_launches_arguments_a_planned_launch_takes(d):
    """The padded backward's fused launch (its preprocessing run through the interpreter here):
    the runtime arguments hold the values it passes at their places, as a planned launch needs
    (else every call would take Triton's JIT path), the dQ buffer in the counters' place as in
    :func:`_sm90.backward`, descriptors of the kernel's width over the head dim's tensors, dK,
    dV and the dQ buffer of the kernel's width, and never the in-kernel dQ conversion."""
    from torch_flashsys.attention._sm90._rawlaunch import _holes

    gen = torch.Generator().manual_seed(d)
    q, k, v, dout, out = (torch.randn(1, 2, 70, d, generator=gen).half() for _ in range(5))
    lse = torch.zeros(1, 2, 70)
    launches = []
    real = _sm90._launch_planned

    def spy(kernel, plans, key, index, values, args, plan):
        if kernel is _sm90.attn_bwd_prep:
            return real(kernel, plans, key, index, values, args, plan)
        launches.append((kernel, values, args(True), args(False), plan()[1]))
        return False

    with (mock.patch.object(_sm90, "_launch_planned", side_effect=spy),
          mock.patch.object(_sm90, "FUSED_CONVERT", True)):  # fmt: skip
        dq, dk, dv = _sm90._padded_backward(dout, q, k, v, out, lse, None, 0.1, True)
    ((kernel, values, full, plain, meta),) = launches
    assert meta["CONVERT"] is False  # (dQ is narrower than the kernel's: never converted there)
    kd = _sm90.kernel_dim(d)
    assert kernel is _sm90.fused_kernel(kd)
    assert _holes(plain, values) is not None
    assert all(not isinstance(a, bool) for a in plain)
    assert [a.block_shape[-1] for a in full[:4]] == [kd] * 4 and full[0].shape[-1] == d
    assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape
    assert dk._base.shape[-1] == kd and values[8].shape[-1] == kd  # (dK's buffer, the dQ sums)


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
@pytest.mark.parametrize(("d", "kd"), [(96, 128), (80, 128), (48, 64), (64, 64), (128, 128)])
def test_padded_head_dims_have_descriptors_of_the_kernels_width(d, kd):
    """The forward's descriptors: blocks of the kernel's head dim over tensors of their own."""
    q = torch.zeros(2, 4, 300, d, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 200, d, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 300)
    args = _sm90.launch_args(q, k, k, q, lse, 0.1)
    rows = (_sm90.BLOCK_M, _sm90.BLOCK_N, _sm90.BLOCK_N, _sm90.BLOCK_M)
    for desc, t, n in zip(args[:4], (q, k, k, q), rows, strict=True):
        assert desc.base is t and desc.shape == list(t.shape)
        assert desc.block_shape == [1, 1, n, kd]


def test_environment_switch_is_read_at_import():
    """Unset: on where Gluon's Hopper API imports on a verified Triton; 1: on wherever it
    imports; 0: off."""
    code = "from torch_flashsys.attention import _sm90; print(_sm90.enabled())"
    for value, expected in (
        ("0", "False"),
        ("", str(_sm90.AVAILABLE and _sm90.VERIFIED)),
        ("1", str(_sm90.AVAILABLE)),
    ):
        env = {**os.environ, "TORCH_FLASHSYS_SM90": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
        assert out == expected


def test_the_hopper_backward_takes_what_the_forward_takes_once_switched_on():
    """The dK/dV rule: the forward's, the backward switch, and a dO of q's shape and dtype whose
    layout a TMA descriptor can read."""
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    with (
        mock.patch.object(_sm90, "ENABLED", True),
        mock.patch.object(_sm90, "_is_sm90", return_value=True),
        mock.patch.object(torch.Tensor, "is_cuda", new=True),
    ):
        with mock.patch.object(_sm90, "BWD_ENABLED", False):
            assert not _sm90.backward_takes(q, q, q, q, 0.1, CAUSAL)
        with mock.patch.object(_sm90, "BWD_ENABLED", True):
            assert _sm90.backward_takes(q, q, q, q, 0.1, CAUSAL)
            assert _sm90.backward_takes(q, q[:, :1], q[:, :1], q.clone(), 0.1, PLAIN)  # GQA
            wide = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
            for args in (
                (q, q, q, q.half(), 0.1, PLAIN),  # dO of another dtype
                (q, q, q, wide[..., ::2], 0.1, PLAIN),  # dO's last dimension strided
                (q, q, q, q, 0.1, Extras(softcap=5.0)),  # not a plain or causal problem
            ):
                assert not _sm90.backward_takes(*args)


def test_the_backward_switch_is_read_at_import():
    """TORCH_FLASHSYS_SM90_BWD=1 turns the Hopper dK/dV kernel on wherever the forward is on;
    unset, it is off (opt-in while it is measured)."""
    code = "from torch_flashsys.attention import _sm90; print(_sm90.BWD_ENABLED)"
    for value, expected in (("", "False"), ("1", str(_sm90.AVAILABLE and _sm90.VERIFIED))):
        env = {**os.environ, "TORCH_FLASHSYS_SM90_BWD": value, "TORCH_FLASHSYS_SM90": ""}
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
        assert out == expected


def _every_kind(lengths: tuple[int, int]) -> dict:
    """A FUSED_SEQ_Q table with the same query lengths for every (causal, GQA) kind."""
    return {(causal, gqa): lengths for causal in (True, False) for gqa in (True, False)}


def test_the_fused_backward_takes_head_dims_64_and_128_and_64_for_determinism():
    """The fused backward's rule: the forward's, its switch, head dim 64 or 128, where it measured
    faster (query lengths in FUSED_SEQ_Q per kind, causal or not, GQA or not; every problem
    with FUSED_ALL), dO a TMA operand of q's shape and dtype. Under
    ``torch.use_deterministic_algorithms(True)``: head dim 64 only (the kernel with ordered dQ
    sums; the split kernel has none), at the lengths in DETERMINISTIC_SEQ_Q."""
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    kv = q[:, :1]  # GQA 4:1
    wide = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    strided = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)[..., ::2]
    with (
        mock.patch.object(_sm90, "FUSED_SEQ_Q", _every_kind((8, 8))),  # 8 query rows in range
        mock.patch.object(_sm90, "ENABLED", True),
        mock.patch.object(_sm90, "_is_sm90", return_value=True),
        mock.patch.object(torch.Tensor, "is_cuda", new=True),
    ):
        with mock.patch.object(_sm90, "FUSED_ENABLED", False):
            assert not _sm90.fused_takes(q, kv, kv, q, 0.1, CAUSAL)
        with mock.patch.object(_sm90, "FUSED_ENABLED", True):
            assert _sm90.fused_takes(q, kv, kv, q.clone(), 0.1, CAUSAL)
            with mock.patch.object(_sm90, "FUSED_ALL", False):  # the default rule
                for k, ex in ((q, CAUSAL), (kv, CAUSAL), (q, PLAIN), (kv, PLAIN)):
                    assert _sm90.fused_takes(q, k, k, q, 0.1, ex)
                    gqa = k.shape[1] < q.shape[1]
                    for lengths in ((1, 7), (9, 100)):  # this kind's range without 8 rows
                        table = {**_every_kind((8, 8)), (ex is CAUSAL, gqa): lengths}
                        with mock.patch.object(_sm90, "FUSED_SEQ_Q", table):
                            assert not _sm90.fused_takes(q, k, k, q, 0.1, ex)
            with mock.patch.object(_sm90, "FUSED_ALL", True):
                assert _sm90.fused_takes(q, q, q, q, 0.1, CAUSAL)
                assert _sm90.fused_takes(q, q, q, q, 0.1, PLAIN)
                assert _sm90.fused_takes(wide, wide[:, :1], wide[:, :1], wide, 0.1, CAUSAL)
            for args in (
                (q, kv, kv, q.half(), 0.1, CAUSAL),  # dO of another dtype
                (q, kv, kv, strided, 0.1, CAUSAL),  # dO's last dimension strided
                (q, kv, kv, q, 0.1, Extras(softcap=5.0)),  # not a plain or causal problem
            ):
                assert not _sm90.fused_takes(*args)
            deterministic = torch.are_deterministic_algorithms_enabled()
            try:
                torch.use_deterministic_algorithms(True)
                with mock.patch.object(_sm90, "FUSED_ALL", False):
                    table = _every_kind((8, 8))
                    with mock.patch.object(_sm90, "DETERMINISTIC_SEQ_Q", table):
                        assert _sm90.fused_takes(q, kv, kv, q, 0.1, CAUSAL)  # ordered sums
                        assert not _sm90.fused_takes(wide, wide[:, :1], wide[:, :1], wide, 0.1,
                                                     CAUSAL)  # fmt: skip
                    for lengths in ((1, 7), (9, 100)):
                        table = {**_every_kind((8, 8)), (True, True): lengths}
                        with mock.patch.object(_sm90, "DETERMINISTIC_SEQ_Q", table):
                            assert not _sm90.fused_takes(q, kv, kv, q, 0.1, CAUSAL)
            finally:
                torch.use_deterministic_algorithms(deterministic)


@contextmanager
def _deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` (warn only: the float64
    references' cuBLAS calls would raise without CUBLAS_WORKSPACE_CONFIG), restored after."""
    saved = torch.are_deterministic_algorithms_enabled()
    saved_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved, warn_only=saved_warn)


def _fused_by_default(heads: int, kv_heads: int, seq: int, seq_k: int, d: int,
                      causal: bool, batch: int = 1) -> bool:  # fmt: skip
    """Whether the default rule (no FUSED_ALL) sends this problem's backward to a fused kernel,
    on a stand-in sm90 GPU of 132 SMs (an H100's)."""
    q = torch.empty(batch, heads, seq, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(batch, kv_heads, seq_k, d, dtype=torch.bfloat16, device="meta")
    with (
        mock.patch.object(_sm90, "_sm_count", return_value=132),
        mock.patch.object(_sm90, "ENABLED", True),
        mock.patch.object(_sm90, "FUSED_ENABLED", True),
        mock.patch.object(_sm90, "FUSED_ALL", False),
        mock.patch.object(_sm90, "_is_sm90", return_value=True),
        mock.patch.object(torch.Tensor, "is_cuda", new=True),
    ):
        return _sm90.fused_takes(q, k, k, q, 0.125, CAUSAL if causal else PLAIN)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "seq_k", "causal", "fused"),
    [(16, 4, 1024, 1024, True, True), (16, 4, 16384, 16384, True, True),
     (16, 4, 32768, 32768, True, True), (16, 16, 1024, 1024, True, True),
     (16, 16, 2048, 2048, True, True), (16, 16, 512, 512, True, False),
     (16, 16, 4096, 4096, True, True), (16, 16, 16384, 16384, True, True),
     (16, 16, 512, 512, False, False), (16, 16, 1024, 1024, False, True),
     (16, 16, 2048, 2048, False, True),
     (16, 4, 256, 256, True, True), (16, 4, 512, 512, True, True), (16, 4, 255, 255, True, False),
     (16, 4, 256, 256, False, True), (16, 4, 1024, 1024, False, True),
     (16, 4, 8192, 8192, False, True), (16, 4, 16384, 16384, False, True),
     (16, 16, 16384, 16384, False, True), (16, 4, 32768, 32768, False, True),
     (16, 16, 32768, 32768, True, True), (16, 16, 65536, 65536, False, True),
     (16, 16, 131072, 131072, True, True), (16, 4, 1 << 20, 1 << 20, True, True),
     (16, 16, 4096, 77, False, False), (16, 4, 4096, 128, True, False),
     (16, 16, 8192, 4096, True, True),
     (16, 16, 512, 4096, False, False), (16, 16, 256, 8192, False, False)],
)  # fmt: skip
def test_the_fused_backward_runs_by_default_where_it_measured_faster(heads, kv_heads, seq, seq_k,
                                                                     causal, fused):  # fmt: skip
    """The committed rule (H100, ``benchmarks/sm90_bwd.py --rule`` and ``--shapes``,
    docs/benchmarks.md): with GQA from 256 rows, causal or not; without GQA causal from 1024
    (since its programs take one head's key tiles in turn, ``benchmarks/gpu_checks/order_ab.py``)
    and without a causal mask from 1024, with no upper bound (0.67-0.73x the portable kernels'
    time at 32768-131072 rows); the portable backward elsewhere. Queries and keys must both be
    in the range, except that without GQA or a causal mask 512-1023 keys take it from 2048 query
    rows (cross-attention, ``benchmarks/gpu_checks/cross_shapes.py``: its kernels 0.83-0.93x
    the portable ones' time there, no gain at 1024 rows or 256 keys); 77 keys against 4096
    queries would be one program per head looping over every query tile, and few query rows
    over many keys make each program's loop short (the portable backward is faster there)."""
    assert _fused_by_default(heads, kv_heads, seq, seq_k, 64, causal) is fused


@pytest.mark.parametrize(
    ("batch", "seq", "seq_k", "causal", "fused"),
    [(4, 2048, 512, False, True), (4, 8192, 512, False, True), (4, 16384, 512, False, True),
     (4, 32768, 512, False, True), (8, 2048, 1023, False, True), (4, 1024, 512, False, False),
     (4, 2048, 511, False, False), (4, 4096, 256, False, False), (4, 2048, 512, True, False),
     (2, 4096, 512, False, False), (1, 16384, 512, False, False), (1, 32768, 512, False, False),
     (3, 4096, 640, False, True), (1, 4096, 1000, False, False), (1, 4096, 1023, False, False),
     (2, 4096, 1023, False, True)],
)  # fmt: skip
def test_cross_attention_over_a_few_hundred_keys_takes_the_fused_backward_where_it_fills_the_gpu(
    batch, seq, seq_k, causal, fused
):
    """512-1023 keys against 2048 or more query rows (16 heads, head dim 64, no GQA, no causal
    mask: FUSED_FEW_KEYS) take the fused backward where its programs (one per 128 keys and
    head) number at least the SMs (132 here): 4-8 x 16 heads over 512 keys (256-512 programs)
    measured 0.83-0.93x the portable kernels' time, 1 x 16 (64 programs) 1.02-1.03x
    (``benchmarks/gpu_checks/cross_shapes.py``, docs/benchmarks.md)."""
    assert _fused_by_default(16, 16, seq, seq_k, 64, causal, batch) is fused


def test_the_fill_rule_counts_a_stand_in_shape_as_filling_the_gpu():
    """The background compiles evaluate the rules on shapes without a device: the few-keys
    clause then counts them as filling the GPU (its builds are queued), asking no device."""
    q, k = _sm90._Shape((1, 16, 4096, 64)), _sm90._Shape((1, 16, 512, 64))
    with (mock.patch.object(_sm90, "FUSED_ENABLED", True),
          mock.patch.object(_sm90, "FUSED_ALL", False),
          mock.patch.object(_sm90, "_sm_count", side_effect=AssertionError)):  # fmt: skip
        assert _sm90.fused_rule(q, k, PLAIN, deterministic=False)


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_the_fused_backward_orders_its_programs_as_measured_fastest(d, causal):
    """Causal: chunks of heads of about one wave of programs, each chunk's heaviest key tiles
    first (CAUSAL_ORDER; ``sm90_bwd.py --variants``: 2-26% faster than keys first or heads first
    from 1024 to 8192 tokens); without a causal mask one head's key tiles after another
    (KEYS_FIRST), head dims 64 and 128 alike."""
    meta = _sm90.fused_constexprs(d, causal, torch.bfloat16)
    assert meta["ORDER"] == (_sm90.CAUSAL_ORDER if causal else _sm90.KEYS_FIRST)
    assert meta["DETERMINISTIC"] is False


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_the_deterministic_fused_backward_starts_a_tiles_predecessors_first(d, causal):
    """Ordered dQ sums: key tile ``nb`` adds into a query tile after the tiles before it in the
    sums' order (causal: the higher key tiles; else the lower ones), and waits for them, so
    those must have smaller program ids (started first), or the kernel could wait forever:
    causal, the lightest tiles first (LIGHTEST_FIRST)."""
    from torch_flashsys.attention._sm90 import _bwd

    meta = _sm90.fused_constexprs(d, causal, torch.bfloat16, deterministic=True)
    assert meta["DETERMINISTIC"] is True and meta.get("DQ_TMA", True) is True
    assert bool(meta["ORDER"] & _sm90.LIGHTEST_FIRST) is causal
    assert not meta["ORDER"] & _sm90.CHUNKED  # the chunks' order is not the sums' order
    # the host's ORDER bits are the kernel's
    assert (_bwd.KEYS_FIRST.value, _bwd.LIGHTEST_FIRST.value, _bwd.CHUNKED.value,
            _bwd.CHUNK_SHIFT.value) == (_sm90.KEYS_FIRST, _sm90.LIGHTEST_FIRST, _sm90.CHUNKED,
                                        _sm90.CHUNK_SHIFT)  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "seq_k", "causal", "fused"),
    [(16, 16, 1024, 1024, True, False), (16, 16, 2048, 2048, True, True),
     (16, 16, 16384, 16384, True, True), (16, 4, 1024, 1024, True, True),
     (16, 16, 1024, 1024, False, True), (16, 4, 16384, 16384, False, True),
     (16, 16, 32768, 32768, True, True), (16, 4, 512, 512, False, True),
     (16, 16, 65536, 65536, False, True), (16, 4, 32768, 32768, True, True),
     (16, 4, 256, 256, True, True), (16, 4, 255, 255, False, False),
     (16, 16, 512, 512, False, False), (16, 16, 4096, 77, False, False)],
)  # fmt: skip
def test_the_split_backward_runs_by_default_where_it_measured_faster(heads, kv_heads, seq, seq_k,
                                                                     causal, fused):  # fmt: skip
    """Head dim 128 (the split kernel; H100, ``benchmarks/sm90_bwd.py --rule --head-dim 128``
    and ``--shapes``, docs/benchmarks.md): with GQA from 256 rows; without GQA from 1024, but
    causal from 2048 (at 1024 its backward measured no faster than the portable one's), with no
    upper bound (0.76-0.79x the portable kernels' time at 32768-65536 rows); keys in the range
    too."""
    assert _fused_by_default(heads, kv_heads, seq, seq_k, 128, causal) is fused


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "d", "causal", "fused"),
    [(16, 16, 16384, 64, True, True), (16, 16, 4096, 64, True, True),
     (16, 16, 2048, 64, True, False), (16, 4, 16384, 64, True, False),
     (16, 4, 1024, 64, True, False), (16, 16, 32768, 64, True, True),
     (16, 16, 1 << 17, 64, True, True), (16, 16, 32768, 128, True, True),
     (16, 16, 32768, 128, False, False),
     (16, 16, 4096, 64, False, False), (16, 4, 4096, 64, False, False),
     (16, 16, 4096, 128, True, False), (16, 16, 8192, 128, True, True),
     (16, 16, 16384, 128, True, True), (16, 4, 8192, 128, True, False),
     (16, 16, 2048, 128, False, False), (16, 16, 4096, 128, False, True),
     (16, 16, 8192, 128, False, True), (16, 16, 16384, 128, False, False)],
)  # fmt: skip
def test_the_deterministic_backward_takes_the_ordered_kernel_where_it_measured_faster(
    heads, kv_heads, seq, d, causal, fused
):
    """Under deterministic algorithms (H100, ``benchmarks/sm90_bwd.py --deterministic``,
    docs/benchmarks.md): the ordered fused kernel for causal head-dim-64 problems without GQA
    from 4096 rows (0.77-0.98x the portable backward's time up to 65536; 1.16-1.35x at
    1024-2048); with GQA (1.02-1.04x) and without a causal mask (its key tiles wait for each
    other), the portable backward. Head dim 128 (the ordered split kernel): causal without GQA
    from 8192 (0.91-0.93x up to 32768), without a causal mask at 4096-8192 (0.84-0.93x);
    elsewhere the portable backward."""
    with _deterministic_algorithms():
        assert _fused_by_default(heads, kv_heads, seq, seq, d, causal) is fused


def test_the_fused_backward_switch_is_read_at_import():
    """TORCH_FLASHSYS_SM90_BWD=fused turns the fused backward on wherever the forward is on, for
    every problem it can run; =1 the dK/dV kernel instead, =0 neither; unset, FUSED_DEFAULT
    decides on a verified Triton (where it measured faster)."""
    code = ("from torch_flashsys.attention import _sm90; "
            "print(_sm90.FUSED_ENABLED, _sm90.FUSED_ALL, _sm90.BWD_ENABLED)")  # fmt: skip
    on = _sm90.AVAILABLE and _sm90.VERIFIED
    for value, expected in (
        ("", f"{on and _sm90.FUSED_DEFAULT} False False"),
        ("fused", f"{on} True False"),
        ("1", f"False False {on}"),
        ("0", "False False False"),
    ):
        env = {**os.environ, "TORCH_FLASHSYS_SM90_BWD": value, "TORCH_FLASHSYS_SM90": ""}
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
        assert out == expected, value


@settings(max_examples=8, deadline=None)
@given(
    batch=st.integers(1, 2), heads=st.integers(1, 3), seq=st.integers(1, 150),
    transposed=st.booleans(), with_dlse=st.booleans(), deterministic=st.booleans(),
    convert=st.booleans(), seed=st.integers(0, 2**16), d=st.sampled_from([64, 48, 96]),
)  # fmt: skip
@example(batch=1, heads=2, seq=70, transposed=False, with_dlse=True, deterministic=False,
         convert=False, seed=1, d=96)  # fmt: skip
def test_the_fused_backward_preprocessing_matches_float64(batch, heads, seq, transposed,
                                                          with_dlse, deterministic, convert,
                                                          seed, d):  # fmt: skip
    """The preprocessing kernel (plain Triton; the interpreter on CPU): D = rowsum(dO * O) - dLSE
    for every row of every head, any layout of O and dO, a zeroed dQ buffer and zeroed
    counters, one per tile of BWD_BLOCK query rows (the deterministic backward's, or the
    in-kernel dQ conversion's). A padded head dim (48, 96): O and dO read up to it (the next
    row's values sit past it in memory), the dQ buffer of the fused kernel's width."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    shape = (batch, seq, heads, d) if transposed else (batch, heads, seq, d)
    out = rand(*shape).half()
    out = out.transpose(1, 2) if transposed else out  # (B, L, H, D) memory
    dout = rand(batch, heads, seq, d).half()
    lse = rand(batch, heads, seq)
    dlse = rand(batch, heads, seq) if with_dlse else None
    delta, dq_acc, sem = _sm90.backward_prep(out, dout, lse, dlse, deterministic, convert=convert)
    ref = (out.double() * dout.double()).sum(-1)
    if with_dlse:
        ref -= dlse.double()
    assert delta.shape == lse.shape and delta.stride() == lse.stride()
    assert (delta.double() - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item())
    assert dq_acc.shape == (*out.shape[:-1], _sm90.kernel_dim(d))
    assert dq_acc.dtype == torch.float32 and dq_acc.is_contiguous() and not dq_acc.any()
    if deterministic or convert:
        assert sem.shape == (batch, heads, -(-seq // _sm90.BWD_BLOCK)) and sem.dtype == torch.int32
        assert not sem.any()
    else:
        assert sem is None


@settings(max_examples=6, deadline=None)
@given(
    batch=st.integers(1, 2), heads=st.integers(1, 3), seq=st.integers(1, 150),
    copies=st.integers(2, 4), transposed=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_the_deterministic_dq_copies_are_summed_in_order(batch, heads, seq, copies, transposed,
                                                        seed):  # fmt: skip
    """The deterministic backward's float32 dQ copies (one per chain) are added in copy order
    into q's dtype and layout: exactly ``((c0 + c1) + c2) ...`` rounded once."""
    gen = torch.Generator().manual_seed(seed)
    acc = torch.randn(copies * batch, heads, seq, 64, generator=gen)
    shape = (batch, seq, heads, 64) if transposed else (batch, heads, seq, 64)
    q = torch.zeros(shape, dtype=torch.float16)
    q = q.transpose(1, 2) if transposed else q
    dq = _sm90.dq_sum(acc, q, copies)
    parts = acc.view(copies, batch, heads, seq, 64)
    total = parts[0].clone()
    for c in range(1, copies):
        total += parts[c]
    assert dq.dtype == q.dtype and dq.stride() == q.stride()
    assert torch.equal(dq, total.half())


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
def test_hopper_kernel_compiles_for_sm90_with_the_installed_triton():
    """The Gluon source compiles for sm90 without a GPU (so CI checks it on its Triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.attention.sm90_offline"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # thirteen forwards (two defaults, two with key and value tiles released together, the
    # cycle probe, two with the dynamic schedule, two with two query buffers: head dim 128's
    # fits the 227 KB of shared memory, two with three consumer warpgroups, two with the chain
    # row maximum), two dK/dV kernels, four fused backwards (head dims 64 and 128, TMA dQ sums)
    assert done.stdout.count("shared memory") == 19, done.stdout
    # A new sequence length compiles nothing: no integer argument is specialized (the first
    # call at a new length took 2-3 s on an H100 when they were).
    assert "\n1 kernel(s) for lengths" in done.stdout, done.stdout


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
def test_builds_queued_after_a_first_call_serve_every_later_length():
    """After a kind of problem's first call, the builds queued for the background
    (``_precompile``: every forward build its length rules pick, and the backward's, fused or
    portable with each tile) are all that calls at any other length need: compiled for sm90
    without a GPU, with the jobs' stand-in arguments, then the launches the library builds from
    real tensors at 220 other lengths (1 to 20000, every bound crossed) compile nothing, under
    deterministic algorithms too (the ordered sums' builds). Before,
    a warm process stopped 2.2-3.7 s at a first call at 700, 2049 or 8192 tokens after one at
    2048 (H100, docs/benchmarks.md); with nothing queued this check counts 3 later compiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # head dim 64 causal GQA (the forward's consumer counts, fused and portable backwards), 128
    # causal from 700 (the dynamic schedule's counter), 128 causal deterministic (ordered sums),
    # 96 causal (the forward on the 128 kernel, the portable backward): the least builds queued
    families = {
        "64,1,bfloat16,2048": 5,
        "128,1,float16,700": 5,
        "128,1,float16,9000,4,det": 5,
        "96,1,bfloat16,2048": 4,
    }
    done = subprocess.run([sys.executable, "-m", "tests.attention.sm90_offline", "precompile",
                           *families], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for family, least in families.items():
        line = next(x for x in done.stdout.splitlines() if x.startswith(family))
        assert line.endswith("of later calls 0"), done.stdout
        assert int(line.split("queued builds ")[1].split(",")[0]) >= least, done.stdout


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
def test_pinned_waits_keep_every_exponential_before_the_products_wait():
    """With PIN_WAIT the compiled kernels (sm90 SASS, without a GPU) compute all of a step's
    exponentials between the wait for its first product and the wait for the second (forward:
    S_j, then P_{j-1} V_{j-1}; fused backward: S^T, then dP^T), in every consumer loop of the
    forward and the fused backward, head dims 64 and 128, causal and not; unpinned, ptxas
    hoists the second wait above most of them (printed, not asserted: it is ptxas's choice)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.attention.sm90_offline", "schedule"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" pinned (a step has ") == 8, done.stdout


def _triton_launcher_of(raw, signature: dict, metas: list):
    """A stand-in for a compiled kernel whose launcher is this Triton's own descriptor-expanding
    wrapper (``wrap_handle_tensordesc``) around ``raw`` (the C entry point's stand-in)."""
    from triton.backends.nvidia.driver import wrap_handle_tensordesc

    launcher = mock.Mock(launch=wrap_handle_tensordesc(raw, signature, metas),
                         global_scratch_size=0, profile_scratch_size=0, num_ctas=1,
                         launch_cooperative_grid=False, launch_pdl=False)  # fmt: skip
    return mock.Mock(run=launcher, packed_metadata=(4, 1, 1000), function=22)


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
def test_raw_launch_passes_what_tritons_launcher_passes():
    """RawLaunch (``_sm90._rawlaunch``), given the values of a launch (the tensors, in the
    descriptors' places too, and the floats), hands the launcher's C entry point the arguments
    Triton's own wrapper would for the descriptors (tensors as their addresses, each descriptor
    as its map, shape and strides, the integers kept from the first call), encoding a slot's map
    once per address; values that are not the arguments' own are refused when it is built; on a
    Triton whose launcher has another layout it declines (None), and the kernels keep Triton's
    launcher."""
    from torch_flashsys.attention._sm90._rawlaunch import RawLaunch

    calls, encoded = [], []
    raw = lambda *a: calls.append(a)

    def encode(*a):
        encoded.append(a)
        return ("map", *a[:2])

    q = torch.randn(2, 100, 3, 64, dtype=torch.bfloat16).transpose(1, 2)  # (B, L, H, D) strides
    k = torch.randn(2, 3, 100, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 3, 100)
    signature = {0: "tensordesc<bf16[1, 1, 64, 64]>", 1: "*fp32", 2: "i32",
                 3: "tensordesc<bf16[1, 1, 128, 64]>", 4: "fp32", 5: "constexpr", 6: "constexpr"}  # fmt: skip
    metas = [{"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [1, 1, 64, 64],
              "fp4_padded": False},
             {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [1, 1, 128, 64],
              "fp4_padded": False}]  # fmt: skip
    compiled = _triton_launcher_of(raw, signature, metas)
    args = (_sm90._descriptor(q, 64), lse, 7, _sm90._descriptor(k, 128), 0.5)
    tail = (True, 3)
    values = (q, lse, k, 0.5)  # what the library passes: no descriptors built, no integers
    assert RawLaunch.build(compiled, (5, 1, 1), args, tail, (q, lse, q, 0.5), encode) is None
    assert RawLaunch.build(compiled, (5, 1, 1), args, tail, (q, lse, k), encode) is None
    launch = RawLaunch.build(compiled, (5, 1, 1), args, tail, values, encode)
    cells = compiled.run.launch.__code__.co_freevars
    if launch is None:  # another Triton's launcher: declined, as it must be
        assert "tensordesc_indices" not in cells
        return
    from triton.runtime import driver

    with mock.patch.object(driver, "_active", mock.Mock()):
        driver.active.utils.fill_tma_descriptor = encode
        compiled.run.launch(5, 1, 1, 11, 22, False, False, None, None, (4, 1, 1000), None, None,
                            None, *args, *tail)  # fmt: skip
    expected = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in calls.pop())
    encoded.clear()
    for _ in range(2):
        launch(11, values)
        assert calls.pop() == expected
    assert len(encoded) == 2  # one map per slot, kept for the second launch
    other, lse2 = torch.randn_like(q), torch.zeros_like(lse)
    launch(12, (other, lse2, k, 0.25))
    sent = calls.pop()
    assert sent[3] == 12 and sent[13] == ("map", other.data_ptr(), 3) and len(encoded) == 3
    assert sent[22] == lse2.data_ptr() and sent[23] == 7 and sent[33] == 0.25
    with pytest.raises(RuntimeError, match="shape"):
        launch(11, (torch.randn(2, 3, 99, 64, dtype=torch.bfloat16), *values[1:]))
    with pytest.raises(RuntimeError, match="shape"):  # q's shape, k's (B, H, L, D) strides
        launch(11, (torch.randn(2, 3, 100, 64, dtype=torch.bfloat16), *values[1:]))


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
def test_triton_launch_rebuilds_the_descriptors_around_the_values():
    """TritonLaunch (the launch where RawLaunch declines) passes Triton's launcher the first
    call's arguments with the values in their places: each descriptor rebuilt around its new
    tensor with the first one's block and layout, other tensors as their addresses, floats as
    given."""
    from torch_flashsys.attention._sm90._rawlaunch import TritonLaunch

    q, k = (torch.randn(1, 2, 80, 64, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.zeros(1, 2, 80)
    args = (_sm90._descriptor(q, 64), lse, 7, _sm90._descriptor(k, 128), 0.5)
    run = mock.Mock()
    compiled = mock.Mock(run=run, packed_metadata=(4, 1, 1000), function=22)
    assert TritonLaunch.build(compiled, (5, 1, 1), args, (True,), (k, lse, k, 0.5)) is None
    launch = TritonLaunch.build(compiled, (5, 1, 1), args, (True,), (q, lse, k, 0.5))
    q2 = torch.randn(1, 2, 80, 64, dtype=torch.bfloat16).transpose(1, 2).contiguous()
    q2 = q2.transpose(1, 2)  # another layout of the same shape
    launch(11, (q2, lse, k, 0.25))
    sent = run.call_args.args
    assert sent[:9] == (5, 1, 1, 11, 22, (4, 1, 1000), None, None, None)
    desc = sent[9]
    assert desc.base is q2 and desc.strides == list(q2.stride()) and desc.shape == list(q2.shape)
    assert desc.block_shape == args[0].block_shape and desc.layout == args[0].layout
    assert sent[10:] == (lse.data_ptr(), 7, sent[12], 0.25, True) and sent[12].base is k
    assert args[0].base is q  # the template is left as it was


@pytest.mark.skipif(not _sm90.AVAILABLE, reason="this Triton has no Gluon Hopper API")
def test_kept_launches_hold_no_tensor_of_the_first_call():
    """A kept launch (RawLaunch or TritonLaunch, in a plan table for as long as its key) holds
    none of the first call's tensors: those buffers (a float32 dQ buffer, the outputs) are
    freed when the call is done with them."""
    import gc
    import weakref

    from torch_flashsys.attention._sm90._rawlaunch import RawLaunch, TritonLaunch

    q, k = (torch.randn(1, 2, 80, 64, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.zeros(1, 2, 80)
    args = (_sm90._descriptor(q, 64), lse, 7, _sm90._descriptor(k, 128), 0.5)
    compiled = mock.Mock(run=mock.Mock(), packed_metadata=(4, 1, 1000), function=22)
    launches = [TritonLaunch.build(compiled, (5, 1, 1), args, (True,), (q, lse, k, 0.5))]
    signature = {0: "tensordesc<bf16[1, 1, 64, 64]>", 1: "*fp32", 2: "i32",
                 3: "tensordesc<bf16[1, 1, 128, 64]>", 4: "fp32", 5: "constexpr"}  # fmt: skip
    metas = [{"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [1, 1, 64, 64],
              "fp4_padded": False},
             {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [1, 1, 128, 64],
              "fp4_padded": False}]  # fmt: skip
    raw = RawLaunch.build(_triton_launcher_of(lambda *a: None, signature, metas), (5, 1, 1), args,
                          (True,), (q, lse, k, 0.5), encode=lambda *a: "map")  # fmt: skip
    launches += [raw] if raw is not None else []
    refs = [weakref.ref(t) for t in (q, k, lse)]
    del q, k, lse, args
    gc.collect()
    assert all(ref() is None for ref in refs), "a kept launch holds the first call's tensors"
    assert all(launch is not None for launch in launches)


_LAYOUTS = st.sampled_from(["contiguous", "transposed"])


def _tensor(shape: tuple, layout: str, dtype=torch.bfloat16) -> torch.Tensor:
    """A CPU tensor of ``shape`` (B, H, L, D), contiguous or a (B, L, H, D) tensor's view."""
    if layout == "contiguous":
        return torch.randn(shape, dtype=dtype)
    b, h, n, d = shape
    return torch.randn(b, n, h, d, dtype=dtype).transpose(1, 2)


def _lse(shape: tuple, layout: str) -> torch.Tensor:
    """float32 (B, H, L): contiguous, or a slice of a longer row (another row stride)."""
    if layout == "contiguous":
        return torch.randn(shape)
    return torch.randn(*shape[:-1], shape[-1] + 8)[..., : shape[-1]]


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2]),
       seq_q=st.integers(1, 300), seq_k=st.integers(1, 300), d=st.sampled_from([64, 128]),
       layouts=st.tuples(*[st.lists(_LAYOUTS, min_size=6, max_size=6)] * 2),
       causal=st.booleans(), deterministic=st.booleans())  # fmt: skip
def test_planned_launches_take_the_arguments_values_and_their_keys_fix_the_rest(
    batch, kv_heads, group, seq_q, seq_k, d, layouts, causal, deterministic
):
    """A planned launch keeps the first call's integer arguments and takes only the values
    (``launch_values`` and its kin): for the forward, dK/dV and fused kernels, the values are
    exactly the tensors and floats of the arguments, in order, and two calls whose launch keys
    are equal (layouts drawn from a few, so that keys often agree) have equal integers."""
    from torch_flashsys.attention._sm90._rawlaunch import _holes

    heads = kv_heads * group
    sets = []
    for lay in layouts:
        q = _tensor((batch, heads, seq_q, d), lay[0])
        k, v = (_tensor((batch, kv_heads, seq_k, d), lay[i]) for i in (1, 2))
        dout = _tensor(q.shape, lay[3])
        out, lse = torch.empty_like(q), _lse(q.shape[:-1], lay[4])
        delta, dk, dv = torch.empty_like(lse), torch.empty_like(k), torch.empty_like(v)
        dq_acc = torch.empty(q.shape)
        sem = torch.zeros(3, dtype=torch.int32) if deterministic else None
        counter = torch.zeros(1, dtype=torch.int32) if lay[5] == "transposed" else None
        scale = float(torch.rand(()))
        fwd = (_sm90.launch_args(q, k, v, out, lse, scale, counter, False),
               _sm90.launch_values(q, k, v, out, lse, scale, counter),
               _sm90.forward_key(q, k, v, lse, causal, 0, None, counter is not None))  # fmt: skip
        dkdv = (_sm90.backward_launch_args(q, k, v, dout, lse, delta, dk, dv, scale, False),
                _sm90.backward_launch_values(q, k, v, dout, lse, delta, dk, dv, scale),
                _sm90.backward_key(q, k, v, dout, lse, dk, dv, causal, 0, delta.stride()))  # fmt: skip
        fused = (_sm90.fused_launch_args(q, k, v, dout, lse, delta, dk, dv, dq_acc, scale, sem,
                                         False),
                 _sm90.fused_launch_values(q, k, v, dout, lse, delta, dk, dv, dq_acc, scale, sem),
                 _sm90.backward_key(q, k, v, dout, lse, dk, dv, causal, 0, deterministic))  # fmt: skip
        sets.append((fwd, dkdv, fused))
    for first, second in zip(*sets, strict=True):
        ints = []
        for args, values, _key in (first, second):
            positions = _holes(args, values)
            assert positions is not None, "the values are not the arguments' tensors and floats"
            ints.append([a for i, a in enumerate(args) if i not in positions])
        if first[2] == second[2]:
            assert ints[0] == ints[1]


gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(
    not _on_sm90(), reason="needs an sm90 GPU with the Hopper path on (Gluon's Hopper API)"
)
DTYPES = [torch.bfloat16, torch.float16]


_run = triton_run


@pytest.fixture
def fresh_launches():
    """No kept launch from an earlier test before the test, none of its own after it (the
    launch tables are per process and keyed on shapes a later test may reuse)."""
    _sm90.forget_launches()
    yield
    _sm90.forget_launches()


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20, deadline=None)
@given(case=cases(max_seq=700, head_dims=(64, 128), max_batch=3))
@example(case=Case(4, 4, 4, 1100, 1100, 128, True, None, False, True, seed=1))
@example(case=Case(3, 8, 1, 1500, 700, 64, False, 0.3, False, False, seed=2))
def test_hopper_path_matches_float64(case, dtype):
    """The plain and causal calls the rule admits run on the Hopper kernel (counted) and match
    float64 as the portable kernels must; the examples have more query tiles than the GPU has
    SMs (the persistent schedule's rounds), seq_k below seq_q and a (B, L, H, D) layout."""
    with _counting_sm90_calls() as spy:
        check_against_reference(case, dtype, _run(case), device="cuda")
    assert spy.call_count == 1


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20, deadline=None)
@given(case=cases(max_seq=700, head_dims=PADDED_CANDIDATES, max_batch=3))
@example(case=Case(2, 4, 4, 1100, 1100, 96, True, None, False, True, seed=21))
@example(case=Case(3, 8, 1, 1500, 700, 80, False, 0.3, False, False, seed=22))
@example(case=Case(1, 2, 2, 2100, 2100, 48, True, None, False, False, seed=23))
@example(case=Case(2, 2, 3, 3000, 2500, 112, False, None, False, True, seed=24))
@example(case=Case(1, 1, 2, 9000, 9000, 32, True, None, False, False, seed=25))
def test_padded_head_dims_run_the_hopper_forward_and_match_float64(case, dtype):
    """Head dims between the kernels' (32, 48, 80, 96, 112, every one put in FWD_PADDED_DIMS
    here) run the forward on the next kernel, its descriptors' blocks wider than the tensors
    (columns past the head dim read as zeros, clipped from the store), and match float64 with
    their gradients (the backward on that forward's lse: portable, or the padded fused kernel
    where BWD_PADDED_DIMS and its length rules send it) by the portable kernels' rule; the
    examples: a (B, L, H, D) layout, GQA, the dynamic schedule and the persistent
    grid's rounds, three consumers (head dim 32 on the 64 kernel at 9000 rows)."""
    with (mock.patch.object(_sm90, "FWD_PADDED_DIMS", frozenset(PADDED_CANDIDATES)),
          _counting_sm90_calls() as spy):  # fmt: skip
        check_against_reference(case, dtype, _run(case), device="cuda")
    assert spy.call_count == 1


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(case=cases(max_seq=700, head_dims=PADDED_CANDIDATES, max_batch=3))
@example(case=Case(2, 4, 4, 1100, 1100, 96, True, None, False, True, seed=31))
@example(case=Case(3, 8, 1, 1500, 700, 80, False, 0.3, False, False, seed=32))
@example(case=Case(1, 2, 2, 2100, 2100, 48, True, None, False, False, seed=33))
@example(case=Case(2, 6, 2, 1, 5, 112, False, None, True, False, seed=34))
@example(case=Case(1, 3, 4, 1200, 900, 32, True, 0.2, False, True, seed=35))
def test_padded_head_dims_run_the_fused_backward_and_match_float64(case, dtype):
    """With FUSED_ALL every backward of a head dim between the kernels' (32-112, all put in
    FWD_PADDED_DIMS and BWD_PADDED_DIMS here) runs the fused kernel of the next head dim
    (counted), its loads over TMA's zero fill and its dK, dV and dQ sums in buffers of that
    width, and dQ, dK and dV match float64 (with a dLSE) by the portable kernels' rule; the
    examples: a (B, L, H, D) layout, GQA, fewer keys than rows, the split kernel (80-112) and
    attn_bwd_sm90 (32, 48), one query row."""
    padded = frozenset(PADDED_CANDIDATES)
    with (mock.patch.object(_sm90, "FWD_PADDED_DIMS", padded),
          mock.patch.object(_sm90, "BWD_PADDED_DIMS", padded),
          mock.patch.object(_sm90, "FUSED_ALL", True),
          mock.patch.object(_sm90, "_padded_backward", wraps=_sm90._padded_backward) as spy,
          _counting_sm90_calls()):  # fmt: skip
        check_against_reference(case, dtype, _run(case), device="cuda")
    assert spy.call_count == 1


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [Case(2, 4, 4, 2100, 2100, 128, True, None, False, True, seed=3),  # 544 tiles, GQA 4:1
     Case(3, 8, 1, 1500, 1400, 64, True, 0.3, False, False, seed=4),  # fewer keys than rows
     Case(1, 2, 1, 1025, 1025, 64, True, None, False, False, seed=5)],  # fewer tiles than SMs
)  # fmt: skip
def test_dynamic_schedule_matches_float64_and_the_static_grid(case, dtype):
    """Causal problems with the tiles taken from a counter (FWD_DYNAMIC) match float64 and give
    the bits of the one-program-per-tile grid (a tile's work is the same wherever it runs); two
    calls in a row on one stream share its counter (each launch leaves it at zero)."""
    q, k, v = case.make(dtype, "cuda", requires_grad=False)
    static = {}
    for dynamic in (False, True):
        with (mock.patch.object(_sm90, "FWD_DYNAMIC", dynamic),
              mock.patch.dict(_sm90.FWD_DYNAMIC_MAX, {64: 1 << 30, 128: 1 << 30})):  # fmt: skip
            assert _sm90.dynamic_schedule(q, True) is dynamic
            check_against_reference(case, dtype, _run(case), device="cuda", grads=False)
            runs = [_run(case)(q, k, v) for _ in range(2)]
        static = static or {"out": runs[0][0], "lse": runs[0][1]}
        for out, lse in runs:
            assert torch.equal(out, static["out"]) and torch.equal(lse, static["lse"])


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [Case(4, 4, 2, 1000, 1000, 64, False, None, False, False, seed=6),  # 256 tiles, 132 SMs
     Case(3, 4, 4, 1100, 1100, 128, True, None, False, True, seed=7),  # dynamic, GQA 4:1
     Case(2, 4, 2, 2048, 1500, 128, False, 0.2, False, False, seed=8),  # fewer keys than rows
     Case(2, 8, 2, 777, 777, 64, True, None, False, False, seed=9)],  # dynamic, 224 tiles
)  # fmt: skip
def test_two_query_buffers_match_float64_and_one_buffer(case, dtype):
    """The forward with two query buffers per warpgroup (FWD_QBUF2_MAX), on problems whose
    programs take several tiles each (so both buffers are refilled in turn), matches float64
    and gives the bits of one buffer (a tile's arithmetic is the same). Each build compiles in
    turn (fresh launch tables: the number of buffers is not in the launch key) and is seen to."""
    q, k, v = case.make(dtype, "cuda", requires_grad=False)
    one = {key: 0 for key in _sm90.FWD_QBUF2_MAX}
    results = []
    for table in (one, {key: 1 << 30 for key in one}):
        buffers = 1 if table is one else 2
        with mock.patch.dict(_sm90.FWD_QBUF2_MAX, table), _fresh_plans() as built:
            assert _sm90.query_buffers(q, case.is_causal) == buffers
            if table is not one:
                check_against_reference(case, dtype, _run(case), device="cuda", grads=False)
            results.append(_run(case)(q, k, v))
        forwards = [meta for meta in built if "QBUF" in meta]
        assert forwards and all(meta["QBUF"] == buffers for meta in forwards)
    (out1, lse1), (out2, lse2) = results
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [Case(4, 4, 2, 1000, 1000, 64, False, None, False, False, seed=16),  # 6 tiles a head, 2 buffers
     Case(2, 4, 2, 3000, 2500, 64, False, 0.2, False, True, seed=17),  # 1 buffer, strided
     Case(2, 8, 2, 777, 777, 64, True, None, False, False, seed=18),  # dynamic, GQA 2:1
     Case(1, 2, 4, 4100, 4100, 64, True, None, False, False, seed=19)],  # dynamic, GQA 4:1
)  # fmt: skip
def test_three_consumers_match_float64_and_two(case, dtype):
    """The forward with three consumer warpgroups (FWD_CONSUMERS3_MIN: tiles of 192 query rows, the
    turn passed round a ring of three) matches float64 and gives the bits of two consumers (a
    row's arithmetic is the same; a causal tile's key tiles past a warpgroup's diagonal add
    zeros). Lengths that are no multiple of 192, programs that take several tiles (the query
    buffers and the ring refilled in turn). Each build compiles and is seen to."""
    q, k, v = case.make(dtype, "cuda", requires_grad=False)
    results = []
    for consumers in (2, 3):
        table = {(d, c): 0 for d in (64, 128) for c in (False, True)} if consumers == 3 else {}
        with mock.patch.object(_sm90, "FWD_CONSUMERS3_MIN", table), _fresh_plans() as built:
            assert _sm90.forward_consumers(q, case.is_causal) == consumers
            if consumers == 3:
                check_against_reference(case, dtype, _run(case), device="cuda", grads=False)
            results.append(_run(case)(q, k, v))
        forwards = [meta for meta in built if "CONSUMERS" in meta]
        assert forwards and all(meta["CONSUMERS"] == consumers for meta in forwards)
        assert all(meta["maxnreg"] == _sm90.FWD_REGS[consumers][0] for meta in forwards)
    (out2, lse2), (out3, lse3) = results
    assert torch.equal(out2, out3) and torch.equal(lse2, lse3)


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=12, deadline=None)
@given(case=cases(max_seq=700, head_dims=(64,), max_batch=3))
@example(case=Case(2, 2, 2, 1000, 600, 64, True, None, False, False, seed=20))
@example(case=Case(1, 2, 2, 500, 1300, 64, True, None, False, True, seed=21))
def test_three_consumers_on_any_shape_match_float64_and_two(case, dtype):
    """Three consumer warpgroups forced at every length (the default takes them from 2049 rows,
    8192 causal) on drawn problems: query and key lengths apart (causal rows past the last key,
    keys past the last row: the examples), GQA, 3-D and (B, L, H, D) layouts, a scale. Each runs
    on the Hopper kernel, matches float64, and gives the bits of two consumers."""
    q, k, v = case.make(dtype, "cuda", requires_grad=False)
    results = []
    for consumers, table in ((3, {(64, False): 0, (64, True): 0}), (2, {})):
        with (mock.patch.object(_sm90, "FWD_CONSUMERS3_MIN", table), _fresh_plans() as built,
              _counting_sm90_calls() as spy):  # fmt: skip
            if consumers == 3:
                check_against_reference(case, dtype, _run(case), device="cuda", grads=False)
            results.append(_run(case)(q, k, v))
            assert spy.call_count >= 1
        forwards = [meta for meta in built if "CONSUMERS" in meta]
        assert forwards and all(meta["CONSUMERS"] == consumers for meta in forwards)
    (out3, lse3), (out2, lse2) = results
    assert torch.equal(out3, out2) and torch.equal(lse3, lse2)


@gpu
@needs_sm90
def test_the_dynamic_schedules_counter_is_left_at_zero_per_stream():
    """Each launch of the dynamic schedule leaves its stream's counter at zero (the launch's last
    addition stores zero back), so the next launch on the stream, or on another stream with its
    own counter, takes every tile once: equal outputs whatever ran before; a call captured in a
    CUDA graph gets a counter of its own and replays correctly."""
    q, k, v = (torch.randn(3, 4, 1500, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with mock.patch.object(_sm90, "FWD_DYNAMIC", True):
        assert _sm90.dynamic_schedule(q, True)
        ref = _sm90.forward(q, k, v, 0.125, True)
        counter = _sm90._COUNTERS[(q.get_device(), torch.cuda.current_stream().cuda_stream)]
        for _ in range(3):
            again = _sm90.forward(q, k, v, 0.125, True)
            assert torch.equal(again[0], ref[0]) and torch.equal(again[1], ref[1])
        torch.cuda.synchronize()
        assert counter.item() == 0
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outs = [_sm90.forward(q, k, v, 0.125, True) for _ in range(2)]
        torch.cuda.synchronize()
        assert _sm90._COUNTERS[(q.get_device(), side.cuda_stream)] is not counter
        for out, lse in outs:
            assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            _sm90.forward(q, k, v, 0.125, True)  # warm up on the side stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = _sm90.forward(q, k, v, 0.125, True)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured[0], ref[0]) and torch.equal(captured[1], ref[1])
        assert counter.item() == 0


@gpu
@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_path_is_deterministic_and_keeps_the_query_layout(causal):
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 2, 300, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with _counting_sm90_calls() as spy:
        first = flash_attention(q, k, v, is_causal=causal, enable_gqa=True)
        again = flash_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert spy.call_count == 2
    assert torch.equal(first, again)
    assert first.stride() == q.stride()


@gpu
@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_broadcast_inputs_and_gradients_match_float64(causal, fresh_launches):
    """Tensors with zero strides (broadcast by ``expand``) on the Hopper kernels, their TMA
    descriptors taking the zero strides: a key/value head expanded over the query heads, and dO
    expanded from one row of weights (``out.backward(w.expand_as(out))``), twice, so that the
    second backward runs the kept launches; out, dQ, dK and dV match float64."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 8, 1100, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(2, 2, 1, 1100, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16, generator=gen)
    for _ in range(2):
        qg = q.clone().requires_grad_()
        k = kv[:, 0].clone().requires_grad_()
        v = kv[:, 1].clone().requires_grad_()
        kx, vx = (t[:, :1].expand(2, 8, 1100, 64) for t in (k, v))  # stride 0 over heads
        with (mock.patch.object(_sm90, "forward", wraps=_sm90.forward) as fwd,
              mock.patch.object(_sm90, "backward", wraps=_sm90.backward) as bwd):  # fmt: skip
            out = flash_attention(qg, kx, vx, is_causal=causal)
            out.backward(w.expand_as(out))  # dO = w broadcast: strides (0, 0, 0, 1)
        assert fwd.call_count == 1 and bwd.call_count == 1
        assert bwd.call_args.args[0].stride() == (0, 0, 0, 1)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (qg, k, v))
        out64, _ = attention_reference(q64, k64[:, :1].expand(2, 8, 1100, 64),
                                       v64[:, :1].expand(2, 8, 1100, 64), causal)  # fmt: skip
        out64.backward(w.double().expand_as(out64))
        for name, ours, ref in (("out", out, out64), ("dq", qg.grad, q64.grad),
                                ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):  # fmt: skip
            err = (ours.double() - ref).abs().max().item()
            assert err <= 2e-2 * max(1.0, ref.abs().max().item()), (name, err)


@gpu
@needs_sm90
def test_new_launch_keys_keep_no_gpu_buffers():
    """Forward+backward calls of new shapes on the Hopper path (each a new launch key: the
    forward, the preprocessing and the fused backward's kept launches) leave no GPU memory
    allocated once their tensors are gone: a kept launch holds no buffer of its first call."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for seq in (1024, 1100, 2048, 2100):
        for d, causal in ((64, True), (128, False)):
            q, k, v = (torch.randn(2, 4, seq, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))  # fmt: skip
            with mock.patch.object(_sm90, "FUSED_ALL", True):
                out = flash_attention(q, k, v, is_causal=causal)
                out.backward(torch.randn_like(out))
            del q, k, v, out
    torch.cuda.synchronize()
    counters = 512 * len(_sm90._COUNTERS)  # the dynamic schedule's int32 per stream (one block)
    assert torch.cuda.memory_allocated() <= before + counters


@gpu
@needs_sm90
def test_hopper_path_serves_plain_calls_once_switched_on():
    """With the switch on, a plain causal bf16 call takes the Hopper kernel."""
    q = torch.randn(1, 4, max(_sm90.MIN_SEQ_K, 128), 64, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(_sm90, "forward", wraps=_sm90.forward) as spy:
        flash_attention(q, q, q, is_causal=True)
    assert spy.call_count == 1


@gpu
@needs_sm90
@pytest.mark.parametrize("length", [1, 2, 3])
@given(seq=st.integers(1, 64))
@settings(max_examples=5, deadline=None)
def test_hopper_path_handles_tiny_sequences(length, seq):
    """A few rows and keys (one partly filled tile): rows past the end are neither read from
    another head nor written."""
    q = torch.randn(length, 2, seq, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(length, 2, seq + 3, 64, device="cuda", dtype=torch.float16)
    with _counting_sm90_calls():
        out = flash_attention(q, k, k, is_causal=False)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), k.double())
    assert (out.double() - ref).abs().max().item() < 2e-3


@contextmanager
def _hopper_backward(pipeline: bool = True):
    """The Hopper dK/dV kernel switched on (every length allowed), its calls counted."""
    with (
        mock.patch.object(_sm90, "BWD_ENABLED", True),
        mock.patch.object(_sm90, "FUSED_ENABLED", False),
        mock.patch.object(_sm90, "BWD_PIPELINE", pipeline),
        mock.patch.object(_sm90, "MIN_SEQ_K", 1),
        mock.patch.object(_sm90, "backward_dkdv", wraps=_sm90.backward_dkdv) as spy,
    ):
        yield spy


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20, deadline=None)
@given(case=cases(max_seq=700, head_dims=(64, 128), max_batch=3), pipeline=st.booleans())
@example(case=Case(4, 4, 4, 1100, 1100, 128, True, None, False, True, seed=1), pipeline=True)
@example(case=Case(3, 8, 1, 1500, 700, 64, False, 0.3, False, False, seed=2), pipeline=True)
@example(case=Case(1, 2, 3, 300, 1000, 64, True, None, False, False, seed=3), pipeline=False)
def test_hopper_backward_matches_float64(case, dtype, pipeline):
    """dK and dV from the Hopper kernel (counted) match float64 as the portable kernels' must:
    GQA groups, ragged lengths, seq_k above and below seq_q, causal and not, strided layouts."""
    with _hopper_backward(pipeline) as spy:
        check_against_reference(case, dtype, _run(case), device="cuda")
    assert spy.call_count == 1


@gpu
@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_backward_is_bitwise_reproducible(causal):
    """No atomics: two backward passes give the same bits."""
    q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)
    with _hopper_backward() as spy:
        grads = []
        for _ in range(2):
            out = flash_attention(q, k, v, is_causal=causal, enable_gqa=True)
            grads.append(torch.autograd.grad(out, (q, k, v), dout))
    assert spy.call_count == 2
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@contextmanager
def _fused_backward():
    """The fused Hopper backward switched on (every length allowed), its calls counted."""
    with (
        mock.patch.object(_sm90, "FUSED_ENABLED", True),
        mock.patch.object(_sm90, "FUSED_ALL", True),
        mock.patch.object(_sm90, "MIN_SEQ_K", 1),
        mock.patch.object(_sm90, "backward", wraps=_sm90.backward) as spy,
    ):
        yield spy


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None)
@given(case=cases(max_seq=700, head_dims=(64, 128), max_batch=3))
@example(case=Case(4, 4, 4, 1100, 1100, 64, True, None, False, True, seed=1))
@example(case=Case(2, 4, 2, 1100, 1100, 128, True, None, False, True, seed=5))
@example(case=Case(3, 8, 1, 1500, 700, 128, False, 0.3, False, False, seed=6))
@example(case=Case(1, 2, 3, 300, 1000, 128, True, None, False, False, seed=7))
@example(case=Case(3, 8, 1, 1500, 700, 64, False, 0.3, False, False, seed=2))
@example(case=Case(1, 2, 3, 300, 1000, 64, True, None, False, False, seed=3))
@example(case=Case(2, 6, 2, 1, 5, 64, False, None, True, False, seed=4))
@example(case=Case(2, 1, 2, 645, 2, 64, False, 0.48238948795141395, True, False, seed=642))
@example(case=Case(1, 11, 1, 1536, 1536, 64, True, None, False, False, seed=16))
@example(case=Case(1, 11, 1, 1536, 1536, 128, True, None, False, True, seed=17))
@example(case=Case(1, 9, 1, 700, 2100, 128, True, None, False, False, seed=18))
def test_fused_backward_matches_float64(case, dtype):
    """dQ, dK and dV from the fused kernels (counted; head dim 64 and the split kernel of head
    dim 128) match float64 as the portable kernels' must, with dLSE: GQA groups, ragged lengths,
    seq_k above and below seq_q, causal and not, 3-D and strided layouts. The example with 2
    keys and a large scale once gave NaN in dQ: exp(0 - LSE) of the zero-filled keys past the
    end overflowed float16. The last three: causal programs in chunks of heads (CAUSAL_ORDER)
    whose last chunk is short (11 heads of 12 key tiles: chunks of 10 and 1; 9 heads of 17:
    7 and 2)."""
    with _fused_backward() as spy:
        check_against_reference(case, dtype, _run(case), device="cuda")
    assert spy.call_count == 1


@gpu
@needs_sm90
@pytest.mark.parametrize(
    "case",
    [Case(2, 2, 4, 700, 700, 64, True, None, False, True, seed=0),
     Case(1, 2, 2, 300, 1000, 128, True, None, False, False, seed=0),
     Case(3, 8, 1, 1500, 700, 128, False, 0.3, False, False, seed=0),
     Case(2, 1, 3, 513, 513, 64, False, None, True, False, seed=0)],
)  # fmt: skip
def test_a_repeated_backward_runs_its_kept_launches_and_matches_float64(case, fresh_launches):
    """From the second eager backward of a launch key on (no dLSE, as in training), the fused
    backward runs its kept launches (kept_backward: no rules' or launch keys' work) and gives
    float64's gradients with each call's fresh inputs; a call with dLSE takes the general path
    again (head dims 64 and 128, GQA, 3-D and (B, L, H, D) layouts, seq_k above and below
    seq_q)."""
    with _fused_backward() as spy:
        for seed in range(3):
            check_against_reference(replace(case, seed=seed), torch.bfloat16, _run(case),
                                    device="cuda", lse_grad=False)  # fmt: skip
        check_against_reference(replace(case, seed=3), torch.bfloat16, _run(case),
                                device="cuda")  # fmt: skip
    kept = [c.kwargs.get("kept") is not None for c in spy.call_args_list]
    assert kept == [False, True, True, False]


@gpu
@needs_sm90
@pytest.mark.parametrize(
    ("case", "fused"),
    [(Case(12, 3, 1, 2048, 512, 64, False, None, False, False, seed=0), True),
     (Case(12, 2, 1, 2500, 700, 64, False, 0.3, False, True, seed=1), True),
     (Case(9, 2, 1, 3000, 1023, 64, False, None, True, False, seed=2), True),
     (Case(12, 3, 1, 1024, 512, 64, False, None, False, False, seed=3), False),
     (Case(12, 3, 1, 2048, 511, 64, False, None, False, False, seed=4), False),
     (Case(12, 3, 1, 2048, 512, 64, True, None, False, False, seed=5), False),
     (Case(2, 3, 1, 2048, 512, 64, False, None, False, False, seed=6), False)],
)  # fmt: skip
def test_cross_attention_over_a_few_hundred_keys_takes_the_fused_backward_by_default(
    case, fused, fresh_launches
):
    """With the default switches, 512-1023 keys against 2048 or more query rows (head dim 64,
    no GQA, no causal mask: FUSED_FEW_KEYS) take the fused backward where its programs fill the
    H100 (144 here), and its gradients match float64's (3-D and (B, L, H, D) layouts); 1024
    query rows, 511 keys, a causal mask or 24 programs keep the portable backward."""
    with mock.patch.object(_sm90, "backward", wraps=_sm90.backward) as spy:
        check_against_reference(case, torch.bfloat16, _run(case), device="cuda")
    assert spy.called is fused


@gpu
@needs_sm90
@pytest.mark.parametrize(
    "case",
    [Case(1, 1, 1, 17000, 17000, 64, True, None, False, False, seed=0),
     Case(1, 1, 2, 16500, 16500, 64, False, None, False, True, seed=1),
     Case(1, 1, 1, 17000, 17000, 128, True, None, True, False, seed=2),
     Case(1, 1, 1, 16400, 16400, 128, False, 0.3, False, False, seed=3)],
)  # fmt: skip
def test_problems_longer_than_16384_take_the_hopper_backward_by_default(case, fresh_launches):
    """Past 16384 rows the fused backward (head dim 64) and the split one (128) run by default
    (no upper bound: their kernels took 0.67-0.79x the portable ones' time at 32768-131072 rows,
    docs/benchmarks.md), and their gradients match float64's (ragged lengths, GQA, 3-D and
    (B, L, H, D) layouts; one head, so that the float64 reference's score matrices fit beside
    the other test processes)."""
    with mock.patch.object(_sm90, "backward", wraps=_sm90.backward) as spy:
        check_against_reference(case, torch.bfloat16, _run(case), device="cuda")
    assert spy.call_count == 1


@gpu
@needs_sm90
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_problems_longer_than_16384_take_the_ordered_kernels(d, fresh_launches):
    """Under deterministic algorithms, causal problems without GQA past 16384 rows take the
    ordered fused (head dim 64) or split (128) kernel by default (no upper bound: 0.77-0.93x
    the portable kernels' time at 32768-65536), match float64 and give the same bits twice."""
    case = Case(1, 1, 1, 16700, 16700, d, True, None, False, False, seed=d)
    with (mock.patch.object(_sm90, "backward", wraps=_sm90.backward) as spy,
          _deterministic_algorithms()):  # fmt: skip
        check_against_reference(case, torch.bfloat16, _run(case), device="cuda")
        q, k, v = case.make(torch.bfloat16, "cuda")
        dout = torch.randn_like(q)
        runs = [torch.autograd.grad(flash_attention(q, k, v, is_causal=True), (q, k, v), dout)
                for _ in range(2)]  # fmt: skip
    assert spy.call_count == 3
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@gpu
@needs_sm90
@pytest.mark.parametrize(
    "case",
    [Case(4, 4, 4, 1100, 1100, 64, True, None, False, True, seed=1),
     Case(2, 4, 2, 1100, 1100, 128, True, None, False, True, seed=5),
     Case(3, 8, 1, 1500, 700, 128, False, 0.3, False, False, seed=6),
     Case(1, 2, 3, 300, 1000, 64, True, None, False, False, seed=3),
     Case(1, 11, 1, 1536, 1536, 128, True, None, False, True, seed=17),
     Case(3, 8, 1, 1500, 700, 64, False, 0.3, False, False, seed=2)],
)  # fmt: skip
def test_fused_backward_with_dq_converted_in_the_kernel_matches_float64(case, fresh_launches):
    """The opt-in in-kernel dQ conversion (FUSED_CONVERT: a converter warp, per-tile counters)
    gives float64's gradients: every tile converted once its last addition landed (a tile
    converted early or twice, or never, would miss whole key tiles' sums), both head dims, GQA,
    ragged lengths, seq_k above and below seq_q."""
    with _fused_backward() as spy, mock.patch.object(_sm90, "FUSED_CONVERT", True):
        check_against_reference(case, torch.bfloat16, _run(case), device="cuda")
    assert spy.call_count == 1


@gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(case=cases(max_seq=700, head_dims=(64, 128), max_batch=3))
@example(case=Case(8, 8, 1, 1100, 1100, 64, True, None, False, False, seed=11))
@example(case=Case(8, 8, 1, 1100, 1100, 128, True, None, False, False, seed=14))
@example(case=Case(2, 2, 3, 300, 1000, 128, True, None, False, True, seed=15))
@example(case=Case(8, 4, 2, 1100, 1100, 64, False, None, False, True, seed=12))
@example(case=Case(6, 16, 1, 700, 700, 64, True, None, False, False, seed=13))
@example(case=Case(1, 2, 3, 300, 1000, 64, True, None, False, False, seed=3))
@example(case=Case(3, 8, 1, 1500, 700, 64, False, 0.3, False, False, seed=2))
def test_deterministic_fused_backward_matches_float64(case, dtype):
    """Under deterministic algorithms the fused kernels (head dim 64; the split kernel at 128)
    add dQ's sums in a fixed order (counted: they run) and match float64 as the portable
    backward must. The first three
    examples have more programs than the GPU has SMs (576, 288 and 576 key tiles of 128): a
    tile waits for its predecessors in the sums' order, which must have started (else the
    kernel hangs); the others: keys beyond the queries (key tiles that see no query, causal)
    and fewer keys. (Sizes kept to a few hundred MB of float64 scores: the GPU suite runs ten
    test processes on one GPU; 4 x 8 x 4096^2 examples ran it out of memory.)"""
    with _fused_backward() as spy, _deterministic_algorithms():
        check_against_reference(case, dtype, _run(case), device="cuda")
    assert spy.call_count == 1


@gpu
@needs_sm90
@pytest.mark.parametrize(("causal", "kv_heads", "seq", "seq_k", "d"),
                         [(True, 2, 3000, 3000, 64), (False, 8, 2500, 2500, 64),
                          (True, 8, 700, 2100, 64), (False, 2, 1000, 300, 64),
                          (True, 8, 3000, 3000, 128), (False, 2, 2500, 2500, 128)])  # fmt: skip
def test_deterministic_fused_backward_is_bitwise_reproducible(causal, kv_heads, seq, seq_k, d):
    """Under ``torch.use_deterministic_algorithms(True)`` the fused kernels run (counted) and
    three passes give the same bits; without it, the unordered sums agree with them up to
    summation order."""
    q = torch.randn(2, 8, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, kv_heads, seq_k, d, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)  # fmt: skip
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)

    def grads():
        out = flash_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads < 8)
        return torch.autograd.grad(out, (q, k, v), dout)

    with _fused_backward() as spy:
        with _deterministic_algorithms():
            runs = [grads() for _ in range(3)]
        assert spy.call_count == 3
        unordered = grads()
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))
    for a, b in zip(unordered, runs[0], strict=True):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


@gpu
@needs_sm90
@pytest.mark.parametrize(
    "case",
    [Case(2, 2, 4, 1500, 1500, 64, True, None, False, False, seed=21),  # GQA 4:1
     Case(2, 4, 1, 1100, 1300, 64, False, None, False, True, seed=22),  # (B, L, H, d) memory
     Case(2, 4, 2, 1500, 1500, 128, True, None, False, False, seed=23),
     Case(3, 4, 1, 900, 700, 128, False, 0.3, False, False, seed=24)],  # fewer keys
)  # fmt: skip
def test_pinned_waits_give_the_same_bits_and_match_float64(case):
    """With FWD_PIN_WAIT (for every head dim and mask) and BWD_PIN_WAIT (a clock read that
    keeps each step's product wait after its exponentials) the forward and the fused backward
    (both built anew and seen to be) match float64, and under deterministic algorithms give the
    unpinned builds' bits: out, lse, dQ (ordered sums), dK, dV. Only the order of instructions
    differs."""
    dtype = torch.bfloat16
    q, k, v = case.make(dtype, "cuda", requires_grad=True)
    dout = torch.randn_like(q)
    runs = []
    for pin in (False, True):
        with (_fresh_plans() as built, _fused_backward() as spy,
              mock.patch.dict(_sm90.FWD_PIN_WAIT, dict.fromkeys(_sm90.FWD_PIN_WAIT, pin)),
              mock.patch.object(_sm90, "BWD_PIN_WAIT", pin)):  # fmt: skip
            if pin:
                check_against_reference(case, dtype, _run(case), device="cuda")
            with _deterministic_algorithms():
                out, lse = _run(case)(q, k, v)
                grads = torch.autograd.grad(_run(case)(q, k, v)[0], (q, k, v), dout)
            runs.append((out, lse, *grads))
            assert spy.call_count >= 1
        kernels = [meta for meta in built if "PIN_WAIT" in meta]
        assert len(kernels) >= 2 and all(meta["PIN_WAIT"] is pin for meta in kernels)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@gpu
@needs_sm90
@pytest.mark.parametrize(
    "case",
    [Case(2, 4, 1, 1500, 1500, 64, True, None, False, False, seed=31),
     Case(1, 2, 2, 2600, 2600, 64, False, None, False, True, seed=32),  # three consumers
     Case(1, 1, 4, 8300, 8300, 64, True, None, False, False, seed=33),  # three, causal
     Case(2, 2, 2, 1100, 900, 128, True, None, False, False, seed=34),
     Case(3, 4, 1, 700, 1300, 128, False, 0.3, False, False, seed=35)],
)  # fmt: skip
def test_the_tree_row_maximum_gives_the_same_bits(case):
    """FWD_TREE_MAX (each score tile's row maximum as a tree of in-thread halves instead of one
    chain per row; maxima do not round): the forward, built anew and seen to be, gives the
    chain's bits (out and lse), with two and three consumer warpgroups, causal or not, and
    matches float64."""
    q, k, v = case.make(torch.bfloat16, "cuda", requires_grad=False)
    runs = []
    for tree in (False, True):
        every = dict.fromkeys(_sm90.FWD_TREE_MAX, tree)
        with _fresh_plans() as built, mock.patch.object(_sm90, "FWD_TREE_MAX", every):
            if tree:
                check_against_reference(case, torch.bfloat16, _run(case), device="cuda",
                                        grads=False)  # fmt: skip
            runs.append(_run(case)(q, k, v))
        forwards = [meta for meta in built if "TREE_MAX" in meta]
        assert forwards and all(meta["TREE_MAX"] is tree for meta in forwards)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@gpu
@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_calls_take_the_hopper_kernels(causal):
    """Under torch.compile (inductor) the calls go through the custom ops; they must reach the
    Hopper forward and the fused backward as eager calls do (they took the portable kernels when
    the ops rebuilt an equal copy of CAUSAL) and match the eager gradients."""
    q = torch.randn(2, 8, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def f(q, k, v):
        return flash_attention(q, k, v, is_causal=causal, enable_gqa=True)

    dout = torch.randn_like(q)
    expected = torch.autograd.grad(f(q, k, v), (q, k, v), dout)
    torch.compiler.reset()
    with (
        mock.patch.object(_sm90, "forward", wraps=_sm90.forward) as fwd,
        mock.patch.object(_sm90, "backward", wraps=_sm90.backward) as bwd,
    ):
        got = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v), dout)
    assert fwd.call_count == 1 and bwd.call_count == 1
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


_NEW_LENGTHS_SCRIPT = """
import sys, torch
from torch_flashsys import flash_attention
from torch_flashsys.attention import _precompile, _sm90, _triton_bwd
d, causal, first, later = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]

def call(n):
    q = torch.randn(1, 8, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    flash_attention(q, k, v, is_causal=causal, enable_gqa=True).sum().backward()
    torch.cuda.synchronize()

kernels = [_sm90.attn_fwd_sm90, _sm90.fused_kernel(d), _sm90.attn_bwd_prep,
           _triton_bwd._launch_dq.kernel, _triton_bwd._launch_dkdv.kernel]
builds = lambda: sum(len(c[0]) for k in kernels for c in k.device_caches.values())
call(first)
assert _precompile.wait(600)
queued = builds()
for n in map(int, later.split(",")):
    call(n)
print("errors", len(_precompile.errors), "queued builds", queued, "later", builds() - queued)
"""


@gpu
@needs_sm90
@pytest.mark.parametrize("d, causal", [(64, True), (128, False)])
def test_later_lengths_find_their_builds_compiled(tmp_path, d, causal):
    """In a fresh process (empty Triton cache): a first fwd+bwd at 2048 tokens, its background
    builds compiled, then calls at lengths across every bound of the length rules (the
    backward's from 700 to 16385, the forward's other builds at 2049 and 8192) compile nothing
    more (they took 2.2-3.7 s each before: docs/benchmarks.md)."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": ROOT}
    later = "700,1500,2049,3000,8192,12000,16385,900"
    done = subprocess.run([sys.executable, "-c", _NEW_LENGTHS_SCRIPT, str(d), str(int(causal)),
                           "2048", later], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("errors 0 ") and line.endswith(" later 0"), done.stdout


_CAPTURE_SCRIPT = """
import time, torch
from torch_flashsys import flash_attention
from torch_flashsys.attention import _precompile
q, k, v = (torch.randn(2, 8, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
flash_attention(q, k, v, is_causal=True).sum().backward()  # the first call: builds queued
x = [t.detach().clone() for t in (q, k, v)]
side = torch.cuda.Stream()
with torch.cuda.stream(side):  # the capture's own warm-up, as CUDA graphs need
    flash_attention(*x, is_causal=True)
torch.cuda.current_stream().wait_stream(side)
captured = busy = 0
deadline = time.monotonic() + 60
while (_precompile._pending or _precompile._running) and time.monotonic() < deadline:
    busy += bool(_precompile._running)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode "global": any thread's unsafe call fails it
        out = flash_attention(*x, is_causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flash_attention(*x, is_causal=True))
    captured += 1
print("captures", captured, "while compiling", busy, "errors", len(_precompile.errors))
"""


@gpu
@needs_sm90
def test_graphs_captured_while_the_background_compiles(tmp_path):
    """CUDA graphs captured (PyTorch's default, global capture mode: a CUDA call another thread
    must not make during a capture fails it) while the background thread compiles the builds a
    first call queued: every capture succeeds and replays the eager result (the thread only
    compiles: no launch, allocation or stream work)."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _CAPTURE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    captured, busy, errors = int(words[1]), int(words[4]), int(words[6])
    assert captured >= 5 and busy >= 5 and errors == 0, done.stdout
