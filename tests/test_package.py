"""The package's public surface: version, the public names, the environment report."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from packaging.version import Version

import torch_flashsys
from torch_flashsys import _env


def test_version_is_pep440():
    assert Version(torch_flashsys.__version__) >= Version("0.1.0.dev0")


def test_public_names():
    for name in ("flash_attention", "FlashAttention", "BucketedDDP", "ShardedOptimizer"):
        assert name in torch_flashsys.__all__
        assert hasattr(torch_flashsys, name)


def test_environment_report_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "torch_flashsys"], capture_output=True, text=True, check=True
    )
    text = proc.stdout
    for field in (
        "torch_flashsys",
        "torch ",
        "triton",
        "python",
        "cuda devices",
        "triton kernels can run",
        "backend='auto' picks",
        "torch.distributed backends",
    ):
        assert field in text, f"{field!r} missing from the report:\n{text}"
    assert torch.__version__ in text
    assert torch_flashsys.__version__ in text


@pytest.mark.parametrize(
    ("flag", "code", "stream", "text"),
    [
        ("--help", 0, "stdout", "usage: python -m torch_flashsys"),
        ("--bogus", 2, "stderr", "unrecognized arguments: --bogus"),
    ],
)
def test_command_line_parses_its_arguments(flag, code, stream, text):
    proc = subprocess.run(
        [sys.executable, "-m", "torch_flashsys", flag], capture_output=True, text=True
    )
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert text in getattr(proc, stream), (proc.stdout, proc.stderr)
    assert "torch_flashsys environment report" not in proc.stdout  # the flag was not ignored


def test_report_matches_backend_resolution():
    info = _env.collect()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from torch_flashsys.attention._backend import resolve_backend

    assert info["backend='auto' picks"].startswith(resolve_backend("auto", torch.device(device)))
    assert ("gloo" in info["torch.distributed backends"]) == torch.distributed.is_gloo_available()
