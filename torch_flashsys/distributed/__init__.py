"""Data-parallel training (:class:`BucketedDDP`, :class:`ShardedOptimizer`) and context parallelism
(the :mod:`~torch_flashsys.distributed.context_parallel` submodule, re-exported here)."""

from torch_flashsys.distributed.context_parallel import (
    context_parallel_attention,
    context_parallel_sdpa,
    gather_sequence,
    shard_position_ids,
    shard_sequence,
)
from torch_flashsys.distributed.ddp import BucketedDDP
from torch_flashsys.distributed.sharded_optimizer import ShardedOptimizer

__all__ = [
    "BucketedDDP",
    "ShardedOptimizer",
    "context_parallel_attention",
    "context_parallel_sdpa",
    "gather_sequence",
    "shard_position_ids",
    "shard_sequence",
]
