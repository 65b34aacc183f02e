"""Gradient buckets for :class:`BucketedDDP`: assignment, flat buffers, ``param.grad`` views.

A bucket holds parameters of one device and dtype (under ZeRO-2 also of one owner rank) in one
flat buffer::

    buffer = [ grad of p0 | grad of p1 | ... | grad of pk | flag p0 | ... | flag pk ]

``param.grad`` is a view into its slice, so gradients cost no memory beyond the buffer and the
reduction needs no copy. The trailing ``flags`` (one element per parameter, 1 when this rank
holds a gradient for it) ride along in the same collective: after it, a flag of zero means no
rank had a gradient, so that parameter's ``grad`` stays ``None`` as in single-process training.

Buffers of buckets that this rank keeps are slices of one storage per (device, dtype), so the
start of a backward can zero all of them with one memset (see ``BucketedDDP._prepare``).
Under ZeRO-2 a bucket owned by another rank has no persistent buffer: one is allocated when
the backward reaches it and released once its reduction to the owner is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import torch_flashsys.distributed._release as _release
from torch_flashsys.distributed._comm_hook import GradBucket, hook_result

_BROADCAST_CHUNK_BYTES = 250 * 2**20  # as torch DDP: large enough for few calls, bounded memory


def assign_buckets(
    params: Sequence[torch.Tensor],
    bucket_bytes: int | None,
    owners: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group parameter indices into buckets, in reverse order of ``params`` (registration order).

    Parameters of different (device, dtype), or of different ``owners`` when given, never share
    a bucket. ``bucket_bytes`` is a soft cap, torch DDP's rule: a bucket takes parameters until
    it holds at least ``bucket_bytes`` of gradient, then closes (so it holds less than
    ``bucket_bytes`` plus its last parameter); ``None`` means no limit, ``0`` one parameter per
    bucket. Against a hard cap (close before the parameter that would cross it), a bucket not yet
    full takes its next parameter however large: the 2.0B LM's 339 parameters make 194 buckets
    at 25 MiB instead of 291 (torch DDP's 194), one collective and its host cost per bucket.
    Buckets are ordered by when their last parameter is expected to receive its gradient
    (reverse registration order).

    Example: params of 4, 4, 4, 8 bytes and ``bucket_bytes=8`` -> ``[[3], [2, 1], [0]]``;
    params of 8, 8, 2 bytes -> ``[[2, 1], [0]]``.
    """
    open_: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.device, p.dtype, None if owners is None else owners[i])
        nbytes = p.numel() * p.element_size()
        current = open_.get(key)
        if current is None:
            current = open_[key] = []
            open_bytes[key] = 0
        current.append(i)
        open_bytes[key] += nbytes
        if bucket_bytes is not None and open_bytes[key] >= bucket_bytes:
            closed.append(open_.pop(key))
    closed.extend(open_.values())
    return sorted(closed, key=lambda bucket: -bucket[-1])


_ALLREDUCE_OPTIONS: dict[dist.ReduceOp.RedOpType, dist.AllreduceOptions] = {}


def all_reduce(group: dist.ProcessGroup, tensor: torch.Tensor, op: dist.ReduceOp) -> dist.Work:
    """Asynchronous all-reduce, straight to the ProcessGroup: the ``torch.distributed`` wrappers
    cost ~30 us per call in Python (measured with gloo), paid on the backward's thread. The
    options object (read-only to the backend) is built once per op."""
    opts = _ALLREDUCE_OPTIONS.get(op)
    if opts is None:
        opts = _ALLREDUCE_OPTIONS[op] = dist.AllreduceOptions()
        opts.reduceOp = op
    return group.allreduce([tensor], opts)


def reduce(
    group: dist.ProcessGroup, tensor: torch.Tensor, op: dist.ReduceOp, dst: int
) -> dist.Work:
    """Asynchronous reduce to group rank ``dst``, straight to the ProcessGroup (as all_reduce)."""
    opts = dist.ReduceOptions()
    opts.reduceOp, opts.rootRank, opts.rootTensor = op, dst, 0
    return group.reduce([tensor], opts)


class _Local:
    """The finished "reduction" of a one-rank group: the sum over one rank is the buffer itself."""

    @staticmethod
    def wait() -> bool:
        return True


_LOCAL = _Local()


