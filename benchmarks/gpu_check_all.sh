#!/usr/bin/env bash
# GPU box (one GPU): the whole GPU test suite, then a short attention speed check of the same code;
# short tables last. Logs under ${OUT:-/tmp/flashsys}.
#   bash benchmarks/gpu_check_all.sh            (WORKERS=8 pytest-xdist processes by default)
#   TESTS="tests/attention/test_gpu.py" BENCH=0 bash benchmarks/gpu_check_all.sh   (a part only)
# Kernel compilation dominates the test time (every feature combination is its own kernel) and
# varies between boxes: the attention/models/memory part took 301 s and, on another H100 box the
# same day (2026-11-23), 507 s with 8 workers. A call may run 600 s, so run the suite in parts:
#   TESTS=tests/attention/test_gpu.py BENCH=0 bash benchmarks/gpu_check_all.sh
#   TESTS="tests/attention/test_compile.py tests/attention/test_module.py tests/models \
#          tests/test_memory_snapshot.py" BENCH=0 bash benchmarks/gpu_check_all.sh
# and tests/distributed without xdist workers (NCCL process groups): the first step of
# benchmarks/gpu_check_ddp.sh, or `python3 -m pytest -q -m gpu tests/distributed`.
# 1. pytest -m gpu tests (default kernel configs: TORCH_FLASHSYS_AUTOTUNE=0, so each variant
#    compiles once; the test processes compile in parallel)
# 2. flash.py: the issue-10 single shapes (ours beside SDPA cuDNN and flash) and the host overhead
set -u
start=$SECONDS
. benchmarks/_gpu_env.sh
env_stamp "$OUT/env.txt"
TORCH_FLASHSYS_AUTOTUNE=0 HYPOTHESIS_PROFILE=gpu timeout ${TEST_TIMEOUT:-480} \
  python3 -m pytest -v -p no:cacheprovider -m gpu -n ${WORKERS:-8} ${TESTS:-tests} -rf \
  > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?, $((SECONDS - start)) s" >> "$OUT/gpu_tests.log"
left=$(( ${BUDGET:-560} - (SECONDS - start) ))
if [ "${BENCH:-1}" = 1 ] && [ "$left" -gt 60 ]; then
  timeout $((left - 10)) python3 benchmarks/flash.py --batch 1 --heads 16 --seq 16384,4096 \
    --dim 64,128 --modes fwd,fwd+bwd --impls "flash_attention,sdpa cudnn_attention,sdpa flash_attention" \
    --host-overhead --no-check --out "$OUT/final_shapes.csv" > "$OUT/final_shapes.md" 2> "$OUT/final_shapes.err"
  echo "flash.py exit $?, $((SECONDS - start)) s" >> "$OUT/final_shapes.err"
fi
echo "== pytest -m gpu tests"
grep -E "PASSED|FAILED|ERROR" "$OUT/gpu_tests.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort | cut -c1-120
grep -E "passed|failed|exit" "$OUT/gpu_tests.log" | tail -3
tail -2 "$OUT/final_shapes.err"
tail -24 "$OUT/final_shapes.md"
echo "== done in $((SECONDS - start)) s"
