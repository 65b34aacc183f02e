"""FlashAttention: a self-attention nn.Module on flash_attention, weight-compatible with MHA."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.utils import parametrize

from torch_flashsys.attention._backend import BACKENDS
from torch_flashsys.attention._kvcache import KVCache
from torch_flashsys.attention.functional import flash_attention

_NAME = "FlashAttention"
_WARNED: set[str] = set()  # one-time warnings already given in this process
# Set on F.scaled_dot_product_attention by distributed.context_parallel_sdpa's router: the
# sequence is then sharded across ranks (read here, as attention imports nothing from distributed).
CONTEXT_PARALLEL_MARK = "torch_flashsys_context_parallel"


def context_parallel_routed() -> bool:
    """Whether ``F.scaled_dot_product_attention`` is a context-parallel router now (directly or
    under another wrapper: ``functools.wraps`` copies the mark)."""
    return getattr(nn.functional.scaled_dot_product_attention, CONTEXT_PARALLEL_MARK, False)


def _mha_unsupported_reason(mha: nn.MultiheadAttention) -> str | None:
    """Why ``mha`` cannot become an equivalent :class:`FlashAttention` (None: it can)."""
    if not mha._qkv_same_embed_dim:
        return f"kdim/vdim ({mha.kdim}/{mha.vdim}) differ from embed_dim ({mha.embed_dim})"
    if mha.bias_k is not None:
        return "add_bias_kv=True is not supported"
    if mha.add_zero_attn:
        return "add_zero_attn=True is not supported"
    if parametrize.is_parametrized(mha) or parametrize.is_parametrized(mha.out_proj):
        return "parametrized weights (torch.nn.utils.parametrize) are not supported"
    return None


def _warn_once(key: str, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` comes up in this process, pointing at the
    code that called the module (past forward and nn.Module's two call wrappers)."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=5)


def _is_causal_mask(mask: torch.Tensor, seq: int) -> bool:
    """True when ``mask`` (bool: True = masked, or additive float) is exactly the causal mask.

    mask: (seq, seq) or (n, seq, seq), as nn.MultiheadAttention takes it.
    """
    if mask.shape[-2:] != (seq, seq) or mask.dim() not in (2, 3):
        return False
    future = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool((mask == future).all())
    if not mask.is_floating_point():
        return False
    ref = torch.zeros(seq, seq, dtype=mask.dtype, device=mask.device).masked_fill(
        future, float("-inf")
    )
    return bool((mask == ref).all())


def _sdpa_mask(
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    batch: int,
    heads: int,
    seq: int,
) -> torch.Tensor | None:
    """MHA's masks (bool: True = not allowed; float: added) -> one SDPA-style mask that broadcasts
    to (batch, heads, seq, seq) (bool: True = allowed), without materialising it when possible."""
    masks = []
    if key_padding_mask is not None:
        kpm = key_padding_mask
        if kpm.dim() == 1:  # unbatched input
            kpm = kpm.unsqueeze(0)
        if kpm.shape != (batch, seq):
            raise ValueError(
                f"{_NAME}: key_padding_mask must be (batch, seq) = ({batch}, {seq}), got "
                f"{tuple(key_padding_mask.shape)}"
            )
        masks.append(kpm.view(batch, 1, 1, seq))
    if attn_mask is not None:
        am = attn_mask
        if am.dim() == 3:
            if am.shape[0] != batch * heads:
                raise ValueError(
                    f"{_NAME}: a 3-D attn_mask must be (batch * num_heads, seq, seq) = "
                    f"({batch * heads}, {seq}, {seq}), got {tuple(am.shape)}"
                )
            am = am.view(batch, heads, seq, seq)
        elif am.shape != (seq, seq):
            raise ValueError(
                f"{_NAME}: attn_mask must be (seq, seq) or (batch * num_heads, seq, seq) with "
                f"seq={seq}, got {tuple(attn_mask.shape)}"
            )
        masks.append(am)
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        allowed = [~m for m in masks]
        return allowed[0] if len(allowed) == 1 else allowed[0] & allowed[1]
    float_dtype = next(m.dtype for m in masks if m.dtype != torch.bool)
    additive = [
        torch.zeros(m.shape, dtype=float_dtype, device=m.device).masked_fill(m, float("-inf"))
        if m.dtype == torch.bool
        else m
        for m in masks
    ]
    return additive[0] if len(additive) == 1 else additive[0] + additive[1]


class FlashAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention computed by :func:`flash_attention`.

    x: (seq, batch, embed_dim) -> (seq, batch, embed_dim) by default, as in
    nn.MultiheadAttention; with ``batch_first=True`` (batch, seq, embed_dim) -> (batch, seq,
    embed_dim); unbatched (seq, embed_dim) also works.

    A fused QKV projection ``in_proj_weight`` / ``in_proj_bias``, attention per head, and an output
    projection ``out_proj``. With ``num_kv_heads == num_heads`` (the default) the parameters have
    the names, shapes and initialisation of :class:`torch.nn.MultiheadAttention`, so an MHA's
    state dict loads as is (see :meth:`from_mha`). With ``num_kv_heads < num_heads``
    (grouped-query attention) ``in_proj_weight`` is ``((num_heads + 2 * num_kv_heads) * head_dim,
    embed_dim)``: query rows, then key rows, then value rows.

    Two call forms:

    - ``forward(x)`` returns the output tensor.
    - nn.MultiheadAttention's form ``forward(query, key, value, key_padding_mask=None,
      need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False)`` returns
      ``(out, None)``, so the module can replace ``self_attn`` in ``nn.TransformerEncoderLayer``.
      Self-attention only: ``key`` and ``value`` must be ``query`` itself. Masks follow MHA's
      conventions: ``key_padding_mask`` (batch, seq) and ``attn_mask`` (seq, seq) or
      (batch * num_heads, seq, seq), bool with True = *not* allowed, or float added to the scores;
      both may be given (both apply). A mask that is exactly the causal mask (as
      ``nn.Transformer.generate_square_subsequent_mask`` makes it), ``is_causal=True`` or
      ``causal=True`` at construction use the causal kernels. A query row with no allowed key
      gives zeros (SDPA's convention; MHA gives NaN). The fused kernel never forms the
      attention weights: with ``need_weights=True`` (MHA's default) the second element is
      ``None`` too, and the first such call in the process warns once (``UserWarning``); pass
      ``need_weights=False`` to silence it.

    Dropout on the attention weights (``dropout``, MHA's argument) applies in training mode only,
    as in nn.MultiheadAttention.

    Inside :func:`~torch_flashsys.distributed.context_parallel_sdpa` (the sequence sharded across
    ranks) the attention runs through its router, over the whole sequence on the router's
    ``backend``; masks, dropout and ``kv_cache`` raise there.

    Generation with a KV cache: ``cache = attn.new_cache(batch, capacity)``, then
    ``attn(x, kv_cache=cache)`` for the prompt and for each new token (under ``torch.no_grad()``):
    the call appends its keys/values to the cache and attends over everything cached (causally,
    queries aligned to the cache's end, when the module is causal or ``is_causal=True``).

    Args:
        embed_dim: model width; ``embed_dim // num_heads`` is the head dim.
        num_heads: query heads.
        num_kv_heads: key/value heads (a divisor of ``num_heads``); default ``num_heads``.
        bias: add biases to the input and output projections (as in MHA).
        dropout: attention-weight dropout probability in training mode (MHA's ``dropout``).
        causal: always apply the causal mask.
        batch_first: ``True``: inputs are (batch, seq, embed_dim); ``False`` (the default, as
            in nn.MultiheadAttention): (seq, batch, embed_dim).
        backend: ``backend`` of :func:`flash_attention` ("auto", "triton", "torch").

    Example:
        >>> attn = FlashAttention(256, 4, causal=True, batch_first=True, backend="torch")
        >>> attn(torch.randn(2, 100, 256)).shape
        torch.Size([2, 100, 256])
    """

    # Read by nn.TransformerEncoderLayer: False keeps it off its fused "fast path", which would
    # run a native kernel on our weights instead of calling this module.
    _qkv_same_embed_dim = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        batch_first: bool = False,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (
            ("embed_dim", embed_dim),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_NAME}: {name} must be a positive int, got {value!r}")
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"{_NAME}: embed_dim ({embed_dim}) must be a multiple of num_heads ({num_heads})"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{_NAME}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        if backend not in BACKENDS:
            raise ValueError(f"{_NAME}: backend must be one of {BACKENDS}, got {backend!r}")
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, (int, float))
            or not 0 <= dropout <= 1
        ):
            raise ValueError(f"{_NAME}: dropout must be a float in [0, 1], got {dropout!r}")
        self.dropout = float(dropout)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal = bool(causal)
        self.batch_first = bool(batch_first)
        self.backend = backend
        kw = {"device": device, "dtype": dtype}
        proj_dim = (num_heads + 2 * num_kv_heads) * self.head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(proj_dim, embed_dim, **kw))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(proj_dim, **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # nn.MultiheadAttention's initialisation (out_proj.weight keeps nn.Linear's default).
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_mha(
        cls, mha: nn.MultiheadAttention, *, causal: bool = False, backend: str = "auto"
    ) -> FlashAttention:
        """A FlashAttention with ``mha``'s weights, device, dtype, batch_first and training mode.

        The new module holds ``mha``'s own Parameter objects (``in_proj_weight``,
        ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``), as
        ``nn.SyncBatchNorm.convert_sync_batchnorm`` does: an optimizer built over the old
        parameters keeps updating them, and their ``requires_grad``, ``grad`` and tensor hooks
        stay. Convert ``copy.deepcopy(mha)`` for independent weights.

        Raises ``ValueError`` for MHAs it cannot reproduce (kdim/vdim != embed_dim,
        add_bias_kv, add_zero_attn, parametrized weights). MHA's attention dropout carries over.
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(
                f"{_NAME}.from_mha: expected an nn.MultiheadAttention, got {type(mha).__name__}"
            )
        reason = _mha_unsupported_reason(mha)
        if reason is not None:
            raise ValueError(f"{_NAME}.from_mha: cannot convert this MultiheadAttention: {reason}")
        weight = mha.in_proj_weight
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            bias=mha.in_proj_bias is not None,
            dropout=mha.dropout,
            causal=causal,
            batch_first=mha.batch_first,
            backend=backend,
            device=weight.device,
            dtype=weight.dtype,
        )
        new._share_parameters(mha)
        return new.train(mha.training)

    def _share_parameters(self, mha: nn.MultiheadAttention) -> None:
        """Register ``mha``'s Parameter objects (not copies) as this module's."""
        for target, source, name in (
            (self, mha, "in_proj_weight"),
            (self, mha, "in_proj_bias"),
            (self.out_proj, mha.out_proj, "weight"),
            (self.out_proj, mha.out_proj, "bias"),
        ):
            setattr(target, name, getattr(source, name))

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, "
            f"bias={self.in_proj_bias is not None}, dropout={self.dropout}, causal={self.causal}, "
            f"batch_first={self.batch_first}, backend={self.backend!r}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, None]:
        mha_form = key is not None or value is not None
        if mha_form:
            if key is not query or value is not query:
                raise NotImplementedError(
                    f"{_NAME}: self-attention only; key and value must be the query tensor "
                    "itself (use nn.MultiheadAttention for cross-attention)"
                )
            if need_weights:
                _warn_once(
                    "need_weights",
                    f"{_NAME}: need_weights=True, but attention weights are not computed by the "
                    "fused kernel; returning (output, None). Pass need_weights=False to silence "
                    "this warning.",
                )
        if not isinstance(query, torch.Tensor) or query.is_nested:
            raise TypeError(f"{_NAME}: query must be a dense torch.Tensor")
        if query.dim() not in (2, 3) or query.shape[-1] != self.embed_dim:
            layout = "(batch, seq, embed_dim)" if self.batch_first else "(seq, batch, embed_dim)"
            raise ValueError(
                f"{_NAME}: input must be {layout} or (seq, embed_dim) with embed_dim="
                f"{self.embed_dim}, got shape {tuple(query.shape)}"
            )
        x = query.unsqueeze(0) if query.dim() == 2 else query
        seq_first = not self.batch_first and query.dim() == 3  # (seq, batch, embed_dim)
        seq = x.shape[0] if seq_first else x.shape[1]
        causal = self.causal or bool(is_causal)
        if kv_cache is not None:
            if key_padding_mask is not None or attn_mask is not None:
                raise ValueError(f"{_NAME}: masks are not supported together with kv_cache")
            out = self._attend(x, seq_first, causal, None, kv_cache)
        else:
            if attn_mask is not None and _is_causal_mask(attn_mask, seq):
                causal, attn_mask = True, None
            batch = x.shape[1] if seq_first else x.shape[0]
            mask = _sdpa_mask(key_padding_mask, attn_mask, batch, self.num_heads, seq)
            out = self._attend(x, seq_first, causal, mask)
        out = out.squeeze(0) if query.dim() == 2 else out
        return (out, None) if mha_form else out

    def new_cache(
        self,
        batch: int,
        capacity: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty :class:`~torch_flashsys.attention.KVCache` for this layer (its key/value heads
        and head dim; the parameters' device and dtype unless given)."""
        weight = self.in_proj_weight
        return KVCache(
            batch, self.num_kv_heads, capacity, self.head_dim,
            device=weight.device if device is None else device,
            dtype=weight.dtype if dtype is None else dtype,
        )  # fmt: skip

    def _attend(
        self,
        x: torch.Tensor,
        seq_first: bool,
        causal: bool,
        mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """(batch, seq, embed_dim) -> (batch, seq, embed_dim), or with ``seq_first`` (seq, batch,
        embed_dim) -> (seq, batch, embed_dim), contiguous either way (as nn.MultiheadAttention's
        seq-first output): the heads are views of the projection in the input's order, and the
        output keeps the query's layout; ``mask`` in SDPA's convention."""
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = nn.functional.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.split((h * d, h_kv * d, h_kv * d), dim=-1)
        # (b, seq, heads, d) -> (b, heads, seq, d); seq-first: (seq, b, heads, d) -> the same
        order = (1, 2, 0, 3) if seq_first else (0, 2, 1, 3)
        q, k, v = (t.unflatten(-1, (-1, d)).permute(order) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if context_parallel_routed():
            # flash_attention would attend to this rank's sequence shard only; the router runs
            # context-parallel attention (and refuses masks and dropout)
            if kv_cache is not None:
                raise NotImplementedError(
                    f"{_NAME}: kv_cache inside context_parallel_sdpa is not supported (a cache "
                    "holds one rank's keys only)"
                )
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                enable_gqa=h_kv != h,
            )  # fmt: skip
        elif kv_cache is not None:  # generation: the new positions join the cache, then attend
            kv_cache.append(k, v)
            out = flash_attention(
                q, kv_cache.key, kv_cache.value, is_causal=causal, enable_gqa=h_kv != h,
                cache_seqlens=kv_cache.seqlens, backend=self.backend,
            )  # fmt: skip
        else:
            out = flash_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                enable_gqa=h_kv != h, backend=self.backend,
            )  # fmt: skip
        back = (2, 0, 1, 3) if seq_first else (0, 2, 1, 3)  # the inverse permutation of order
        return self.out_proj(out.permute(back).flatten(-2))