def _holds(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    """Whether ``grad`` is ``view`` (the same tensor object, or the same memory and shape)."""
    if grad is None or grad.layout != torch.strided:  # a sparse one has no data pointer
        return False
    return grad is view or (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape)


class Bucket:
    """Flat gradient buffer of some parameters (one device and dtype) and their ``grad`` views.

    ``owner``: ``None`` (every rank keeps the average: all-reduce) or the group rank that keeps
    it (ZeRO-2: reduce to the owner). ``keeps``: this rank keeps the result, so its buffer is
    persistent (bound with :meth:`bind`); otherwise :meth:`allocate` makes a transient one.

    Per-backward state: ``ready[k]`` (gradient of ``params[k]`` accumulated), ``pending`` (count
    not ready), ``phantom`` (indices whose ``grad`` was set to a zeroed view and has received
    nothing since), ``flags_set`` (the buffer was zeroed and its flags set to 1 in this
    backward, so no gradient slice or flag needs touching before the reduction), ``work``.

    ZeRO-2 owner state (see ``GradientReducer.separate_reduced``): ``reduced`` (the buffer holds
    the average its last reduction brought, which the other ranks do not hold), ``carry`` (such
    an average set aside by a backward that did not synchronize, while local gradients were
    added to it) and ``carry_version`` (the buffer's version when that backward ended), and
    ``seen_task`` (the autograd graph task that last looked at them).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        owner: int | None = None,
        keeps: bool = True,
    ) -> None:
        self.params, self.names = list(params), list(names)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.numels = [p.numel() for p in self.params]
        self.total = sum(self.numels)
        self.size = self.total + len(self.params)  # elements: gradients, then one flag each
        self.nbytes = self.total * self.params[0].element_size()
        self.owner, self.keeps = owner, keeps
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.flags: torch.Tensor | None = None
        self.phantom: set[int] = set()
        self.flags_set = False
        self.reset()
        self.work: dist.Work | None = None
        self.future: torch.futures.Future | None = None  # a communication hook's
        self.hook_bucket: GradBucket | None = None
        self._comm: torch.Tensor | None = None  # what is being reduced (buffer or a copy)
        self._sent: torch.Tensor | None = None  # the alias of _comm handed to the backend
        self._none_here: list[int] = []  # params with no gradient on this rank at launch
        self.reduced = False
        self.carry: torch.Tensor | None = None
        self.carry_version = -1
        self.seen_task = -1

    def bind(self, buffer: torch.Tensor) -> None:
        """Use ``buffer`` (``size`` elements) and move existing gradients into it."""
        self.buffer = buffer
        self.views = [
            chunk.view_as(p)
            for chunk, p in zip(buffer[: self.total].split(self.numels), self.params, strict=True)
        ]
        self.flags = buffer[self.total :]
        self.flags_set = False
        for k in range(len(self.params)):
            self.adopt_grad(k)

    def allocate(self, point: bool = True) -> None:
        """A transient buffer (ZeRO-2, another rank's bucket): zeroed, flags 1, and (``point``)
        ``None`` grads pointed at their views so that the backward accumulates into it in place."""
        self.buffer = torch.zeros(self.size, dtype=self.dtype, device=self.device)
        self.views = [
            chunk.view_as(p)
            for chunk, p in zip(
                self.buffer[: self.total].split(self.numels), self.params, strict=True
            )
        ]
        self.flags = self.buffer[self.total :]
        self.flags.fill_(1)
        self.flags_set = True
        if point:
            self.point_grads(zeroed=True)

    def release(self) -> None:
        """Drop a transient buffer and this rank's gradients of its (not owned) parameters."""
        for p in self.params:
            p.grad = None
        self.buffer, self.views, self.flags = None, [], None
        self.phantom.clear()
        self.flags_set = False
        self.reduced, self.carry = False, None

    def reset(self) -> None:
        """Forget the previous backward's readiness (call before a synchronizing backward)."""
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)

    def holds_views(self) -> bool:
        """Whether some parameter's ``grad`` is its view (holds data a memset would destroy)."""
        return any(_holds(p.grad, v) for p, v in zip(self.params, self.views, strict=True))

    def start_backward(self, holds: bool) -> None:
        """At a backward's first hook: keep the gradients the views hold (``holds``: accumulated
        under no_sync, zeroed in place, set by hand), else zero the buffer, set the flags to 1
        and point every ``None`` grad at its zeroed view."""
        if holds:
            self.flags_set = False
            self.point_grads(zeroed=False)
        else:
            self.buffer.zero_()
            self.flags.fill_(1)
            self.flags_set = True
            self.point_grads(zeroed=True)

    def point_grads(self, zeroed: bool) -> None:
        """Point every ``None`` grad at its view (zeroing it unless ``zeroed``): AccumulateGrad
        then adds in place instead of handing over a fresh tensor that would need copying."""
        for k, p in enumerate(self.params):
            if p.grad is None:
                if not zeroed:
                    self.views[k].zero_()
                p.grad = self.views[k]
                self.phantom.add(k)

    def clear_phantoms(self) -> None:
        """End of a backward: grads we pointed at zeroed views that received nothing -> None."""
        for k in self.phantom:
            if _holds(self.params[k].grad, self.views[k]):
                self.params[k].grad = None
        self.phantom.clear()

    def adopt_grad(self, k: int) -> None:
        """Make ``params[k].grad`` the bucket view again, copying a gradient held elsewhere (a
        grad replaced by hand, or created by AccumulateGrad when the view was not in place)."""
        p, view = self.params[k], self.views[k]
        grad = p.grad
        if self.phantom:
            self.phantom.discard(k)
        if grad is view or grad is None or _holds(grad, view):
            return
        if grad.layout != torch.strided:  # a sparse gradient of a parameter not known as sparse
            grad = grad.to_dense()  # (nn.Embedding(sparse=True) weights are reduced sparse)
        view.copy_(grad)
        p.grad = view

    def prepare(self) -> None:
        """Before the reduction: adopt gradients not yet in the buffer, zero the slices of
        parameters without a gradient on this rank and set their flags to 0."""
        if self.buffer is None:  # ZeRO-2: no gradient of this bucket arrived on this rank
            self.allocate(point=False)
        self._none_here = []
        if self.pending or not self.flags_set:  # else: every gradient arrived, flags are 1
            if not self.flags_set:
                self.flags.fill_(1)
            for k, p in enumerate(self.params):
                if self.ready[k]:
                    continue  # adopted in its hook
                if p.grad is None or k in self.phantom:  # no gradient here: contribute zeros
                    if p.grad is None and not self.flags_set:
                        self.views[k].zero_()
                    self._none_here.append(k)
                else:  # accumulated earlier (no_sync) or set by hand
                    self.adopt_grad(k)
            if self._none_here:
                self.flags[self._none_here] = 0

    def launch(
        self,
        group: dist.ProcessGroup,
        divisor: int,
        comm_dtype: torch.dtype | None,
        reduce_avg: bool = False,
    ) -> None:
        """Start the averaging reduction of the whole buffer, flags included (asynchronous): an
        all-reduce, or a reduce to group rank ``owner`` (ZeRO-2). ``group``: a ProcessGroup (not
        ``None``); ``divisor``: what the sum is divided by (the world size, or under ``join()``
        the number of ranks still training).

        ``reduce_avg``: the backend averages (``ReduceOp.AVG``, NCCL; only when ``divisor`` is
        the group's size); else divide, then sum.
        """
        self.prepare()
        if comm_dtype is None or self.buffer.element_size() <= 2:
            self._comm = self.buffer
        else:  # as torch's bf16/fp16 compress hooks: cast, divide, reduce, cast back
            self._comm = self.buffer.to(comm_dtype)
            reduce_avg = False  # divide first: a low-precision sum could overflow
        if reduce_avg:
            op = dist.ReduceOp.AVG
        else:
            if divisor > 1:
                self._comm.div_(divisor)
            op = dist.ReduceOp.SUM
        if group.size() == 1:  # nothing to exchange: skip the collective and its host cost
            self.work = _LOCAL  # (a compressed copy still round-trips, as with more ranks)
            return
        # An alias only the Work holds once we drop it: exit waits for its release (_release).
        self._sent = _release.alias(self._comm)
        if self.owner is None:
            self.work = all_reduce(group, self._sent, op)
        else:
            self.work = reduce(group, self._sent, op, self.owner)

    def launch_hook(
        self, run: Callable[[GradBucket], torch.futures.Future], index: int, count: int
    ) -> None:
        """Start the reduction by a communication hook (``register_comm_hook``): ``run`` gets
        the gradients (the buffer without its flags) as a GradBucket (``index`` of ``count``)
        and returns the Future of the reduced flat tensor. The flags are reduced separately."""
        self.prepare()
        grads = self.buffer[: self.total]
        self.hook_bucket = GradBucket(grads, self.params, self.numels, index, count)
        self.future = run(self.hook_bucket)

    def finish(self, expose: bool = True) -> None:
        """Wait for the reduction and write its result into the buffer (or, for a bucket this
        rank does not keep, drop its gradients and buffer); ``expose``: then point the grads
        at it (:meth:`expose`; ``False`` when the flags are reduced separately, after)."""
        if self.future is not None:
            value = self.future.wait()
            self.future = None
            grads = self.buffer[: self.total]
            result = hook_result(value, self.total, self.hook_bucket)
            self.hook_bucket = None
            if not _same_memory(result, grads):
                grads.copy_(result.reshape(-1))
        elif self.work is not None:
            self.work.wait()
            # an owner's average of a reduction over several ranks: counted once from now on
            self.reduced = self.keeps and self.owner is not None and self.work is not _LOCAL
            self.work = None
            if self._sent is not None:
                _release.handed_back(self._sent)
                self._sent = None
            if not self.keeps:
                self._comm = None
                self.release()
                return
            if self._comm is not self.buffer:
                self.buffer.copy_(self._comm)
            self._comm = None
        else:
            return
        if expose:
            self.expose()

    def expose(self) -> None:
        """After the reduction: ``grad`` of a parameter no rank had a gradient for -> ``None``."""
        if self._none_here:  # only then read flags (a host sync on GPU)
            used = self.flags[self._none_here].ne(0).tolist()
            for k, globally_used in zip(self._none_here, used, strict=True):
                self.params[k].grad = self.views[k] if globally_used else None
            self._none_here = []
        self.phantom.clear()
        self.flags_set = False

    @property
    def busy(self) -> bool:
        """A reduction was started and not finished."""
        return self.work is not None or self.future is not None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel()


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
                    _release.handed_back(flat)  # dropped below; see _release
                    if not is_src:
                        for c, piece in zip(
                            chunk, flat.split([c.numel() for c in chunk]), strict=True
                        ):
                            c.copy_(piece.view_as(c))
                    chunk, chunk_bytes = [], 0
                if t is not None:
                    chunk.append(t)
                    chunk_bytes += t.nbytes
