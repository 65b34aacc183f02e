# Untracked probe: AdamW (foreach, the CUDA default) step on the 2.0B model's parameters with
# grads (a) separate tensors, (b) BucketedDDP views, buckets unaligned (old layout),
# (c) BucketedDDP views, buckets 64-byte aligned (new). ws1 NCCL.
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)
from torch_flashsys import BucketedDDP
from torch_flashsys.distributed import _reducer
from torch_flashsys.models import build_model

def timed(opt, n=10):
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    cpu, wall = [], []
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0, w0 = time.thread_time(), time.perf_counter()
        e0.record(); opt.step(); e1.record()
        t1 = time.thread_time()
        torch.cuda.synchronize()
        w1 = time.perf_counter()
        cpu.append((t1 - t0) * 1e3); wall.append((w1 - w0) * 1e3); gpu.append(e0.elapsed_time(e1))
    med = lambda x: sorted(x)[len(x) // 2]
    return f"cpu {med(cpu):7.2f} ms  wall {med(wall):7.2f} ms  gpu {med(gpu):7.2f} ms"

model = build_model("2.0B", context_length=512, attention="sdpa", device="cuda")
params = list(model.parameters())
for mode in ["separate", "views-unaligned", "views-aligned"]:
    for p in params:
        p.grad = None
    ddp = None
    if mode == "separate":
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
    else:
        _reducer._ALIGN_BYTES = 1 if mode == "views-unaligned" else 64
        ddp = BucketedDDP(model, bucket_size_mb=25.0)
        for b in ddp._buckets:
            for p, v in zip(b.params, b.views):
                v.normal_(0, 1e-3); p.grad = v
    mis = sum(p.grad.data_ptr() % 16 != 0 for p in params)
    opt = torch.optim.AdamW(params, lr=1e-5)
    print(f"{mode:16s} grads not 16B-aligned: {mis:3d}/{len(params)}  step: {timed(opt)}", flush=True)
    del opt
    if ddp is not None:
        for p in params:
            p.grad = None
        del ddp
    torch.cuda.empty_cache()
dist.destroy_process_group()
