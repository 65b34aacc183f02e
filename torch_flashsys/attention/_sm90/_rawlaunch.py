"""The Hopper kernels' repeat launches with less host work than Triton's launcher.

After a kernel's first call for a launch key, ``_sm90`` launches the compiled kernel directly
(``CompiledKernel.run``, Triton's launcher object). On Triton 3.6 that launcher still does, per
call, in Python: the scratch allocations (none for these kernels), a loop over every argument that
expands each host ``TensorDescriptor`` into its ``CUtensorMap`` (``cuTensorMapEncodeTiled``),
shape and strides, and in C a ``data_ptr()`` call and a ``cuPointerGetAttribute`` per tensor.
:class:`RawLaunch` does the same launch from the launcher's C entry point with what the key fixes
precomputed: each descriptor's map is encoded once per (slot, address) and kept (a map is a pure
function of the address, shape, strides, block and swizzle, and the launch key fixes all but the
address, so a kept map is never stale), its shape and strides spliced in from a template, and
tensors passed as their addresses. It is built only where the launcher has the layout this was
written against (:func:`RawLaunch.build` returns None otherwise, and the caller keeps Triton's
launcher): Triton 3.6's ``wrap_handle_tensordesc`` closure, no scratch memory, no launch hooks.
"""

from __future__ import annotations

from typing import Any

import torch

MAX_MAPS = 64  # kept maps per descriptor slot (addresses); beyond that the slot starts afresh


class RawLaunch:
    """A compiled kernel's launch from its launcher's C entry point (see the module docstring).

    Calls take the kernel's runtime arguments in parameter order with each descriptor's tensor in
    its place (the descriptor's shape, strides, block and swizzle are the key's, taken from the
    descriptors :meth:`build` saw); ``tail``: its constexprs (fixed per launch key).
    """

    def __init__(self, raw, encode, grid, head: tuple, slots: list, tail: tuple) -> None:
        self._raw = raw
        self._encode = encode  # (address, *encode args) -> CUtensorMap
        self._grid = grid
        self._head = head  # (cooperative, pdl, None, None, packed metadata, None, None, None)
        self._slots = slots  # per descriptor: (position, encode args, shape + strides, maps)
        self._tail = tail

    @classmethod
    def build(cls, compiled: Any, grid: tuple, args: tuple, tail: tuple,
              encode: Any = None) -> RawLaunch | None:  # fmt: skip
        """The raw launch of ``compiled`` (a Triton ``CompiledKernel``) for ``args`` like these,
        or None where its launcher is not the layout this module knows. ``encode``: the map
        encoder (default the driver's ``fill_tma_descriptor``; tests pass a stand-in)."""
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
            slots = []
            for position, meta in zip(sorted(indices), metas, strict=True):
                desc = args[position]
                if meta is None or meta["fp4_padded"] or desc.padding == "nan":
                    return None
                enc = (meta["swizzle"], meta["elem_size"],
                       TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
                       list(desc.shape), list(desc.strides), 0)  # fmt: skip
                slots.append((position, enc, (*desc.shape, *desc.strides), {}))
            if not slots:
                return None
            head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                    compiled.packed_metadata, None, None, None)  # fmt: skip
        except (AttributeError, KeyError, TypeError, ValueError, ImportError):
            return None
        return cls(raw, encode, grid, head, slots, tail)

    def __call__(self, stream: int, function: int, args: tuple) -> None:
        g0, g1, g2 = self._grid
        flat: list = [g0, g1, g2, stream, function, *self._head]
        slots = iter(self._slots)
        position, enc, dims, maps = next(slots)
        for i, a in enumerate(args):
            if i != position:
                flat.append(a.data_ptr() if a.__class__ is torch.Tensor else a)
                continue
            ptr = a.data_ptr()
            tensor_map = maps.get(ptr)
            if tensor_map is None:
                if list(a.shape) != enc[4] or list(a.stride()) != enc[5]:
                    raise RuntimeError("RawLaunch: a descriptor's shape differs from its key's")
                if len(maps) >= MAX_MAPS:
                    maps.clear()
                tensor_map = maps[ptr] = self._encode(ptr, *enc)
            flat.append(tensor_map)
            flat += dims
            position, enc, dims, maps = next(slots, _DONE)
        flat += self._tail
        self._raw(*flat)


_DONE = (-1, None, None, None)
