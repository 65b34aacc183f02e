#!/usr/bin/env bash
# GPU box (H100): attention GPU tests, then the cs336 preset and SDPA backends; short table last.
#   bash benchmarks/gpu_check_attention.sh            (writes logs/CSVs under ${OUT:-/tmp/flashsys})
set -u
OUT=${OUT:-/tmp/flashsys}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# Tests: default kernel configs only (TORCH_FLASHSYS_AUTOTUNE=0) so each variant compiles once.
TORCH_FLASHSYS_AUTOTUNE=0 HYPOTHESIS_PROFILE=gpu timeout ${TEST_TIMEOUT:-300} \
  python3 -m pytest -q -m gpu tests/attention -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
# Benchmark with autotuning on.
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/flash.py --preset cs336 --out "$OUT/cs336.csv" \
  2>"$OUT/cs336.err" | tee "$OUT/cs336.md"
tail -3 "$OUT/cs336.err"
