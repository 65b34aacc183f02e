"""GPU box: the ordered (deterministic) fused kernel's variants one process each, with a time
limit per variant (a variant that waits forever is reported, not waited for).

    python3 benchmarks/gpu_checks/ordered_variants.py [--limit 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = {
    "unordered (not deterministic)": {"DETERMINISTIC": False},
    "1 chain, lag 1": {"CHAINS": 1, "SIGNAL_LAG": 1},
    "2 chains, lag 1": {"CHAINS": 2, "SIGNAL_LAG": 1},
    "2 chains, lag 2": {"CHAINS": 2, "SIGNAL_LAG": 2},
    "4 chains, lag 3": {"CHAINS": 4, "SIGNAL_LAG": 3},
}
SHAPES = [(1, 16, 16, 16384, 64, True), (4, 16, 16, 4096, 64, True), (4, 16, 16, 4096, 64, False)]
CODE = """
import json, sys
sys.path.insert(0, {root!r})
import benchmarks.sm90_bwd as bwd
rows = bwd.variant_rows({shape!r}, {{"v": {{"DETERMINISTIC": True, **{extra!r}}}}})
print(json.dumps(rows[0]))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--limit", type=float, default=60.0)
    args = p.parse_args()
    print("| shape | variant | kernel_ms | max_grad_diff |\n|---|---|---|---|")
    for shape in SHAPES:
        for name, extra in VARIANTS.items():
            code = CODE.format(root=ROOT, shape=shape, extra=extra)
            try:
                done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                      text=True, timeout=args.limit)  # fmt: skip
                row = (
                    json.loads(done.stdout.strip().splitlines()[-1])
                    if done.returncode == 0
                    else None
                )
                cell = (
                    f"{row['kernel_ms']:.3f} | {row['max_grad_diff_vs_portable']:.3g}"
                    if row
                    else f"failed: {done.stderr.strip().splitlines()[-1][:80]} |"
                )
            except subprocess.TimeoutExpired:
                cell = f"no result in {args.limit:.0f} s (waits forever?) |"
            print(f"| {shape} | {name} | {cell} |", flush=True)


if __name__ == "__main__":
    main()
