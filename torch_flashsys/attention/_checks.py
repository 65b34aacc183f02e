"""Input validation for flash_attention, in one place. Every rule raises with the argument's name."""

from __future__ import annotations

import math
import numbers

import torch

from torch_flashsys.attention._backend import (
    BACKENDS,
    interpreter_active,
    resolve_backend,
    triton_installed,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_HEAD_DIMS = "16..256, multiples of 8"

_NAME = "flash_attention"


def _fail(exc: type[Exception], msg: str) -> None:
    raise exc(f"{_NAME}: {msg}")


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """``scale`` as a float; by default ``1 / sqrt(head_dim)``. Head dim 0 makes every score an
    empty dot product (0), whatever the scale: SDPA's uniform weights, here with scale 1."""
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


def triton_head_dim_ok(head_dim: int) -> bool:
    return 16 <= head_dim <= 256 and head_dim % 8 == 0


def check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: object,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    backend: str,
    window_size: object = None,
    softcap: object = None,
    alibi_slopes: object = None,
) -> str:
    """Validate flash_attention's arguments; return the concrete backend ("triton" or "torch").

    The common call (no mask, ALiBi, window or softcap; plain float/bool scalars) is checked once
    per (shapes, dtypes, devices, enable_gqa, backend, environment): repeats are a dict lookup.
    Only successes are remembered, so every invalid call still raises.
    """
    if (
        attn_mask is None
        and alibi_slopes is None
        and window_size is None
        and softcap is None
        and is_causal.__class__ is bool
        and enable_gqa.__class__ is bool
        and dropout_p.__class__ is float
        and 0.0 <= dropout_p <= 1.0
        and (scale is None or (scale.__class__ is float and math.isfinite(scale)))
        and isinstance(query, torch.Tensor)
        and isinstance(key, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and backend.__class__ is str
        and not torch.compiler.is_compiling()  # traced: symbolic shapes make no dict keys
    ):
        device = query.device
        # What the backend choice reads besides the tensors (tests patch these functions).
        env = (triton_installed(), interpreter_active())
        memo = (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, device,
                key.device, value.device, enable_gqa, backend, env)  # fmt: skip
        resolved = _VALID.get(memo)
        if resolved is None:
            resolved = _check_inputs(query, key, value, None, dropout_p, is_causal, scale,
                                     enable_gqa, backend)  # fmt: skip
            if len(_VALID) >= _MAX_VALID:
                _VALID.clear()
            _VALID[memo] = resolved
        return resolved
    return _check_inputs(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
        window_size, softcap, alibi_slopes,
    )  # fmt: skip


_VALID: dict[tuple, str] = {}  # the common call's validated signatures -> resolved backend
_MAX_VALID = 1024


def _check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: object,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    backend: str,
    window_size: object = None,
    softcap: object = None,
    alibi_slopes: object = None,
) -> str:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")

    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        _fail(
            TypeError, f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}"
        )
    if (
        isinstance(dropout_p, bool)
        or not isinstance(dropout_p, (int, float))
        or not 0.0 <= dropout_p <= 1.0
    ):
        _fail(ValueError, f"dropout_p must be a float in [0, 1], got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        _fail(TypeError, f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        _fail(TypeError, f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if scale is not None:
        _check_scale(scale)
    if backend not in BACKENDS:
        _fail(ValueError, f"backend must be one of {BACKENDS}, got {backend!r}")
    if window_size is not None and (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    ):
        _fail(
            ValueError,
            "window_size must be None or a pair of ints (left, right), each >= 0 or -1 for "
            f"unbounded, got {window_size!r}",
        )
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        _fail(
            ValueError,
            f"softcap must be None (off) or a finite float > 0, got {softcap!r} (flash-attn's "
            "softcap=0.0 for 'off' is softcap=None here)",
        )

    # Ranks and shapes: (..., heads, seq, head_dim), any number of leading batch dimensions.
    if query.dim() < 2:
        _fail(
            ValueError,
            "query must have at least 2 dimensions (..., seq, head_dim), got "
            f"{query.dim()}-D with shape {tuple(query.shape)}",
        )
    if key.dim() != query.dim() or value.dim() != query.dim():
        _fail(
            ValueError,
            "query, key and value must have the same number of dimensions, got "
            f"{query.dim()}, {key.dim()} and {value.dim()}",
        )
    e_q, e_k, e_v = query.shape[-1], key.shape[-1], value.shape[-1]
    if e_q != e_k:
        _fail(
            ValueError,
            f"query and key must have the same head dim (last dimension), got {e_q} and {e_k} "
            f"(value may differ: {e_v})",
        )
    if key.shape[:-1] != value.shape[:-1]:
        _fail(
            ValueError,
            "key and value must have the same shape except the head dim, got "
            f"{tuple(key.shape)} and {tuple(value.shape)} (sequence lengths "
            f"{key.shape[-2]} and {value.shape[-2]})",
        )
    if query.dim() >= 4 and query.shape[:-3] != key.shape[:-3]:
        _fail(
            ValueError,
            "query and key must have the same batch dimensions (all but the last three), got "
            f"{tuple(query.shape[:-3])} and {tuple(key.shape[:-3])}",
        )
    if query.dim() >= 3:
        h_q, h_kv = query.shape[-3], key.shape[-3]
        if h_q != h_kv:
            if not enable_gqa:
                _fail(
                    ValueError,
                    f"query has {h_q} heads but key/value have {h_kv}; pass enable_gqa=True for "
                    "grouped-query attention",
                )
            if h_kv == 0 or h_q % h_kv != 0:
                _fail(
                    ValueError,
                    f"with enable_gqa=True the query heads ({h_q}) must be a multiple of the "
                    f"key/value heads ({h_kv})",
                )

    # Dtypes and devices.
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(
                TypeError,
                f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}",
            )
    if not query.dtype == key.dtype == value.dtype:
        _fail(
            TypeError,
            "query, key and value must have the same dtype, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}",
        )
    if not query.device == key.device == value.device:
        _fail(
            ValueError,
            "query, key and value must be on the same device, got "
            f"{query.device}, {key.device} and {value.device}",
        )

    if attn_mask is not None:
        _check_mask(attn_mask, query, key)
    if alibi_slopes is not None:
        _check_alibi(alibi_slopes, query)

    resolved = resolve_backend(backend, query.device)
    if query.shape[-2] == 0 or key.shape[-2] == 0 or e_q == 0 or e_v == 0:
        # an empty sequence or head dim: SDPA's zeros / uniform weights / empty output, from the
        # PyTorch backend
        return "torch"
    if backend == "auto" and query.dtype == torch.float64:
        resolved = "torch"  # float64 (e.g. gradcheck): the PyTorch backend, on any device
    if resolved == "triton":
        if query.dtype not in TRITON_DTYPES:
            _fail(
                TypeError,
                f"backend='triton' supports float16, bfloat16 and float32, got {query.dtype}; "
                "use backend='torch' (or 'auto') for float64",
            )
        if query.dtype == torch.bfloat16 and interpreter_active():
            _fail(
                TypeError,
                "backend='triton' under the Triton interpreter (TRITON_INTERPRET=1) computes "
                "wrong results for torch.bfloat16 (the interpreter's bfloat16 dot is broken); use "
                "backend='torch' (or 'auto'), float16/float32, or CUDA tensors without "
                "TRITON_INTERPRET",
            )
        if not triton_installed():
            _fail(RuntimeError, "backend='triton' needs the triton package (pip install triton)")
        if query.device.type != "cuda" and not (
            query.device.type == "cpu" and interpreter_active()
        ):
            _fail(
                RuntimeError,
                f"backend='triton' needs CUDA tensors, got tensors on {query.device}; use "
                "backend='torch', or set TRITON_INTERPRET=1 before importing triton to run the "
                "kernels on CPU tensors through the Triton interpreter",
            )
        for name, e in (("query/key", e_q), ("value", e_v)):
            if not triton_head_dim_ok(e):
                _fail(
                    ValueError,
                    f"backend='triton' supports head dims {TRITON_HEAD_DIMS}, got {e} ({name}); "
                    "use backend='torch' for other head dims",
                )
    return resolved


