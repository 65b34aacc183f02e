#!/usr/bin/env bash
# GPU box (H100): the feature and varlen presets (issues 12 and 15) and a torch.profiler breakdown of
# fwd+bwd (ours beside SDPA cuDNN/flash) of the committed code; short tables last.
#   bash benchmarks/gpu_check_attention_features.sh      (CSVs/logs under ${OUT:-/tmp/flashsys})
set -u
start=$SECONDS
OUT=${OUT:-/tmp/flashsys}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "git $(git rev-parse --short HEAD 2>/dev/null) (uncommitted changes: $(git status --porcelain 2>/dev/null | wc -l))"
} | tee "$OUT/env_features.txt"
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
