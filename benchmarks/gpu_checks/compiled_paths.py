"""Which attention kernels a training step of the e2e model runs, eager and under torch.compile
(issue 27: compiled steps were 3-6% slower with flash_attention, eager ones not): the Hopper
rules' answers (with the inputs' layouts where they say no) and the step's attention kernels.

    PYTHONPATH=. python3 benchmarks/gpu_checks/compiled_paths.py [--context 8192]
"""

import argparse
import collections

import torch

from benchmarks.model import _batch, _stepper
from torch_flashsys.attention import _sm90
from torch_flashsys.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, default=8192)
p.add_argument("--vocab", type=int, default=10_000)
p.add_argument("--size", default="1B")
p.add_argument("--device", default="cuda")
args = p.parse_args()
counts = collections.Counter()


def _sig(*ts):
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 16) for t in ts)


def _wrap(name, fn, n):
    def wrapped(*a):
        r = fn(*a)
        counts[(name, r, None if r else _sig(*a[:n]))] += 1
        return r

    return wrapped


_sm90.forward_takes = _wrap("forward_takes", _sm90.forward_takes, 3)
_sm90.fused_takes = _wrap("fused_takes", _sm90.fused_takes, 4)
device = torch.device(args.device)
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
activity = getattr(torch.profiler.ProfilerActivity, device.type.upper())
tokens, targets = _batch(args.vocab, 8192 // args.context, args.context, device)
for compiled in (False, True):
    torch.compiler.reset()
    torch.manual_seed(0)
    model = build_model(args.size, context_length=args.context, attention="flash",
                        vocab_size=args.vocab, device=device)  # fmt: skip
    run = torch.compile(model) if compiled else model
    step = _stepper(run, "train", torch.bfloat16, device, tokens, targets)
    for _ in range(3):
        step()
    sync()
    counts.clear()
    with torch.profiler.profile(activities=[activity]) as prof:
        ms = step()["step"]
        sync()
    print(f"\n## compiled={compiled} context={args.context}: step {ms:.1f} ms")
    for key, n in sorted(counts.items(), key=str):
        print(f"  {n:4d} x {key}")
    total = 0.0
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if any(s in e.key for s in ("attn", "flash", "cudnn", "sdpa")):
            total += e.device_time_total
            print(f"  | {e.key[:80]} | {e.count} | {e.device_time_total / 1e3:.2f} ms |")
    print(f"  attention kernels {total / 1e3:.2f} ms of the step")
    del model, run, step
