#!/usr/bin/env bash
# GPU box (one H100): the benchmarking harness end to end in <= 8 minutes; short table last.
#   bash benchmarks/gpu_check_harness.sh        (files under ${OUT:-/tmp/flashsys-harness})
# Steps, each under its own `timeout` (a step that runs out loses only its own results):
#   0. GPU tests of the memory-snapshot checks (a real CUDA snapshot must validate)
#   1. model.py: forward and forward+backward, every Table-1 size at context 512, fp32 and bf16
#   2. model.py --preset memory: peak memory of 2.7B at 128/256/512, fwd and train, fp32/bf16;
#      then one 2.7B train step recorded as a memory_viz snapshot (snapshot.pickle, validated)
#   3. flash.py --preset sweep: batch 8, one head, d 16..128 x seq 256..16384, bf16, forward and
#      backward (OOM rows kept), in the time left (TOTAL_BUDGET, default 450 s, covers all steps)
# Writes 8 files (the most that comes back from the GPU box): model.csv model.png memory.csv
# memory.png snapshot.pickle sweep.csv sweep.png harness.log.
# All-reduce (separate, on the 4-GPU machine; NCCL+GPU and gloo+CPU in one launch each):
#   torchrun --nproc_per_node=2 benchmarks/allreduce.py --out $OUT/allreduce2.csv
#   torchrun --nproc_per_node=4 benchmarks/allreduce.py --out $OUT/allreduce4.csv --plot $OUT/allreduce.png
set -u
OUT=${OUT:-/tmp/flashsys-harness}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG=$OUT/harness.log
: >"$LOG"
DEADLINE=$((SECONDS + ${TOTAL_BUDGET:-450}))  # seconds for all steps; the summary follows
declare -A STATUS
step() {  # step NAME SECONDS CMD...: run under timeout, log everything, remember the exit code
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then STATUS[$name]="skipped: out of time"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "== $name (limit ${secs}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$secs" "$@" >>"$LOG" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc$([ $rc = 124 ] && echo ' TIMEOUT') $((SECONDS - t0))s"
  echo "== $name: ${STATUS[$name]}" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$LOG"
python3 -c "import matplotlib" 2>/dev/null || echo "matplotlib missing: no PNGs" | tee -a "$LOG"

step tests 45 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_memory_snapshot.py
step model "${MODEL_TIMEOUT:-100}" python3 benchmarks/model.py \
  --size small,medium,large,xl,2.7B --context-length 512 --dtype fp32,bf16 --mode fwd,fwd+bwd \
  --warmup 2 --steps 5 --out "$OUT/model.csv" --plot "$OUT/model.png"
step memory "${MEMORY_TIMEOUT:-80}" python3 benchmarks/model.py --preset memory \
  --out "$OUT/memory.csv" --plot "$OUT/memory.png"
step snapshot "${SNAPSHOT_TIMEOUT:-45}" python3 benchmarks/model.py --size 2.7B \
  --context-length 128 --dtype bf16 --mode train --warmup 1 --steps 1 \
  --memory-max-entries "${SNAPSHOT_ENTRIES:-30000}" --memory-profile "$OUT/snapshot.pickle"
if [ -f "$OUT/snapshot.pickle" ] && [ "$(stat -c %s "$OUT/snapshot.pickle")" -gt 15000000 ]; then
  echo "snapshot.pickle over 15 MB: recording fewer events" | tee -a "$LOG"
  step snapshot-small 45 python3 benchmarks/model.py --size 2.7B --context-length 128 \
    --dtype bf16 --mode train --warmup 1 --steps 1 --memory-max-entries 8000 \
    --memory-profile "$OUT/snapshot.pickle"
fi
# The sweep gets what is left: configurations it cannot start in time are rows marked
# 'skipped (time budget)'. Autotuning costs ~30 s per head dim (SWEEP_AUTOTUNE=0: default
# kernel configs, faster to run, slower kernels at d=128).
budget=$((DEADLINE - SECONDS - 45))
step sweep "$((budget + 40))" env TORCH_FLASHSYS_AUTOTUNE="${SWEEP_AUTOTUNE:-1}" \
  python3 benchmarks/flash.py --preset sweep --dtype bf16 --modes fwd,bwd --time-budget "$budget" \
  --impls "flash_attention,naive,naive (compiled),sdpa flash_attention" \
  --out "$OUT/sweep.csv" --plot "$OUT/sweep.png"

# The short table last: step status, then forward / forward+backward ms per size and dtype.
python3 - "$OUT" "${!STATUS[@]}" "${STATUS[@]}" <<'EOF'
import csv, os, sys
out, rest = sys.argv[1], sys.argv[2:]
names, codes = rest[: len(rest) // 2], rest[len(rest) // 2 :]
print("\n### gpu_check_harness\n\n| step | status |\n|---|---|")
for n, c in sorted(zip(names, codes)):
    print(f"| {n} | {c} |")
for f in sorted(os.listdir(out)):
    print(f"| file {f} | {os.path.getsize(os.path.join(out, f)) / 2**20:.2f} MiB |")
def table(name, key, cols, label):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return
    rows = list(csv.DictReader(open(path)))
    def cell(first, dtype, mode):
        r = [r for r in rows if (r[label], r["dtype"], r["mode"]) == (first, dtype, mode)]
        v = r[0].get(key, "") if r else ""
        return f"{float(v):.1f}" if v.replace(".", "", 1).isdigit() else (v or r[0]["step ms"] if r else "")
    print(f"\n| {name}: {label} | " + " | ".join(f"{d} {m} {key}" for d, m in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for first in dict.fromkeys(r[label] for r in rows):
        print(f"| {first} | " + " | ".join(cell(first, d, m) for d, m in cols) + " |")
table("model.csv", "step ms", [(d, m) for d in ("fp32", "bf16") for m in ("fwd", "fwd+bwd")], "size")
table("memory.csv", "peak MiB", [(d, m) for d in ("fp32", "bf16") for m in ("fwd", "train")], "context")
path = os.path.join(out, "sweep.csv")
if os.path.exists(path):
    rows = list(csv.DictReader(open(path)))
    ok = sum(isinstance(r.get("fwd ms"), str) and r["fwd ms"].replace(".", "", 1).isdigit() for r in rows)
    oom = sum("OOM" in (r.get("fwd ms", "") + r.get("bwd ms", "")) for r in rows)
    skipped = sum("skipped" in r.get("fwd ms", "") for r in rows)
    print(f"\nsweep.csv: {len(rows)} rows, {ok} timed, {oom} OOM, {skipped} skipped (time budget)")
EOF
