"""TransformerLM: the decoder-only reference language model, and build_model."""

from __future__ import annotations

import torch
from torch import nn

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

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(
                f"TransformerLM.forward: tokens must be 2-D (batch, seq), got shape "
                f"{tuple(tokens.shape)}"
            )
        if tokens.shape[1] > self.config.context_length:
            raise ValueError(
                f"TransformerLM.forward: sequence length {tokens.shape[1]} exceeds "
                f"context_length {self.config.context_length}"
            )
        x = self.token_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope)
        return self.lm_head(self.final_norm(x))


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
