"""Building blocks of the reference LM: RMSNorm, SwiGLU, rotary embeddings, causal attention."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from torch_flashsys.attention._kvcache import KVCache
from torch_flashsys.models._config import ATTENTION_CHOICES


def _init_linear(layer: nn.Linear, std: float = 0.02) -> None:
    nn.init.trunc_normal_(layer.weight, std=std, a=-3 * std, b=3 * std)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, computed in float32
    (float64 for float64 inputs).

    x: (..., d_model) -> (..., d_model), same dtype.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        x32 = x.to(acc)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(acc)).to(x.dtype)


class SwiGLU(nn.Module):
    """Gated feed-forward ``w2(silu(w1 x) * w3 x)``. x: (..., d_model) -> (..., d_model)."""

    def __init__(self, d_model: int, d_ff: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.w1 = nn.Linear(d_model, d_ff, **kw)
        self.w3 = nn.Linear(d_model, d_ff, **kw)
        self.w2 = nn.Linear(d_ff, d_model, **kw)
        for layer in (self.w1, self.w2, self.w3):
            _init_linear(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), half-split form: feature ``i`` pairs with ``i + dim/2``.

    x: (batch, heads, seq, head_dim) -> same shape; position ``p`` rotates pair ``i`` by
    ``p * theta ** (-2i / head_dim)``. The cos/sin tables are non-persistent buffers (not in the
    state dict) built in float32 for ``context_length`` positions.
    """

    def __init__(self, head_dim: int, context_length: int, theta: float = 10_000.0, *, device=None):
        super().__init__()
        # Angles in float64 (p * inv_freq loses digits in float32 at long contexts), tables float32.
        pos = torch.arange(context_length, device=device, dtype=torch.float64)
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device).double() / head_dim)
        angles = torch.outer(pos, inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # (context, head_dim/2)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(
        self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate ``x``'s positions ``offset .. offset + seq - 1`` (offset: generation with a cache),
        or ``positions`` ((seq,) or (batch, seq) int64: e.g. a context-parallel shard's global
        positions)."""
        if positions is None:
            seq = x.shape[-2]
            cos, sin = self.cos[offset : offset + seq], self.sin[offset : offset + seq]
        else:  # (seq, dim/2), or (batch, 1, seq, dim/2) to broadcast over the heads
            cos, sin = self.cos[positions], self.sin[positions]
            if positions.dim() == 2:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def _nvtx(name: str, enabled: bool) -> contextlib.AbstractContextManager:
    """An NVTX range on CUDA (visible in nsys), a no-op context elsewhere."""
    return torch.cuda.nvtx.range(name) if enabled else contextlib.nullcontext()


def naive_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + causal mask) v`` with the (seq, seq) scores materialised.

    q, k, v: (batch, heads, seq, head_dim) -> (batch, heads, seq, head_dim). On CUDA the three
    steps are NVTX ranges "attention/scores", "attention/softmax", "attention/final_matmul".
    """
    # No ranges while torch.compile traces: an NVTX context manager would break the graph.
    cuda = q.is_cuda and not torch.compiler.is_compiling()
    seq = q.shape[-2]
    with _nvtx("attention/scores", cuda):
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    with _nvtx("attention/softmax", cuda):
        probs = torch.softmax(scores, dim=-1)
    with _nvtx("attention/final_matmul", cuda):
        return probs @ v


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Key/value heads repeated for their query heads (grouped-query attention, naive path)."""
    group = q.shape[1] // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str, flash_backend: str = "auto"
) -> torch.Tensor:
    """Causal attention by ``impl`` ("naive" | "sdpa" | "flash"). q (B, H, L, D), k and v
    (B, H_kv, L, D) with H a multiple of H_kv (grouped-query attention) -> (B, H, L, D).

    Inside :func:`~torch_flashsys.distributed.context_parallel_sdpa` the sequence is sharded
    across ranks: "flash" then runs through its router (context-parallel attention on the
    router's backend; calling flash_attention here would attend to this rank's shard only), and
    "naive" raises."""
    gqa = k.shape[1] != q.shape[1]
    if impl != "sdpa":
        from torch_flashsys.distributed.context_parallel import context_parallel_active

        if context_parallel_active():
            if impl == "naive":
                raise NotImplementedError(
                    "causal_attention: attention='naive' inside context_parallel_sdpa would "
                    "attend to this rank's sequence shard only; build the model with "
                    "attention='flash' or 'sdpa'"
                )
            impl = "sdpa"  # the router: context-parallel attention over the whole sequence
    if impl == "flash":
        from torch_flashsys.attention import flash_attention

        return flash_attention(q, k, v, is_causal=True, enable_gqa=gqa, backend=flash_backend)
    if impl == "sdpa":
        # Looked up at call time, so torch_flashsys.sdpa_override() also reroutes this path.
        if gqa:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            )
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if impl == "naive":
        return naive_causal_attention(q, _expand_kv(q, k), _expand_kv(q, v))
    raise ValueError(f"causal_attention: impl must be one of {ATTENTION_CHOICES}, got {impl!r}")


def cached_causal_attention(
    q: torch.Tensor, cache: KVCache, impl: str, flash_backend: str = "auto"
) -> torch.Tensor:
    """The new queries (the cache's last positions) against everything cached, causally.

    "flash" reads the cache in place (``cache_seqlens``, the split-KV kernel on GPUs); "sdpa" and
    "naive" attend to the cache's valid prefix with a bottom-right causal mask.
    """
    if impl == "flash":
        from torch_flashsys.attention import flash_attention

        return flash_attention(
            q, cache.key, cache.value, is_causal=True, cache_seqlens=cache.seqlens,
            enable_gqa=cache.key.shape[1] != q.shape[1], backend=flash_backend,
        )  # fmt: skip
    n, total = q.shape[-2], cache.length
    k, v = _expand_kv(q, cache.key[:, :, :total]), _expand_kv(q, cache.value[:, :, :total])
    allowed = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    if impl == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    if impl == "naive":
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    raise ValueError(f"causal_attention: impl must be one of {ATTENTION_CHOICES}, got {impl!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on queries and keys, optionally grouped-query.

    x: (batch, seq, d_model) -> (batch, seq, d_model). Fused QKV projection ``qkv_proj``
    (d_model -> (num_heads + 2 num_kv_heads) head_dim: queries, then keys, then values; no bias)
    and output projection ``out_proj`` (no bias). ``rope`` is passed to ``forward`` so that all
    layers share the LM's tables.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        attention: str = "flash",
        flash_backend: str = "auto",
        num_kv_heads: int | None = None,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.attention = attention
        self.flash_backend = flash_backend
        kw = {"bias": False, "device": device, "dtype": dtype}
        width = (num_heads + 2 * self.num_kv_heads) * (d_model // num_heads)
        self.qkv_proj = nn.Linear(d_model, width, **kw)
        self.out_proj = nn.Linear(d_model, d_model, **kw)
        _init_linear(self.qkv_proj)
        _init_linear(self.out_proj)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``cache``: generation; x holds the positions after those cached, which it appends.
        ``positions``: the tokens' positions for RoPE (default ``arange(seq)``)."""
        b, seq, d_model = x.shape
        heads, kv, dim = self.num_heads, self.num_kv_heads, d_model // self.num_heads
        qkv = self.qkv_proj(x).view(b, seq, heads + 2 * kv, dim).transpose(1, 2)
        q, k, v = qkv.split([heads, kv, kv], dim=1)  # (b, heads or kv heads, seq, head_dim)
        offset = 0 if cache is None else cache.length
        q, k = rope(q, offset, positions), rope(k, offset, positions)
        if cache is None:
            out = causal_attention(q, k, v, self.attention, self.flash_backend)
        else:
            cache.append(k, v)
            out = cached_causal_attention(q, cache, self.attention, self.flash_backend)
        return self.out_proj(out.transpose(1, 2).reshape(b, seq, d_model))
