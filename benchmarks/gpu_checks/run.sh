#!/usr/bin/env bash
# GPU box: the GPU tests and benchmarks of the committed code, one section per call (each fits a
# 10-minute limit); logs, CSVs and tables under ${OUT:-/tmp/flashsys}, short tables printed last.
#   bash benchmarks/gpu_checks/run.sh SECTION...     (from the repository root)
# Sections and their variables: docs/benchmarking.md ("GPU box").
set -u
OUT=${OUT:-/tmp/flashsys}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $((${BUDGET:-$1} - (SECONDS - start))); }  # left DEFAULT_BUDGET: seconds left
step() {  # step NAME SECONDS CMD...: stdout to NAME.md, stderr to NAME.err, exit code and time last
  local name=$1 secs=$2
  shift 2
  timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.md" 2>"$OUT/$name.err"
  echo "$name exit $?, $((SECONDS - start)) s" >>"$OUT/$name.err"
}
show() {  # show NAME [LINES]: the step's exit line and the tail of its output
  echo "== $1"
  tail -n 1 "$OUT/$1.err"
  tail -n "${2:-24}" "$OUT/$1.md"
}
shows() { for s in "$@"; do show "${s%:*}" "${s#*:}"; done; }  # shows NAME:LINES...
pack() {  # pack DIR: $OUT/DIR as DIR.tgz (tables, plots) and DIR_traces.tar (the TRACES files,
  # default every trace_*; ~4 MB each for the 2.0B LM), then removes DIR
  [ -d "$OUT/$1" ] || return 0
  tar czf "$OUT/$1.tgz" -C "$OUT" --exclude='*.json.gz' "$1"
  (cd "$OUT/$1" && ls ${TRACES:-trace_*} >/dev/null 2>&1 && tar cf "$OUT/$1_traces.tar" ${TRACES:-trace_*})
  rm -rf "${OUT:?}/$1"
}
ngpus() { python3 -c "import torch; print(min(${1:-64}, torch.cuda.device_count()))"; }
HOST=(--batch 1 --heads 4 --seq 128 --dim 64 --modes fwd --no-check --host-overhead)
PEERS="flash_attention,sdpa cudnn_attention,sdpa flash_attention"

tests() {  # (six test processes: ten ran an 80 GB H100 out of memory, docs/benchmarks.md)
  TORCH_FLASHSYS_AUTOTUNE=0 HYPOTHESIS_PROFILE=gpu step gpu_tests "${TEST_TIMEOUT:-480}" \
    python3 -m pytest -v -p no:cacheprovider -m gpu -n "${WORKERS:-6}" ${TESTS:-tests} -rf --durations=15
  if [ "${BENCH:-1}" = 1 ] && [ "$(left 560)" -gt 60 ]; then
    step final_shapes $(($(left 560) - 10)) python3 benchmarks/flash.py --batch 1 --heads 16 \
      --seq 16384,4096 --dim 64,128 --modes fwd,fwd+bwd --impls "$PEERS" --host-overhead \
      --no-check --out "$OUT/final_shapes.csv"
  fi
  grep -E "PASSED|FAILED|ERROR" "$OUT/gpu_tests.md" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' \
    | sort | cut -c1-120
  show gpu_tests 3
  [ -f "$OUT/final_shapes.md" ] && show final_shapes
}

attention() {
  step overhead 120 python3 benchmarks/flash.py "${HOST[@]}" --impls flash_attention --profile-host
  step peers "${PEERS_TIMEOUT:-420}" python3 benchmarks/flash.py --preset peers --workers 8 \
    --out "$OUT/attention_peers_h100.csv"
  step target_4096 120 python3 benchmarks/flash.py --batch 1 --heads 16 --seq 4096 --dim 64 \
    --modes fwd+bwd --impls "$PEERS" --out "$OUT/target_4096.csv"
  step longest 120 python3 benchmarks/flash.py --batch 1 --heads 16 --seq 262144 --dim 64 \
    --modes fwd+bwd --impls flash_attention --no-check
  grep -E "us/call|tottime|^ +[0-9]" "$OUT/overhead.err" | head -24
  shows longest:3 target_4096:6 overhead:9 peers:60
}

