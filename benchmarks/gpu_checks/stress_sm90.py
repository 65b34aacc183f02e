"""Many random problems on the Hopper kernels against float64 (more than the GPU suite draws).

The GPU suite's property tests draw short problems (up to 700 tokens) and 20-40 examples; the
fused backward, which the default rule runs only from 1024 tokens, gets a few fixed shapes there.
This script draws many problems per mode with the suite's rule (``check_against_reference``:
out, lse, dq, dk, dv against float64, at most ~2x PyTorch's own error), records every failure
instead of stopping at the first, and counts which kernels ran:

- ``default``: the default rule, query and key lengths 1024-2600 (self-attention or not), head dims
  64 and 128, bf16 / fp16, causal or not, GQA, scale, 3-D and (B, L, H, D) layouts;
- ``fused_all``: ``TORCH_FLASHSYS_SM90_BWD=fused`` (the fused backward on every problem the forward
  takes) and the forward on any key length, problems of 1-700 tokens (ragged tiles, few keys);
- ``features`` and ``packed``: the GPU suite's feature and packed-batch properties (masks, dropout,
  windows, softcap, ALiBi; ``cu_seqlens``), which run on the portable kernels (the count says
  which reached the Hopper ones), up to 300 tokens;
- ``deterministic``: under ``torch.use_deterministic_algorithms(True)``, the shapes where the
  ordered dQ sums run (head dim 64 causal, 128 causal or not, without GQA, 4096-4600 tokens;
  8192 for 128 causal is left out: its float64 reference is slow), each run twice and required
  to give the same bits.

    PYTHONPATH=. python3 benchmarks/gpu_checks/stress_sm90.py --mode default --examples 150

One mode per process (the backward switch is read at import). Failures print as they happen;
after ``--budget`` seconds the remaining examples are skipped; a table prints last (the
examples that ran). A fresh GPU box compiles each kernel variant first: the feature and packed
modes, whose portable kernels have many variants, ran out of a 520 s limit with 400 and 300
examples asked for (H100, 2026-11-26).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from unittest import mock

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
MODES = ["default", "fused_all", "deterministic", "features", "packed"]
parser.add_argument("--mode", choices=MODES, required=True)
parser.add_argument("--examples", type=int, default=100)
parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
parser.add_argument(
    "--budget",
    type=float,
    default=480.0,
    help="seconds: later examples are drawn but not run (the table still prints)",
)
args = parser.parse_args()
if args.mode == "fused_all":
    os.environ["TORCH_FLASHSYS_SM90_BWD"] = "fused"

import torch  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch_flashsys.attention._sm90 as _sm90  # noqa: E402
from tests.attention.cases import Case, check_against_reference, triton_run  # noqa: E402
from tests.attention.test_features import check_features, feature_cases  # noqa: E402
from tests.attention.test_varlen import check_packed, packed_cases  # noqa: E402

LENGTHS = {"default": (1024, 2600), "fused_all": (1, 700), "deterministic": (4096, 4600)}


@st.composite
def problems(draw) -> tuple[Case, torch.dtype]:
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    if args.mode == "features":
        return draw(feature_cases(max_seq=300, head_dims=(16, 64, 128))), dtype
    if args.mode == "packed":
        return draw(packed_cases(max_len=300, head_dims=(64, 128))), dtype
    lo, hi = LENGTHS[args.mode]
    deterministic = args.mode == "deterministic"
    head_dim = draw(st.sampled_from([64, 128]))
    causal = True if deterministic and head_dim == 64 else draw(st.booleans())
    seq_q = draw(st.integers(lo, hi))
    seq_k = seq_q if deterministic or draw(st.booleans()) else draw(st.integers(lo, hi))
    rank3 = not deterministic and draw(st.booleans())
    case = Case(
        batch=draw(st.integers(1, 1 if deterministic else 3)),
        kv_heads=1 if rank3 else draw(st.integers(1, 2)),
        group=1 if deterministic else draw(st.sampled_from([1, 2, 4])),
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        is_causal=causal,
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        rank3=rank3,
        transposed=not rank3 and draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    return case, dtype


def main() -> int:
    stats = {"examples": 0, "sm90 forward": 0, "fused backward": 0, "failures": 0}
    failures: list[str] = []
    start = time.monotonic()
    min_seq = 1 if args.mode == "fused_all" else _sm90.MIN_SEQ_K

    @settings(max_examples=args.examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(problem=problems())
    def check(problem):
        case, dtype = problem
        if time.monotonic() - start > args.budget:
            return
        stats["examples"] += 1
        with (
            mock.patch.object(_sm90, "forward", wraps=_sm90.forward) as fwd,
            mock.patch.object(_sm90, "backward", wraps=_sm90.backward) as bwd,
            mock.patch.object(_sm90, "MIN_SEQ_K", min_seq),
        ):
            try:
                if args.mode == "deterministic":
                    with _deterministic():
                        check_against_reference(case, dtype, triton_run(case), device="cuda")
                        _same_bits_twice(case, dtype)
                elif args.mode == "features":
                    check_features(case, dtype, "triton", device="cuda")
                elif args.mode == "packed":
                    check_packed(case, dtype, "triton", device="cuda")
                else:
                    check_against_reference(case, dtype, triton_run(case), device="cuda")
            except Exception as exc:  # every failure is recorded, none stops the run
                stats["failures"] += 1
                failures.append(f"{case} {dtype}: {type(exc).__name__}: {str(exc)[:300]}")
                print("FAILED", failures[-1], flush=True)
            stats["sm90 forward"] += fwd.call_count > 0
            stats["fused backward"] += bwd.call_count > 0
        torch.cuda.empty_cache()

    if args.seed is not None:
        seed(args.seed)(check)()
    else:
        check()
    print(f"\n`stress_sm90.py --mode {args.mode} --examples {args.examples}`, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.monotonic() - start:.0f} s\n")  # fmt: skip
    print("| mode | " + " | ".join(stats) + " |")
    print("|---" * (len(stats) + 1) + "|")
    print(f"| {args.mode} | " + " | ".join(str(v) for v in stats.values()) + " |")
    return 1 if failures else 0


class _deterministic:
    def __enter__(self):
        self.before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.before)


def _same_bits_twice(case: Case, dtype: torch.dtype) -> None:
    grads = []
    for _ in range(2):
        q, k, v = case.make(dtype, "cuda")
        out, lse = triton_run(case)(q, k, v)
        out.backward(torch.ones_like(out))
        grads.append((out, lse, q.grad, k.grad, v.grad))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *grads, strict=True):
        if not torch.equal(a, b):
            raise AssertionError(f"{name} differs between two deterministic runs")


if __name__ == "__main__":
    sys.exit(main())
