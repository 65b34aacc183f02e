"""Fused attention: :func:`flash_attention` (FlashAttention-2) and the :class:`FlashAttention` module."""

from torch_flashsys.attention._dropin import (
    disable_sdpa_override,
    enable_sdpa_override,
    replace_attention,
    sdpa_override,
)
from torch_flashsys.attention._kvcache import KVCache
from torch_flashsys.attention.functional import flash_attention
from torch_flashsys.attention.module import FlashAttention

__all__ = [
    "FlashAttention",
    "KVCache",
    "disable_sdpa_override",
    "enable_sdpa_override",
    "flash_attention",
    "replace_attention",
    "sdpa_override",
]
