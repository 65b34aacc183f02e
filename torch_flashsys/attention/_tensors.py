"""Tensor plumbing shared by the backends: outputs in the query's memory layout."""

from __future__ import annotations

import torch


def empty_like_layout(t: torch.Tensor, last: int) -> torch.Tensor:
    """An empty tensor of ``t``'s shape with last dimension ``last``, in ``t``'s memory layout
    (the order of its strides), e.g. a (B, L, H, E) tensor viewed as (B, H, L, E)."""
    if last == t.shape[-1]:
        return torch.empty_like(t)
    # Outermost first (descending strides, ties in dimension order), by insertion rather than
    # sorted(key=...): under torch.compile with dynamic shapes the strides are symbolic, and
    # Dynamo refuses a sort on them but guards a comparison.
    order: list[int] = []
    for d in range(t.dim() - 1):
        i = 0
        while i < len(order) and t.stride(order[i]) >= t.stride(d):
            i += 1
        order.insert(i, d)
    base = t.new_empty([t.shape[d] for d in order] + [last])
    inverse = [order.index(d) for d in range(t.dim() - 1)] + [t.dim() - 1]
    return base.permute(inverse)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` when its last dimension has stride 1 (what the kernels read), else a contiguous
    copy: the rare tensor whose last dimension is strided (an expanded gradient of
    ``out.sum()``, a K cache kept as (B, H, D, S) and passed transposed)."""
    return t if t.stride(-1) == 1 else t.contiguous()
