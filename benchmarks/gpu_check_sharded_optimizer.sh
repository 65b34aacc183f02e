#!/usr/bin/env bash
# GPU box (2 GPUs): ShardedOptimizer tests (gloo and NCCL), then the benchmark (xl); table last.
#   bash benchmarks/gpu_check_sharded_optimizer.sh      (logs and JSON under ${OUT:-/tmp/flashsys})
set -u
OUT=${OUT:-/tmp/flashsys}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())"
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider \
  tests/distributed/test_sharded_optimizer.py 2>&1 | tee "$OUT/sharded_optimizer_tests.log" | tail -5
timeout ${BENCH_TIMEOUT:-500} torchrun --nproc_per_node=${NPROC:-2} benchmarks/sharded_optimizer.py \
  --size ${SIZE:-xl} --out "$OUT/sharded_optimizer.json" 2>"$OUT/sharded_optimizer.err" \
  | tee "$OUT/sharded_optimizer.md"
tail -3 "$OUT/sharded_optimizer.err"
