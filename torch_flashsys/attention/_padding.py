"""Right-padded causal masks, recognized and run without the mask.

A Hugging Face model trained on right-padded batches passes SDPA a boolean (batch, 1, L, L) mask
that is the causal mask AND "key < the sequence's length": query row i sees keys j <= min(i,
n_b - 1). That is exactly flash_attention's top-left causal mask on sequence b's first n_b keys,
which the mask-free kernels run (the Hopper path included) without reading L x L mask values or
computing the padded keys' tiles. :func:`key_lengths` recognizes such a mask (one comparison on
the mask's device and one synchronization per mask tensor: the lengths slice the keys, so the
host needs them; a model passes one mask object to all its layers, and the result is kept for
it); :func:`run_per_sequence` runs the sequences one call each.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

# The shortest sequences (query rows) the per-sequence route takes on a GPU: each sequence is a
# call of its own, and below this its host time outweighs the mask path's extra work (H100,
# ``benchmarks/gpu_checks/padded_masks.py``, docs/benchmarks.md). On CPUs every length gains.
MIN_SEQ_CUDA = 1024

# The last mask looked at: (weak reference, version counter, data pointer, causal) -> its lengths
# (None: not a right-padded causal mask). A model's layers all pass the same mask object.
_last: tuple[weakref.ref, int, int, bool, list[int] | None] | None = None


def key_lengths(mask: torch.Tensor, batch: int, seq_q: int, seq_k: int,
                is_causal: bool) -> list[int] | None:  # fmt: skip
    """Each sequence's key count n_b when ``mask`` (with ``is_causal``: together with the causal
    mask) is a right-padded causal mask of shape (batch, 1, seq_q, seq_k), seq_q == seq_k: True
    exactly at keys j <= i with j < n_b, every n_b >= 1. None otherwise, for CUDA sequences
    shorter than MIN_SEQ_CUDA, and where the answer would need a synchronization that cannot
    happen (a CUDA graph being captured, a traced or compiled region)."""
    global _last
    if mask.is_cuda and seq_q < MIN_SEQ_CUDA:
        return None
    if (mask.dtype != torch.bool or mask.dim() != 4 or seq_q != seq_k
            or tuple(mask.shape) != (batch, 1, seq_q, seq_k) or seq_q == 0):  # fmt: skip
        return None
    if torch.compiler.is_compiling() or not _plain_tensor(mask):
        return None
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    last = _last
    if (last is not None and last[0]() is mask and last[1] == mask._version
            and last[2] == mask.data_ptr() and last[3] == is_causal):  # fmt: skip
        return last[4]
    lengths = _lengths(mask[:, 0], is_causal)
    _last = (weakref.ref(mask), mask._version, mask.data_ptr(), is_causal, lengths)
    return lengths


def _plain_tensor(t: torch.Tensor) -> bool:
    """A tensor with real values here (not a fake, functional or other subclass)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _lengths(mask: torch.Tensor, is_causal: bool) -> list[int] | None:
    """:func:`key_lengths` of a (batch, L, L) boolean mask, computed on its device."""
    seq = mask.shape[-1]
    rows = torch.arange(seq, device=mask.device)
    causal = rows[None, :] <= rows[:, None]  # key j <= query row i
    seen = mask & causal if is_causal else mask
    n = seen[:, -1, :].sum(-1)  # the last row sees every key the sequence has
    expected = causal[None] & (rows[None, None, :] < n[:, None, None])
    same = torch.all(seen == expected).view(1) & torch.all(n >= 1).view(1)
    found = torch.cat([same.long(), n.long()]).tolist()  # the one synchronization
    return found[1:] if found[0] else None


def run_per_sequence(call: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``call(q, k, v)`` -> ``(out, lse)``, a causal problem without a mask, on each sequence's
    query rows and first n_b keys; the outputs stacked along the batch (an unpadded batch: one
    call). Gradients flow through the slices and the stacking."""
    if all(n == key.shape[-2] for n in lengths):
        return call(query, key, value)
    outs, lses = [], []
    for b, n in enumerate(lengths):
        out, lse = call(query[b : b + 1], key[b : b + 1, :, :n], value[b : b + 1, :, :n])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