def _check_scale(scale: object) -> None:
    """A real number, as SDPA takes it: float, int, a numpy scalar or a 0-d tensor holding one."""
    expected = "scale must be a finite real number (float, int, numpy scalar or 0-d tensor) or None"
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0:
            _fail(TypeError, f"{expected}, got a tensor of shape {tuple(scale.shape)}")
        if scale.requires_grad:
            _fail(TypeError, "scale gets no gradient (as in SDPA): pass scale.detach()")
        if scale.dtype == torch.bool or scale.is_complex():
            _fail(TypeError, f"{expected}, got a 0-d tensor of dtype {scale.dtype}")
        value = scale.item()
    else:
        value = scale
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        _fail(TypeError, f"{expected}, got {scale!r}")


def _check_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
    if mask.dtype != torch.bool and not mask.is_floating_point():
        _fail(
            TypeError,
            f"attn_mask must be a bool mask (True = attend) or a float mask added to the scores, "
            f"got dtype {mask.dtype}",
        )
    if mask.device != query.device:
        _fail(ValueError, f"attn_mask must be on {query.device} like query, got {mask.device}")
    target = (*query.shape[:-1], key.shape[-2])
    try:
        ok = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
    except RuntimeError:
        ok = False
    if not ok:
        _fail(
            ValueError,
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {target} "
            "(query.shape[:-1] + (seq_k,))",
        )
    if mask.requires_grad and torch.is_grad_enabled():
        _fail(
            NotImplementedError,
            "a gradient with respect to attn_mask is not supported; pass attn_mask.detach() (or "
            "use torch.nn.functional.scaled_dot_product_attention's math backend for a learned "
            "additive bias)",
        )


def _check_alibi(slopes: object, query: torch.Tensor) -> None:
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
        what = slopes.dtype if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        _fail(TypeError, f"alibi_slopes must be a float tensor, got {what}")
    heads = query.shape[-3] if query.dim() >= 3 else 1
    batch = math.prod(query.shape[:-3]) if query.dim() >= 4 else 1
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        _fail(
            ValueError,
            f"alibi_slopes must have shape (heads,) = ({heads},) or (batch, heads) = "
            f"({batch}, {heads}), got {tuple(slopes.shape)}",
        )
    if slopes.device != query.device:
        _fail(ValueError, f"alibi_slopes must be on {query.device} like query, got {slopes.device}")
