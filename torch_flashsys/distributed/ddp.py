"""BucketedDDP: data parallelism with bucketed, overlapped gradient all-reduce."""

from __future__ import annotations

from typing import Any

import torch


class BucketedDDP(torch.nn.Module):
    """Not implemented yet: constructing one raises ``NotImplementedError``."""

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "torch_flashsys.BucketedDDP is not implemented yet; use "
            "torch.nn.parallel.DistributedDataParallel meanwhile"
        )
