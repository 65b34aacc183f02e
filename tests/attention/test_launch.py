"""The launch cache (torch_flashsys.attention._launch) against a fake Triton kernel, on CPU: the
first call per key takes Triton's path, repeats go straight to the compiled kernel with the same
arguments, and anything that changes Triton's specialization (pointer alignment, device) misses.
The real kernels' fast path is covered on CUDA by tests/attention/test_gpu.py."""

from __future__ import annotations

import types

import pytest
import torch

from torch_flashsys.attention import _launch


class _Tensor:
    """Stands in for a CUDA tensor: the cache reads is_cuda, get_device() and data_ptr()."""

    is_cuda = True

    def __init__(self, ptr: int, device: int = 0) -> None:
        self.ptr, self.device = ptr, device

    def get_device(self) -> int:
        return self.device

    def data_ptr(self) -> int:
        return self.ptr


class _Kernel:
    """An autotuned kernel: kernel[grid](*args, **constexprs) runs Triton's path."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.configs = [object()]
        self.fn = types.SimpleNamespace(arg_names=["X", "Y", "n", "HEAD", "BLOCK"])
        self.best_config = types.SimpleNamespace(kwargs={"BLOCK": 32})
        compiled = types.SimpleNamespace(function="function", packed_metadata="packed")
        compiled.run = lambda *a: log.append(("fast", a))
        self.compiled = compiled

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.log.append(("triton", args, constexprs, grid({**constexprs, "BLOCK": 32})))
            return self.compiled

        return launch


@pytest.fixture
def cuda_like(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, False)
    monkeypatch.setattr(_launch, "interpreter_active", lambda: False)


def _call(cache, x, y, n=100):
    grid = lambda meta: (n // meta["BLOCK"] + 1,)
    cache(("key", n), grid, (x, y, n), {"HEAD": 64})


def test_repeat_launch_goes_straight_to_the_compiled_kernel(cuda_like):
    log = []
    cache = _launch.LaunchCache(_Kernel(log), n_tensors=2)
    x, y = _Tensor(4096), _Tensor(8192)
    _call(cache, x, y)
    assert log[-1][0] == "triton" and cache.hits == 0
    _call(cache, x, y)
    assert cache.hits == 1
    kind, args = log[-1]
    # (grid x, y, z, stream, function, packed metadata, launch metadata, hooks, *args, *constexprs),
    # the tensors as their addresses (the launcher's C code takes integers as they are)
    assert kind == "fast"
    assert args == (4, 1, 1, 1000, "function", "packed", None, None, None, 4096, 8192, 100, 64, 32)


def test_changed_alignment_length_or_device_misses(cuda_like, monkeypatch):
    log = []
    cache = _launch.LaunchCache(_Kernel(log), n_tensors=2)
    _call(cache, _Tensor(4096), _Tensor(8192))
    _call(cache, _Tensor(4096 + 8), _Tensor(8192))  # not 16-byte aligned: Triton specializes
    assert log[-1][0] == "triton"
    _call(cache, _Tensor(4096), _Tensor(8192), n=300)  # another key
    assert log[-1][0] == "triton"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    _call(cache, _Tensor(4096, device=1), _Tensor(8192, device=1))  # function handles: per device
    assert log[-1][0] == "triton" and cache.hits == 0


def test_fast_launch_can_be_turned_off(cuda_like, monkeypatch):
    monkeypatch.setenv("TORCH_FLASHSYS_FAST_LAUNCH", "0")
    log = []
    cache = _launch.LaunchCache(_Kernel(log), n_tensors=2)
    for _ in range(3):
        _call(cache, _Tensor(4096), _Tensor(8192))
    assert [entry[0] for entry in log] == ["triton"] * 3 and cache.hits == 0


@pytest.mark.parametrize("setting, expected", [("highest", "ieee"), ("high", "tf32")])
def test_float32_dot_precision_follows_pytorch(setting, expected):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        assert _launch.dot_precision(torch.float32) == expected
        assert _launch.dot_precision(torch.bfloat16) == "tf32"  # 16-bit inputs: unaffected
    finally:
        torch.set_float32_matmul_precision(previous)


def test_profiler_launch_hooks_get_tritons_path(cuda_like, monkeypatch):
    """A registered launch hook (proton does this) must see every launch: no fast path then."""
    log = []
    cache = _launch.LaunchCache(_Kernel(log), n_tensors=2)
    _call(cache, _Tensor(4096), _Tensor(8192))
    monkeypatch.setattr(_launch, "_RUNTIME", types.SimpleNamespace(
        launch_enter_hook=types.SimpleNamespace(calls=[print]), launch_exit_hook=None))  # fmt: skip
    _call(cache, _Tensor(4096), _Tensor(8192))
    assert log[-1][0] == "triton" and cache.hits == 0
    monkeypatch.setattr(_launch, "_RUNTIME", types.SimpleNamespace(
        launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=None))  # fmt: skip
    _call(cache, _Tensor(4096), _Tensor(8192))  # an empty hook chain (newer Tritons) is no hook
    assert log[-1][0] == "fast" and cache.hits == 1
