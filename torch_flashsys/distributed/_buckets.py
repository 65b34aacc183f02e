"""Gradient buckets for :class:`BucketedDDP`: assignment, flat buffers, ``param.grad`` views.

A bucket holds parameters of one device and dtype in one flat buffer::

    buffer = [ grad of p0 | grad of p1 | ... | grad of pk | flag p0 | ... | flag pk ]

``param.grad`` is a view into its slice, so gradients cost no memory beyond the buffer and the
all-reduce needs no copy. The trailing ``flags`` (one element per parameter, 1 when this rank
holds a gradient for it) ride along in the same all-reduce: after it, a flag of zero means no
rank had a gradient, so that parameter's ``grad`` stays ``None`` as in single-process training.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

_BROADCAST_CHUNK_BYTES = 250 * 2**20  # as torch DDP: large enough for few calls, bounded memory


def assign_buckets(params: Sequence[torch.Tensor], bucket_bytes: int | None) -> list[list[int]]:
    """Group parameter indices into buckets, in reverse order of ``params`` (registration order).

    Parameters of different (device, dtype) never share a bucket. A bucket holds at most
    ``bucket_bytes`` of gradient unless a single parameter is larger (then it is alone);
    ``None`` means no limit, ``0`` one parameter per bucket. Buckets are ordered by when their
    last parameter is expected to receive its gradient (reverse registration order).

    Example: params of 4, 4, 4, 8 bytes and ``bucket_bytes=8`` -> ``[[3], [2, 1], [0]]``.
    """
    open_: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    open_bytes: dict[tuple[torch.device, torch.dtype], int] = {}
    closed: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        key, nbytes = (p.device, p.dtype), p.numel() * p.element_size()
        current = open_.get(key)
        full = bucket_bytes is not None and (
            bucket_bytes == 0 or open_bytes.get(key, 0) + nbytes > bucket_bytes
        )
        if current and full:
            closed.append(current)
            current = None
        if current is None:
            current = open_[key] = []
            open_bytes[key] = 0
        current.append(i)
        open_bytes[key] += nbytes
    closed.extend(open_.values())
    return sorted(closed, key=lambda bucket: -bucket[-1])


class Bucket:
    """Flat gradient buffer of some parameters (one device and dtype) and their ``grad`` views.

    Per-backward state: ``ready[k]`` (gradient of ``params[k]`` accumulated), ``pending`` (count
    not ready), ``work`` (the in-flight all-reduce, if launched).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
        self.params, self.names = list(params), list(names)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        numels = [p.numel() for p in self.params]
        total = sum(numels)
        self.nbytes = total * self.params[0].element_size()
        self.buffer = torch.zeros(total + len(numels), dtype=self.dtype, device=self.device)
        self.views = [
            chunk.view_as(p)
            for chunk, p in zip(self.buffer[:total].split(numels), self.params, strict=True)
        ]
        self.flags = self.buffer[total:]
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work: dist.Work | None = None
        self._comm: torch.Tensor | None = None  # what is being all-reduced (buffer or a copy)
        self._none_here: list[int] = []  # params with no gradient on this rank at launch
        for k in range(len(self.params)):  # existing gradients move into the buffer
            self.adopt_grad(k)

    def reset(self) -> None:
        """Forget the previous backward's readiness (call before a synchronizing backward)."""
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = self._comm = None

    def adopt_grad(self, k: int) -> None:
        """Make ``params[k].grad`` the bucket view again (after ``zero_grad(set_to_none=True)``
        AccumulateGrad creates a fresh tensor: copy it in, then point ``grad`` at the view)."""
        p, view = self.params[k], self.views[k]
        grad = p.grad
        if grad is None or (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape):
            return
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"BucketedDDP: parameter {self.names[k]!r} got a {grad.layout} gradient; only "
                "dense (strided) gradients are supported (e.g. use nn.Embedding(sparse=False))"
            )
        view.copy_(grad)
        p.grad = view

    def launch(
        self,
        group: dist.ProcessGroup | None,
        world: int,
        comm_dtype: torch.dtype | None,
        reduce_avg: bool = False,
    ) -> None:
        """Start the averaging all-reduce of the whole buffer (asynchronous).

        ``reduce_avg``: the backend averages (``ReduceOp.AVG``, NCCL); else divide, then sum.
        """
        self._none_here = []
        for k, p in enumerate(self.params):
            self.adopt_grad(k)
            if p.grad is None:  # contributes zeros; ``grad`` stays None unless another rank has one
                self.views[k].zero_()
                self._none_here.append(k)
        self.flags.fill_(1)
        if self._none_here:
            self.flags[self._none_here] = 0
        if comm_dtype is None or self.buffer.element_size() <= 2:
            self._comm = self.buffer
        else:  # as torch's bf16/fp16 compress hooks: cast, divide, reduce, cast back
            self._comm = self.buffer.to(comm_dtype)
            reduce_avg = False  # divide first: a low-precision sum could overflow
        if reduce_avg:
            op = dist.ReduceOp.AVG
        else:
            self._comm.div_(world)
            op = dist.ReduceOp.SUM
        self.work = dist.all_reduce(self._comm, op=op, group=group, async_op=True)

    def finish(self) -> None:
        """Wait for the all-reduce and expose the averaged gradients through ``param.grad``."""
        if self.work is None:
            return
        self.work.wait()
        if self._comm is not self.buffer:
            self.buffer.copy_(self._comm)
        if self._none_here:  # only then read flags (a host sync on GPU)
            used = self.flags[self._none_here].ne(0).tolist()
            for k, globally_used in zip(self._none_here, used, strict=True):
                if globally_used:
                    self.params[k].grad = self.views[k]
        self.work = self._comm = None


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup | None = None
) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values: one broadcast per (device, dtype) and
    250 MiB chunk instead of one per tensor. ``src`` is a global rank."""
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    is_src = dist.get_rank() == src
    with torch.no_grad():
        for same_kind in by_key.values():
            chunk: list[torch.Tensor] = []
            chunk_bytes = 0
            for t in [*same_kind, None]:
                if chunk and (t is None or chunk_bytes + t.nbytes > _BROADCAST_CHUNK_BYTES):
                    flat = torch.cat([c.reshape(-1) for c in chunk])
                    dist.broadcast(flat, src, group=group)
                    if not is_src:
                        for c, piece in zip(
                            chunk, flat.split([c.numel() for c in chunk]), strict=True
                        ):
                            c.copy_(piece.view_as(c))
                    chunk, chunk_bytes = [], 0
                if t is not None:
                    chunk.append(t)
                    chunk_bytes += t.nbytes
