"""Ring attention: queries stay, key/value shards travel around the ring of a process group.

Forward: at step ``s`` rank ``r`` attends its queries to the key/value shard of rank
``r - s`` (the blocks of :func:`ring_plan`) while the next shard is already in flight
(``batch_isend_irecv``), and merges the partial outputs by their log-sum-exp:
``out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)``, ``lse = lse_a - logsigmoid(lse_a - lse_b)``
(accumulated in float32, float64 for float64 inputs).

Backward (exact): FA2's backward of a block needs only the *global* ``out`` and ``lse`` of its query
rows (``D = rowsum(dO * O)``, ``P = exp(S - lse)``), so each block's ``dq``/``dk``/``dv`` are its
exact share. Key/value shards travel the same way again; each shard's ``dk``/``dv`` accumulator
travels one step behind it, collecting every rank's share, and its last hop brings it home.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_flashsys.attention._extras import CAUSAL, PLAIN
from torch_flashsys.distributed._cp_layout import ring_plan

_KV_TAG, _GRAD_TAG = 71, 72  # gloo matches point-to-point messages by tag (NCCL ignores tags)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def block_forward(q, k, v, scale: float, causal: bool, backend: str):
    """``(out, lse)`` of one block on ``backend`` ("triton" or "torch"); 4-D inputs."""
    ex = CAUSAL if causal else PLAIN
    if backend == "triton":
        from torch_flashsys.attention._triton_fwd import attention_forward

        return attention_forward(q, k, v, scale, ex)
    from torch_flashsys.attention._torch_impl import _no_autocast, tiled_forward

    with _no_autocast(q.device):
        return tiled_forward(q, k, v, scale, ex)


def block_backward(dout, q, k, v, out, lse, scale: float, causal: bool, backend: str):
    """``(dq, dk, dv)`` of one block given the global ``out``/``lse`` of its query rows."""
    ex = CAUSAL if causal else PLAIN
    if backend == "triton":
        from torch_flashsys.attention._triton_bwd import attention_backward

        c = [t.contiguous() for t in (dout, q, k, v, out, lse)]
        return attention_backward(*c, None, scale, ex)
    from torch_flashsys.attention._torch_impl import _no_autocast, tiled_backward

    with _no_autocast(q.device):
        return tiled_backward(dout, q, k, v, out, lse, None, scale, ex)


class Ring:
    """The neighbours of this rank in ``group`` and an asynchronous one-step shift."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def shift(self, tensors, tag: int) -> _Shift:
        """Start sending ``tensors`` to the next rank and receiving the previous rank's."""
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in recvs]
        return _Shift(dist.batch_isend_irecv(ops), recvs, sends)


class _Shift:
    def __init__(self, works, received, sent) -> None:
        self.works, self.received, self._sent = works, received, sent  # keep sends alive

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def _merge(acc: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Fold a partial ``(out_b, lse_b)`` into the running ``(acc, lse)`` views, in place."""
    lse_b = lse_b.to(lse.dtype)
    acc.sub_(torch.sigmoid(lse_b - lse).unsqueeze(-1) * (acc - out_b.to(acc.dtype)))
    lse.sub_(torch.nn.functional.logsigmoid(lse - lse_b))


def ring_forward(q, k, v, ring: Ring, scale: float, causal: bool, layout: str, backend: str):
    """The local output shard and its float32/64 ``lse``."""
    seq = q.shape[-2]
    acc = lse = None
    kv = (k, v)
    for step in range(ring.world):
        pending = ring.shift(kv, _KV_TAG) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        for rows, cols, c in ring_plan(ring.rank, src, ring.world, layout, causal, seq):
            out_b, lse_b = block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                         scale, c, backend)  # fmt: skip
            if acc is None:  # the first step's block covers every query row
                acc, lse = out_b.to(_acc_dtype(q)), lse_b.to(_acc_dtype(q))
            else:
                _merge(acc[:, :, rows], lse[:, :, rows], out_b, lse_b)
        if pending is not None:
            kv = tuple(pending.wait())
    return acc.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, ring: Ring, scale, causal, layout, backend):
    """``(dq, dk, dv)`` of the local shards."""
    seq, acc_t = q.shape[-2], _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc_t, device=q.device)
    kv, grads = (k, v), None
    for step in range(ring.world):
        pending = ring.shift(kv, _KV_TAG) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        dk = torch.zeros(k.shape, dtype=acc_t, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc_t, device=v.device)
        for rows, cols, c in ring_plan(ring.rank, src, ring.world, layout, causal, seq):
            dq_b, dk_b, dv_b = block_backward(
                dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                out[:, :, rows], lse[:, :, rows], scale, c, backend,
            )  # fmt: skip
            dq[:, :, rows] += dq_b
            dk[:, :, cols] += dk_b
            dv[:, :, cols] += dv_b
        if grads is not None:  # the shard's accumulator arrives one step behind the shard
            dk_in, dv_in = grads.wait()
            dk += dk_in
            dv += dv_in
        grads = ring.shift((dk, dv), _GRAD_TAG)
        if pending is not None:
            kv = tuple(pending.wait())
    dk, dv = grads.wait()  # the last hop brings this rank's own accumulator home
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_NO_DOUBLE_BACKWARD = (
    b"context_parallel_attention: mode='ring' has no double backward (a gradient of its "
    b"gradients, as a gradient penalty's backward after create_graph=True); mode='ulysses' has "
    b"one (flash_attention's)"
)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, causal: bool, layout: str, backend: str):
        out, lse = ring_forward(q, k, v, ring, scale, causal, layout, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, scale, causal, layout, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            grads = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (dout, q, k, v)):
            # create_graph=True: gradients whose own backward raises. (Constants would drop the
            # attention's second-order terms silently; torch's once_differentiable looks at
            # dout only, which is often a constant while q, k and v are not.)
            refuse = torch._C._functions.DelayedError(_NO_DOUBLE_BACKWARD, len(grads))
            grads = refuse(*(g.detach().requires_grad_() for g in grads))
        return (*grads, None, None, None, None, None)
