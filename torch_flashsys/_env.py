"""Environment report for bug reports (``python -m torch_flashsys``)."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from importlib import metadata

import torch
import torch.distributed as dist

from torch_flashsys._version import __version__
from torch_flashsys.attention._backend import (
    interpreter_active,
    resolve_backend,
    triton_can_run_on,
    triton_installed,
)


def _version_of(dist_name: str) -> str:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def collect() -> dict[str, object]:
    """The report as a dict (what ``python -m torch_flashsys`` prints)."""
    cuda = torch.cuda.is_available()
    devices = (
        [
            f"{i}: {torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())
        ]
        if cuda
        else []
    )
    kernel_device = torch.device("cuda" if cuda else "cpu")
    if triton_can_run_on(kernel_device):
        kernels = (
            "yes, on CUDA"
            if not interpreter_active()
            else "yes, through the Triton interpreter (TRITON_INTERPRET=1), with backend='triton' "
            "only (slow; no bfloat16)"
        )
    elif not triton_installed():
        kernels = "no: triton is not installed"
    else:
        kernels = (
            "no: no CUDA device (set TRITON_INTERPRET=1 and pass backend='triton' to interpret "
            "them on CPU)"
        )
    backends = [
        name
        for name, available in (
            ("gloo", dist.is_available() and dist.is_gloo_available()),
            ("nccl", dist.is_available() and dist.is_nccl_available()),
            ("mpi", dist.is_available() and dist.is_mpi_available()),
        )
        if available
    ]
    return {
        "torch_flashsys": __version__,
        "torch": torch.__version__,
        "triton": _version_of("triton"),
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "cuda (torch build)": torch.version.cuda or "none (CPU build)",
        "cuda devices": ", ".join(devices) if devices else "none",
        "triton interpreter": "on" if interpreter_active() else "off",
        "triton kernels can run": kernels,
        "backend='auto' picks": (
            f"{resolve_backend('auto', kernel_device)} for {kernel_device.type} tensors"
            + ("" if not cuda else f", {resolve_backend('auto', torch.device('cpu'))} for cpu")
        ),
        "torch.distributed backends": ", ".join(backends) if backends else "none",
    }


def report() -> str:
    info = collect()
    width = max(map(len, info))
    lines = ["torch_flashsys environment report"]
    lines += [f"  {key:<{width}} : {value}" for key, value in info.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m torch_flashsys [--help]``: print the report; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m torch_flashsys",
        description="Print an environment report to paste into bug reports: versions, GPUs, "
        "whether the Triton kernels can run, which attention backend 'auto' picks, and the "
        "available torch.distributed backends. Takes no other arguments.",
    )
    parser.parse_args(argv)
    print(report())
    return 0
