"""FlashAttention nn.Module (not implemented yet)."""

from __future__ import annotations

from typing import Any

import torch


class FlashAttention(torch.nn.Module):
    """Not implemented yet: constructing one raises ``NotImplementedError``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "torch_flashsys.FlashAttention is not implemented yet; call "
            "torch_flashsys.flash_attention inside your own module meanwhile"
        )
