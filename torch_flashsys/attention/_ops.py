"""How the Triton kernels are called: an autograd.Function in eager mode, custom ops under compile.

Eager calls go through :class:`_TritonAttention`, an ``autograd.Function`` whose forward and backward
launch the kernels directly (no dispatcher round trip): with the launch cache in ``_launch`` one
forward + backward costs a few tens of microseconds of CPU. Under ``torch.compile`` the same
kernels are reached through the ``torch.library`` custom ops ``torch_flashsys::attn_fwd`` /
``attn_bwd``, with fake (meta) implementations and registered autograd, so
``torch.compile(fullgraph=True)`` sees one opaque node (no graph break) and CUDA graphs capture it.

Both paths take query/key/value in the caller's rank (3-D or 4-D) and save q, k, v, out and lse.

A backward that runs with grad mode on (``torch.autograd.grad(..., create_graph=True)``, e.g. a
gradient penalty) computes the gradients with the PyTorch tiled backward instead of the kernels:
differentiable ops, so a second backward gets the second-order terms (slower; see
docs/attention.md). Under torch.compile, AOTAutograd traces the backward with grad mode off (the
kernels) and refuses a double backward itself.
"""

from __future__ import annotations

import torch

from torch_flashsys.attention._extras import Extras
from torch_flashsys.attention._functorch import (
    check_backward_unmapped,
    unwrap_dead,
    vmap_rule,
)
from torch_flashsys.attention._tensors import empty_like_layout
from torch_flashsys.attention._torch_impl import differentiable_backward
from torch_flashsys.attention._triton_bwd import attention_backward
from torch_flashsys.attention._triton_fwd import attention_forward

_LIB = "torch_flashsys"


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(N, L, E) -> (1, N, L, E) view; 4-D passes through. Dim -3 is the head dim either way.

    The kernels read the last dimension with stride 1; the rare tensor whose last dimension is
    strided (e.g. an expanded gradient of ``out.sum()``) is copied.
    """
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.unsqueeze(0) if t.dim() == 3 else t


def _forward(q, k, v, scale: float, ex: Extras):
    out, lse = attention_forward(_as_4d(q), _as_4d(k), _as_4d(v), scale, ex)
    if q.dim() == 3:  # back to 3-D; 4-D results already have the caller's shapes (no views)
        out, lse = out.squeeze(0), lse.squeeze(0)
    if q.stride(-1) != 1:  # the kernels ran on a copy: the output still takes q's layout
        out = empty_like_layout(q, v.shape[-1]).copy_(out)
    return out, lse


def _backward(dout, q, k, v, out, lse, dlse, scale: float, ex: Extras):
    # lse/dlse are (..., L): give them the same leading (1, N) as the 3-D -> 4-D views.
    three_d = q.dim() == 3
    lse4 = lse.unsqueeze(0) if three_d else lse
    dlse4 = None
    if dlse is not None:
        dlse4 = dlse.expand_as(lse).reshape(lse4.shape).contiguous()
    dq, dk, dv = attention_backward(
        _as_4d(dout), _as_4d(q), _as_4d(k), _as_4d(v), _as_4d(out), lse4, dlse4, scale, ex
    )
    if three_d:
        return dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)
    return dq, dk, dv


class _TritonAttention(torch.autograd.Function):
    """Eager path: the kernels launched from forward/backward with no dispatcher in between."""

    @staticmethod
    def forward(q, k, v, scale: float, ex: Extras):
        return _forward(q, k, v, scale, ex)

    @staticmethod
    def setup_context(ctx, inputs, output):  # separate from forward: torch.func needs it
        q, k, v, scale, ex = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.scale, ctx.ex = scale, ex
        ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient

    @staticmethod
    def vmap(info, in_dims, *args):
        return vmap_rule(_TritonAttention, info, in_dims, *args)

    @staticmethod
    def backward(ctx, dout, dlse):
        check_backward_unmapped(dout, dlse)
        if ctx.ex.seqused_k is not None:
            raise NotImplementedError(
                "flash_attention: no backward with cache_seqlens (KV-cache decoding is forward "
                "only); run generation under torch.no_grad()"
            )
        q, k, v, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
            dq, dk, dv = differentiable_backward(dout, q, k, v, out, lse, dlse, ctx.scale, ctx.ex)
            return dq, dk, dv, None, None
        if dout is None:
            dout = torch.zeros_like(out)
        if _functorch_active():  # torch.func.grad: the op unwraps its tensors for the kernels
            with torch.no_grad():  # (first order: the op has no autograd)
                dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, dlse, *_op_args(ctx.scale, ctx.ex))
        else:  # (torch.func.vjp's pullback runs after its transform: its wrappers are dead)
            dout, q, k, v, out, lse, dlse = unwrap_dead(dout, q, k, v, out, lse, dlse)
            dq, dk, dv = _backward(dout, q, k, v, out, lse, dlse, ctx.scale, ctx.ex)
        return dq, dk, dv, None, None


# The custom ops take the Extras spelled out (a custom op's schema holds tensors and scalars).
def _op_args(scale: float, ex: Extras) -> tuple:
    return (ex.mask, ex.alibi, ex.seed, scale, ex.left, ex.right, ex.softcap, ex.dropout_p,
            ex.cu_q, ex.cu_k, ex.max_q, ex.max_k)  # fmt: skip


def _extras(mask, alibi, seed, left, right, softcap, dropout_p, cu_q, cu_k, max_q, max_k):
    return Extras(mask, left, right, softcap, alibi, dropout_p, seed, cu_q, cu_k, max_q, max_k)


@torch.library.custom_op(f"{_LIB}::attn_fwd", mutates_args=())
def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    alibi: torch.Tensor | None,
    seed: torch.Tensor | None,
    scale: float,
    left: int,
    right: int,
    softcap: float,
    dropout_p: float,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel: ``(out, lse)``; out like ``q``, lse float32 of shape ``q.shape[:-1]``."""
    ex = _extras(mask, alibi, seed, left, right, softcap, dropout_p, cu_q, cu_k, max_q, max_k)
    return _forward(q, k, v, scale, ex)


