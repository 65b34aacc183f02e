"""GPU box: the fused head-dim-64 backward's program order on causal problems, heads fastest (the
default) against keys fastest (as the head-dim-128 split kernel runs), kernel-only ``do_bench``
medians over the ``--rule`` grid's causal shapes, beside the portable backward's kernels (one
process, same tensors).

    python3 benchmarks/gpu_checks/order_ab.py [--out order_ab.csv]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import benchmarks.sm90_bwd as bwd
from benchmarks._harness import parser, report


def main() -> None:
    args = parser(__doc__, smoke="(none: GPU only)").parse_args()
    bwd.FUSED_VARIANTS = {"heads first": {"ORDER": bwd._sm90.HEADS_FIRST},
                          "keys first": {"ORDER": bwd._sm90.KEYS_FIRST}}  # fmt: skip
    shapes = [shape for shape in bwd.RULE_SHAPES if shape[5]]  # causal, head dim 64
    rows = []
    for shape in shapes:
        for r in bwd.variant_rows(shape):
            rows.append({"shape": r["shape"], "impl": f"fused, {r['variant']}",
                         "kernel_ms": r["kernel_ms"]})  # fmt: skip
        for r in bwd.rows_for(shape, "cuda", {"portable": bwd.VARIANTS["portable"]}):
            if r["impl"] == "portable":
                rows.append({"shape": r["shape"], "impl": "portable",
                             "kernel_ms": r["bwd_kernels_ms"]})  # fmt: skip
    report("Fused backward (d 64, causal): program order, kernel ms", rows,
           ("shape", "impl", "kernel_ms"), args.out)  # fmt: skip


if __name__ == "__main__":
    main()
