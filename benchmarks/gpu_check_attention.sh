#!/usr/bin/env bash
# GPU box (H100): attention benchmarks of the committed code; short tables last.
#   bash benchmarks/gpu_check_attention.sh      (CSVs/logs under ${OUT:-/tmp/flashsys})
# 1. host overhead of one eager fwd+bwd call (+ a cProfile), 2. the peer grid (--preset peers),
# 3. the issue's single-shape targets and the longest sequence. The GPU tests are separate
#    (benchmarks/gpu_check_all.sh runs `pytest -m gpu` over the whole suite).
set -u
. benchmarks/_gpu_env.sh
env_stamp "$OUT/env_attention.txt"
timeout 120 python3 benchmarks/flash.py --batch 1 --heads 4 --seq 128 --dim 64 --modes fwd \
  --impls flash_attention --no-check --host-overhead --profile-host > "$OUT/overhead.md" 2> "$OUT/overhead.err"
timeout ${PEERS_TIMEOUT:-420} python3 benchmarks/flash.py --preset peers --workers 8 \
  --out "$OUT/attention_peers_h100.csv" > "$OUT/peers.md" 2> "$OUT/peers.err"
timeout 120 python3 benchmarks/flash.py --batch 1 --heads 16 --seq 4096 --dim 64 --modes fwd+bwd \
  --impls "flash_attention,sdpa cudnn_attention,sdpa flash_attention" --out "$OUT/target_4096.csv" \
  > "$OUT/target_4096.md" 2> "$OUT/target_4096.err"
timeout 90 python3 - > "$OUT/longest.md" 2>&1 <<'PY'
import time, torch
from torch_flashsys import flash_attention
n = 262144
q, k, v = (torch.randn(1, 16, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
for i in range(2):
    torch.cuda.synchronize(); t = time.perf_counter()
    out = flash_attention(q, k, v, is_causal=True); out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
print(f"longest: fwd+bwd (1, 16, {n}, 64) bf16 causal: {(time.perf_counter() - t) * 1e3:.0f} ms, "
      f"finite grads: {all(bool(t.grad.isfinite().all()) for t in (q, k, v))}, "
      f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
PY
tail -3 "$OUT/peers.err"; grep -v "^\s*$" "$OUT/overhead.err" | grep -E "us/call|tottime|^ +[0-9]" | head -24
cat "$OUT/longest.md" | tail -2
tail -6 "$OUT/target_4096.md"; tail -9 "$OUT/overhead.md"
cat "$OUT/peers.md"
