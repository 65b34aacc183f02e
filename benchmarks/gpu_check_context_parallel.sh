#!/usr/bin/env bash
# GPU box: context parallelism (issue "long context across GPUs") in one command of ~5 minutes:
#
#   OUT=<dir> bash benchmarks/gpu_check_context_parallel.sh     # NPROC=1|2 (default: GPUs, max 2)
#   BENCH_ARGS=--smoke bash benchmarks/gpu_check_context_parallel.sh   # dry run of the script on CPU
#
# 1. pytest -m gpu (and with 2+ GPUs multigpu) tests/distributed/test_context_parallel.py: world
#    size 1 on NCCL == flash_attention; ring and Ulysses on 2 GPUs (Triton kernels, NCCL) vs
#    flash_attention on the whole sequence, float32 and bfloat16 (~1 min, mostly compilation)
# 2. benchmarks/context_parallel.py: the longest trainable context of the LLaMA-1B-shaped LM
#    (bf16 autocast, AdamW, batch 1, checkpointed blocks, chunked loss) by binary search on 1 GPU
#    (and per mode on NPROC GPUs), ~110 s per search (it reports the bracket reached), then
#    attention fwd+bwd per rank vs single-GPU flash_attention, incl. the world-size-1 overhead.
# The table is printed last; rows also go to $OUT/context_parallel.csv.
set -u
start=$SECONDS
. benchmarks/_gpu_env.sh
N=${NPROC:-$(python3 -c "import torch; print(min(2, torch.cuda.device_count()))")}
BENCH_ARGS=${BENCH_ARGS:---time-budget ${SEARCH_S:-100}}
env_stamp "$OUT/env.txt"

marker=gpu
[ "$N" -ge 2 ] && marker="gpu or multigpu"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "$marker" \
  tests/distributed/test_context_parallel.py > "$OUT/cp_gpu_tests.log" 2>&1
echo "pytest exit $?, $((SECONDS - start)) s" >> "$OUT/cp_gpu_tests.log"

modes=ring
[ "$N" -ge 2 ] && modes=ring,ulysses
timeout $((${BUDGET:-300} - (SECONDS - start))) python3 benchmarks/context_parallel.py \
  --nproc "$N" --modes "$modes" $BENCH_ARGS --out "$OUT/context_parallel.csv" \
  > "$OUT/cp_bench.md" 2> "$OUT/cp_bench.err"
echo "benchmark exit $?, $((SECONDS - start)) s" >> "$OUT/cp_bench.err"

echo "== pytest -m \"$marker\" tests/distributed/test_context_parallel.py"
grep -E "passed|failed|error|exit" "$OUT/cp_gpu_tests.log" | tail -4
echo "== benchmark"
tail -n 3 "$OUT/cp_bench.err"
tail -n 16 "$OUT/cp_bench.md"
echo "== done in $((SECONDS - start)) s"
