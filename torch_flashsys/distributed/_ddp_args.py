"""BucketedDDP's constructor arguments, ours and torch DDP's: checked and resolved.

A call written for ``torch.nn.parallel.DistributedDataParallel`` swaps as it is. Each of torch's
arguments is honoured with torch's meaning (``device_ids``, ``output_device``,
``broadcast_buffers``, ``init_sync``, ``process_group``, ``bucket_cap_mb``,
``forward_sync_buffers``), accepted as a no-op (``NO_OPS``, each with the reason) or refused
with ``NotImplementedError`` (``UNSUPPORTED``). docs/migration.md has the whole table.

Problems are returned, not raised: BucketedDDP puts each problem's rank-independent ``rule``
into its cross-rank check first, so every rank raises (with its own ``message``) and none is
left waiting in a collective (``device_ids=[rank]`` differs on every rank by design).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

COMPRESSION = {"bf16": torch.bfloat16, "fp16": torch.float16}

# torch DDP's flags that change nothing here, and why (the values must still be bools).
NO_OPS = {
    "find_unused_parameters": "unused parameters are always handled (found at the end of each "
    "backward, without a graph walk)",
    "check_reduction": "deprecated in torch DDP, where it does nothing either",
    "gradient_as_bucket_view": "gradients are always views into their buckets",
    "static_graph": "nothing is recorded from the first iterations; reentrant activation "
    "checkpointing, which torch DDP supports with it, is not supported (use_reentrant=False is)",
    "skip_all_reduce_unused_params": "unused parameters reduce with their bucket, at no extra "
    "collective; the results are the same",
    "batched_grad_copy": "gradients are accumulated in their bucket views, never copied",
}
# torch DDP's arguments BucketedDDP cannot honour: anything but None raises, saying what to do.
UNSUPPORTED = {
    "delay_all_reduce_named_params": "(torch DDP's delayed all-reduce of named parameters)",
    "param_to_hook_all_reduce": "(torch DDP's delayed all-reduce of named parameters)",
    "mixed_precision": "(torch DDP's private _MixedPrecision); use torch.autocast, and "
    "grad_compression='bf16' to reduce gradients in bf16",
    "device_mesh": "; for a 1-D mesh pass process_group=device_mesh.get_group(0)",
    "bucket_cap_mb_list": "(per-bucket sizes); pass one bucket_size_mb",
}


class _DefaultBucketMB(float):
    """The default ``bucket_size_mb`` (25.0), told apart from an explicit 25.0 by identity so
    that passing both ``bucket_size_mb`` and torch's ``bucket_cap_mb`` can be refused."""


DEFAULT_BUCKET_MB = _DefaultBucketMB(25.0)


class Problem(NamedTuple):
    """An invalid argument: the exception to raise, its message, and the rule broken without
    rank-specific values (compared across ranks)."""

    kind: type[Exception]
    message: str
    rule: str


def _problem(kind: type[Exception], message: str, rule: str | None = None) -> Problem:
    return Problem(kind, f"BucketedDDP: {message}", f"BucketedDDP: {rule or message}")


class Options(NamedTuple):
    """The resolved options (meaningful when there is no problem)."""

    bucket_size_mb: float | None
    init_sync: bool  # verify-only (False) or broadcast from rank 0 (True) at construction
    init_buffers: bool  # buffers broadcast at construction (with init_sync)
    forward_buffers: bool  # buffers broadcast before forwards and after join()
    input_device: torch.device | None  # device_ids given: inputs are moved there (torch DDP)