features() {
  step features "${FEATURES_TIMEOUT:-240}" python3 benchmarks/flash.py --preset features \
    --out "$OUT/attention_features_h100.csv"
  step varlen "${VARLEN_TIMEOUT:-200}" python3 benchmarks/flash.py --preset varlen \
    --out "$OUT/attention_varlen_h100.csv"
  [ "${PROFILE:-1}" = 1 ] && step profile 120 python3 benchmarks/flash.py --profile
  shows profile:30 varlen:16 features:30
}

startup() {
  step startup 240 python3 benchmarks/flash.py --first-call --out "$OUT/attention_startup.csv"
  step varlen 150 python3 benchmarks/flash.py --preset varlen --out "$OUT/attention_varlen.csv"
  step host 120 python3 benchmarks/flash.py "${HOST[@]}" --impls "$PEERS" --out "$OUT/attention_host.csv"
  shows startup:40 varlen:40 host:40
}

tune() {
  step tune "${TUNE_TIMEOUT:-330}" python3 benchmarks/tune_attention.py ${TUNE_ARGS:-} --out "$OUT/tune.csv"
  step tune_decode 120 python3 benchmarks/tune_attention.py --kernels decode --out "$OUT/tune_decode.csv"
  TORCH_FLASHSYS_AUTOTUNE=0 HYPOTHESIS_PROFILE=gpu step attention_tests "${TEST_TIMEOUT:-240}" \
    python3 -m pytest -q -m gpu tests/attention -x -p no:cacheprovider
  shows attention_tests:12 tune_decode:16 tune:60
}

harness() {
  local deadline=$((SECONDS + ${TOTAL_BUDGET:-450}))
  step snapshot_tests 45 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_memory_snapshot.py
  step model "${MODEL_TIMEOUT:-100}" python3 benchmarks/model.py --size small,medium,large,xl,2.7B \
    --context-length 512 --dtype fp32,bf16 --mode fwd,fwd+bwd --warmup 2 --steps 5 \
    --out "$OUT/model.csv" --plot "$OUT/model.png"
  step memory "${MEMORY_TIMEOUT:-80}" python3 benchmarks/model.py --preset memory \
    --out "$OUT/memory.csv" --plot "$OUT/memory.png"
  step snapshot "${SNAPSHOT_TIMEOUT:-45}" python3 benchmarks/model.py --size 2.7B --context-length 128 \
    --dtype bf16 --mode train --warmup 1 --steps 1 --memory-max-entries "${SNAPSHOT_ENTRIES:-30000}" \
    --memory-profile "$OUT/snapshot.pickle"
  # The sweep gets what is left: configurations it cannot start in time are rows marked
  # 'skipped (time budget)'. SWEEP_AUTOTUNE=0: default kernel configs (faster to run).
  local budget=$((deadline - SECONDS - 45))
  TORCH_FLASHSYS_AUTOTUNE="${SWEEP_AUTOTUNE:-1}" step sweep $((budget + 40)) python3 benchmarks/flash.py \
    --preset sweep --dtype bf16 --modes fwd,bwd --time-budget "$budget" --out "$OUT/sweep.csv" \
    --impls "flash_attention,naive,naive (compiled),sdpa flash_attention" --plot "$OUT/sweep.png"
  shows snapshot_tests:3 snapshot:3
  tail -n 2 "$OUT/snapshot.err"
  shows model:24 memory:16 sweep:8
}

