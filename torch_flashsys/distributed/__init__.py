"""Data-parallel training: :class:`BucketedDDP` and :class:`ShardedOptimizer`."""

from torch_flashsys.distributed.ddp import BucketedDDP
from torch_flashsys.distributed.sharded_optimizer import ShardedOptimizer

__all__ = ["BucketedDDP", "ShardedOptimizer"]
