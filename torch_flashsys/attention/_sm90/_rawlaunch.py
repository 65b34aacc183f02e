"""The Hopper kernels' repeat launches with less host work than Triton's launcher.

After a kernel's first call for a launch key, ``_sm90`` launches the compiled kernel directly. A
launch key (shapes, strides, dtype, flags, device) fixes every integer argument of a launch, so a
repeat launch needs only what changes between calls of one key, its *values*: each tensor (in a
TMA descriptor's place too) and each float (the scale), in parameter order. Both launch objects
here keep the first call's arguments as a template and take just those values:

- :class:`RawLaunch` calls the launcher's C entry point with the flat argument list Triton's
  launcher would build, the constants filled in once: each descriptor's ``CUtensorMap`` is encoded
  once per (slot, address) and kept (a map is a pure function of the address, shape, strides,
  block and swizzle, and the key fixes all but the address, so a kept map is never stale), its
  shape and strides spliced in, tensors passed as their addresses. Triton's launcher would, per
  call, expand every host ``TensorDescriptor`` in Python (``cuTensorMapEncodeTiled``) and ask the
  driver about each tensor. Built only where the launcher has the layout this was written against
  (:meth:`RawLaunch.build` returns None otherwise): Triton 3.6's ``wrap_handle_tensordesc``
  closure, no scratch memory.
- :class:`TritonLaunch` is the fallback for other Tritons: Triton's launcher object, with the
  descriptors rebuilt from the values.

Both check, when built, that the values the caller passes are the first call's tensors and floats
at those places (else they return None and the caller keeps Triton's JIT path).
"""

from __future__ import annotations

from typing import Any

import torch

MAX_MAPS = 64  # kept maps per descriptor slot (addresses); beyond that the slot starts afresh
_FLOAT, _TENSOR = object(), object()  # kinds of a value that is no descriptor


def _holes(args: tuple, values: tuple) -> list[int] | None:
    """Where each value goes among ``args`` (their positions, in order), or None when ``values``
    are not exactly ``args``' descriptors' tensors, tensors and floats, in order."""
    positions = []
    for i, a in enumerate(args):
        if _is_descriptor(a) or a.__class__ is torch.Tensor or a.__class__ is float:
            positions.append(i)
    if len(positions) != len(values):
        return None
    for i, value in zip(positions, values, strict=True):
        a = args[i]
        same = a.base is value if _is_descriptor(a) else a is value
        if not same and not (a.__class__ is float and a == value):
            return None
    return positions


def _is_descriptor(a: Any) -> bool:
    return hasattr(a, "block_shape") and hasattr(a, "base")


