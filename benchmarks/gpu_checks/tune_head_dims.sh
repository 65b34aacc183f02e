#!/usr/bin/env bash
# Tile sweep of one head-dim class (default 256) on the GPU box, merged into the committed sweep's
# rows (its rows of the same kernels and head dims replaced) and made into a tile table; then the
# head-dim problems timed with the committed table and with the new one, beside SDPA, in the same
# run. Files under $OUT: tune<D>.csv, tune_merged.csv, sm90.json (the candidate table),
# head_dims_before.csv, head_dims_after.csv, tests.txt.
#
#   OUT=$OUT DIMS=256 bash benchmarks/gpu_checks/tune_head_dims.sh
#   OUT=$OUT DIMS=256 KERNELS=dkdv BEFORE=0 SUITE=1 bash benchmarks/gpu_checks/tune_head_dims.sh
# KERNELS: which kernels to sweep; BEFORE=0: no timing with the committed table; SUITE=1: the
# whole GPU suite with the candidate table (run.sh tests), else the fp16/bf16 property tests.
set -u
OUT=${OUT:-/tmp/out}
DIMS=${DIMS:-256}
KERNELS=${KERNELS:-fwd,dq,dkdv}
SHAPES=${SHAPES:-4x16/16x2048:2048x96c,2x32/32x4096:4096x96c,4x32/32x2048:2048x80c,4x16/16x2048:2048x256c,1x16/8x8192:8192x256c,4x16/16x2048:2048x256,2x8/8x4096:4096x256c}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
start=$SECONDS
if [ "${BEFORE:-1}" != 0 ]; then
  python3 benchmarks/gpu_checks/cross_shapes.py --rounds 2 --no-host --impls "ours,sdpa default" \
    --shapes "$SHAPES" --out "$OUT/head_dims_before.csv" > "$OUT/before.txt" 2>&1
  echo "before: rc $? at $((SECONDS - start)) s"
fi
timeout 420 python3 benchmarks/tune_attention.py --kernels "$KERNELS" --dims "$DIMS" \
  --out "$OUT/tune$DIMS.csv" > "$OUT/tune.txt" 2>&1
echo "tune: rc $? at $((SECONDS - start)) s"
python3 - "$OUT/tune$DIMS.csv" "$OUT/tune_merged.csv" "$KERNELS" "$DIMS" <<'PY'
import csv, sys
kernels, dims = set(sys.argv[3].split(",")), set(sys.argv[4].split(","))
old = list(csv.DictReader(open("docs/data/attention_tune_h100.csv")))
old = [r for r in old if not (r["kernel"] in kernels and r["dim"] in dims)]
new = list(csv.DictReader(open(sys.argv[1])))
cols = list(dict.fromkeys([*old[0], *new[0]]))
with open(sys.argv[2], "w", newline="") as f:
    w = csv.DictWriter(f, cols)
    w.writeheader()
    w.writerows(old + new)
PY
python3 benchmarks/tune_attention.py --from-csv "$OUT/tune_merged.csv" --table "$OUT/sm90.json"
cp "$OUT/sm90.json" torch_flashsys/attention/tiles/sm90.json
if [ "${SUITE:-0}" = 1 ]; then
  BENCH=0 OUT=$OUT TEST_TIMEOUT=400 bash benchmarks/gpu_checks/run.sh tests > "$OUT/tests.txt" 2>&1
  echo "GPU suite (new table): $(grep -cE "FAILED|ERROR" "$OUT/gpu_tests.md") failed/error lines; $(tail -1 "$OUT/gpu_tests.md") at $((SECONDS - start)) s"
else
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_gpu.py \
    -k "test_triton_matches_float64_on_cuda and (dtype4 or dtype5)" > "$OUT/tests.txt" 2>&1
  echo "tests (new table): rc $? $(tail -1 "$OUT/tests.txt") at $((SECONDS - start)) s"
fi
python3 benchmarks/gpu_checks/cross_shapes.py --rounds 2 --no-host --impls "ours,sdpa default,cudnn" \
  --shapes "$SHAPES" --out "$OUT/head_dims_after.csv" > "$OUT/after.txt" 2>&1
echo "after: rc $? at $((SECONDS - start)) s"
tail -n 20 "$OUT/tune.txt"
if [ "${BEFORE:-1}" != 0 ]; then echo "== before (committed table)"; tail -n 16 "$OUT/before.txt"; fi
echo "== after (new table)"; tail -n 22 "$OUT/after.txt"