ddp() {
  local n=${NPROC:-$(ngpus)} marker=gpu
  [ "$n" -ge 2 ] && marker="gpu or multigpu"
  [ "${SKIP_TESTS:-0}" != 1 ] && step ddp_tests "${DDP_TEST_TIMEOUT:-200}" python3 -m pytest -v \
    -p no:cacheprovider -rf --durations=20 -n "${DDP_WORKERS:-1}" -m "$marker" tests/distributed
  # The benchmark gets what is left but ~150 s kept for the profile; it starts no round that
  # would not fit (round 1 always runs: about 80 s on one H200 for the 11 variants).
  local bench=$(($(left 530) - 150)) v=plain,torch-ddp,torch-ddp-zero,torch-fsdp2,torch-fsdp2-noreshard
  v=$v,torch-fsdp2-bf16,torch-fsdp2-bf16-noreshard,ours-ddp,ours-ddp-copy,ours-ddp-zero1,ours-ddp-zero2
  v=${BENCH_VARIANTS:-$v,ours-ddp-keep,ours-ddp-zero1-keep,ours-ddp-zero2-keep}
  [ "${SKIP_BENCH:-0}" != 1 ] && step ddp_bench $((bench + 90)) torchrun --standalone \
    --nproc_per_node="$n" benchmarks/ddp.py ${BENCH_ARGS:---preset 2.0B} --variants "$v" \
    --time-budget "$bench"
  cp docs/data/ddp_"$n"x*.csv "$OUT"/ 2>/dev/null
  local prof=$(($(left 530) - 25))
  [ "$prof" -gt 45 ] && step ddp_profile $((prof + 20)) torchrun --standalone \
    --nproc_per_node="$n" benchmarks/ddp.py ${BENCH_ARGS:---preset 2.0B} --profile "$OUT/profile" \
    --warmup 2 --profile-steps 3 --time-budget "$prof" --trace \
    --variants "${PROFILE_VARIANTS:-plain,torch-ddp,ours-ddp,torch-ddp-zero,ours-ddp-zero1,ours-ddp-zero2}"
  pack profile
  [ -f "$OUT/ddp_tests.md" ] && grep -E "PASSED|FAILED|ERROR" "$OUT/ddp_tests.md" | cut -c1-120 \
    && show ddp_tests 4
  [ -f "$OUT/ddp_profile.md" ] && show ddp_profile 24
  [ -f "$OUT/ddp_bench.md" ] && show ddp_bench 18
}

sharded() {
  step sharded_bench "${BENCH_TIMEOUT:-500}" torchrun --standalone \
    --nproc_per_node="${NPROC:-2}" benchmarks/ddp.py ${BENCH_ARGS:---preset sharded} \
    --variants torch-ddp,torch-ddp-zero,torch-ddp-zero-view,torch-ddp-sharded \
    --out "$OUT/sharded_optimizer.csv"
  show sharded_bench 12
}

e2e() {  # issue 27's training step; E2E_ARGS e.g. "--compiled eager" to split it across calls
  step e2e "${E2E_TIMEOUT:-560}" python3 benchmarks/model.py --preset e2e ${E2E_ARGS:-} \
    --out "$OUT/e2e_h100.csv"
  shows e2e:16
}

sm90bwd() {  # the Hopper backward kernels (opt-in): their GPU tests, the A/B, then (if both ran) the
  # whole GPU suite with it switched on (TESTS, TEST_TIMEOUT as in "tests")
  HYPOTHESIS_PROFILE=gpu step bwd_tests "${BWD_TEST_TIMEOUT:-150}" python3 -m pytest -q -rf \
    -p no:cacheprovider -m gpu -n 4 -x tests/attention/test_sm90.py
  if tail -n 1 "$OUT/bwd_tests.err" | grep -q "exit 0,"; then
    step bwd_bench "${BWD_BENCH_TIMEOUT:-150}" python3 benchmarks/sm90_bwd.py --out "$OUT/sm90_bwd_h100.csv"
    step bwd_rule "${BWD_RULE_TIMEOUT:-120}" python3 benchmarks/sm90_bwd.py --rule \
      --out "$OUT/sm90_fused_rule_h100.csv"
    if tail -n 1 "$OUT/bwd_bench.err" | grep -q "exit 0,"; then
      TORCH_FLASHSYS_SM90_BWD=${SM90_BWD:-fused} BENCH=0 tests
    fi
  fi
  shows bwd_tests:8
  [ -f "$OUT/bwd_bench.md" ] && show bwd_bench 30 && tail -n 5 "$OUT/bwd_bench.err"
  [ -f "$OUT/bwd_rule.md" ] && show bwd_rule 34
}

