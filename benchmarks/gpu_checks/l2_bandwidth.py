"""How fast this GPU's L2 cache feeds its SMs (issue 27: what the Hopper forward asks of it).

    PYTHONPATH=. python3 benchmarks/gpu_checks/l2_bandwidth.py

Every program of a grid of ``PROGRAMS_PER_SM`` programs per SM reads a buffer of ``MB`` MB
(float32, 16 KB a step, from a program-dependent start, wrapping around) and sums it: a buffer
that fits the L2 (50 MB on the H100) is read from L2 after its first pass, one far larger from
memory. Reported: bytes read per second (``do_bench`` median). The Hopper forward's key/value
traffic per second of its time is ``benchmarks/sm90_fwd.py``'s ``kv_tb_s`` column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

BLOCK = 4096  # float32 per step and program (16 KB)
STEPS = 512  # steps per program
PROGRAMS_PER_SM = (2, 4)
MB = (4, 8, 16, 24, 2048)


@triton.jit
def _read(x_ptr, out_ptr, n_blocks, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    offs = tl.arange(0, BLOCK)
    start = pid * 97
    for i in range(STEPS):
        blk = (start + i) % n_blocks
        acc += tl.load(x_ptr + blk.to(tl.int64) * BLOCK + offs)
    tl.store(out_ptr + pid.to(tl.int64) * BLOCK + offs, acc)


def read_tb_s(x: torch.Tensor, programs: int) -> float:
    """TB/s of ``programs`` programs each reading STEPS blocks of ``x`` (``do_bench`` median)."""
    out = torch.empty(programs * BLOCK, device=x.device)

    def run():
        _read[(programs,)](x, out, x.numel() // BLOCK, STEPS=STEPS, BLOCK=BLOCK, num_warps=8)

    run()
    return programs * STEPS * BLOCK * 4 / do_bench(run, warmup=25, rep=200) / 1e9


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton "
          f"{triton.__version__}\n")  # fmt: skip
    print("| buffer MB | programs / SM | read TB/s |")
    print("|---|---|---|")
    for mb in MB:
        x = torch.randn(mb * 2**20 // 4, device="cuda")
        for per_sm in PROGRAMS_PER_SM:
            print(f"| {mb} | {per_sm} | {read_tb_s(x, sms * per_sm):.2f} |")


if __name__ == "__main__":
    main()
