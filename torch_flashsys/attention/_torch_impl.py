"""Pure-PyTorch tiled FlashAttention-2: runs on any device; the reference for the Triton kernels.

Same numerics as the kernels: scores and accumulators in float32 (float64 for float64 inputs), P
cast to V's dtype before the second matmul, online softmax over key tiles (FA2 Algorithm 1) and a
backward pass that recomputes P from the saved logsumexp with ``D = rowsum(dO * O)`` (FA2
Algorithm 2, eqs. 13-19). Memory is linear in the sequence length: one (BLOCK_M, BLOCK_N) score
tile per (batch, head) at a time. The score modifications of ``_extras`` (masks, windows,
soft-capping, ALiBi, dropout) are applied per tile exactly as the kernels apply them, with the
same dropout random numbers (``_dropout``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from torch_flashsys.attention._dropout import keep_scale, keep_threshold, keep_tile
from torch_flashsys.attention._extras import PLAIN, Extras
from torch_flashsys.attention._tensors import empty_like_layout

BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # key rows per tile


def _grouped(t: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """View (..., H, L, E) as (B, Hkv, G, L, E): query heads grouped by the key/value head they use."""
    t4 = t.unsqueeze(0) if t.dim() == 3 else t
    return t4.unflatten(1, (n_kv_heads, t4.shape[1] // n_kv_heads if n_kv_heads else 1))


def _kv(t: torch.Tensor) -> torch.Tensor:
    """View key/value (..., Hkv, S, E) as (B, Hkv, 1, S, E), broadcasting over the query group."""
    return (t.unsqueeze(0) if t.dim() == 3 else t).unsqueeze(2)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _Tiles:
    """Per-tile score rule for one problem: scores -> modified scores, keep mask, dropout."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        scale: float,
        ex: Extras,
        bh_base: int = 0,
        shift: int = 0,
    ) -> None:
        self.shift = shift  # query row i sits at position i + shift (KV cache: bottom-right)
        self.ex, self.scale = ex, scale
        self.n_kv = k.shape[-3]
        q4 = q.unsqueeze(0) if q.dim() == 3 else q
        self.batch, self.heads, self.seq_q = q4.shape[0], q4.shape[1], q4.shape[2]
        self.seq_k = k.shape[-2]
        self.device = q.device
        group = self.heads // self.n_kv if self.n_kv else 1  # no heads: nothing to group
        # (B, Hkv, G, 1, 1) index of each query head, for dropout counters and ALiBi slopes
        self.bh = bh_base + torch.arange(self.batch * self.heads, device=q.device).view(
            self.batch, self.n_kv, group, 1, 1
        )
        self.mask = None if ex.mask is None else ex.mask.unflatten(1, (self.n_kv, group))
        self.slopes = None
        if ex.alibi is not None:
            self.slopes = ex.alibi.unflatten(1, (self.n_kv, group))[..., None, None]
        self.seed = ex.seed[0] if ex.seed is not None else 0  # a tensor: no sync, no graph break
        self.threshold = keep_threshold(ex.dropout_p)
        self.inv_keep = keep_scale(ex.dropout_p)

    def key_range(self, i0: int, rows: int) -> tuple[int, int]:
        """Keys [lo, hi) that some query row in [i0, i0 + rows) may attend."""
        p0 = i0 + self.shift
        lo = max(0, p0 - self.ex.left) if self.ex.left >= 0 else 0
        hi = min(self.seq_k, p0 + rows + self.ex.right) if self.ex.right >= 0 else self.seq_k
        return lo, hi

    def scores(self, qk: torch.Tensor, i0: int, j0: int):
        """Raw ``q.k`` tile -> (modified scores with -inf where not allowed, tanh for softcap)."""
        rows, cols = qk.shape[-2:]
        ex = self.ex
        s = qk * self.scale
        t = None
        if ex.softcap > 0:
            t = torch.tanh(s / ex.softcap)
            s = ex.softcap * t
        i = self.shift + torch.arange(i0, i0 + rows, device=self.device)[:, None]
        j = torch.arange(j0, j0 + cols, device=self.device)[None, :]
        if self.slopes is not None:
            s = s - self.slopes * (i - j).abs().to(s.dtype)
        keep = None
        if ex.left >= 0:
            keep = j >= i - ex.left
        if ex.right >= 0:
            right = j <= i + ex.right
            keep = right if keep is None else keep & right
        if self.mask is not None:
            m = self.mask[..., i0 : i0 + rows, j0 : j0 + cols]
            if m.dtype == torch.bool:
                keep = m if keep is None else keep & m
            else:
                s = s + m.to(s.dtype)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        return s, t

    def dropout(self, p: torch.Tensor, i0: int, j0: int) -> torch.Tensor:
        """P with dropped elements zeroed (not rescaled: the caller folds in 1 / (1 - p))."""
        if not self.ex.dropout_p:
            return p
        rows, cols = p.shape[-2:]
        i = torch.arange(i0, i0 + rows, device=self.device)[:, None]
        j = torch.arange(j0, j0 + cols, device=self.device)[None, :]
        keep = keep_tile(self.seed, self.bh, i, j, self.threshold)
        return p * keep