@attn_fwd.register_fake
def _(q, k, v, mask, alibi, seed, scale, left, right, softcap, dropout_p, cu_q, cu_k, mq, mk):
    return empty_like_layout(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::attn_bwd", mutates_args=())
def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    mask: torch.Tensor | None,
    alibi: torch.Tensor | None,
    seed: torch.Tensor | None,
    scale: float,
    left: int,
    right: int,
    softcap: float,
    dropout_p: float,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernels: ``(dq, dk, dv)`` shaped like ``(q, k, v)``; dk/dv summed over GQA groups."""
    ex = _extras(mask, alibi, seed, left, right, softcap, dropout_p, cu_q, cu_k, max_q, max_k)
    return _backward(dout, q, k, v, out, lse, dlse, scale, ex)


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, mask, alibi, seed, scale, left, right, softcap, dropout_p, *_):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, alibi, seed, *scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.extras = (mask, alibi, seed, *scalars)


def _op_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True, called eagerly (compiled graphs refuse it)
        mask, alibi, seed, scale, *scalars = ctx.extras
        ex = _extras(mask, alibi, seed, *scalars)
        dq, dk, dv = differentiable_backward(dout, q, k, v, out, lse, dlse, scale, ex)
        return (dq, dk, dv) + (None,) * 12
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, dlse, *ctx.extras)
    return (dq, dk, dv) + (None,) * 12


attn_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def triton_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ex: Extras
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable Triton attention; inputs already validated by ``flash_attention``."""
    if torch.compiler.is_compiling():
        return attn_fwd(q, k, v, *_op_args(scale, ex))
    if _functorch_active():  # vmap/grad transforms: autograd.Function.apply's own path
        return _TritonAttention.apply(q, k, v, scale, ex)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # What Function.apply does outside functorch transforms, minus its Python overhead (a
        # closure, a signature check, a generator over the arguments): a few microseconds a call.
        return _apply(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), scale, ex)
    return _forward(q, k, v, scale, ex)


_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _TritonAttention)
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
