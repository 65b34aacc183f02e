#!/usr/bin/env bash
# Tile sweep of one head-dim class (default 256) on the GPU box, merged into the committed sweep's
# rows and made into a tile table; then the head-dim problems timed with the committed table and
# with the new one, beside SDPA, in the same run. Files under $OUT: tune<D>.csv, tune_merged.csv,
# sm90.json (the candidate table), head_dims_before.csv, head_dims_after.csv.
#
#   OUT=$OUT DIMS=256 bash benchmarks/gpu_checks/tune_head_dims.sh
set -u
OUT=${OUT:-/tmp/out}
DIMS=${DIMS:-256}
SHAPES=${SHAPES:-4x16/16x2048:2048x96c,2x32/32x4096:4096x96c,4x32/32x2048:2048x80c,4x16/16x2048:2048x256c,1x16/8x8192:8192x256c,4x16/16x2048:2048x256,2x8/8x4096:4096x256c}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
start=$SECONDS
python3 benchmarks/gpu_checks/cross_shapes.py --rounds 2 --no-host --impls "ours,sdpa default" \
  --shapes "$SHAPES" --out "$OUT/head_dims_before.csv" > "$OUT/before.txt" 2>&1
echo "before: rc $? at $((SECONDS - start)) s"
timeout 420 python3 benchmarks/tune_attention.py --dims "$DIMS" --out "$OUT/tune$DIMS.csv" > "$OUT/tune.txt" 2>&1
echo "tune: rc $? at $((SECONDS - start)) s"
python3 - "$OUT/tune$DIMS.csv" "$OUT/tune_merged.csv" <<'PY'
import csv, sys
old = list(csv.DictReader(open("docs/data/attention_tune_h100.csv")))
new = list(csv.DictReader(open(sys.argv[1])))
cols = list(dict.fromkeys([*old[0], *new[0]]))
with open(sys.argv[2], "w", newline="") as f:
    w = csv.DictWriter(f, cols)
    w.writeheader()
    w.writerows(old + new)
PY
python3 benchmarks/tune_attention.py --from-csv "$OUT/tune_merged.csv" --table "$OUT/sm90.json"
cp "$OUT/sm90.json" torch_flashsys/attention/tiles/sm90.json
python3 -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_gpu.py -k "test_triton_matches_float64_on_cuda and (dtype4 or dtype5)" > "$OUT/tests.txt" 2>&1
echo "tests (new table): rc $? $(tail -1 "$OUT/tests.txt") at $((SECONDS - start)) s"
python3 benchmarks/gpu_checks/cross_shapes.py --rounds 2 --no-host --impls "ours,sdpa default,cudnn" \
  --shapes "$SHAPES" --out "$OUT/head_dims_after.csv" > "$OUT/after.txt" 2>&1
echo "after: rc $? at $((SECONDS - start)) s"
tail -n 40 "$OUT/tune.txt"
echo "== before (committed table)"; tail -n 12 "$OUT/before.txt"
echo "== after (new table)"; tail -n 14 "$OUT/after.txt"
