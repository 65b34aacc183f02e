"""Pure-PyTorch tiled FlashAttention-2: runs on any device; the reference for the Triton kernels.

Same numerics as the kernels: scores and accumulators in float32, P cast to V's dtype before the
second matmul, online softmax over key tiles (FA2 Algorithm 1) and a backward pass that recomputes
P from the saved logsumexp with ``D = rowsum(dO * O)`` (FA2 Algorithm 2, eqs. 13-19). Memory is
linear in the sequence length: one (BLOCK_M, BLOCK_N) score tile per (batch, head) at a time.
"""

from __future__ import annotations

import contextlib

import torch

BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # key rows per tile


def _grouped(t: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """View (..., H, L, E) as (B, Hkv, G, L, E): query heads grouped by the key/value head they use."""
    t4 = t.unsqueeze(0) if t.dim() == 3 else t
    return t4.unflatten(1, (n_kv_heads, t4.shape[1] // n_kv_heads))


def _kv(t: torch.Tensor) -> torch.Tensor:
    """View key/value (..., Hkv, S, E) as (B, Hkv, 1, S, E), broadcasting over the query group."""
    return (t.unsqueeze(0) if t.dim() == 3 else t).unsqueeze(2)


def _causal_mask(i0: int, rows: int, j0: int, cols: int, device: torch.device) -> torch.Tensor:
    """True where key j0+c lies after query i0+r (top-left aligned causal mask)."""
    r = torch.arange(i0, i0 + rows, device=device)[:, None]
    c = torch.arange(j0, j0 + cols, device=device)[None, :]
    return c > r


def tiled_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out`` (like q, same layout) and float32 ``lse`` of shape ``q.shape[:-1]``."""
    n_kv = k.shape[-3]
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    qg, kg, vg = _grouped(q, n_kv), _kv(k), _kv(v)
    og, lseg = _grouped(out, n_kv), _grouped(lse.unsqueeze(-1), n_kv).squeeze(-1)
    for i0 in range(0, seq_q, block_m):
        qi = qg[..., i0 : i0 + block_m, :].float()
        rows = qi.shape[-2]
        m = torch.full(qi.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros(qi.shape[:-1], device=q.device)
        acc = torch.zeros(qi.shape, device=q.device)
        hi = min(seq_k, i0 + rows) if is_causal else seq_k  # later keys are masked for every row
        for j0 in range(0, hi, block_n):
            kj = kg[..., j0 : j0 + block_n, :].float()
            vj = vg[..., j0 : j0 + block_n, :]
            s = (qi @ kj.transpose(-1, -2)) * scale
            if is_causal and j0 + kj.shape[-2] - 1 > i0:  # tile crosses the diagonal
                s = s.masked_fill(_causal_mask(i0, rows, j0, kj.shape[-2], q.device), float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))  # finite: key 0 is visible to every row
            p = torch.exp(s - m_new.unsqueeze(-1))
            alpha = torch.exp(m - m_new)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + p.to(v.dtype).float() @ vj.float()
            m = m_new
        og[..., i0 : i0 + rows, :] = (acc / l.unsqueeze(-1)).to(q.dtype)
        lseg[..., i0 : i0 + rows] = m + torch.log(l)
    return out, lse


def tiled_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq, dk, dv)``; dk/dv summed over the query heads of each GQA group."""
    n_kv = k.shape[-3]
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    delta = (dout.float() * out.float()).sum(-1)  # D = rowsum(dO * O)
    if dlse is not None:
        delta = delta - dlse.float()  # d lse / d S = P, folded into D
    qg, dog, kg, vg = _grouped(q, n_kv), _grouped(dout, n_kv), _kv(k), _kv(v)
    lseg = _grouped(lse.unsqueeze(-1), n_kv).squeeze(-1)
    deltag = _grouped(delta.unsqueeze(-1), n_kv).squeeze(-1)
    dq = torch.zeros(qg.shape, device=q.device)
    dk = torch.zeros(kg.shape, device=q.device).squeeze(2)
    dv = torch.zeros(vg.shape, device=q.device).squeeze(2)
    for j0 in range(0, seq_k, block_n):
        kj = kg[..., j0 : j0 + block_n, :].float()
        vj = vg[..., j0 : j0 + block_n, :].float()
        cols = kj.shape[-2]
        dkj = torch.zeros_like(dk[..., j0 : j0 + cols, :])
        dvj = torch.zeros_like(dkj)
        lo = (j0 // block_m) * block_m if is_causal else 0  # earlier queries see none of these keys
        for i0 in range(lo, seq_q, block_m):
            qi = qg[..., i0 : i0 + block_m, :].float()
            doi = dog[..., i0 : i0 + block_m, :].float()
            rows = qi.shape[-2]
            p = torch.exp((qi @ kj.transpose(-1, -2)) * scale - lseg[..., i0 : i0 + rows, None])
            if is_causal and j0 + cols - 1 > i0:
                p = p.masked_fill(_causal_mask(i0, rows, j0, cols, q.device), 0.0)
            dvj += (p.to(v.dtype).float().transpose(-1, -2) @ doi).sum(2)
            dp = doi @ vj.transpose(-1, -2)
            ds = (p * (dp - deltag[..., i0 : i0 + rows, None])).to(q.dtype).float()
            dq[..., i0 : i0 + rows, :] += ds @ kj
            dkj += (ds.transpose(-1, -2) @ qi).sum(2)
        dk[..., j0 : j0 + cols, :] = dkj * scale
        dv[..., j0 : j0 + cols, :] = dvj
    dq = (dq * scale).flatten(1, 2).view(q.shape).to(q.dtype)
    return dq, dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off for ``device`` (where autocast exists for it)."""
    if device.type in ("cpu", "cuda", "xpu", "mps"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class TiledAttention(torch.autograd.Function):
    """Autograd for the tiled path; saves q, k, v, out and lse (as the Triton op does).

    Autocast is off inside: the float32 score/accumulator matmuls must stay float32 (the caller
    already cast the inputs to the autocast dtype).
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool, scale: float):
        with _no_autocast(q.device):
            out, lse = tiled_forward(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        with _no_autocast(q.device):
            dq, dk, dv = tiled_backward(dout, q, k, v, out, lse, dlse, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None
