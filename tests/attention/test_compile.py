"""torch.compile(fullgraph=True) with no graph break, and torch.library.opcheck on the custom ops."""

from __future__ import annotations

import pytest
import torch

from tests.attention.cases import Case
from torch_flashsys import flash_attention
from torch_flashsys.attention._backend import triton_can_run_on

pytestmark = pytest.mark.skipif(
    not triton_can_run_on(torch.device("cpu")) and not torch.cuda.is_available(),
    reason="the custom ops wrap Triton kernels: needs CUDA or the Triton interpreter",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TinyAttentionModel(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = flash_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
def test_model_compiles_fullgraph_and_matches_eager(backend):
    torch.manual_seed(0)
    model = TinyAttentionModel().to(DEVICE)
    x = torch.randn(2, 19, 32, device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out_c = compiled(x)
    out_c.sum().backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out_e = model(x)
    out_e.sum().backward()
    torch.testing.assert_close(out_c, out_e, atol=2e-5, rtol=1e-4)
    for gc, p in zip(grads_c, model.parameters(), strict=True):
        torch.testing.assert_close(gc, p.grad, atol=2e-5, rtol=1e-4)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_custom_ops(causal):
    from torch_flashsys.attention._ops import attn_bwd, attn_fwd

    case = Case(1, 1, 2, 17, 9, 16, causal, None, False, True, seed=11)
    q, k, v = case.make(torch.float32, DEVICE, requires_grad=True)
    torch.library.opcheck(attn_fwd, (q, k, v, causal, 0.25))
    out, lse = attn_fwd(q.detach(), k.detach(), v.detach(), causal, 0.25)
    dout = torch.randn_like(out)
    torch.library.opcheck(
        attn_bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, None, causal, 0.25)
    )
    torch.library.opcheck(
        attn_bwd,
        (dout, q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse), causal, 0.25),
    )
