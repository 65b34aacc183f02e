"""Drop-in helpers: replace_attention (swap nn.MultiheadAttention) and sdpa_override (reroute SDPA).

Exported as ``torch_flashsys.replace_attention``, ``torch_flashsys.sdpa_override`` and, from
``torch_flashsys.attention``, ``enable_sdpa_override`` / ``disable_sdpa_override``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torch_flashsys.attention._backend import BACKENDS
from torch_flashsys.attention._checks import check_inputs
from torch_flashsys.attention._dispatch import autocast_inputs, right_padded
from torch_flashsys.attention._padding import route
from torch_flashsys.attention.functional import flash_attention
from torch_flashsys.attention.module import FlashAttention, _mha_unsupported_reason

__all__ = ["disable_sdpa_override", "enable_sdpa_override", "replace_attention", "sdpa_override"]


# --------------------------------------------------------------------------------------------
# replace_attention


def _is_cross_attention(parent: nn.Module, child_name: str) -> bool:
    # nn.TransformerDecoderLayer.multihead_attn attends to the encoder's memory.
    return isinstance(parent, nn.TransformerDecoderLayer) and child_name == "multihead_attn"


def replace_attention(
    model: nn.Module,
    *,
    backend: str = "auto",
    should_replace: Callable[[str, nn.MultiheadAttention], bool] | None = None,
) -> list[str]:
    """Swap the self-attention ``nn.MultiheadAttention`` modules of ``model`` for FlashAttention.

    In place, keeping device, dtype, ``batch_first``, attention dropout, training mode and the
    weights themselves: the new modules hold the old ones' Parameter objects (see
    :meth:`FlashAttention.from_mha`), so an optimizer built before the swap keeps training them,
    tied parameters stay tied, and ``requires_grad`` and tensor hooks stay. Masks keep arriving
    through MHA's call form (``key_padding_mask``, ``attn_mask``, with MHA's conventions) and
    are passed to flash_attention; causal masks and ``is_causal=True`` use the causal kernels.

    Swapped: every ``nn.MultiheadAttention`` (batch_first or not) except the cross-attention
    ``multihead_attn`` of ``nn.TransformerDecoderLayer``, those ``should_replace(name, mha)``
    rejects, and those FlashAttention cannot reproduce (kdim/vdim != embed_dim, add_bias_kv,
    add_zero_attn, parametrized weights): these are left alone with a ``UserWarning`` naming
    them and why. A swapped module called as cross-attention raises at call time; exclude it
    with ``should_replace``.
    ``nn.TransformerEncoder`` modules get ``use_nested_tensor = False``: their nested-tensor
    path would turn padded batches into nested tensors, and FlashAttention takes the padding
    mask instead.

    Args:
        model: any module; it is changed in place.
        backend: ``backend`` of the new modules (see :func:`flash_attention`).
        should_replace: optional filter ``(qualified_name, mha) -> bool``.

    Returns:
        The qualified names of the swapped modules (as in ``model.named_modules()``).

    Example:
        >>> layer = nn.TransformerEncoderLayer(64, 4, dropout=0.0, batch_first=True)
        >>> encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> replace_attention(encoder, backend="torch")
        ['layers.0.self_attn', 'layers.1.self_attn']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"replace_attention: model must be an nn.Module, got {type(model)}")
    if isinstance(model, nn.MultiheadAttention):
        raise TypeError(
            "replace_attention: model is itself an nn.MultiheadAttention and cannot be swapped "
            "in place; use FlashAttention.from_mha(mha)"
        )
    swapped: list[str] = []
    skipped: list[str] = []
    converted: dict[int, FlashAttention] = {}  # one replacement per shared MHA instance
    # remove_duplicate=False: a module registered under two names is swapped under both.
    for name, child in list(model.named_modules(remove_duplicate=False)):
        if not isinstance(child, nn.MultiheadAttention):
            continue
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if _is_cross_attention(parent, child_name):
            continue
        if should_replace is not None and not should_replace(name, child):
            continue
        reason = _mha_unsupported_reason(child)
        if reason is not None:
            skipped.append(f"{name} ({reason})")
            continue
        if id(child) not in converted:
            converted[id(child)] = FlashAttention.from_mha(child, backend=backend)
        setattr(parent, child_name, converted[id(child)])
        swapped.append(name)
    if skipped:
        warnings.warn(
            "replace_attention: left these nn.MultiheadAttention modules unchanged: "
            + "; ".join(skipped),
            UserWarning,
            stacklevel=2,
        )
    if swapped:
        for module in model.modules():
            if isinstance(module, nn.TransformerEncoder):
                module.use_nested_tensor = False
    return swapped


# --------------------------------------------------------------------------------------------
# sdpa_override
#
# The state is F.scaled_dot_product_attention itself: torch's function, or a router that holds
# it (``_flashsys_original``). enable/disable switch it globally, like torch.set_grad_enabled;
# sdpa_override() puts back on exit what it found on entry, like torch.no_grad().


