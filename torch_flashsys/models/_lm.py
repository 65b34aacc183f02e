"""TransformerLM: the decoder-only reference language model, and build_model."""

from __future__ import annotations

import torch
from torch import nn

from torch_flashsys.attention._kvcache import KVCache
from torch_flashsys.models._config import ATTENTION_CHOICES, ModelConfig
from torch_flashsys.models._layers import (
    CausalSelfAttention,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    _init_linear,
)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))`` then ``x + ffn(norm2(x))``. (B, L, D) -> same."""

    def __init__(self, config: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.norm1 = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.attn = CausalSelfAttention(
            config.d_model, config.num_heads, config.attention, config.flash_backend, **kw
        )
        self.norm2 = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.ffn = SwiGLU(config.d_model, config.d_ff, **kw)

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding, cache: KVCache | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cache)
        return x + self.ffn(self.norm2(x))


class TransformerLM(nn.Module):
    """Decoder-only Transformer language model: pre-norm, RMSNorm, SwiGLU, RoPE, causal attention.

    tokens: (batch, seq) int64 ids in ``[0, vocab_size)``, ``seq <= context_length``
    -> logits: (batch, seq, vocab_size), the model's dtype.

    Layout: ``token_embeddings`` -> ``layers`` (``num_layers`` x :class:`TransformerBlock`) ->
    ``final_norm`` -> ``lm_head`` (untied). The attention implementation ("naive", "sdpa",
    "flash") changes only how attention is computed, never the parameters, so one state dict
    serves all three; switch with :meth:`set_attention`.

    Example:
        >>> model = TransformerLM(ModelConfig.from_size("tiny", vocab_size=100, attention="sdpa"))
        >>> model(torch.randint(0, 100, (2, 16))).shape
        torch.Size([2, 16, 100])
    """

    def __init__(self, config: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(
                f"TransformerLM: config must be a ModelConfig, got {type(config).__name__}"
            )
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.token_embeddings = nn.Embedding(config.vocab_size, config.d_model, **kw)
        nn.init.trunc_normal_(self.token_embeddings.weight, std=0.02, a=-0.06, b=0.06)
        self.rope = RotaryEmbedding(
            config.head_dim, config.context_length, config.rope_theta, device=device
        )
        self.layers = nn.ModuleList(
            TransformerBlock(config, **kw) for _ in range(config.num_layers)
        )
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, **kw)
        _init_linear(self.lm_head)

    @property
    def attention(self) -> str:
        """The attention implementation in use: "naive", "sdpa" or "flash"."""
        return self.layers[0].attn.attention if len(self.layers) else self.config.attention

    def set_attention(self, attention: str, *, flash_backend: str | None = None) -> None:
        """Switch every layer to another attention implementation (parameters are unchanged)."""
        if attention not in ATTENTION_CHOICES:
            raise ValueError(
                f"TransformerLM.set_attention: attention must be one of {ATTENTION_CHOICES}, "
                f"got {attention!r}"
            )
        for layer in self.layers:
            layer.attn.attention = attention
            if flash_backend is not None:
                layer.attn.flash_backend = flash_backend

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Number of parameters (optionally without the token embedding table)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.token_embeddings.weight.numel() if exclude_embeddings else n

    def forward(self, tokens: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """``caches`` (one per layer, :meth:`new_caches`): generation; ``tokens`` are the positions
        after those cached, and their keys/values are appended."""
        if tokens.dim() != 2:
            raise ValueError(
                f"TransformerLM.forward: tokens must be 2-D (batch, seq), got shape "
                f"{tuple(tokens.shape)}"
            )
        cached = 0 if caches is None else caches[0].length if caches else 0
        if cached + tokens.shape[1] > self.config.context_length:
            raise ValueError(
                f"TransformerLM.forward: sequence length {cached + tokens.shape[1]} exceeds "
                f"context_length {self.config.context_length}"
            )
        if caches is not None and len(caches) != len(self.layers):
            raise ValueError(
                f"TransformerLM.forward: caches must hold one KVCache per layer "
                f"({len(self.layers)}), got {len(caches)}"
            )
        x = self.token_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, self.rope, None if caches is None else caches[i])
        return self.lm_head(self.final_norm(x))

    def new_caches(self, batch: int, capacity: int | None = None) -> list[KVCache]:
        """Empty per-layer KV caches for generation (capacity: the context length by default),
        on the model's device and dtype."""
        c = self.config
        w = self.lm_head.weight
        capacity = c.context_length if capacity is None else capacity
        return [
            KVCache(batch, c.num_heads, capacity, c.head_dim, device=w.device, dtype=w.dtype)
            for _ in self.layers
        ]

    @torch.no_grad()
    def generate(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        *,
        use_cache: bool = True,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue ``tokens`` (batch, seq) by ``max_new_tokens``: (batch, seq + max_new_tokens).

        Greedy (``temperature=0``) or sampled (softmax of logits / temperature, optionally the
        ``top_k`` most likely). ``use_cache``: run the prompt once and then one position per step
        against per-layer KV caches (the "flash" attention reads them in place with
        ``cache_seqlens``); ``False``: re-run the whole sequence every step (the reference).

        Example:
            >>> model = build_model("tiny", context_length=32, vocab_size=50, attention="flash")
            >>> model.generate(torch.zeros(2, 4, dtype=torch.long), 6).shape
            torch.Size([2, 10])
        """
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0
        ):
            raise ValueError(
                f"TransformerLM.generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}"
            )
        total = tokens.shape[1] + max_new_tokens
        if total > self.config.context_length:
            raise ValueError(
                f"TransformerLM.generate: {tokens.shape[1]} + {max_new_tokens} tokens exceed "
                f"context_length {self.config.context_length}"
            )
        out = tokens
        caches = self.new_caches(tokens.shape[0], total) if use_cache else None
        step_input = tokens
        for _ in range(max_new_tokens):
            logits = self(step_input if use_cache else out, caches)[:, -1].float()
            nxt = _sample(logits, temperature, top_k, generator)
            out = torch.cat([out, nxt], dim=1)
            step_input = nxt
        return out


def _sample(logits, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """(batch, vocab) logits -> (batch, 1) next tokens."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


def build_model(
    size: str,
    *,
    context_length: int = 256,
    attention: str = "flash",
    vocab_size: int = 10_000,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> TransformerLM:
    """A :class:`TransformerLM` of a named size (a key of :data:`MODEL_SIZES`).

    Example:
        >>> model = build_model("tiny", context_length=64, attention="naive", vocab_size=128)
        >>> model(torch.zeros(1, 64, dtype=torch.long)).shape
        torch.Size([1, 64, 128])
    """
    config = ModelConfig.from_size(
        size, context_length=context_length, attention=attention, vocab_size=vocab_size
    )
    return TransformerLM(config, device=device, dtype=dtype)
