#!/usr/bin/env bash
# GPU box (2+ GPUs): BucketedDDP tests (gloo and NCCL), then benchmarks/ddp.py on 2 GPUs;
# the short table comes last.
#   bash benchmarks/gpu_check_ddp.sh            (writes logs/results under ${OUT:-/tmp/flashsys})
#   SIZE=large bash benchmarks/gpu_check_ddp.sh (a smaller model; default xl)
set -u
OUT=${OUT:-/tmp/flashsys}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider \
  tests/distributed/test_ddp.py 2>&1 | tee "$OUT/ddp_gpu_tests.log" | tail -8
timeout ${BENCH_TIMEOUT:-900} torchrun --standalone --nproc_per_node=2 benchmarks/ddp.py \
  --size "${SIZE:-xl}" --out "$OUT/ddp.json" 2>"$OUT/ddp.err" | tee "$OUT/ddp.md"
tail -3 "$OUT/ddp.err"
