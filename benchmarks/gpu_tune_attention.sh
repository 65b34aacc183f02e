#!/usr/bin/env bash
# GPU box (H100): sweep the attention kernels' tile configs, the eager host overhead, then the
# attention GPU tests; short tables last. Writes CSVs/logs under ${OUT:-/tmp/flashsys}.
#   bash benchmarks/gpu_tune_attention.sh
set -u
OUT=${OUT:-/tmp/flashsys}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${TUNE_TIMEOUT:-330} python3 benchmarks/tune_attention.py ${TUNE_ARGS:---ws} --out "$OUT/tune.csv" \
  > "$OUT/tune.md" 2> "$OUT/tune.err"
tail -4 "$OUT/tune.err"
timeout ${OVERHEAD_TIMEOUT:-120} python3 benchmarks/flash.py --batch 1 --heads 4 --seq 128 --dim 64 \
  --impls "flash_attention,sdpa flash_attention,sdpa cudnn_attention" --modes fwd --host-overhead \
  --no-check > "$OUT/overhead.md" 2> "$OUT/overhead.err"
TORCH_FLASHSYS_AUTOTUNE=0 HYPOTHESIS_PROFILE=gpu timeout ${TEST_TIMEOUT:-240} \
  python3 -m pytest -q -m gpu tests/attention -x -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -12 "$OUT/gpu_tests.log"
tail -8 "$OUT/overhead.md"
cat "$OUT/tune.md"