deterministic() {  # the ordered (deterministic) fused backward: its GPU tests, then the A/B
  # under torch.use_deterministic_algorithms(True) against the portable backward and cuDNN
  # (DET_SHAPES, e.g. "1x16/16x16384x128c,..."; default: sm90_bwd.py's DETERMINISTIC_SHAPES)
  HYPOTHESIS_PROFILE=gpu step det_tests "${DET_TEST_TIMEOUT:-200}" python3 -m pytest -q -rf \
    -p no:cacheprovider -m gpu -n 4 -x tests/attention/test_sm90.py -k deterministic
  step det_bench "${DET_BENCH_TIMEOUT:-300}" python3 benchmarks/sm90_bwd.py --deterministic \
    ${DET_SHAPES:+--shapes "$DET_SHAPES"} --out "$OUT/sm90_deterministic.csv"
  shows det_tests:4 det_bench:60
}

forward() {  # the Hopper forward: its GPU tests (test_sm90.py), compile-time variants beside cuDNN
  # (FWD_SHAPES, e.g. "1x16/16x16384x128c,..."; default: sm90_fwd.py's SHAPES), the cycle timeline
  HYPOTHESIS_PROFILE=gpu step sm90_tests "${SM90_TEST_TIMEOUT:-240}" python3 -m pytest -q -rf \
    -p no:cacheprovider -m gpu -n 4 tests/attention/test_sm90.py
  step fwd_variants "${FWD_TIMEOUT:-200}" python3 benchmarks/sm90_fwd.py \
    ${FWD_SHAPES:+--shapes "$FWD_SHAPES"} --out "$OUT/sm90_fwd.csv"
  step fwd_timeline 150 python3 benchmarks/sm90_fwd.py --timeline --shapes \
    "${TIMELINE_SHAPES:-1x16/16x16384x128c,1x16/16x16384x128,1x16/16x16384x64c}" \
    --out "$OUT/sm90_fwd_timeline.csv"
  shows sm90_tests:4 fwd_variants:24 fwd_timeline:40
}

pins() {  # the Hopper kernels with and without pinned product waits (FWD_PIN_WAIT, BWD_PIN_WAIT)
  step pin_ab "${PIN_TIMEOUT:-360}" python3 benchmarks/gpu_checks/pin_wait_ab.py \
    --out "$OUT/pin_wait_ab.csv"
  shows pin_ab:48
}

context_parallel() {
  local n=${NPROC:-$(ngpus 2)} marker=gpu modes=ring
  [ "$n" -ge 2 ] && marker="gpu or multigpu" && modes=ring,ulysses
  [ "${SKIP_TESTS:-0}" != 1 ] && step cp_tests 150 python3 -m pytest -q -p no:cacheprovider -m "$marker" \
    tests/distributed/test_context_parallel.py
  step cp_bench "$(left 300)" python3 benchmarks/context_parallel.py --nproc "$n" \
    --modes "$modes" --parts "${CP_PARTS:-longest,attention}" \
    ${BENCH_ARGS:---time-budget ${SEARCH_S:-100}} --out "$OUT/context_parallel.csv"
  [ -f "$OUT/cp_tests.md" ] && show cp_tests 4
  show cp_bench 16
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/env.txt"
echo "git $(git rev-parse --short HEAD 2>/dev/null) (uncommitted changes: \
$(git status --porcelain 2>/dev/null | wc -l))" | tee -a "$OUT/env.txt"
for section in "${@:-tests}"; do
  case $section in
    tests | attention | features | startup | tune | harness | ddp | sharded | e2e | context_parallel | sm90bwd | deterministic | forward | pins) "$section" ;;
    *) echo "unknown section $section (see docs/benchmarking.md)" >&2 && exit 2 ;;
  esac
done
echo "== done in $((SECONDS - start)) s"
