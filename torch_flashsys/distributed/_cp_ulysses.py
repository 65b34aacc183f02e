"""Ulysses attention: an all-to-all trades the sequence shard for a head shard, and back.

``(batch, heads, seq / P, dim)`` on every rank becomes ``(batch, heads / P, seq, dim)`` (all tokens,
this rank's heads) by one ``all_to_all_single``; attention runs locally on whole sequences; a second
all-to-all returns ``(batch, heads, seq / P, dim_v)``. The backward of an all-to-all is the reverse
all-to-all. Per layer each rank sends ``O(seq * heads * dim / P)`` elements, independent of P's
ring steps, but ``heads`` and ``kv_heads`` must be multiples of P.

The gathered sequence is the rank-ordered concatenation of the shards; with the zigzag layout a
causal mask needs it in global order, so the chunks are permuted there and back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_flashsys.distributed._cp_layout import natural_order, shard_order


def _all_to_all(x: torch.Tensor, scatter: int, gather: int, group) -> torch.Tensor:
    """Split ``x`` into P pieces along ``scatter``, send piece ``p`` to rank ``p``, and concatenate
    the received pieces (in rank order) along ``gather``. Not recorded by autograd:
    :class:`_AllToAll` is its differentiable form."""
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=scatter)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter: int, gather: int, group):
        ctx.args = (gather, scatter, group)
        return _all_to_all(x, scatter, gather, group)

    @staticmethod
    def backward(ctx, grad):
        # The reverse all-to-all, itself differentiable (a double backward runs it back): under
        # create_graph=True the gradient stays connected to the graph
        return _AllToAll.apply(grad, *ctx.args), None, None, None


def _permute_chunks(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Reorder the equal chunks of dim 2 (the sequence): chunk ``i`` of the result is ``order[i]``."""
    b, h, seq, d = x.shape
    index = torch.tensor(order, device=x.device)
    return x.view(b, h, len(order), seq // len(order), d).index_select(2, index).view(b, h, seq, d)


def ulysses_attention(q, k, v, group, layout: str, is_causal: bool, attend) -> torch.Tensor:
    """``attend(q, k, v, is_causal)`` on whole sequences and a 1/P share of the heads."""
    world = dist.get_world_size(group)
    q, k, v = (_AllToAll.apply(t, 1, 2, group) for t in (q, k, v))
    reorder = is_causal and layout == "zigzag"
    if reorder:  # global order for the causal mask
        to_global = natural_order(world, layout)
        q, k, v = (_permute_chunks(t, to_global) for t in (q, k, v))
    out = attend(q, k, v, is_causal)
    if reorder:
        out = _permute_chunks(out, shard_order(world, layout))
    return _AllToAll.apply(out, 2, 1, group)