class RawLaunch:
    """A compiled kernel's launch from its launcher's C entry point (see the module docstring):
    ``launch(stream, values)``."""

    def __init__(self, raw, encode, template: list, holes: list) -> None:
        self._raw = raw
        self._encode = encode  # (address, *encode args) -> CUtensorMap
        self._template = template  # the flat argument list, values' places left None
        self._holes = holes  # per value: (flat index, kind or (encode args, maps))

    @classmethod
    def build(cls, compiled: Any, grid: tuple, args: tuple, tail: tuple, values: tuple,
              encode: Any = None) -> RawLaunch | None:  # fmt: skip
        """The raw launch of ``compiled`` (a Triton ``CompiledKernel``) on ``grid`` for launches
        like ``args`` (the first call's, with host descriptors; ``tail``: the constexprs), taking
        ``values`` (see the module docstring); None where its launcher is not the layout this
        module knows. ``encode``: the map encoder (default the driver's
        ``fill_tma_descriptor``; tests pass a stand-in)."""
        positions = _holes(args, values)
        if positions is None:
            return None
        try:
            launcher = compiled.run
            inner = launcher.launch
            cells = dict(zip(inner.__code__.co_freevars,
                             (c.cell_contents for c in inner.__closure__ or ()), strict=True))  # fmt: skip
            raw, indices, metas = (cells["launcher"], cells["tensordesc_indices"],
                                   cells["tensordesc_meta"])  # fmt: skip
            if (launcher.global_scratch_size or launcher.profile_scratch_size
                    or getattr(launcher, "num_ctas", 1) != 1):  # fmt: skip
                return None
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
            from triton.runtime import driver

            encode = encode or driver.active.utils.fill_tma_descriptor
            descriptors = {}
            for position, meta in zip(sorted(indices), metas, strict=True):
                desc = args[position]
                if meta is None or meta["fp4_padded"] or desc.padding == "nan":
                    return None
                descriptors[position] = (meta["swizzle"], meta["elem_size"],
                                         TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                                         meta["block_size"], list(desc.shape),
                                         list(desc.strides), 0)  # fmt: skip
            if not descriptors or set(descriptors) - set(positions):
                return None
            template = [*grid, None, compiled.function, launcher.launch_cooperative_grid,
                        launcher.launch_pdl, None, None, compiled.packed_metadata, None, None,
                        None]  # fmt: skip
            holes = []
            for i, a in enumerate(args):
                if i in descriptors:
                    holes.append((len(template), (descriptors[i], {})))
                    template += [None, *a.shape, *a.strides]
                elif i in positions:
                    holes.append(
                        (len(template), _TENSOR if a.__class__ is torch.Tensor else _FLOAT)
                    )
                    template.append(None)
                else:
                    template.append(a)
            template += tail
        except (AttributeError, KeyError, TypeError, ValueError, ImportError):
            return None
        return cls(raw, encode, template, holes)

    def __call__(self, stream: int, values: tuple) -> None:
        flat = self._template.copy()
        flat[3] = stream
        for (at, kind), value in zip(self._holes, values, strict=True):
            if kind is _TENSOR:
                flat[at] = value.data_ptr()
            elif kind is _FLOAT:
                flat[at] = value
            else:
                ptr = value.data_ptr()
                enc, maps = kind
                tensor_map = maps.get(ptr)
                if tensor_map is None:
                    tensor_map = self._new_map(value, ptr, enc, maps)
                flat[at] = tensor_map
        self._raw(*flat)

    def _new_map(self, t: torch.Tensor, ptr: int, enc: tuple, maps: dict):
        if list(t.shape) != enc[4] or list(t.stride()) != enc[5]:
            raise RuntimeError("RawLaunch: a descriptor's shape differs from its key's")
        if len(maps) >= MAX_MAPS:
            maps.clear()
        tensor_map = maps[ptr] = self._encode(ptr, *enc)
        return tensor_map


class TritonLaunch:
    """A compiled kernel's launch through Triton's launcher object (``CompiledKernel.run``):
    ``launch(stream, values)``, the descriptors rebuilt around the values' tensors, the other
    tensors passed as their addresses (which the launcher takes as they are; a tensor costs it a
    ``data_ptr()`` call and a ``cuPointerGetAttribute``). Also the planned launch of plain
    Triton kernels (no descriptors)."""

    def __init__(self, compiled: Any, grid: tuple, args: tuple, tail: tuple,
                 positions: list) -> None:  # fmt: skip
        self._run = compiled.run
        self._head = (*grid, compiled.function, compiled.packed_metadata)
        # The template keeps no tensor of the first call (a kept launch would pin its buffers):
        # the values' places are None, a descriptor's a blank of its block and layout.
        self._args = [None] * len(args)
        self._blanks = {}
        for i, a in enumerate(args):
            if _is_descriptor(a):
                blank = object.__new__(a.__class__)
                blank.__dict__.update(a.__dict__, base=None, shape=None, strides=None)
                self._blanks[i] = blank
            elif i not in positions:
                self._args[i] = a
        self._positions = positions
        self._tail = tail

    @classmethod
    def build(cls, compiled: Any, grid: tuple, args: tuple, tail: tuple,
              values: tuple) -> TritonLaunch | None:  # fmt: skip
        """As :meth:`RawLaunch.build`, for any Triton whose compiled kernel has a launcher."""
        positions = _holes(args, values)
        fields = ("run", "function", "packed_metadata")
        if positions is None or any(getattr(compiled, f, None) is None for f in fields):
            return None  # (a Triton whose compiled kernel lacks a launcher field: the JIT)
        return cls(compiled, grid, args, tail, positions)

    def __call__(self, stream: int, values: tuple) -> None:
        args = self._args.copy()
        for i, value in zip(self._positions, values, strict=True):
            blank = self._blanks.get(i)
            if blank is not None:  # the same block and layout around this call's tensor
                desc = object.__new__(blank.__class__)
                desc.__dict__.update(blank.__dict__, base=value, shape=list(value.shape),
                                     strides=list(value.stride()))  # fmt: skip
                value = desc
            elif value.__class__ is torch.Tensor:
                value = value.data_ptr()
            args[i] = value
        g0, g1, g2, function, packed = self._head
        self._run(g0, g1, g2, stream, function, packed, None, None, None, *args, *self._tail)
