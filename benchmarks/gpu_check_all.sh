#!/usr/bin/env bash
# GPU box (one GPU): the whole GPU test suite, then a short attention speed check of the same code;
# short tables last. Logs under ${OUT:-/tmp/flashsys}.
#   bash benchmarks/gpu_check_all.sh            (WORKERS=6 pytest-xdist processes by default)
# 1. pytest -m gpu tests (default kernel configs: TORCH_FLASHSYS_AUTOTUNE=0, so each variant
#    compiles once; the test processes compile in parallel)
# 2. flash.py: the issue-10 single shapes (ours beside SDPA cuDNN and flash) and the host overhead
set -u
start=$SECONDS
OUT=${OUT:-/tmp/flashsys}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "git $(git rev-parse --short HEAD 2>/dev/null) (uncommitted changes: $(git status --porcelain 2>/dev/null | wc -l))"
} | tee "$OUT/env.txt"
TORCH_FLASHSYS_AUTOTUNE=0 HYPOTHESIS_PROFILE=gpu timeout ${TEST_TIMEOUT:-420} \
  python3 -m pytest -q -p no:cacheprovider -m gpu -n ${WORKERS:-6} tests -rf \
  > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?, $((SECONDS - start)) s" >> "$OUT/gpu_tests.log"
left=$(( ${BUDGET:-560} - (SECONDS - start) ))
if [ "$left" -gt 60 ]; then
  timeout $((left - 10)) python3 benchmarks/flash.py --batch 1 --heads 16 --seq 16384,4096 \
    --dim 64,128 --modes fwd,fwd+bwd --impls "flash_attention,sdpa cudnn_attention,sdpa flash_attention" \
    --host-overhead --no-check --out "$OUT/final_shapes.csv" > "$OUT/final_shapes.md" 2> "$OUT/final_shapes.err"
  echo "flash.py exit $?, $((SECONDS - start)) s" >> "$OUT/final_shapes.err"
fi
echo "== pytest -m gpu tests"
grep -E "FAILED|ERROR|passed|failed|exit" "$OUT/gpu_tests.log" | tail -15
tail -2 "$OUT/final_shapes.err"
tail -24 "$OUT/final_shapes.md"
echo "== done in $((SECONDS - start)) s"
