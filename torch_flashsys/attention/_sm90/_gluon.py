"""Guarded import of Gluon (``triton.experimental.gluon``) and its Hopper module.

Gluon's API moves between Triton releases; the Hopper kernels are written against Triton 3.6 and
also compile with 3.9, whose TMA copies are named ``async_load`` / ``async_store`` (3.6:
``async_copy_global_to_shared`` / ``async_copy_shared_to_global``): :data:`tma_load` and
:data:`tma_store` are whichever this Triton has, as are :data:`thread_barrier` (3.9:
``gl.barrier``) and :data:`tma_reduce_add` (3.9: ``tma.async_atomic_add``; 3.6 has the IR
operation but no Python name, so it is defined here). ``AVAILABLE`` is False where the import fails
(no Gluon, another API): the kernels are then not defined and the portable Triton kernels serve
every call. ``VERIFIED`` says whether this Triton is one the kernels were run and checked on.
"""

from __future__ import annotations

try:  # the names the sm90 kernels use, all of them, so a partial API counts as absent
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.9: ``barrier``
    tma_reduce_add = getattr(tma, "async_atomic_add", None)  # 3.9; 3.6 has only the IR op
    if tma_reduce_add is None:
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        _ADD = _ir.DESCRIPTOR_REDUCE_KIND.ADD

        @_builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """TMA bulk reduction: add ``src`` (shared memory) into the global tile at ``coord``
            (what 3.9 names ``tma.async_atomic_add``); completes as a TMA store group."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ADD, tensor_desc.handle, coord, src.handle)

    AVAILABLE = hasattr(gl, "warp_specialize") and hasattr(gl, "NVMMADistributedLayout")

    @gluon.jit
    def clock64(x):
        """%clock64, for the kernels' ``PROBE == 3`` timelines; ``x`` any scalar (a dependence
        that keeps the read in place)."""
        return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=gl.int64,
                                         is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def schedule_fence(x):
        """A read of %clock, which ptxas keeps in program order with the instructions around it
        (so that timelines mean something): placed before a ``warpgroup_mma_wait``, it stops
        ptxas from hoisting the wait (``WARPGROUP.DEPBAR``) above the work written before it to
        overlap the products still in flight. The read needs a use or ptxas drops it: a
        ``bar.warp.sync`` predicated on the clock reading all ones (the warp reads the clock in
        one instruction, so its lanes agree; the warp is converged, so the barrier is harmless
        on the rare cycle it runs, and ptxas emits it as a predicated NOP). ``x``: any scalar.
        Three instructions."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 c;\n"
            "mov.u32 c, %clock; setp.eq.u32 p, c, -1;\n"
            "@p bar.warp.sync -1;\n"
            "mov.u32 $0, $1; }",
            "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def lap(total, since, x):
        """One phase of a ``PROBE == 3`` timeline: ``(total + the cycles since since, now)``;
        ``x`` any scalar (a dependence that keeps the clock read in place)."""
        now = clock64(x)
        return total + (now - since), now

    @gluon.jit
    def store_probes(base, values):
        """The ``PROBE == 3`` timelines' scalars, as float32 at ``base``, ``base + 1``, ..."""
        for i in gl.static_range(len(values)):
            gl.store(base + i, values[i].to(gl.float32))

except Exception:  # ImportError, or an API whose import itself fails
    gluon = gl = fence_async_shared = mbarrier = tma = tma_load = tma_store = None
    thread_barrier = tma_reduce_add = clock64 = lap = store_probes = schedule_fence = None
    warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    AVAILABLE = False

try:
    import triton
    from packaging.version import Version

    # Triton releases whose Gluon ran these kernels on an H100 through the GPU test suite.
    VERIFIED = AVAILABLE and Version(triton.__version__).release[:2] in {(3, 6)}
except Exception:  # no triton, or a version string packaging cannot read
    VERIFIED = False

__all__ = [
    "AVAILABLE",
    "VERIFIED",
    "TensorDescriptor",
    "clock64",
    "fence_async_shared",
    "gl",
    "gluon",
    "lap",
    "mbarrier",
    "schedule_fence",
    "store_probes",
    "thread_barrier",
    "tma",
    "tma_load",
    "tma_reduce_add",
    "tma_store",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]
