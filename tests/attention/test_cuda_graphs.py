"""CUDA-graph capture of a decode step and of a forward+backward training step through
flash_attention: replays with new data in the captured buffers match float64 references."""

from __future__ import annotations

import pytest
import torch

from tests.attention.cases import assert_close
from tests.attention.test_kvcache import decode_reference
from tests.reference import attention_reference
from torch_flashsys import flash_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_step_captured_in_a_cuda_graph(dtype):
    batch, kv_heads, group, capacity, dim = 8, 2, 4, 1024, 128
    g = torch.Generator(device="cuda").manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    q = rand(batch, kv_heads * group, 1, dim)
    k, v = rand(batch, kv_heads, capacity, dim), rand(batch, kv_heads, capacity, dim)
    lens = torch.randint(1, capacity, (batch,), device="cuda", dtype=torch.int32, generator=g)

    def step():
        return flash_attention(q, k, v, cache_seqlens=lens, enable_gqa=True, is_causal=True)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compile and allocate outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):  # new tokens: new query, the cache grows by one, new lengths
            q.copy_(rand(*q.shape))
            k.copy_(rand(*k.shape))
            v.copy_(rand(*v.shape))
            lens.copy_(torch.randint(1, capacity, (batch,), device="cuda", generator=g))
            graph.replay()
            torch.cuda.synchronize()
            host = [t.cpu() for t in (q, k, v)]
            ref, _ = decode_reference(*(t.double() for t in host), lens.cpu(), causal=True)
            base, _ = decode_reference(*(t.float() for t in host), lens.cpu(), causal=True)
            assert_close("out", out.cpu(), base.to(dtype), ref, dtype)


def test_training_step_captured_in_a_cuda_graph():
    """Whole-step capture (PyTorch's recipe): projection, attention, loss, backward. Replays
    with new inputs give the eager step's gradients (same kernels) and float64's within bf16
    tolerance."""
    torch.manual_seed(5)
    batch, heads, seq, dim = 2, 4, 384, 64
    proj = torch.nn.Linear(dim, 3 * dim, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16)

    def step():
        q, k, v = proj(x).chunk(3, dim=-1)
        out = flash_attention(q, k, v, is_causal=True)
        out.float().square().sum().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile, and let autograd make its buffers, outside the capture
            proj.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    proj.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [proj.weight.grad.clone(), proj.bias.grad.clone()]
        eager = torch.nn.Linear(dim, 3 * dim, device="cuda", dtype=torch.bfloat16)
        eager.load_state_dict(proj.state_dict())
        q, k, v = eager(x).chunk(3, dim=-1)
        flash_attention(q, k, v, is_causal=True).float().square().sum().backward()
        for got, want in zip(replayed, (eager.weight.grad, eager.bias.grad), strict=True):
            assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        w = proj.weight.detach().double().requires_grad_()
        b = proj.bias.detach().double().requires_grad_()
        q, k, v = torch.nn.functional.linear(x.double(), w, b).chunk(3, dim=-1)
        ref, _ = attention_reference(q, k, v, is_causal=True)
        ref.square().sum().backward()
        for got, want in zip(replayed, (w.grad, b.grad), strict=True):
            err = (got.double() - want).abs().max() / want.abs().max()
            assert err < 3e-2, f"relative gradient error {err:.3g} (bf16)"
