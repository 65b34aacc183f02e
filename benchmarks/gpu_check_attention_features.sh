#!/usr/bin/env bash
# GPU box (H100): the feature and varlen presets (issues 12 and 15) and a torch.profiler breakdown of
# fwd+bwd (ours beside SDPA cuDNN/flash) of the committed code; short tables last.
#   bash benchmarks/gpu_check_attention_features.sh      (CSVs/logs under ${OUT:-/tmp/flashsys})
set -u
start=$SECONDS
. benchmarks/_gpu_env.sh
env_stamp "$OUT/env_features.txt"
timeout ${FEATURES_TIMEOUT:-240} python3 benchmarks/flash.py --preset features \
  --out "$OUT/attention_features_h100.csv" > "$OUT/features.md" 2> "$OUT/features.err"
echo "features exit $?, $((SECONDS - start)) s" >> "$OUT/features.err"
timeout ${VARLEN_TIMEOUT:-200} python3 benchmarks/flash.py --preset varlen \
  --out "$OUT/attention_varlen_h100.csv" > "$OUT/varlen.md" 2> "$OUT/varlen.err"
echo "varlen exit $?, $((SECONDS - start)) s" >> "$OUT/varlen.err"
if [ "${PROFILE:-1}" = 1 ]; then
  timeout 120 python3 benchmarks/profile_attention.py > "$OUT/profile.md" 2> "$OUT/profile.err"
  echo "profile exit $?, $((SECONDS - start)) s" >> "$OUT/profile.err"
fi
tail -2 "$OUT/features.err" "$OUT/varlen.err" "$OUT/profile.err"
grep -E "^\| (flash|ours|sdpa|flex|Flex)|^### |^wall" "$OUT/profile.md" | head -30
cat "$OUT/varlen.md" | tail -16
cat "$OUT/features.md" | tail -30
echo "== done in $((SECONDS - start)) s"
