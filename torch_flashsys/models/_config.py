"""ModelConfig and the named model sizes (MODEL_SIZES) of the reference Transformer LM."""

from __future__ import annotations

import dataclasses

ATTENTION_CHOICES = ("naive", "sdpa", "flash")

# d_model / d_ff / num_layers / num_heads. "tiny" is for tests and the demo (fast on a CPU); the
# others are Table 1 of the seed project (head dims: 64 everywhere except 2.7B, which has 80).
# "2.0B" is "xl" under its parameter count (1,998M with the default vocabulary): the model of
# the DDP benchmark (benchmarks/ddp.py --preset 2.0B).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4},
    "small": {"d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12},
    "medium": {"d_model": 1024, "d_ff": 4096, "num_layers": 24, "num_heads": 16},
    "large": {"d_model": 1280, "d_ff": 5120, "num_layers": 36, "num_heads": 20},
    "xl": {"d_model": 1600, "d_ff": 6400, "num_layers": 48, "num_heads": 25},
    "2.7B": {"d_model": 2560, "d_ff": 10240, "num_layers": 32, "num_heads": 32},
    "2.0B": {"d_model": 1600, "d_ff": 6400, "num_layers": 48, "num_heads": 25},
    # LLaMA-3.2-1B-shaped: width, depth and FFN, 32 query heads of 64 sharing 8 key/value heads.
    "1B": {"d_model": 2048, "d_ff": 8192, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8},
    # LLaMA-3.2-3B-shaped: 24 query heads of 128 sharing 8 key/value heads (head dim 128).
    "3B": {"d_model": 3072, "d_ff": 8192, "num_layers": 28, "num_heads": 24, "num_kv_heads": 8},
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of :class:`~torch_flashsys.models.TransformerLM`.

    Attributes:
        d_model: width of the residual stream.
        d_ff: hidden width of the SwiGLU feed-forward block.
        num_layers: number of Transformer blocks.
        num_heads: attention heads; ``d_model`` must be a multiple of it and the head dim
            ``d_model // num_heads`` must be even (RoPE rotates pairs of features).
        num_kv_heads: key/value heads (grouped-query attention: each serves
            ``num_heads // num_kv_heads`` query heads); None: ``num_heads`` (multi-head).
        vocab_size: number of token ids (default 10,000).
        context_length: longest sequence the model accepts (RoPE tables are built for it).
        attention: ``"naive"`` (explicit scores/softmax/matmul, NVTX ranges on CUDA), ``"sdpa"``
            (``torch.nn.functional.scaled_dot_product_attention``) or ``"flash"``
            (:func:`torch_flashsys.flash_attention`). Always causal.
        flash_backend: the ``backend`` passed to ``flash_attention`` when ``attention="flash"``.
        rope_theta: RoPE base frequency.
        norm_eps: RMSNorm epsilon.
        activation_checkpointing: recompute each block's activations in the backward instead of
            storing them (``torch.utils.checkpoint``, non-reentrant) while training: only the
            blocks' inputs stay alive, at the cost of a second forward of every block.

    Example:
        >>> cfg = ModelConfig.from_size("small", context_length=512, attention="sdpa")
        >>> cfg.d_model, cfg.head_dim
        (768, 64)
    """

    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    vocab_size: int = 10_000
    context_length: int = 256
    attention: str = "flash"
    flash_backend: str = "auto"
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size", "context_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig: {name} must be a positive int, got {value!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise TypeError(
                f"ModelConfig: activation_checkpointing must be a bool, got "
                f"{self.activation_checkpointing!r}"
            )
        kv = self.num_kv_heads
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1
                               or self.num_heads % kv):  # fmt: skip
            raise ValueError(
                f"ModelConfig: num_kv_heads must be a positive int dividing num_heads "
                f"({self.num_heads}), got {kv!r}"
            )
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"ModelConfig: d_model ({self.d_model}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"ModelConfig: the head dim d_model // num_heads must be even for RoPE, got "
                f"{self.head_dim}"
            )
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(
                f"ModelConfig: attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or ``num_heads`` without grouped-query attention."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @classmethod
    def from_size(cls, size: str, **overrides: object) -> ModelConfig:
        """The config of a named size (a key of :data:`MODEL_SIZES`), with fields overridden."""
        if size not in MODEL_SIZES:
            raise ValueError(
                f"ModelConfig.from_size: size must be one of {list(MODEL_SIZES)}, got {size!r}"
            )
        return cls(**{**MODEL_SIZES[size], **overrides})  # type: ignore[arg-type]
