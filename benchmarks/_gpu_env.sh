# Sourced by the benchmarks/gpu_check_*.sh scripts (run from the repository root): the output
# folder, the import path, and `env_stamp FILE`, which prints the GPU, the torch/triton versions and
# the commit and writes them to FILE.
OUT=${OUT:-/tmp/flashsys}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
env_stamp() {
  {
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "git $(git rev-parse --short HEAD 2>/dev/null) (uncommitted changes: $(git status --porcelain 2>/dev/null | wc -l))"
  } | tee "$1"
}
