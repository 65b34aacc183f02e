"""Right-padded causal masks, recognized and run without the mask.

A Hugging Face model trained on right-padded batches passes SDPA a boolean (batch, 1, L, L) mask
that is the causal mask AND "key < the sequence's length": query row i sees keys j <= min(i,
n_b - 1). That is exactly flash_attention's top-left causal mask on sequence b's first n_b keys,
which the mask-free kernels run (the Hopper path included) without reading L x L mask values or
computing the padded keys' tiles. :func:`key_lengths` recognizes such a mask (one comparison on
the mask's device and one synchronization per mask tensor: the lengths slice the keys, so the
host needs them; a model passes one mask object to all its layers, and for a CUDA mask the
result is kept for it); :func:`per_sequence` runs the sequences one kernel call each, in one
autograd node, and :func:`packed_layout` lays them out as one packed (cu_seqlens) problem
(:func:`route` chooses).
"""

from __future__ import annotations

import os
import weakref

import torch

from torch_flashsys.attention._autograd import Kernels
from torch_flashsys.attention._extras import CAUSAL, Extras
from torch_flashsys.attention._tensors import empty_like_layout

# On a GPU, sequences (query rows) of at least PER_SEQUENCE_MIN_SEQ_CUDA run one causal call each
# (the Hopper kernels where they take them; a training step hides each call's host time there:
# H100, docs/benchmarks.md), shorter ones from MIN_SEQ_CUDA as one packed call (cu_seqlens, the
# portable kernels: one call's host time), shorter still on the mask path
# (``benchmarks/gpu_checks/padded_masks.py``). On CPUs every length runs per sequence.
PER_SEQUENCE_MIN_SEQ_CUDA = 1024
MIN_SEQ_CUDA = 512

BLOCK_ELEMENTS = 1 << 24  # the mask check's temporaries: at most about this many elements

# TORCH_FLASHSYS_PADDED_MASKS=0 (read at import): every mask takes the mask path.
ENABLED = os.environ.get("TORCH_FLASHSYS_PADDED_MASKS", "1") != "0"
# The devices whose masks' answers are kept (per object, version counter and address): CUDA, where
# looking costs a synchronization. There a write PyTorch does not count (through ``.data``, a
# DLPack alias, another library's kernel) is not seen (docs/attention.md). A CPU mask is looked
# at on every call: nothing to save, and a buffer refilled through a NumPy alias is seen.
KEPT_DEVICES = frozenset({"cuda"})

# The last masks looked at, newest first: (weak reference, version counter, data pointer, causal,
# its lengths or None: not a right-padded causal mask). A model's layers pass the same mask
# object, or a few alternating ones (sliding-window and full layers): each is looked at once.
_seen: list[tuple[weakref.ref, int, int, bool, list[int] | None]] = []
KEPT_MASKS = 4


def key_lengths(mask: torch.Tensor, batch: int, seq_q: int, seq_k: int,
                is_causal: bool) -> list[int] | None:  # fmt: skip
    """Each sequence's key count n_b when ``mask`` (with ``is_causal``: together with the causal
    mask) is a right-padded causal mask of shape (batch, 1, seq_q, seq_k), seq_q == seq_k: True
    exactly at keys j <= i with j < n_b, every n_b >= 1. None otherwise, when switched off
    (ENABLED), for CUDA sequences shorter than MIN_SEQ_CUDA, and where the answer would need a
    synchronization that cannot happen (a CUDA graph being captured, a traced or compiled
    region). Kept for the last KEPT_MASKS mask objects on KEPT_DEVICES."""
    global _seen
    if not ENABLED or (mask.is_cuda and seq_q < MIN_SEQ_CUDA):
        return None
    if (mask.dtype != torch.bool or mask.dim() != 4 or seq_q != seq_k
            or tuple(mask.shape) != (batch, 1, seq_q, seq_k) or seq_q == 0):  # fmt: skip
        return None
    if torch.compiler.is_compiling() or not _plain_tensor(mask):
        return None
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if mask.is_inference() or mask.device.type not in KEPT_DEVICES:  # looked at every call
        return _lengths(mask[:, 0], is_causal)  # (inference tensors have no version counter)
    version, address, seen = mask._version, mask.data_ptr(), _seen
    for ref, v, a, c, lengths in seen:
        if ref() is mask and v == version and a == address and c == is_causal:
            return lengths
    lengths = _lengths(mask[:, 0], is_causal)
    entry = (weakref.ref(mask), version, address, is_causal, lengths)
    _seen = [entry, *(e for e in seen if e[0]() is not None)][:KEPT_MASKS]
    return lengths


