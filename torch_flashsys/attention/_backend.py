"""Which attention backend runs a call: Triton (GPU or interpreter) or the PyTorch tiled path.

The one place that maps ``backend=`` to a concrete backend (:func:`choose_backend`); the checks
that the chosen backend can run the call live in ``_checks``.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

BACKENDS = ("auto", "triton", "torch")


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # a Linux-only dependency


def triton_installed() -> bool:
    """True when the ``triton`` package can be imported."""
    return _TRITON_INSTALLED


def interpreter_active() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors (slowly).

    Triton reads the variable when a kernel is defined, so it must be set before this package's
    kernels are first used (``tests/conftest.py`` sets it before anything imports triton).
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_can_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors that live on ``device``."""
    if not triton_installed():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreter_active()


TRITON_HEAD_DIMS = "16..256, multiples of 8"


def triton_head_dim_ok(head_dim: int) -> bool:
    return 16 <= head_dim <= 256 and head_dim % 8 == 0


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``backend="auto"`` to ``"triton"`` or ``"torch"`` for tensors on ``device``.

    ``"auto"`` picks the Triton kernels for CUDA tensors only, and only when they run compiled:
    under ``TRITON_INTERPRET=1`` the interpreter would run them (about 1000x slower than the torch
    path, and its bfloat16 ``tl.dot`` is wrong), so it runs only when asked for with
    ``backend="triton"``.
    """
    if backend == "auto":
        compiled = device.type == "cuda" and triton_installed() and not interpreter_active()
        return "triton" if compiled else "torch"
    return backend


def choose_backend(
    backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> str:
    """The backend a validated call runs on: :func:`resolve_backend`, except that an empty
    sequence or head dim runs on the PyTorch backend (SDPA's zeros / uniform weights / empty
    output) whatever was asked for, and ``"auto"`` runs float64 there (e.g. gradcheck), and head
    dims the Triton kernels do not take (with a warning: that path is slower on a GPU), as SDPA
    falls back to its math kernel."""
    if query.shape[-2] == 0 or key.shape[-2] == 0 or query.shape[-1] == 0 or value.shape[-1] == 0:
        return "torch"
    if backend == "auto" and query.dtype == torch.float64:
        return "torch"
    chosen = resolve_backend(backend, query.device)
    dims = (query.shape[-1], value.shape[-1])
    if backend == "auto" and chosen == "triton" and not all(map(triton_head_dim_ok, dims)):
        warnings.warn(
            f"flash_attention: head dims {dims[0]} (query/key) and {dims[1]} (value) are not "
            f"all in the Triton kernels' range ({TRITON_HEAD_DIMS}); running the PyTorch tiled "
            "path instead, which is slower on a GPU (backend='torch' says so explicitly)",
            stacklevel=4,
        )
        return "torch"
    return chosen
