"""Input validation for flash_attention: flat checks, one per concern, and one error helper.

Every rule raises through :func:`fail`, which names the function (``flash_attention: ...``), the
argument, what was expected and what was given. :func:`check_inputs` runs the checks in a fixed
order (types, scalars, shapes, dtypes/devices, mask, ALiBi, what the chosen backend needs) and
remembers the common call's successes, so a repeated call costs one dict lookup.
"""

from __future__ import annotations

import math
import numbers

import torch

from torch_flashsys.attention._backend import (
    BACKENDS,
    TRITON_HEAD_DIMS,
    choose_backend,
    interpreter_active,
    triton_head_dim_ok,
    triton_installed,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

NAME = "flash_attention"


def fail(exc: type[Exception], msg: str, name: str = NAME) -> None:
    """Raise ``exc("<name>: <msg>")``: the one way the attention checks report bad input."""
    raise exc(f"{name}: {msg}")


def refuse(args: dict[str, object], context: str) -> None:
    """ValueError naming the arguments of ``args`` that are set (not None): this call would
    ignore them, ``context`` says why."""
    used = [name for name, value in args.items() if value is not None]
    if used:
        fail(ValueError, f"{', '.join(used)} {'is' if len(used) == 1 else 'are'} not taken "
                         f"{context}")  # fmt: skip


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """``scale`` as a float; by default ``1 / sqrt(head_dim)``. Head dim 0 makes every score an
    empty dot product (0), whatever the scale: SDPA's uniform weights, here with scale 1."""
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


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
    memo = None
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
        # What the backend choice reads besides the tensors (tests patch these functions).
        env = (triton_installed(), interpreter_active())
        memo = (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
                query.device, key.device, value.device, enable_gqa, backend, env)  # fmt: skip
        resolved = _VALID.get(memo)
        if resolved is not None:
            return resolved
    check_types(query, key, value, attn_mask)
    check_scalars(dropout_p, is_causal, enable_gqa, scale, backend, window_size, softcap)
    check_shapes(query, key, value, enable_gqa)
    check_dtypes_devices(query, key, value)
    if attn_mask is not None:
        check_mask(attn_mask, query, key)
    if alibi_slopes is not None:
        check_alibi(alibi_slopes, query)
    resolved = choose_backend(backend, query, key, value)
    if resolved == "triton":
        check_triton(query, value)
    if memo is not None:
        if len(_VALID) >= _MAX_VALID:
            _VALID.clear()
        _VALID[memo] = resolved
    return resolved


_VALID: dict[tuple, str] = {}  # the common call's validated signatures -> resolved backend
_MAX_VALID = 1024


def check_types(query: object, key: object, value: object, attn_mask: object) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        fail(TypeError, f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _type_name(x: object) -> str:
    """``float``, ``numpy.bool`` (numpy's own types named with their module)."""
    kind = type(x)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def dropout_float(dropout_p: object) -> float:
    """``dropout_p`` as a float. SDPA takes a float, an int, a numpy scalar or a 0-d tensor
    holding one; anything else, or a value outside [0, 1], raises ``ValueError``."""
    expected = "dropout_p must be a real number in [0, 1] (float, int, numpy scalar or 0-d tensor)"
    value = float(_real_scalar(dropout_p, expected, ValueError))
    if not 0.0 <= value <= 1.0:
        fail(ValueError, f"{expected}, got {dropout_p!r}")
    return value


def _real_scalar(x: object, expected: str, exc: type[Exception]) -> numbers.Real:
    """``x`` as a Python real number, as SDPA takes its scalars (a float, an int, a numpy
    scalar or a 0-d real tensor); anything else raises ``exc`` with ``expected``."""
    value = x
    if isinstance(x, torch.Tensor):
        if x.dim() != 0:
            fail(exc, f"{expected}, got a tensor of shape {tuple(x.shape)}")
        if x.dtype == torch.bool or x.is_complex():
            fail(exc, f"{expected}, got a 0-d tensor of dtype {x.dtype}")
        value = x.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(exc, f"{expected}, got {_type_name(x)} {x!r}")
    return value


def check_scalars(dropout_p, is_causal, enable_gqa, scale, backend, window_size, softcap) -> None:
    dropout_float(dropout_p)
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            fail(TypeError, f"{name} must be a bool, got {_type_name(flag)}")
    if scale is not None:
        _check_scale(scale)
    if backend not in BACKENDS:
        fail(ValueError, f"backend must be one of {BACKENDS}, got {backend!r}")
    if window_size is not None and (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    ):
        fail(ValueError, "window_size must be None or a pair of ints (left, right), each >= 0 or "
                         f"-1 for unbounded, got {window_size!r}")  # fmt: skip
    if softcap is not None and (
        not _is_real(softcap) or not math.isfinite(softcap) or softcap <= 0
    ):
        fail(ValueError, f"softcap must be None (off) or a finite float > 0, got {softcap!r} "
                         "(flash-attn's softcap=0.0 for 'off' is softcap=None here)")  # fmt: skip


def _check_scale(scale: object) -> None:
    """A real number, as SDPA takes it: float, int, a numpy scalar or a 0-d tensor holding one."""
    expected = "scale must be a finite real number (float, int, numpy scalar or 0-d tensor) or None"
    if isinstance(scale, torch.Tensor) and scale.dim() == 0 and scale.requires_grad:
        fail(TypeError, "scale gets no gradient (as in SDPA): pass scale.detach()")
    if not math.isfinite(_real_scalar(scale, expected, TypeError)):
        fail(ValueError, f"scale must be finite, got {scale!r}")


def check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa) -> None:
    """(..., heads, seq, head_dim), any number of leading batch dimensions."""
    if query.dim() < 2:
        fail(ValueError, "query must have at least 2 dimensions (..., seq, head_dim), got "
                         f"{query.dim()}-D with shape {tuple(query.shape)}")  # fmt: skip
    if key.dim() != query.dim() or value.dim() != query.dim():
        fail(ValueError, "query, key and value must have the same number of dimensions, got "
                         f"{query.dim()}, {key.dim()} and {value.dim()}")  # fmt: skip
    e_q, e_k, e_v = query.shape[-1], key.shape[-1], value.shape[-1]
    if e_q != e_k:
        fail(ValueError, f"query and key must have the same head dim (last dimension), got {e_q} "
                         f"and {e_k} (value may differ: {e_v})")  # fmt: skip
    if key.shape[:-1] != value.shape[:-1]:
        fail(ValueError, "key and value must have the same shape except the head dim, got "
                         f"{tuple(key.shape)} and {tuple(value.shape)} (sequence lengths "
                         f"{key.shape[-2]} and {value.shape[-2]})")  # fmt: skip
    if query.dim() >= 4 and query.shape[:-3] != key.shape[:-3]:
        fail(ValueError, "query and key must have the same batch dimensions (all but the last "
                         f"three), got {tuple(query.shape[:-3])} and {tuple(key.shape[:-3])} "
                         "(key and value are not broadcast: expand them)")  # fmt: skip
    if query.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        h_q, h_kv = query.shape[-3], key.shape[-3]
        if not enable_gqa:
            fail(ValueError, f"query has {h_q} heads (dimension -3) but key/value have {h_kv}; "
                             "pass enable_gqa=True for grouped-query attention (key and value "
                             "are not broadcast: expand them to the query's heads)")  # fmt: skip
        if h_kv == 0 or h_q % h_kv != 0:
            fail(ValueError, f"with enable_gqa=True the query heads ({h_q}) must be a multiple of "
                             f"the key/value heads ({h_kv})")  # fmt: skip


def check_dtypes_devices(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in SUPPORTED_DTYPES:
            fail(TypeError, f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        fail(TypeError, "query, key and value must have the same dtype, got "
                        f"{query.dtype}, {key.dtype} and {value.dtype}")  # fmt: skip
    if not query.device == key.device == value.device:
        fail(ValueError, "query, key and value must be on the same device, got "
                         f"{query.device}, {key.device} and {value.device}")  # fmt: skip


def check_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
    if mask.dtype != torch.bool and not mask.is_floating_point():
        fail(TypeError, "attn_mask must be a bool mask (True = attend) or a float mask added to "
                        f"the scores, got dtype {mask.dtype}")  # fmt: skip
    if mask.device != query.device:
        fail(ValueError, f"attn_mask must be on {query.device} like query, got {mask.device}")
    target = (*query.shape[:-1], key.shape[-2])
    try:
        ok = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
    except RuntimeError:
        ok = False
    if not ok:
        fail(ValueError, f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {target} "
                         "(query.shape[:-1] + (seq_k,))")  # fmt: skip
    if mask.requires_grad and torch.is_grad_enabled():
        fail(NotImplementedError, "a gradient with respect to attn_mask is not supported; pass "
                                  "attn_mask.detach() (or use torch.nn.functional."
                                  "scaled_dot_product_attention's math backend for a learned "
                                  "additive bias)")  # fmt: skip


def check_alibi(slopes: object, query: torch.Tensor) -> None:
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
        what = slopes.dtype if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        fail(TypeError, f"alibi_slopes must be a float tensor, got {what}")
    heads = query.shape[-3] if query.dim() >= 3 else 1
    batch = math.prod(query.shape[:-3]) if query.dim() >= 4 else 1
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        fail(ValueError, f"alibi_slopes must have shape (heads,) = ({heads},) or (batch, heads) = "
                         f"({batch}, {heads}), got {tuple(slopes.shape)}")  # fmt: skip
    if slopes.device != query.device:
        fail(ValueError, f"alibi_slopes must be on {query.device} like query, got {slopes.device}")


def check_triton(query: torch.Tensor, value: torch.Tensor) -> None:
    """What ``backend="triton"`` needs: dtype, triton, a device it runs on, head dims."""
    if query.dtype not in TRITON_DTYPES:
        fail(TypeError, f"backend='triton' supports float16, bfloat16 and float32, got "
                        f"{query.dtype}; use backend='torch' (or 'auto') for float64")  # fmt: skip
    if query.dtype == torch.bfloat16 and interpreter_active():
        fail(TypeError, "backend='triton' under the Triton interpreter (TRITON_INTERPRET=1) "
                        "computes wrong results for torch.bfloat16 (the interpreter's bfloat16 "
                        "dot is broken); use backend='torch' (or 'auto'), float16/float32, or "
                        "CUDA tensors without TRITON_INTERPRET")  # fmt: skip
    if not triton_installed():
        fail(RuntimeError, "backend='triton' needs the triton package (pip install triton)")
    device = query.device
    if device.type != "cuda" and not (device.type == "cpu" and interpreter_active()):
        fail(RuntimeError, f"backend='triton' needs CUDA tensors, got tensors on {device}; use "
                           "backend='torch', or set TRITON_INTERPRET=1 before importing triton "
                           "to run the kernels on CPU tensors through the Triton interpreter")  # fmt: skip
    for name, e in (("query/key", query.shape[-1]), ("value", value.shape[-1])):
        if not triton_head_dim_ok(e):
            fail(ValueError, f"backend='triton' supports head dims {TRITON_HEAD_DIMS}, got {e} "
                             f"({name}); use backend='torch' for other head dims")  # fmt: skip