def route(query: torch.Tensor) -> str:
    """How a right-padded problem runs: ``"per_sequence"`` or ``"packed"``."""
    if query.is_cuda and query.shape[-2] < PER_SEQUENCE_MIN_SEQ_CUDA:
        return "packed"
    return "per_sequence"


# The last lengths packed: (lengths, seq, device) -> (cu_seqlens_q, cu_seqlens_k, key rows).
_layout: tuple[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


def packed_layout(lengths: list[int], seq: int, device: torch.device,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The packed problem of a right-padded batch: int32 cumulative lengths of the queries (all
    ``seq`` rows of each sequence, padded ones included) and of the keys (n_b each), and the int64
    rows of the (batch x seq) keys that remain, on ``device``; kept for the last lengths (a
    model's layers share them; one host-to-device copy per batch)."""
    global _layout
    key = (tuple(lengths), seq, device)
    last = _layout
    if last is not None and last[0] == key:
        return last[1]
    n = torch.tensor(lengths)
    cu_q = torch.arange(len(lengths) + 1, dtype=torch.int32) * seq
    cu_k = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_k[1:] = n.cumsum(0)
    rows = torch.cat([torch.arange(b * seq, b * seq + m) for b, m in enumerate(lengths)])
    found = (cu_q.to(device), cu_k.to(device), rows.to(device))
    _layout = (key, found)
    return found


def _plain_tensor(t: torch.Tensor) -> bool:
    """A tensor with real values here (not a fake, functional or other subclass)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _lengths(mask: torch.Tensor, is_causal: bool) -> list[int] | None:
    """:func:`key_lengths` of a (batch, L, L) boolean mask, computed on its device in blocks of
    rows (at most ~16M elements per temporary: a 32k-token mask is already 1 GB)."""
    batch, seq = mask.shape[0], mask.shape[-1]
    keys = torch.arange(seq, device=mask.device)
    n = mask[:, -1, :].sum(-1)  # the last row sees every key its sequence has (causal or not)
    same = (n >= 1).all()
    rows_per_block = max(1, BLOCK_ELEMENTS // (batch * seq))
    for r0 in range(0, seq, rows_per_block):
        rows = keys[r0 : r0 + rows_per_block]
        causal = keys[None, :] <= rows[:, None]  # key j <= query row i
        seen = mask[:, r0 : r0 + rows_per_block]
        if is_causal:
            seen = seen & causal
        expected = causal[None] & (keys[None, None, :] < n[:, None, None])
        same = same & (seen == expected).all()
    found = torch.cat([same.view(1).long(), n.long()]).tolist()  # the one synchronization
    return found[1:] if found[0] else None


def per_sequence(base: Kernels, lengths: list[int]) -> Kernels:
    """A backend pair (``_autograd.Kernels``) that runs ``base`` on each sequence's causal problem
    (its query rows, its first n_b keys) and writes the results into whole-batch tensors: one
    autograd node for the batch (slicing under autograd would add a zero-filled batch-sized
    gradient per sequence). The Extras it is called with (the mask's) serve the differentiable
    backward under ``create_graph=True``; these kernels ignore them. Keys past n_b get zero dK
    and dV (no query sees them)."""

    def forward(q, k, v, scale: float, ex: Extras):
        out = lse = None
        for b, n in enumerate(lengths):
            o, m = base.forward(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale,
                                CAUSAL)  # fmt: skip
            if out is None:  # (the dtypes the backend returns: float64 on the PyTorch one)
                out = empty_like_layout(q, v.shape[-1]).to(o.dtype)
                lse = m.new_empty(q.shape[:-1])
            out[b : b + 1] = o
            lse[b : b + 1] = m
        return out, lse

    def backward(dout, q, k, v, out, lse, dlse, scale: float, ex: Extras):
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b, n in enumerate(lengths):
            s = slice(b, b + 1)
            grads = base.backward(dout[s], q[s], k[s, :, :n], v[s, :, :n], out[s], lse[s],
                                  None if dlse is None else dlse[s], scale, CAUSAL)  # fmt: skip
            dq[s], dk[s, :, :n], dv[s, :, :n] = grads
        return dq, dk, dv

    return Kernels(forward, backward)
