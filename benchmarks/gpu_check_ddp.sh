#!/usr/bin/env bash
# GPU box: the DDP / ZeRO tests and benchmark (issues 18 and 19) on every GPU of the machine, in
# one command that fits a 10-minute limit (BUDGET, default 530 s, for everything):
#
#   OUT=<dir> bash benchmarks/gpu_check_ddp.sh          # NPROC=<n> to use fewer GPUs
#   NPROC=2 BENCH_ARGS=--smoke bash benchmarks/gpu_check_ddp.sh   # a dry run of the script on CPU
#
# 1. pytest -m gpu tests/distributed (NCCL at world size 1; with 2+ GPUs also -m multigpu)
# 2. torchrun --nproc_per_node=N benchmarks/ddp.py --preset 2.0B (2.0B LM, batch 4 x 512 per
#    rank, bf16 autocast, AdamW, zero_grad() to None; every variant, 2 interleaved rounds while
#    the budget allows) -> docs/data/ddp_<N>x<gpu>.csv, copied to $OUT
# 3. torch.profiler, a few steps of the main variants -> $OUT/profile/profile_<variant>.txt
# Logs go to $OUT; the short tables are printed last (benchmark table at the very end).
# Expected on one H200: tests ~1.5 min, benchmark ~3 min (2 rounds), profile ~1.5 min.
set -u
start=$SECONDS
. benchmarks/_gpu_env.sh
BUDGET=${BUDGET:-530}
N=${NPROC:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
BENCH_ARGS=${BENCH_ARGS:---preset 2.0B}
left() { echo $((BUDGET - (SECONDS - start))); }
env_stamp "$OUT/env.txt"

marker=gpu
[ "$N" -ge 2 ] && marker="gpu or multigpu"
if [ "${SKIP_TESTS:-0}" != 1 ]; then  # SKIP_TESTS=1: the tests ran already (gpu_check_all.sh)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m "$marker" tests/distributed \
    >"$OUT/ddp_gpu_tests.log" 2>&1
  echo "pytest exit $?, $((SECONDS - start)) s" >>"$OUT/ddp_gpu_tests.log"
fi

# The benchmark gets what is left but ~150 s kept for the profile; it starts no round that
# would not fit (round 1 always runs: about 80 s on one H200 for the 11 variants).
bench=$(($(left) - 150))
variants=plain,torch-ddp,torch-ddp-zero,torch-fsdp2,torch-fsdp2-noreshard,torch-fsdp2-bf16
variants=$variants,torch-fsdp2-bf16-noreshard,ours-ddp,ours-ddp-copy,ours-ddp-zero1,ours-ddp-zero2
timeout $((bench + 90)) torchrun --standalone --nproc_per_node="$N" benchmarks/ddp.py \
  $BENCH_ARGS --variants "$variants" --time-budget "$bench" \
  >"$OUT/ddp_bench.md" 2>"$OUT/ddp_bench.err"
echo "benchmark exit $?, $((SECONDS - start)) s" >>"$OUT/ddp_bench.err"
cp docs/data/ddp_"$N"x*.csv "$OUT"/ 2>/dev/null

prof=$(($(left) - 25))
if [ "$prof" -gt 45 ]; then
  timeout $((prof + 20)) torchrun --standalone --nproc_per_node="$N" benchmarks/ddp.py \
    $BENCH_ARGS --profile "$OUT/profile" --warmup 2 --profile-steps 3 --time-budget "$prof" \
    --variants plain,torch-ddp,ours-ddp,ours-ddp-copy,torch-ddp-zero,ours-ddp-zero2 \
    >"$OUT/ddp_profile.md" 2>"$OUT/ddp_profile.err"
  echo "profile exit $?, $((SECONDS - start)) s" >>"$OUT/ddp_profile.err"
fi

echo
echo "== pytest -m \"$marker\" tests/distributed"
grep -E "passed|failed|error|exit" "$OUT/ddp_gpu_tests.log" | tail -4
echo
echo "== profile ($OUT/profile)"
tail -n 24 "$OUT/ddp_profile.md" 2>/dev/null
tail -n 2 "$OUT/ddp_profile.err" 2>/dev/null
echo
echo "== benchmark ($(ls "$OUT"/ddp_"$N"x*.csv 2>/dev/null))"
tail -n 3 "$OUT/ddp_bench.err"
tail -n 18 "$OUT/ddp_bench.md"
echo "== done in $((SECONDS - start)) s"