def _sequences(ex: Extras, heads: int):
    """A packed batch, one sequence at a time: (query rows, key rows, that sequence's Extras, its
    first dropout-counter head ``b * heads``)."""
    cu_q, cu_k = ex.cu_q.tolist(), ex.cu_k.tolist()
    for b in range(len(cu_q) - 1):
        alibi = None if ex.alibi is None else ex.alibi[b : b + 1]
        sub = dataclasses.replace(ex, alibi=alibi, cu_q=None, cu_k=None)
        yield slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]), sub, b * heads


def tiled_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    ex: Extras = PLAIN,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    bh_base: int = 0,
    shift: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out`` (q's shape with v's head dim, q's layout) and ``lse`` of shape
    ``q.shape[:-1]`` (float32; float64 for float64 inputs). A packed batch (``ex.varlen``: 4-D
    views (1, heads, total, dim)) and a KV cache (``ex.seqused_k``) are computed one sequence at
    a time."""
    if ex.seqused_k is not None:
        out = empty_like_layout(q, v.shape[-1])
        lse = torch.empty(q.shape[:-1], device=q.device, dtype=_acc_dtype(q))
        heads, seq_q = q.shape[1], q.shape[2]
        for b, used in enumerate(ex.seqused_k.tolist()):
            sub = dataclasses.replace(
                ex, seqused_k=None,
                mask=None if ex.mask is None else ex.mask[b : b + 1, ..., :used],
                alibi=None if ex.alibi is None else ex.alibi[b : b + 1],
            )  # fmt: skip
            o, l = tiled_forward(
                q[b : b + 1], k[b : b + 1, :, :used], v[b : b + 1, :, :used], scale, sub,
                bh_base=b * heads, shift=used - seq_q,
            )  # fmt: skip
            out[b : b + 1], lse[b : b + 1] = o, l
        return out, lse
    if ex.varlen:
        out = empty_like_layout(q, v.shape[-1])
        lse = torch.empty(q.shape[:-1], device=q.device, dtype=_acc_dtype(q))
        for rq, rk, sub, base in _sequences(ex, q.shape[1]):
            o, l = tiled_forward(q[:, :, rq], k[:, :, rk], v[:, :, rk], scale, sub, bh_base=base)
            out[:, :, rq], lse[:, :, rq] = o, l
        return out, lse
    tiles = _Tiles(q, k, scale, ex, bh_base, shift)
    acc_t = _acc_dtype(q)
    n_kv, seq_q = k.shape[-3], q.shape[-2]
    out = empty_like_layout(q, v.shape[-1])
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=acc_t)
    qg, kg, vg = _grouped(q, n_kv), _kv(k), _kv(v)
    og, lseg = _grouped(out, n_kv), _grouped(lse.unsqueeze(-1), n_kv).squeeze(-1)
    for i0 in range(0, seq_q, block_m):
        qi = qg[..., i0 : i0 + block_m, :].to(acc_t)
        rows = qi.shape[-2]
        m = torch.full(qi.shape[:-1], float("-inf"), device=q.device, dtype=acc_t)
        l = torch.zeros(qi.shape[:-1], device=q.device, dtype=acc_t)
        acc = torch.zeros((*qi.shape[:-1], v.shape[-1]), device=q.device, dtype=acc_t)
        lo, hi = tiles.key_range(i0, rows)
        for j0 in range((lo // block_n) * block_n, hi, block_n):
            kj = kg[..., j0 : min(j0 + block_n, hi), :].to(acc_t)
            vj = vg[..., j0 : min(j0 + block_n, hi), :]
            s, _ = tiles.scores(qi @ kj.transpose(-1, -2), i0, j0)
            m_new = torch.maximum(m, s.amax(-1))
            m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with nothing yet
            p = torch.exp(s - m_use.unsqueeze(-1))
            alpha = torch.exp(m - m_use)
            l = l * alpha + p.sum(-1)
            p = tiles.dropout(p, i0, j0)
            acc = acc * alpha.unsqueeze(-1) + p.to(v.dtype).to(acc_t) @ vj.to(acc_t)
            m = m_new
        l_safe = l.masked_fill(l == 0, 1.0)  # a row that attends nothing: out 0, lse -inf
        if ex.dropout_p:
            acc = acc * tiles.inv_keep  # kept probabilities are scaled by 1 / (1 - p)
        og[..., i0 : i0 + rows, :] = (acc / l_safe.unsqueeze(-1)).to(q.dtype)
        lseg[..., i0 : i0 + rows] = m + torch.log(l)
    return out, lse


def tiled_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, scale: float, ex: Extras = PLAIN,
    block_m: int = BLOCK_M, block_n: int = BLOCK_N, bh_base: int = 0, recorded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns ``(dq, dk, dv)``; dk/dv summed over the query heads of each GQA group.

    ``recorded``: autograd records these ops for a second backward (``out`` and ``lse`` the
    forward's over the same keys). The values are the same; the recorded gradients stay in the
    accumulation dtype up to q, k, v and dout (each cast once) and reach them through this
    call's own score tiles (:func:`_recorded_rows`), not through ``out`` and ``lse``."""
    if ex.varlen:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rq, rk, sub, base in _sequences(ex, q.shape[1]):
            d = None if dlse is None else dlse[:, :, rq]
            dq[:, :, rq], dk[:, :, rk], dv[:, :, rk] = tiled_backward(
                dout[:, :, rq], q[:, :, rq], k[:, :, rk], v[:, :, rk], out[:, :, rq],
                lse[:, :, rq], d, scale, sub, bh_base=base, recorded=recorded,
            )  # fmt: skip
        return dq, dk, dv
    tiles = _Tiles(q, k, scale, ex, bh_base)
    acc_t = _acc_dtype(q)
    n_kv = k.shape[-3]
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    ins = (q, k, v, dout)
    if recorded:  # out, lse and D as values: _recorded_rows gives lse and D their gradients
        out, lse = out.detach(), lse.detach()
        # cast once: a second backward sums each input's gradient terms (in a penalty large
        # ones that cancel) in acc_t, not tile by tile in the input's dtype
        ins = tuple(t.to(acc_t) for t in ins)
    delta = ((dout.detach() if recorded else dout).to(acc_t) * out.to(acc_t)).sum(-1)  # D
    if dlse is not None:
        delta = delta - dlse.to(acc_t)  # d lse / d S = P, folded into D
    qg, kg, vg, dog = _grouped(ins[0], n_kv), _kv(ins[1]), _kv(ins[2]), _grouped(ins[3], n_kv)
    # A row that attended nothing has lse = -inf: +inf makes its recomputed P zero.
    lse_safe = lse.masked_fill(lse == float("-inf"), float("inf"))
    lseg = _grouped(lse_safe.unsqueeze(-1), n_kv).squeeze(-1)
    deltag = _grouped(delta.unsqueeze(-1), n_kv).squeeze(-1)
    terms = {}  # recorded: each tile's (tanh, P, dP), made by _recorded_rows
    if recorded:
        lseg, deltag, terms = _recorded_rows(tiles, qg, dog, kg, vg, lseg, deltag, block_m, block_n)
    # Sums out of place, joined at the end: under vmap (vmap over grad) a term is batched even
    # where a buffer made from an unmapped input would not be (no in-place write into one).
    dq_rows: dict[int, torch.Tensor] = {}
    dk_tiles, dv_tiles = [], []
    for j0 in range(0, seq_k, block_n):
        kj = kg[..., j0 : j0 + block_n, :].to(acc_t)
        vj = vg[..., j0 : j0 + block_n, :].to(acc_t)
        dkj, dvj = _zeros(kj.select(2, 0)), _zeros(vj.select(2, 0))
        for i0 in _query_tiles(ex, j0, kj.shape[-2], seq_q, block_m):
            qi = qg[..., i0 : i0 + block_m, :].to(acc_t)
            doi = dog[..., i0 : i0 + block_m, :].to(acc_t)
            rows = qi.shape[-2]
            if recorded:
                t, p, dp = terms[i0, j0]
            else:
                s, t = tiles.scores(qi @ kj.transpose(-1, -2), i0, j0)
                p = torch.exp(s - lseg[..., i0 : i0 + rows, None])
                dp = _dp(tiles, doi, vj, i0, j0)
            pd = tiles.dropout(p, i0, j0) * tiles.inv_keep if ex.dropout_p else p
            dvj = dvj + (pd.to(v.dtype).to(acc_t).transpose(-1, -2) @ doi).sum(2)
            ds = p * (dp - deltag[..., i0 : i0 + rows, None])
            if t is not None:
                ds = ds * (1 - t * t)  # through softcap * tanh(s / softcap)
            ds = ds.to(q.dtype).to(acc_t)
            dq_i = ds @ kj
            dq_rows[i0] = dq_i if i0 not in dq_rows else dq_rows[i0] + dq_i
            dkj = dkj + (ds.transpose(-1, -2) @ qi).sum(2)
        dk_tiles.append(dkj * scale)
        dv_tiles.append(dvj)
    dq = _joined([dq_rows[i0] if i0 in dq_rows else _zeros(qg[..., i0 : i0 + block_m, :], acc_t)
                  for i0 in range(0, seq_q, block_m)], qg, acc_t)  # fmt: skip
    dk = _joined(dk_tiles, k, acc_t)
    dv = _joined(dv_tiles, v, acc_t)
    dq = (dq * scale).flatten(1, 2).reshape(q.shape).to(q.dtype)
    return dq, dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype)


