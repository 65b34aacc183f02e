"""torch.func support of the attention autograd.Function (``_autograd``), for both backends.

The Function defines ``setup_context`` (what ``torch.func.grad``/``vjp`` need) and the ``vmap`` rule
here: the mapped dimension is folded into the batch dimension and the Function runs once on the
whole batch, so the kernels see ordinary tensors. Score modifications that carry tensors (a mask,
ALiBi slopes, dropout's seed, a packed batch, a KV cache) are not mapped: they raise, with the
list of what works. A backward that runs under ``vmap`` (``jacrev``, ``vmap`` over ``grad`` or
``vjp``: per-sample gradients) gets batched tensors; grad mode is on under every transform, so it
runs on PyTorch ops (``_torch_impl.tiled_backward``, which writes into no unbatched buffer), which
vmap batches; a packed batch's backward there raises.
Forward-mode AD (``jvp``, ``jacfwd``, ``hessian``) is not implemented either: PyTorch's own
``NotImplementedError`` says so (a ``jvp`` staticmethod that raised would make Dynamo refuse to
trace the Functions).
"""

from __future__ import annotations

import torch

from torch_flashsys.attention._extras import Extras

SUPPORTED = (
    "supported: torch.func.grad, vjp and jacrev, torch.func.vmap of the forward (with is_causal, "
    "scale, enable_gqa, window_size and softcap), and vmap over grad or vjp (per-sample "
    "gradients; that backward runs on PyTorch ops)"
)


def _mapped_first(t: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """The mapped dimension of ``t`` at the front (an expanded view when ``t`` is not mapped)."""
    if dim is None:
        return t.unsqueeze(0).expand(size, *t.shape)
    return t.movedim(dim, 0)


def vmap_rule(function, info, in_dims, q, k, v, scale: float, ex: Extras, kernels):
    """``function.vmap``: one call on the batch with the mapped dimension folded into it."""
    unmapped = [name for name, t in (("attn_mask", ex.mask), ("alibi_slopes", ex.alibi),
                                     ("dropout_p > 0", ex.seed), ("cu_seqlens", ex.cu_q),
                                     ("cache_seqlens", ex.seqused_k)) if t is not None]  # fmt: skip
    if unmapped:
        raise NotImplementedError(
            f"flash_attention: torch.func.vmap does not support {', '.join(unmapped)}; {SUPPORTED}"
        )
    n = info.batch_size
    q, k, v = (_mapped_first(t, d, n) for t, d in zip((q, k, v), in_dims[:3], strict=True))
    if q.dim() == 4:  # a 3-D problem (heads, seq, dim): the mapped dimension is its batch
        return function.apply(q, k, v, scale, ex, kernels), (0, 0)
    out, lse = function.apply(*(t.flatten(0, 1) for t in (q, k, v)), scale, ex, kernels)
    return (out.unflatten(0, (n, -1)), lse.unflatten(0, (n, -1))), (0, 0)


def unwrap_dead(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The plain tensors under wrappers of transforms that have exited (``torch.func.vjp``'s
    pullback runs after its transform); others as they are."""
    if not any(t is not None and _is_wrapped(t) for t in tensors):  # the common case
        return tensors
    return tuple(t if t is None else _unwrap_if_dead(t) for t in tensors)


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def check_backward_batchable(ex: Extras, *tensors: torch.Tensor | None) -> None:
    """Raise where a backward under vmap (jacrev, vmap over grad or vjp: some of ``tensors``
    batched) cannot run: it runs on PyTorch ops (grad mode is on under every torch.func
    transform), which vmap batches, except a packed batch's per-sequence writes."""
    if not any(t is not None and torch._C._functorch.is_batchedtensor(t) for t in tensors):
        return
    if ex.cu_q is not None or not torch.is_grad_enabled():
        raise NotImplementedError(
            "flash_attention: the backward cannot run under torch.func.vmap (torch.func.jacrev, "
            "vmap over grad or vjp) with cu_seqlens or with grad mode off; "
            f"{SUPPORTED}"
        )
