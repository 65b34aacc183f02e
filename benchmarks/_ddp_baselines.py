"""The seed project's DDP comparison points for benchmarks/ddp.py (not public API).

Both broadcast rank 0's parameters at construction and synchronize only when
``finish_gradient_synchronization()`` is called after backward, so no communication overlaps the
backward pass:

- :class:`NaiveDDP`: one synchronous all-reduce per parameter gradient.
- :class:`FlatDDP`: all gradients flattened into one buffer, one all-reduce, copied back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _AfterBackwardDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self._world = dist.get_world_size()
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, 0)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.module.parameters() if p.grad is not None]


class NaiveDDP(_AfterBackwardDDP):
    """Per-parameter synchronous all-reduce after backward."""

    def finish_gradient_synchronization(self) -> None:
        for g in self._grads():
            dist.all_reduce(g)
            g.div_(self._world)


class FlatDDP(_AfterBackwardDDP):
    """One all-reduce of all gradients (flattened into a temporary buffer) after backward."""

    def finish_gradient_synchronization(self) -> None:
        grads = self._grads()
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(self._world)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(piece.view_as(g))