def _query_tiles(ex: Extras, j0: int, cols: int, seq_q: int, block_m: int) -> range:
    """Starts of the query tiles that may attend a key of the tile ``[j0, j0 + cols)``."""
    lo = max(0, j0 - ex.right) if ex.right >= 0 else 0
    hi = min(seq_q, j0 + cols + ex.left) if ex.left >= 0 else seq_q
    return range((lo // block_m) * block_m, hi, block_m)


def _dp(tiles: _Tiles, doi: torch.Tensor, vj: torch.Tensor, i0: int, j0: int) -> torch.Tensor:
    """``dP = dO V^T`` of one tile, dropped and rescaled as P was (float ``doi``, ``vj``)."""
    dp = doi @ vj.transpose(-1, -2)
    return tiles.dropout(dp, i0, j0) * tiles.inv_keep if tiles.ex.dropout_p else dp


def _recorded_rows(tiles: _Tiles, qg, dog, kg, vg, lseg, deltag, block_m: int, block_n: int):
    """``(lse rows, D rows, {(i0, j0): (tanh, P, dP)})``: the saved lse and D (grouped) plus
    zero-valued terms that give them their gradients, of every order, through the score tiles in
    the accumulation dtype (lse as ``logsumexp(S)``, D as ``rowsum(P * dP)``), and each tile's
    terms made from them. Through the saved ``out`` and ``lse`` those gradients would reach q, k,
    v by the forward's own backward, in the inputs' dtype (float16: out's gradient and that
    backward's dS rounded to float16) while the terms they cancel stay float32 here: with one
    key (P = 1) a penalty's dk came out 0.0165 off float64, PyTorch's own float16 error 0.0029."""
    acc_t, ex = _acc_dtype(qg), tiles.ex
    seq_q, seq_k = qg.shape[-2], kg.shape[-2]
    pairs = [(i0, j0) for j0 in range(0, seq_k, block_n)
             for i0 in _query_tiles(ex, j0, min(block_n, seq_k - j0), seq_q, block_m)]  # fmt: skip
    scores, sums, deltas, terms = {}, {}, {}, {}
    for i0, j0 in pairs:  # sums[i0] = rowsum(exp(S - lse)): 1 up to rounding
        qi = qg[..., i0 : i0 + block_m, :].to(acc_t)
        s, t = tiles.scores(qi @ kg[..., j0 : j0 + block_n, :].to(acc_t).transpose(-1, -2), i0, j0)
        term = torch.exp(s - lseg[..., i0 : i0 + qi.shape[-2], None]).sum(-1)
        scores[i0, j0] = s, t
        sums[i0] = term if i0 not in sums else sums[i0] + term
    logs = {}
    for i0, total in sums.items():  # a row with no key: total 0, no term
        log = torch.log(total.masked_fill(total.detach() == 0, 1.0))
        logs[i0] = log - log.detach()
    lse_rows = _rows(lseg, logs, block_m)
    for i0, j0 in pairs:
        s, t = scores[i0, j0]
        p = torch.exp(s - lse_rows[..., i0 : i0 + s.shape[-2], None])
        doi = dog[..., i0 : i0 + block_m, :].to(acc_t)
        dp = _dp(tiles, doi, vg[..., j0 : j0 + block_n, :].to(acc_t), i0, j0)
        terms[i0, j0] = t, p, dp
        term = (p * dp - (p * dp).detach()).sum(-1)
        deltas[i0] = term if i0 not in deltas else deltas[i0] + term
    return lse_rows, _rows(deltag, deltas, block_m), terms


def _rows(base: torch.Tensor, terms: dict[int, torch.Tensor], block_m: int) -> torch.Tensor:
    """``base`` (..., L) plus each query tile's ``terms[i0]`` (none: nothing), out of place."""
    parts = [base[..., i0 : i0 + block_m] + terms[i0] if i0 in terms else
             base[..., i0 : i0 + block_m] for i0 in range(0, base.shape[-1], block_m)]  # fmt: skip
    return torch.cat(parts, dim=-1) if parts else base


def _joined(tiles: list[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Tiles' gradients (query rows or key tiles) joined along the sequence; zeros of ``like``'s
    shape for none (an empty sequence)."""
    return torch.cat(tiles, dim=-2) if tiles else _zeros(like, dtype)


def _zeros(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Contiguous zeros of ``like``'s shape, taken from the tensor, not from its sizes as ints:
    in Dynamo's backward graph of the Function a head-dim size passed as an int is read from the
    incoming gradient's stride (``sym_stride(dout, 2)``, a PyTorch bug), which is not the head
    dim when the gradient arrives in another layout (expanded, or the output's (B, L, H, E))."""
    return torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off for ``device`` (where autocast exists for it)."""
    if device.type in ("cpu", "cuda", "xpu", "mps"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def forward(q, k, v, scale: float, ex: Extras):
    """:func:`tiled_forward` with autocast off: the float32 score/accumulator matmuls must stay
    float32 (the caller already cast the inputs to the autocast dtype)."""
    with _no_autocast(q.device):
        return tiled_forward(q, k, v, scale, ex)


def differentiable_backward(dout, q, k, v, out, lse, dlse, scale: float, ex: Extras):
    """``(dq, dk, dv)`` through differentiable PyTorch ops, autocast off: under
    ``create_graph=True`` they record a graph, so a second backward (a gradient penalty) is exact.
    ``out`` and ``lse`` (the forward's saved outputs) enter that graph as values only: it reaches
    q, k, v through its own score tiles in float32 (``recorded``), not through the forward's
    node."""
    with _no_autocast(q.device):
        return tiled_backward(dout, q, k, v, out, lse, dlse, scale, ex,
                              recorded=torch.is_grad_enabled())  # fmt: skip