def _bucket_problem(bucket_size_mb: Any, bucket_cap_mb: Any) -> Problem | None:
    if bucket_cap_mb is not None and bucket_size_mb is not DEFAULT_BUCKET_MB:
        return _problem(
            TypeError,
            "bucket_cap_mb is torch DDP's name for bucket_size_mb; pass one of them, got "
            f"bucket_size_mb={bucket_size_mb!r} and bucket_cap_mb={bucket_cap_mb!r}",
        )
    name, value = ("bucket_size_mb", bucket_size_mb)
    if bucket_cap_mb is not None:
        name, value = "bucket_cap_mb", bucket_cap_mb
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and name == "bucket_size_mb":
        hint = (
            "torch DDP's second positional argument is device_ids, BucketedDDP's is "
            "bucket_size_mb: pass device_ids= by keyword"
        )
        return _problem(
            TypeError,
            f"bucket_size_mb must be a number or None, got {type(value).__name__} {value!r}; {hint}",
            f"bucket_size_mb must be a number or None, got {type(value).__name__}; {hint}",
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _problem(
            TypeError,
            f"{name} must be a number or None, got {type(value).__name__} {value!r}",
        )
    if not math.isfinite(value) or value < 0:
        return _problem(
            ValueError,
            f"{name} must be finite and >= 0 (0: one parameter per bucket; None: one bucket), "
            f"got {value!r}",
        )
    return None


def _type_problem(flags: dict[str, Any]) -> Problem | None:
    """Bools, ``dim``, ``forward_sync_buffers``, and torch's arguments we cannot honour."""
    for name, value in flags.items():
        if name in UNSUPPORTED:
            if value is not None:
                return _problem(
                    NotImplementedError,
                    f"{name} is not supported {UNSUPPORTED[name]} (got {type(value).__name__})",
                )
        elif name == "dim":
            if isinstance(value, bool) or not isinstance(value, int):
                return _problem(TypeError, f"dim must be an int, got {type(value).__name__}")
        elif name in ("broadcast_buffers", "forward_sync_buffers"):
            if value is not None and not isinstance(value, bool):
                return _problem(
                    TypeError,
                    f"{name} must be a bool or None, got {type(value).__name__}",
                )
        elif not isinstance(value, bool):
            return _problem(TypeError, f"{name} must be a bool, got {type(value).__name__}")
    return None


def _is_device(spec: Any, device: torch.device) -> bool:
    """Whether ``spec`` (an index, a torch.device or a string, as torch DDP takes) names ``device``."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec == device.index
    try:
        named = torch.device(spec)
    except (TypeError, RuntimeError):
        return False
    return named.type == device.type and named.index in (None, device.index)


def _device_problem(
    devices: set[torch.device], device_ids: Any, output_device: Any
) -> Problem | None:
    """torch DDP's rules: both None, or (one accelerator holds the module) that device."""
    if device_ids is not None and not isinstance(device_ids, (list, tuple)):
        return _problem(
            TypeError,
            "device_ids must be None or a list of one device, got "
            f"{type(device_ids).__name__} {device_ids!r}",
            f"device_ids must be None or a list of one device, got {type(device_ids).__name__}",
        )
    (device,) = devices if len(devices) == 1 else (None,)
    where = (
        "a module on several devices"
        if device is None
        else "a module on the CPU"
        if device.type == "cpu"
        else None
    )
    for name, given, ok in (
        ("device_ids", device_ids, lambda d: len(d) == 1 and _is_device(d[0], device)),
        ("output_device", output_device, lambda d: _is_device(d, device)),
    ):
        if given is None or (name == "device_ids" and len(given) == 0):
            continue  # torch DDP takes [] as None
        if where is not None:
            return _problem(
                ValueError,
                f"{name} must be None for {where} (as in torch DDP), got {given!r}",
                f"{name} must be None for {where} (as in torch DDP)",
            )
        if not ok(given):
            want = f"[{device.index}]" if name == "device_ids" else str(device.index)
            return _problem(
                ValueError,
                f"{name} must be None or {want}, the device holding the module ({device}) on "
                f"this rank, got {given!r}",
                f"{name} must be None or name the device holding the module",
            )
    return None


def resolve(
    module: torch.nn.Module,
    bucket_size_mb: Any,
    grad_compression: Any,
    torch_args: dict[str, Any],
) -> tuple[Options, Problem | None]:
    """The options of ``BucketedDDP(module, bucket_size_mb, ..., **torch_args)`` and the first
    problem with them, if any. ``torch_args`` holds every keyword argument torch DDP also has."""
    args = dict(torch_args)
    device_ids, output_device = args.pop("device_ids"), args.pop("output_device")
    bucket_cap_mb = args.pop("bucket_cap_mb")
    problem = _bucket_problem(bucket_size_mb, bucket_cap_mb) or _type_problem(args)
    if problem is None and grad_compression is not None and grad_compression not in COMPRESSION:
        problem = _problem(
            ValueError,
            f"grad_compression must be None, 'bf16' or 'fp16', got {grad_compression!r}",
        )
    devices = {p.device for p in module.parameters()}
    problem = problem or _device_problem(devices, device_ids, output_device)
    size = bucket_cap_mb if bucket_cap_mb is not None else bucket_size_mb
    # torch DDP: forward_sync_buffers, when given, rules the forwards and buffers are still
    # broadcast at construction; else broadcast_buffers (None: True) rules both.
    forward_sync, broadcast = args["forward_sync_buffers"], args["broadcast_buffers"] is not False
    options = Options(
        bucket_size_mb=None if size is None or problem else float(size),
        init_sync=args["init_sync"] is not False,
        init_buffers=forward_sync is not None or broadcast,
        forward_buffers=bool(forward_sync) if forward_sync is not None else broadcast,
        input_device=next(iter(devices)) if device_ids and not problem else None,
    )
    return options, problem