def _supported(query: Any, key: Any, value: Any, args: dict[str, Any], backend: str) -> bool:
    """Whether flash_attention computes exactly what SDPA would for these arguments."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and not t.is_nested for t in tensors):
        return False
    # SDPA broadcasts leading dims; flash_attention needs equal batch sizes (and equal leading
    # dims for 3-D inputs, where check_inputs would read dim -3 as heads).
    if query.dim() == 3 and not (query.shape[0] == key.shape[0] == value.shape[0]):
        return False
    try:
        check_inputs(
            query,
            key,
            value,
            args["attn_mask"],
            args["dropout_p"],
            args["is_causal"],
            args["scale"],
            args["enable_gqa"],
            backend,
        )
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return False
    return True


# Devices where, with backend="auto", a masked call stays on SDPA unless its mask is a
# right-padded causal one that runs one causal call per sequence (``_padding.route``): on the
# H100 the portable mask path took 1.5-2.3x the time of SDPA's masked kernels, and the packed
# route for 512-1023 tokens made a Hugging Face Llama step 1.025x SDPA's (docs/benchmarks.md).
MASKS_LEFT_TO_SDPA_ON = frozenset({"cuda"})


# Head dims the Hopper kernels serve at their own width (query, key and value alike:
# ``_sm90.forward_takes``, ``_sm90.fused_takes``). A 16-bit call with others took on an H100
# 1.01-1.14x SDPA's default (cuDNN) fwd+bwd at head dims 80 and 96 and 4096-8192 tokens (the
# next Hopper kernels, ``_sm90.FWD_PADDED_DIMS`` and ``BWD_PADDED_DIMS``), 1.27x at 2048 causal
# tokens (either backward), 1.33-1.43x at 256 (docs/benchmarks.md, 2026-11-27/28): with
# backend="auto" the override leaves those calls to SDPA on such a GPU.
HOPPER_HEAD_DIMS = frozenset({64, 128})


def _on_hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` is on an sm90 GPU with the Hopper path on (no Triton: no Hopper path)."""
    if not t.is_cuda:
        return False
    try:
        import torch_flashsys.attention._sm90 as _sm90
    except ImportError:
        return False
    return _sm90.enabled() and _sm90._is_sm90(t.get_device())


def _slower_head_dims(query, key, value) -> bool:
    """Whether a 16-bit call has head dims the Hopper kernels do not serve, on a GPU where they
    run (``_on_hopper``): there the portable kernels' time exceeds SDPA's."""
    if query.dtype not in (torch.float16, torch.bfloat16):
        return False
    d = query.shape[-1]
    if d in HOPPER_HEAD_DIMS and key.shape[-1] == d and value.shape[-1] == d:
        return False
    return _on_hopper(query)


def _faster_than_sdpa(query, key, value, args: dict[str, Any], backend: str) -> bool:
    """Whether a supported call goes to flash_attention: always with an explicit backend; with
    ``backend="auto"``, not a 16-bit call whose head dims the Hopper kernels do not serve on a
    GPU where they run (:func:`_slower_head_dims`), and not a masked call on
    MASKS_LEFT_TO_SDPA_ON without ``is_causal`` (SDPA raises on a mask with is_causal in some of
    its backends: such calls keep running here) unless its mask is a right-padded causal mask
    run one call per sequence."""
    if backend == "auto" and _slower_head_dims(query, key, value):
        return False
    mask = args["attn_mask"]
    if (mask is None or backend != "auto" or args["is_causal"]
            or query.device.type not in MASKS_LEFT_TO_SDPA_ON):  # fmt: skip
        return True
    if query.dim() != 4 or route(query) != "per_sequence":
        return False
    mods = (args["dropout_p"], False, None, None, None)
    return right_padded(query, key, mask, mods) is not None


def _make_router(original: Callable[..., torch.Tensor], backend: str) -> Callable[..., Any]:
    # functools.wraps gives the router SDPA's own signature and annotations.
    @functools.wraps(original)
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                     is_causal=False, scale=None, enable_gqa=False, **extra):  # fmt: skip
        args = {
            "attn_mask": attn_mask,
            "dropout_p": dropout_p,
            "is_causal": is_causal,
            "scale": scale,
            "enable_gqa": enable_gqa,
        }
        # Under autocast SDPA casts its inputs first, so inputs of mixed dtypes are valid there
        # (a Hugging Face Llama's query and key leave the rotary embedding in float32): the
        # check sees what flash_attention will compute on, as SDPA's does.
        q, k, v = autocast_inputs(query, key, value)
        routed = not extra and _supported(q, k, v, args, backend)
        if routed and _faster_than_sdpa(q, k, v, args, backend):
            return flash_attention(q, k, v, **args, backend=backend)
        if enable_gqa:  # passed only when set: older torch versions lack the argument
            extra["enable_gqa"] = enable_gqa
        return original(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            **extra,
        )

    scaled_dot_product_attention._flashsys_router = True  # type: ignore[attr-defined]
    scaled_dot_product_attention._flashsys_original = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _install_router(fn: str, backend: str) -> None:
    """Route F.scaled_dot_product_attention (on top of the original SDPA, never of a router)."""
    _check_backend(fn, backend)
    F.scaled_dot_product_attention = _make_router(_original_sdpa(), backend)


