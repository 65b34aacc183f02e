"""Guarded import of Gluon (``triton.experimental.gluon``) and its Hopper module.

Gluon's API moves between Triton releases; the Hopper kernels are written against Triton 3.6.
``AVAILABLE`` is False where the import fails (no Gluon, another API): the kernels are then not
defined and the portable Triton kernels serve every call.
"""

from __future__ import annotations

try:  # the names the sm90 kernels use, all of them, so a partial API counts as absent
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    AVAILABLE = hasattr(gl, "warp_specialize") and hasattr(gl, "NVMMADistributedLayout")
except Exception:  # ImportError, or an API whose import itself fails
    gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    AVAILABLE = False

__all__ = [
    "AVAILABLE",
    "TensorDescriptor",
    "gl",
    "gluon",
    "mbarrier",
    "tma",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]
