"""ShardedOptimizer: ZeRO-1 optimizer-state sharding."""

from __future__ import annotations

from typing import Any

import torch


class ShardedOptimizer(torch.optim.Optimizer):
    """Not implemented yet: constructing one raises ``NotImplementedError``."""

    def __init__(self, params: Any, optimizer_cls: type, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "torch_flashsys.ShardedOptimizer is not implemented yet; use "
            "torch.distributed.optim.ZeroRedundancyOptimizer meanwhile"
        )
