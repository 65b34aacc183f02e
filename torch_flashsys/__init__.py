"""torch_flashsys: FlashAttention-2 in Triton, bucketed DDP and ZeRO-1/2 optimizer sharding.

Public API (everything else is private or a documented submodule):

- :func:`flash_attention` / :class:`FlashAttention`: fused attention (``torch_flashsys.attention``),
  with the drop-in helpers :func:`replace_attention` and :func:`sdpa_override`.
- :class:`BucketedDDP` / :class:`ShardedOptimizer`: data-parallel training
  (``torch_flashsys.distributed``).
"""

from torch_flashsys._version import __version__
from torch_flashsys.attention import (
    FlashAttention,
    disable_sdpa_override,
    enable_sdpa_override,
    flash_attention,
    replace_attention,
    sdpa_override,
)
from torch_flashsys.distributed import BucketedDDP, ShardedOptimizer

__all__ = [
    "BucketedDDP",
    "FlashAttention",
    "ShardedOptimizer",
    "__version__",
    "disable_sdpa_override",
    "enable_sdpa_override",
    "flash_attention",
    "replace_attention",
    "sdpa_override",
]
