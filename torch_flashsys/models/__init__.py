"""The reference Transformer language model used by the demo and the benchmarks.

A decoder-only LM (pre-norm, RMSNorm, SwiGLU, RoPE, causal attention) whose attention is
selectable as ``"naive"`` (explicit scores/softmax/matmul), ``"sdpa"``
(``torch.nn.functional.scaled_dot_product_attention``) or ``"flash"``
(:func:`torch_flashsys.flash_attention`), in the sizes of :data:`MODEL_SIZES`.

Example:
    >>> from torch_flashsys.models import build_model
    >>> model = build_model("tiny", context_length=32, vocab_size=100, attention="sdpa")
    >>> model(torch.randint(0, 100, (4, 32))).shape
    torch.Size([4, 32, 100])
"""

from torch_flashsys.models._config import ATTENTION_CHOICES, MODEL_SIZES, ModelConfig
from torch_flashsys.models._lm import TransformerLM, build_model

__all__ = ["ATTENTION_CHOICES", "MODEL_SIZES", "ModelConfig", "TransformerLM", "build_model"]
