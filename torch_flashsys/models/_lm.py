"""TransformerLM: the decoder-only reference language model, and build_model."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

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
            config.d_model, config.num_heads, config.attention, config.flash_backend,
            config.kv_heads, **kw,
        )  # fmt: skip
        self.norm2 = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.ffn = SwiGLU(config.d_model, config.d_ff, **kw)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, *state) -> torch.Tensor:
        """``state``: (cache, positions) as :meth:`CausalSelfAttention.forward` takes them."""
        x = x + self.attn(self.norm1(x), rope, *state)
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

    def forward(
        self,
        tokens: torch.Tensor,
        caches: list[KVCache] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``caches`` (one per layer, :meth:`new_caches`): generation; ``tokens`` are the positions
        after those cached, and their keys/values are appended. ``position_ids``: (seq,) or
        (batch, seq) int64 positions for RoPE, each ``< context_length`` (default ``arange(seq)``;
        under context parallelism pass :func:`~torch_flashsys.distributed.shard_position_ids`)."""
        return self.lm_head(self.final_norm(self._trunk(tokens, caches, position_ids)))

    def loss(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        chunk_size: int | None = None,
        reduction: str = "mean",
        ignore_index: int = -100,
    ) -> torch.Tensor:
        """Cross-entropy of the next-token logits against ``targets`` (batch, seq) int64, as
        ``F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten(), ...)``.

        ``chunk_size``: compute the logits ``chunk_size`` positions at a time, each chunk's
        logits recomputed in the backward (checkpointed), so the (batch, seq, vocab) logits never
        exist at once: at long contexts they outgrow the whole model's activations.
        ``reduction``: ``"mean"`` (over targets that are not ``ignore_index``) or ``"sum"``.
        """
        if reduction not in ("mean", "sum"):
            raise ValueError(
                f"TransformerLM.loss: reduction must be 'mean' or 'sum', got {reduction!r}"
            )
        if targets.shape != tokens.shape:
            raise ValueError(
                f"TransformerLM.loss: targets must have the shape of tokens "
                f"{tuple(tokens.shape)}, got {tuple(targets.shape)}"
            )
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(
                f"TransformerLM.loss: chunk_size must be a positive int or None, got {chunk_size!r}"
            )
        hidden = self.final_norm(self._trunk(tokens, None, position_ids))
        step = chunk_size or tokens.shape[1]
        total = hidden.new_zeros((), dtype=torch.float32 if hidden.dtype != torch.float64 else None)
        for i in range(0, tokens.shape[1], step):
            args = (hidden[:, i : i + step], targets[:, i : i + step], self.lm_head.weight)
            if chunk_size is not None and torch.is_grad_enabled():
                part = checkpoint(_chunk_loss, *args, ignore_index, use_reentrant=False)
            else:
                part = _chunk_loss(*args, ignore_index)
            total = total + part
        if reduction == "sum":
            return total
        return total / (targets != ignore_index).sum()

    def _trunk(self, tokens, caches, position_ids) -> torch.Tensor:
        """Embeddings and blocks: the hidden states before the final norm."""
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
        if position_ids is not None and position_ids.shape[-1] != tokens.shape[1]:
            raise ValueError(
                f"TransformerLM.forward: position_ids must be (seq,) or (batch, seq) with seq = "
                f"{tokens.shape[1]}, got shape {tuple(position_ids.shape)}"
            )
        x = self.token_embeddings(tokens)
        recompute = self.config.activation_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if recompute and caches is None:
                x = checkpoint(layer, x, self.rope, None, position_ids, use_reentrant=False,
                               context_fn=_recompute_with_this_sdpa)  # fmt: skip
            else:
                x = layer(x, self.rope, None if caches is None else caches[i], position_ids)
        return x

    def new_caches(self, batch: int, capacity: int | None = None) -> list[KVCache]:
        """Empty per-layer KV caches for generation (capacity: the context length by default),
        on the model's device and dtype."""
        c = self.config
        w = self.lm_head.weight
        capacity = c.context_length if capacity is None else capacity
        return [
            KVCache(batch, c.kv_heads, capacity, c.head_dim, device=w.device, dtype=w.dtype)
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


def _recompute_with_this_sdpa():
    """Checkpoint contexts: the recomputation in the backward calls the
    ``F.scaled_dot_product_attention`` this forward called (an ``sdpa_override`` or
    ``context_parallel_sdpa`` block may have ended before the backward; recomputing with another
    attention would give wrong gradients, e.g. local-only attention under context parallelism)."""
    return contextlib.nullcontext(), _sdpa_set_to(F.scaled_dot_product_attention)


@contextlib.contextmanager
def _sdpa_set_to(fn):
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fn
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous


def _chunk_loss(hidden, targets, weight, ignore_index: int) -> torch.Tensor:
    """Summed cross-entropy of one chunk; the logits in float32 (float64 for float64 weights)."""
    logits = F.linear(hidden, weight)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )


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
    activation_checkpointing: bool = False,
    num_kv_heads: int | None = None,
) -> TransformerLM:
    """A :class:`TransformerLM` of a named size (a key of :data:`MODEL_SIZES`); ``num_kv_heads``
    overrides the size's key/value heads (grouped-query attention) when given.

    Example:
        >>> model = build_model("tiny", context_length=64, attention="naive", vocab_size=128)
        >>> model(torch.zeros(1, 64, dtype=torch.long)).shape
        torch.Size([1, 64, 128])
    """
    kv = {} if num_kv_heads is None else {"num_kv_heads": num_kv_heads}
    config = ModelConfig.from_size(
        size, context_length=context_length, attention=attention, vocab_size=vocab_size,
        activation_checkpointing=activation_checkpointing, **kv,
    )  # fmt: skip
    return TransformerLM(config, device=device, dtype=dtype)
