"""How the Triton kernels are called: the autograd Function in eager mode, custom ops under compile.

Eager calls go through :class:`~torch_flashsys.attention._autograd.Attention` with :data:`TRITON`,
whose forward and backward launch the kernels directly (no dispatcher round trip): with the launch
cache in ``_launch`` one forward + backward costs a few tens of microseconds of CPU. Under
``torch.compile`` the same kernels are reached through the ``torch.library`` custom ops
``torch_flashsys::attn_fwd`` / ``attn_bwd``, with fake (meta) implementations and registered
autograd, so ``torch.compile(fullgraph=True)`` sees one opaque node (no graph break) and CUDA
graphs capture it. The ops take the :class:`Extras` spelled out (a custom op's schema holds tensors
and scalars), in the order :data:`OP_EXTRAS` defines once.

A backward with grad mode on (``create_graph=True``) runs the differentiable PyTorch backward (see
``_autograd``). Under torch.compile, AOTAutograd traces the backward with grad mode off (the
kernels) and refuses a double backward itself.
"""

from __future__ import annotations

import torch

import torch_flashsys.attention._sm90 as _sm90
from torch_flashsys.attention._autograd import NO_CACHE_BACKWARD, Kernels, apply
from torch_flashsys.attention._extras import CAUSAL, Extras, canonical
from torch_flashsys.attention._functorch import unwrap_dead
from torch_flashsys.attention._tensors import empty_like_layout, unit_last_stride
from torch_flashsys.attention._torch_impl import differentiable_backward
from torch_flashsys.attention._triton_bwd import attention_backward
from torch_flashsys.attention._triton_fwd import attention_forward

_LIB = "torch_flashsys"


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(N, L, E) -> (1, N, L, E) view; 4-D passes through. Dim -3 is the head dim either way.

    The kernels read the last dimension with stride 1 (:func:`unit_last_stride`).
    """
    t = unit_last_stride(t)
    return t.unsqueeze(0) if t.dim() == 3 else t


def _forward(q, k, v, scale: float, ex: Extras):
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    if _sm90.forward_takes(q4, k4, v4, scale, ex):  # Hopper: the warp-specialized kernel
        out, lse = _sm90.forward(q4, k4, v4, scale, ex is CAUSAL)
    else:
        out, lse = attention_forward(q4, k4, v4, scale, ex)
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


def _kernel_backward(dout, q, k, v, out, lse, dlse, scale: float, ex: Extras):
    """The first-order backward of :class:`Attention` on the Triton backend."""
    if _functorch_active():  # torch.func.grad: the op unwraps its tensors for the kernels
        with torch.no_grad():  # (first order: the op has no autograd)
            return attn_bwd(dout, q, k, v, out, lse, dlse, *_op_args(scale, ex))
    # (torch.func.vjp's pullback runs after its transform: its wrappers are dead)
    dout, q, k, v, out, lse, dlse = unwrap_dead(dout, q, k, v, out, lse, dlse)
    return _backward(dout, q, k, v, out, lse, dlse, scale, ex)


TRITON = Kernels(_forward, _kernel_backward)

# The Extras fields (and the scale) the custom ops take after their tensors, with their schema
# types: the one definition of the ops' argument order.
OP_EXTRAS = (
    ("mask", "Tensor?"), ("alibi", "Tensor?"), ("seed", "Tensor?"), ("scale", "float"),
    ("left", "SymInt"), ("right", "SymInt"), ("softcap", "float"), ("dropout_p", "float"),
    ("cu_q", "Tensor?"), ("cu_k", "Tensor?"), ("max_q", "SymInt"), ("max_k", "SymInt"),
    ("seqused_k", "Tensor?"),
)  # fmt: skip
_NAMES = tuple(name for name, _ in OP_EXTRAS)
_NO_GRADS = (None,) * len(OP_EXTRAS)
_SEQUSED_K = _NAMES.index("seqused_k")  # its place among the ops' trailing arguments


def _op_args(scale: float, ex: Extras) -> tuple:
    return tuple(scale if name == "scale" else getattr(ex, name) for name in _NAMES)


def _from_op_args(args) -> tuple[float, Extras]:
    fields = dict(zip(_NAMES, args, strict=True))
    return fields.pop("scale"), canonical(Extras(**fields))  # PLAIN/CAUSAL: the same objects


def _schema(tensors: str, returns: str) -> str:
    extras = ", ".join(f"{kind} {name}" for name, kind in OP_EXTRAS)
    return f"({tensors}, {extras}) -> ({returns})"


@torch.library.custom_op(
    f"{_LIB}::attn_fwd",
    mutates_args=(),
    schema=_schema("Tensor q, Tensor k, Tensor v", "Tensor, Tensor"),
)
def attn_fwd(q, k, v, *extras):
    """Forward kernel: ``(out, lse)``; out like ``q``, lse float32 of shape ``q.shape[:-1]``."""
    return _forward(q, k, v, *_from_op_args(extras))


@attn_fwd.register_fake
def _(q, k, v, *extras):
    return empty_like_layout(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


_BWD_TENSORS = "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse"


@torch.library.custom_op(
    f"{_LIB}::attn_bwd", mutates_args=(), schema=_schema(_BWD_TENSORS, "Tensor, Tensor, Tensor")
)
def attn_bwd(dout, q, k, v, out, lse, dlse, *extras):
    """Backward kernels: ``(dq, dk, dv)`` shaped like ``(q, k, v)``; dk/dv summed over GQA groups."""
    return _backward(dout, q, k, v, out, lse, dlse, *_from_op_args(extras))


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, *extras):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *extras = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.extras = extras


def _op_backward(ctx, dout, dlse):
    if ctx.extras[_SEQUSED_K] is not None:  # as the eager Function does
        raise NotImplementedError(NO_CACHE_BACKWARD)
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if torch.is_grad_enabled():  # create_graph=True, called eagerly (compiled graphs refuse it)
        grads = differentiable_backward(dout, q, k, v, out, lse, dlse, *_from_op_args(ctx.extras))
    else:
        grads = attn_bwd(dout, q, k, v, out, lse, dlse, *ctx.extras)
    return (*grads, *_NO_GRADS)


attn_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def triton_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ex: Extras
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable Triton attention; inputs already validated by ``flash_attention``."""
    if torch.compiler.is_compiling():
        return attn_fwd(q, k, v, *_op_args(scale, ex))
    return apply(q, k, v, scale, ex, TRITON)


_functorch_active = torch._C._are_functorch_transforms_active
