"""Test setup: Triton interpreter on CPU-only machines, the `gpu` marker, hypothesis profiles."""

from __future__ import annotations

import gc
import os

# Must happen before anything imports triton: Triton decides at kernel-definition time whether to
# interpret. Without CUDA the kernels then run on CPU tensors, so CI exercises the real kernels.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=15,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "dev", deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "gpu", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA devices"))


@pytest.fixture(autouse=True)
def _return_cuda_memory(request):
    """After a GPU test, its process hands its cached CUDA memory back to the driver. The GPU
    suite runs in several processes (pytest-xdist) on one device, and the NCCL tests start rank
    processes of their own: a worker that had run the 2**31-element test kept ~40 GB cached
    afterwards, and four NCCL world-size-1 tests that ran beside it failed for want of memory
    (H100, 2026-11-26)."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
