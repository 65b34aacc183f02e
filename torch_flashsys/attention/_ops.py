"""torch.library custom ops around the Triton kernels: fake (meta) implementations and autograd.

Registering the kernels as custom ops lets ``torch.compile(fullgraph=True)`` treat them as opaque
nodes (no graph break) and lets CUDA graphs capture them. The ops take query/key/value in the
caller's rank (3-D or 4-D) so that the autograd node of the returned tensor is the op's own node; it
saves q, k, v, out and lse.
"""

from __future__ import annotations

import contextlib

import torch

_LIB = "torch_flashsys"


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(N, L, E) -> (1, N, L, E) view; 4-D passes through. Dim -3 is the head dim either way."""
    return t.unsqueeze(0) if t.dim() == 3 else t


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device: make it the tensors' device.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@torch.library.custom_op(f"{_LIB}::attn_fwd", mutates_args=())
def attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel: ``(out, lse)``; out like ``q``, lse float32 of shape ``q.shape[:-1]``."""
    from torch_flashsys.attention._triton_fwd import attention_forward

    with _device_guard(q):
        out, lse = attention_forward(_as_4d(q), _as_4d(k), _as_4d(v), is_causal, scale)
    return out.view(q.shape), lse.view(q.shape[:-1])


@attn_fwd.register_fake
def _(q, k, v, is_causal, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::attn_bwd", mutates_args=())
def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernels: ``(dq, dk, dv)`` shaped like ``(q, k, v)``; dk/dv summed over GQA groups."""
    from torch_flashsys.attention._triton_bwd import attention_backward

    # lse/dlse are (..., L): give them the same leading (1, N) as the 3-D -> 4-D views.
    lse4 = (lse.unsqueeze(0) if q.dim() == 3 else lse).contiguous()
    dlse4 = None if dlse is None else dlse.expand_as(lse).reshape(lse4.shape).contiguous()
    with _device_guard(q):
        dq, dk, dv = attention_backward(
            _as_4d(dout),
            _as_4d(q),
            _as_4d(k),
            _as_4d(v),
            _as_4d(out),
            lse4,
            dlse4,
            is_causal,
            scale,
        )
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal = is_causal
    ctx.scale = scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, dlse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def triton_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable Triton attention; inputs already validated by ``flash_attention``."""
    return attn_fwd(q, k, v, is_causal, scale)
