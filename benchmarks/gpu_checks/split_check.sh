#!/usr/bin/env bash
# GPU box: the head-dim-128 fused (split) backward: its float64 tests (with the head-dim-64 fused
# ones), kernel-only variants, then the backward A/B against the portable kernels and cuDNN.
#   OUT=/tmp/x bash benchmarks/gpu_checks/split_check.sh
set -u
OUT=${OUT:-/tmp/flashsys}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu TORCH_FLASHSYS_AUTOTUNE=0
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/attention/test_sm90.py \
  -k "fused" -rf >"$OUT/tests.log" 2>&1
echo "tests exit $?"
timeout 120 python3 benchmarks/sm90_bwd.py --variants --head-dim 128 --out "$OUT/variants.csv" \
  >"$OUT/variants.md" 2>&1
echo "variants exit $?"
timeout "${AB_TIMEOUT:-200}" python3 benchmarks/sm90_bwd.py --out "$OUT/sm90_bwd.csv" >"$OUT/ab.md" 2>&1
echo "ab exit $?"
tail -n 8 "$OUT/tests.log"
tail -n 12 "$OUT/variants.md"
tail -n 26 "$OUT/ab.md"
