"""The one autograd Function of flash_attention, serving both backends.

A backend is a :class:`Kernels` pair: a forward ``(q, k, v, scale, ex) -> (out, lse)`` and a
first-order backward ``(dout, q, k, v, out, lse, dlse, scale, ex) -> (dq, dk, dv)``. :data:`TORCH`
is the PyTorch tiled path (autocast off inside); the Triton pair lives in ``_ops`` (imported only
when the Triton backend runs). Both save q, k, v, out and lse, take query/key/value in the
caller's rank (3-D or 4-D), and share ``setup_context`` and the ``vmap`` rule (what ``torch.func``
needs, ``_functorch``).

A backward that runs with grad mode on (``torch.autograd.grad(..., create_graph=True)``, e.g. a
gradient penalty) computes the gradients with the PyTorch tiled backward whatever the backend:
differentiable ops, so a second backward gets the second-order terms (slower; see
docs/attention.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from torch_flashsys.attention._extras import Extras
from torch_flashsys.attention._functorch import check_backward_batchable, vmap_rule
from torch_flashsys.attention._torch_impl import differentiable_backward, forward

NO_CACHE_BACKWARD = (
    "flash_attention: no backward with cache_seqlens (KV-cache decoding is forward only); run "
    "generation under torch.no_grad()"
)


class Kernels(NamedTuple):
    """One backend as :class:`Attention` calls it."""

    forward: Callable  # (q, k, v, scale, ex) -> (out, lse)
    backward: Callable  # (dout, q, k, v, out, lse, dlse, scale, ex) -> (dq, dk, dv), first order


TORCH = Kernels(forward, differentiable_backward)


class Attention(torch.autograd.Function):
    """``(out, lse)`` of ``kernels.forward``; gradients from ``kernels.backward`` (first order) or
    the differentiable PyTorch backward (under ``create_graph=True``)."""

    @staticmethod
    def forward(q, k, v, scale: float, ex: Extras, kernels: Kernels):
        return kernels.forward(q, k, v, scale, ex)

    @staticmethod
    def setup_context(ctx, inputs, output):  # separate from forward: torch.func needs it
        q, k, v, scale, ex, kernels = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.scale, ctx.ex, ctx.kernels = scale, ex, kernels
        ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient

    @staticmethod
    def vmap(info, in_dims, *args):
        return vmap_rule(Attention, info, in_dims, *args)

    @staticmethod
    def backward(ctx, dout, dlse):
        if ctx.ex.seqused_k is not None:
            raise NotImplementedError(NO_CACHE_BACKWARD)
        q, k, v, out, lse = ctx.saved_tensors
        if _functorch_active():  # under vmap (jacrev, vmap over grad/vjp): batched tensors
            check_backward_batchable(ctx.ex, dout, dlse, q, k, v, out, lse)
        if dout is None:
            dout = torch.zeros_like(out)
        # create_graph=True (and every torch.func transform): the gradients must be
        # differentiable; PyTorch ops, which vmap also batches
        backward = differentiable_backward if torch.is_grad_enabled() else ctx.kernels.backward
        dq, dk, dv = backward(dout, q, k, v, out, lse, dlse, ctx.scale, ctx.ex)
        return dq, dk, dv, None, None, None


def torch_attention(q, k, v, scale: float, ex: Extras) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention on the PyTorch backend; inputs already validated."""
    if torch.compiler.is_compiling():  # Dynamo refuses one tensor passed to a Function twice
        k = k.view_as(k) if k is q else k
        v = v.view_as(v) if v is q or v is k else v
        return Attention.apply(q, k, v, scale, ex, TORCH)
    return apply(q, k, v, scale, ex, TORCH)


def apply(q, k, v, scale: float, ex: Extras, kernels: Kernels):
    """``Attention.apply(q, k, v, scale, ex, kernels)`` in eager mode, minus its Python overhead
    where nothing needs it: the forward alone when no gradient is wanted, and outside functorch
    transforms what ``Function.apply`` does without its closure, signature binding and generator
    over the arguments (a few microseconds a call)."""
    if _functorch_active():  # vmap/grad transforms: autograd.Function.apply's own path
        return Attention.apply(q, k, v, scale, ex, kernels)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _apply(
            _unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), scale, ex, kernels
        )
    return kernels.forward(q, k, v, scale, ex)


_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, Attention)
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
