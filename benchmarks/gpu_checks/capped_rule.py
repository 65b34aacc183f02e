"""A benchmark run under the Hopper backward's length rule as it was until 2026-11-27 (the fused
and split kernels' ranges ending at 16384 query rows and keys: longer problems took the portable
backward), for an A/B against the default rule in another process. The arguments are
``benchmarks/model.py``'s, e.g. the 32k-token training step:

    PYTHONPATH=. python3 benchmarks/gpu_checks/capped_rule.py --preset e2e --context-length 32768 \
        --tokens 32768 --compiled compiled --out e2e_capped.csv
"""

import sys

from torch_flashsys.attention import _sm90

CAP = 16384  # the tables' upper bound before the twenty-third session


def cap_rules(cap: int = CAP) -> None:
    """Every length range of the default (non-deterministic) Hopper backward ends at ``cap``."""
    for table in (_sm90.FUSED_SEQ_Q, _sm90.SPLIT_SEQ_Q):
        for kind, (lo, hi) in list(table.items()):
            table[kind] = (lo, min(hi, cap))


if __name__ == "__main__":
    cap_rules()
    from benchmarks import model

    model.main(sys.argv[1:])
