"""torch_flashsys: FlashAttention-2 in Triton, bucketed DDP and ZeRO-1 optimizer sharding.

Public API (everything else is private or a documented submodule):

- :func:`flash_attention` / :class:`FlashAttention`: fused attention (``torch_flashsys.attention``).
- :class:`BucketedDDP` / :class:`ShardedOptimizer`: data-parallel training
  (``torch_flashsys.distributed``).
"""

from torch_flashsys._version import __version__
from torch_flashsys.attention import FlashAttention, flash_attention
from torch_flashsys.distributed import BucketedDDP, ShardedOptimizer

__all__ = ["BucketedDDP", "FlashAttention", "ShardedOptimizer", "__version__", "flash_attention"]