def _original_sdpa() -> Callable[..., torch.Tensor]:
    current = F.scaled_dot_product_attention
    return current._flashsys_original if _is_router(current) else current


def _check_backend(fn: str, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")


def enable_sdpa_override(*, backend: str = "auto") -> None:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to flash_attention until
    :func:`disable_sdpa_override`.

    A global switch, like ``torch.set_grad_enabled``: calling it again only changes ``backend``
    (one :func:`disable_sdpa_override` still turns it off). Inside a ``with sdpa_override():``
    block it lasts until the block exits, which puts back the state found on entry (as
    ``torch.no_grad()`` does with ``torch.set_grad_enabled``). See :func:`sdpa_override` for
    what is routed where.
    """
    _install_router("enable_sdpa_override", backend)


def disable_sdpa_override() -> None:
    """Turn the override off: put back torch's own ``scaled_dot_product_attention``, whatever
    enabled it (:func:`enable_sdpa_override` or an enclosing ``with sdpa_override():`` block,
    which then restores on exit the state found on entry). No-op when the override is off.
    """
    F.scaled_dot_product_attention = _original_sdpa()


def _is_router(fn: object) -> bool:
    return bool(getattr(fn, "_flashsys_router", False))


@contextlib.contextmanager
def sdpa_override(*, backend: str = "auto") -> Iterator[None]:
    """Context manager: calls of ``torch.nn.functional.scaled_dot_product_attention`` inside it
    run :func:`flash_attention` where it supports the arguments, the original SDPA otherwise.

    Routed to flash_attention: float16/bfloat16/float32 query/key/value (float64 on the PyTorch
    backend) of shape ``(..., seq, head_dim)`` with equal leading dims (any number of them), a
    value head dim that may differ from the query's, empty lengths, bool or float ``attn_mask``
    (one that needs no gradient), any ``dropout_p``, ``is_causal``, ``scale``, ``enable_gqa``
    with a divisible head count, and (for the Triton backend) head dims 16..256 in multiples of
    8; a mask together with ``is_causal`` applies both (as SDPA's CPU kernel does; its math path
    raises). Everything else (broadcast batch dims, nested tensors, float64 with
    ``backend="triton"``, unknown keyword arguments) goes to the original SDPA unchanged. On a
    GPU with ``backend="auto"``, a call with a mask and without ``is_causal`` stays on SDPA,
    whose masked kernels are faster than flash_attention's mask path, unless the mask is a
    right-padded causal mask (a Hugging Face model's padded batches) of at least
    ``_padding.PER_SEQUENCE_MIN_SEQ_CUDA`` (1024) tokens, which flash_attention runs without
    the mask (docs/attention.md); and on an H100/H200 with ``backend="auto"``, a float16 or
    bfloat16 call whose head dims are not 64 or 128 (query, key and value alike) stays on SDPA,
    whose kernels are faster there than flash_attention's portable ones. Results
    of routed calls match SDPA to floating-point rounding (with dropout: in distribution, the
    random numbers differ); gradients flow through both.

    On exit, also when the block raises, ``scaled_dot_product_attention`` is put back to what
    it was on entry: blocks nest, and :func:`enable_sdpa_override` /
    :func:`disable_sdpa_override` called inside a block last until it exits (the rule of
    ``torch.no_grad()`` and ``torch.set_grad_enabled``). The patch is
    process-wide (all threads): blocks of several threads that overlap without nesting keep
    routing until the last of them exits, which puts back what the first found on entry. It
    affects code that looks the function up at call time
    (``F.scaled_dot_product_attention(...)``, including nn.MultiheadAttention's internals), not
    a reference imported earlier with ``from torch.nn.functional import ...``. Usable as a
    decorator too.

    Example:
        >>> q = k = v = torch.randn(1, 2, 16, 32)
        >>> with sdpa_override(backend="torch"):
        ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash_attention
    """
    with _BLOCKS_LOCK:
        block = [F.scaled_dot_product_attention]  # what to put back on exit
        _install_router("sdpa_override", backend)
        _BLOCKS.append(block)
    try:
        yield
    finally:
        with _BLOCKS_LOCK:
            index = next(i for i, b in enumerate(_BLOCKS) if b is block)
            del _BLOCKS[index]
            if index == len(_BLOCKS):  # the newest block (always, when blocks nest)
                F.scaled_dot_product_attention = block[0]
            else:  # an older block of another thread: the next one puts back what this found
                _BLOCKS[index][0] = block[0]


# The open sdpa_override blocks, oldest first, each a one-item list: the SDPA it puts back on exit.
# Blocks of several threads may exit out of order; the block opened after the one exiting then
# inherits what that one found on entry, so the last exit restores the state before the first.
_BLOCKS: list[list[Callable[..., Any]]] = []
_BLOCKS_LOCK = threading.Lock()
