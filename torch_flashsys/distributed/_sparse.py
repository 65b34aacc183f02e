"""Sparse gradients for :class:`BucketedDDP`: weights of ``nn.Embedding`` / ``nn.EmbeddingBag``
with ``sparse=True``, reduced as sparse tensors, as torch DDP does.

Torch DDP gives each such weight a bucket of its own and all-reduces the sparse gradient (gloo's
sparse all-reduce all-gathers every rank's indices and values and sums them; NCCL has none).
Here the same algorithm is written with dense collectives, so it runs on any backend:

1. one all-gather of a small table per rank: for each sparse parameter, whether this rank has a
   gradient, whether it is dense, its number of (coalesced) rows and its ``sparse_dim``;
2. per parameter, one all-gather of the indices and one of the values (divided by the world
   size first), each padded to the largest row count;
3. concatenate every rank's rows and ``coalesce()``: the sum. ``param.grad`` becomes that
   coalesced sparse tensor, ``None`` if no rank had a gradient (as for dense parameters).

If some rank's gradient is dense (a weight tied to a dense use, e.g. an output head: sparse +
dense accumulate to dense), every rank all-reduces the dense gradient instead and the result is
dense, as single-process training would give. The reduction runs at the end of each
synchronizing backward, after every dense bucket was started.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_flashsys.distributed._verify import collective_device

_HAS, _DENSE, _ROWS, _SPARSE_DIM = range(4)  # columns of the per-rank table


def sparse_gradient_params(module: nn.Module) -> set[int]:
    """``id`` of every parameter whose gradient is sparse: ``nn.Embedding`` and
    ``nn.EmbeddingBag`` weights with ``sparse=True`` (torch DDP's rule)."""
    return {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }


def _local(grad: torch.Tensor | None) -> tuple[torch.Tensor | None, list[int]]:
    """This rank's gradient (sparse ones coalesced) and its row of the table."""
    if grad is None:
        return None, [0, 0, 0, 0]
    if grad.layout == torch.sparse_coo:
        grad = grad.coalesce()
        return grad, [1, 0, grad._nnz(), grad.sparse_dim()]
    return grad, [1, 1, 0, 0]  # strided (or another layout: made dense)


class SparseReduction:
    """One reduction of the sparse parameters' gradients: :meth:`start`, then :meth:`finish`.

    params/names: the sparse parameters; ``wrap(what, fn)`` runs ``fn`` and re-raises a failure
    naming ``what`` (BucketedDDP's collective errors).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        wrap: Callable[[str, Callable[[], Any]], Any],
    ) -> None:
        self.params, self.names, self.wrap = list(params), list(names), wrap
        self.plans: list[tuple] = []

    def start(self, group: dist.ProcessGroup, divisor: int) -> None:
        """Exchange the table (waits for it), then start every parameter's collectives."""
        world = dist.get_world_size(group)
        grads, rows = zip(*(_local(p.grad) for p in self.params), strict=True)
        mine = torch.tensor(rows, dtype=torch.int64, device=collective_device(group))
        tables = [torch.empty_like(mine) for _ in range(world)]
        what = f"the all-gather of the sparse gradients' sizes ({', '.join(map(repr, self.names))})"
        self.wrap(what, lambda: dist.all_gather(tables, mine, group=group))
        table = torch.stack(tables).cpu()  # (world, parameter, column)
        self.plans = []
        for i, (p, grad) in enumerate(zip(self.params, grads, strict=True)):
            col = table[:, i]
            has = col[:, _HAS].bool()
            if not has.any():
                self.plans.append(("none",))
                continue
            dims = set(col[has & ~col[:, _DENSE].bool(), _SPARSE_DIM].tolist())
            if col[:, _DENSE].any() or len(dims) > 1:
                self.plans.append(self._start_dense(p, grad, group, divisor))
            else:
                rows_per_rank = col[:, _ROWS].tolist()
                self.plans.append(
                    self._start_sparse(p, grad, group, divisor, rows_per_rank, dims.pop())
                )

    def _start_dense(self, p, grad, group, divisor) -> tuple:
        if grad is None:
            flat = torch.zeros_like(p, memory_format=torch.contiguous_format)
        else:
            flat = (grad.to_dense() if grad.layout != torch.strided else grad).div(divisor)
        work = dist.all_reduce(flat, group=group, async_op=True)
        return ("dense", flat, [work])

    def _start_sparse(self, p, grad, group, divisor, rows_per_rank, sparse_dim) -> tuple:
        most, world = max(rows_per_rank), len(rows_per_rank)
        indices = torch.zeros(sparse_dim, most, dtype=torch.int64, device=p.device)
        values = torch.zeros(most, *p.shape[sparse_dim:], dtype=p.dtype, device=p.device)
        if grad is not None and grad._nnz():
            indices[:, : grad._nnz()] = grad.indices()
            torch.div(grad.values(), divisor, out=values[: grad._nnz()])
        all_indices = [torch.empty_like(indices) for _ in range(world)]
        all_values = [torch.empty_like(values) for _ in range(world)]
        works = []
        if most:
            works.append(dist.all_gather(all_indices, indices, group=group, async_op=True))
            works.append(dist.all_gather(all_values, values, group=group, async_op=True))
        return ("sparse", rows_per_rank, all_indices, all_values, works)

    def finish(self, keep: Sequence[bool] | None = None) -> None:
        """Wait and set each ``param.grad`` to the sum (``keep[i]`` False: ZeRO-2, a parameter
        another rank owns, whose gradient is then ``None`` here)."""
        plans, self.plans = self.plans, []
        for i, (p, plan) in enumerate(zip(self.params, plans, strict=True)):
            for work in plan[-1] if plan[0] != "none" else ():
                self.wrap(f"the exchange of the sparse gradient of {self.names[i]!r}", work.wait)
            if plan[0] == "none" or (keep is not None and not keep[i]):
                p.grad = None
            elif plan[0] == "dense":
                p.grad = plan[1]
            else:
                _, rows_per_rank, all_indices, all_values, _ = plan
                indices = torch.cat(
                    [t[:, :n] for t, n in zip(all_indices, rows_per_rank, strict=True)], dim=1
                )
                values = torch.cat([t[:n] for t, n in zip(all_values, rows_per_rank, strict=True)])
                p.grad = torch.sparse_coo_tensor(
                    indices, values, p.shape, check_invariants=False
                ).coalesce()
