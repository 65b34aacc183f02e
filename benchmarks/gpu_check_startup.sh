#!/usr/bin/env bash
# GPU box (one GPU): what a user waits for and the host-bound rows, in one command (~3 min):
#   OUT=<dir> bash benchmarks/gpu_check_startup.sh
# 1. flash.py --first-call: per dtype, the first fwd+bwd in a fresh process with an empty Triton
#    cache, the first call at 8 new lengths, a warm call; SDPA's default in its own fresh process
#    -> $OUT/attention_startup.csv
# 2. flash.py --preset varlen: packed batch (cu_seqlens and nested jagged) and KV-cache decoding
#    beside cuDNN / the copy bound -> $OUT/attention_varlen.csv
# 3. flash.py --host-overhead: host time of one eager fwd+bwd call beside SDPA's backends
#    -> $OUT/attention_host.csv
set -u
start=$SECONDS
. benchmarks/_gpu_env.sh
env_stamp "$OUT/env.txt"
step() {  # name, timeout, command...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.md" 2> "$OUT/$name.err"
  echo "$name exit $?, $((SECONDS - start)) s" >> "$OUT/$name.err"
}
step startup 240 python3 benchmarks/flash.py --first-call --out "$OUT/attention_startup.csv"
step varlen 150 python3 benchmarks/flash.py --preset varlen --out "$OUT/attention_varlen.csv"
step host 120 python3 benchmarks/flash.py --batch 1 --heads 4 --seq 128 --dim 64 --modes fwd \
  --impls "flash_attention,sdpa cudnn_attention,sdpa flash_attention" --no-check --host-overhead \
  --out "$OUT/attention_host.csv"
for name in startup varlen host; do
  echo "== $name"
  tail -n 1 "$OUT/$name.err"
  grep -E "^\|" "$OUT/$name.md" | tail -n 40
done
echo "== done in $((SECONDS - start)) s"
