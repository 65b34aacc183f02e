"""KVCache: a pre-allocated key/value cache for one attention layer, for generation."""

from __future__ import annotations

import torch

_NAME = "KVCache"


class KVCache:
    """Keys and values of the positions seen so far, written in place; no re-allocation per step.

    ``key``: ``(batch, kv_heads, capacity, head_dim)``, ``value``: ``(batch, kv_heads, capacity,
    head_dim_v)``, ``seqlens``: int32 ``(batch,)`` valid positions per sequence. Pass them to
    :func:`~torch_flashsys.flash_attention` as ``flash_attention(q, cache.key, cache.value,
    cache_seqlens=cache.seqlens, is_causal=True)``; :class:`~torch_flashsys.FlashAttention` does
    it for you with ``forward(x, kv_cache=cache)``.

    Example:
        >>> cache = KVCache(2, 4, 1024, 64)
        >>> cache.append(torch.randn(2, 4, 10, 64), torch.randn(2, 4, 10, 64))   # the prompt
        >>> cache.length, cache.seqlens.tolist()
        (10, [10, 10])
    """

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        *,
        head_dim_v: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        for name, value in (("batch", batch), ("kv_heads", kv_heads), ("capacity", capacity),
                            ("head_dim", head_dim)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_NAME}: {name} must be a positive int, got {value!r}")
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.key = torch.zeros(batch, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.value = torch.zeros(batch, kv_heads, capacity, head_dim_v, device=device, dtype=dtype)
        self.seqlens = torch.zeros(batch, device=device, dtype=torch.int32)
        self.length = 0  # positions appended so far (host-side: no device synchronization)

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``(batch, kv_heads, n, head_dim)`` new keys/values after each sequence's
        ``seqlens`` positions and advance ``seqlens`` by ``n``."""
        b, h, cap, d = self.key.shape
        n = key.shape[2]
        if key.shape != (b, h, n, d) or value.shape != (b, h, n, self.value.shape[-1]):
            raise ValueError(
                f"{_NAME}.append: key/value must be (batch, kv_heads, n, head_dim) = ({b}, {h}, n, "
                f"{d}) / (..., {self.value.shape[-1]}), got {tuple(key.shape)} and "
                f"{tuple(value.shape)}"
            )
        if self.length + n > cap:
            raise ValueError(
                f"{_NAME}.append: {n} new positions after {self.length} exceed the capacity {cap}"
            )
        pos = self.seqlens.long()[:, None] + torch.arange(n, device=self.seqlens.device)  # (b, n)
        index = pos.view(b, 1, n, 1)
        self.key.scatter_(2, index.expand(b, h, n, d), key.to(self.key.dtype))
        self.value.scatter_(
            2, index.expand(b, h, n, self.value.shape[-1]), value.to(self.value.dtype)
        )
        self.seqlens += n
        self.length += n

    def reset(self) -> None:
        """Forget every position (the memory is kept)."""
        self.seqlens.zero_()
        self.length = 0

    def __repr__(self) -> str:
        b, h, cap, d = self.key.shape
        return (
            f"KVCache(batch={b}, kv_heads={h}, capacity={cap}, head_dim={d}, length={self.length}, "
            f"dtype={self.key.dtype}, device={self.key.device})"
        )
