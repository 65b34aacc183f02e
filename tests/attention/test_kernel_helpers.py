"""The kernels' shared ``@triton.jit`` helpers on their own, against float64: run on CUDA, or on
CPU through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from torch_flashsys.attention._backend import triton_can_run_on  # noqa: E402
from torch_flashsys.attention._triton_common import _tanh_and_slope  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_can_run_on(torch.device("cpu"))),
    reason="needs CUDA or the Triton interpreter",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _tanh_kernel(X, T, G, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t, g = _tanh_and_slope(tl.load(X + offs, mask=offs < n, other=0.0))
    tl.store(T + offs, t, mask=offs < n)
    tl.store(G + offs, g, mask=offs < n)


def test_softcap_tanh_and_its_slope_are_precise_at_every_magnitude():
    """softcap's tanh and ``1 - tanh^2``: tiny arguments (a softcap far above the scores) must
    not cancel, saturated ones keep the slope's relative precision."""
    mags = torch.logspace(-9, 1.3, 4000, dtype=torch.float64)  # |x| from 1e-9 to 20
    x = torch.cat([mags, -mags]).float().to(DEVICE)
    t, g = torch.empty_like(x), torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, t, g, x.numel(), BLOCK=1024)
    x64 = x.double().cpu()
    t_ref, g_ref = torch.tanh(x64), torch.cosh(x64).pow(-2)
    t_rel = ((t.double().cpu() - t_ref).abs() / t_ref.abs()).max().item()
    g_rel = ((g.double().cpu() - g_ref).abs() / g_ref).max().item()
    assert t_rel < 1e-6, f"tanh: relative error {t_rel:.3g}"  # float32 rounding: 6e-8 each
    # a saturated x's slope inherits the rounding of 2 |x| log2(e) (|x| = 20: ~4e-6)
    assert g_rel < 1e-5, f"1 - tanh^2: relative error {g_rel:.3g}"
