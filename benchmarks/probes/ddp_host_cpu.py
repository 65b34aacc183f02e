"""CPU probe: host CPU per backward and per optimizer step, plain vs torch DDP vs BucketedDDP.

A scaled-down 2.0B LM (48 layers, shapes / 25, bucket cap scaled by the same area) so that the
bucket structure matches the 2.0B model's (ours 291 buckets). gloo, world size 1 and 2,
one thread per process. Reports thread CPU (main thread) per backward / per step+zero_grad,
median and min over steps, and process CPU per iteration.
usage: python ddp_host.py [--ws 1 2] [--steps 30] [--variants ...] [--profile VARIANT]
"""
import argparse, os, sys, time, statistics, socket, json
import torch, torch.distributed as dist, torch.multiprocessing as mp

D = 64
CAP_MB = 25.0 * (D / 1600) ** 2

def build():
    from torch_flashsys.models import TransformerLM
    from torch_flashsys.models._config import ModelConfig
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=D, d_ff=4 * D, num_layers=48, num_heads=4, vocab_size=400,
                      context_length=16, attention="naive")
    return TransformerLM(cfg)

def _set_mode(variant):
    """ours@head: HEAD's bucket assignment and launch, no alignment; ours@softcap: new assignment,
    HEAD's launch (no ws1 skip), no alignment; ours@noalign: all but the alignment."""
    sys.path.insert(0, "/work/probe/oldcode")
    import old_buckets
    from torch_flashsys.distributed import _reducer, _buckets
    if not hasattr(_buckets, "_new"):
        _buckets._new = (_reducer.assign_buckets, _buckets.Bucket.launch, _reducer._ALIGN_BYTES)
    assign, launch, align = _buckets._new
    mode = variant.split("@")[1] if "@" in variant else ""
    _reducer.assign_buckets = old_buckets.assign_buckets if mode == "head" else assign
    _reducer._ALIGN_BYTES = 1 if mode in ("head", "softcap", "noalign") else align
    return old_buckets.Bucket.launch if mode in ("head", "softcap") else None

def _patch_launch(m, launch):
    import types
    if launch is not None:
        for b in m._buckets:
            b.launch = types.MethodType(launch, b)

def make(variant, model):
    launch = _set_mode(variant)
    variant = variant.split("@")[0]
    from torch_flashsys import BucketedDDP
    from torch_flashsys.distributed.sharded_optimizer import ShardedOptimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    kw = dict(lr=1e-3, weight_decay=0.01)
    if variant == "plain":
        m = model
    elif variant.startswith("torch-ddp"):
        m = DDP(model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=variant != "torch-ddp-nogab")
    else:
        m = BucketedDDP(model, bucket_size_mb=CAP_MB)
    if variant == "ours-zero1":
        opt = ShardedOptimizer(m.parameters(), torch.optim.AdamW, **kw)
    elif variant == "ours-zero2":
        opt = ShardedOptimizer(m.parameters(), torch.optim.AdamW, shard_gradients=True, **kw)
    elif variant == "torch-ddp-zero":
        opt = ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, **kw)
    else:
        opt = torch.optim.AdamW(m.parameters(), **kw)
    if variant.startswith("ours"):
        _patch_launch(m, launch)
    return m, opt

def body(rank, world, variants, steps, prof, out):
    torch.manual_seed(rank)
    x = torch.randint(0, 400, (1, 16))
    built = {v: make(v, build()) for v in variants}
    rec = {v: ([], [], []) for v in variants}
    for s in range(steps + 3):
        if s == 3:
            dist.barrier()
        for v in variants:
            m, opt = built[v]
            loss = m(x).float().square().mean()
            p0 = time.process_time()
            t0 = time.thread_time()
            loss.backward()
            t1 = time.thread_time()
            opt.step()
            opt.zero_grad()
            t2 = time.thread_time()
            p1 = time.process_time()
            if s >= 3:
                bw, st, it = rec[v]
                bw.append(t1 - t0); st.append(t2 - t1); it.append(p1 - p0)
    if prof in built:
        import cProfile
        m, opt = built[prof]
        pr = cProfile.Profile()
        for _ in range(10):
            loss = m(x).float().square().mean()
            pr.enable(); loss.backward(); opt.step(); opt.zero_grad(); pr.disable()
        pr.dump_stats(f"/work/probe/prof_{prof}_ws{world}_r{rank}.out")
    res = {}
    q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))] * 1e3
    for v in variants:
        m, _ = built[v]
        nb = len(m._buckets) if hasattr(m, "_buckets") else None
        if v.startswith("torch-ddp"):
            nb = len(m.reducer._get_zeros_like_grad_buckets())
        bw, st, it = rec[v]
        res[v] = dict(buckets=nb, bw_med=q(bw, 0.5), bw_min=q(bw, 0.1), st_med=q(st, 0.5),
                      st_min=q(st, 0.1), proc_med=q(it, 0.5))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)

def entry(rank, world, port, *args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, world, *args)
    finally:
        dist.destroy_process_group()

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ws", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=["plain", "torch-ddp", "torch-ddp-nogab", "ours"])
    ap.add_argument("--profile", default="")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    for ws in a.ws:
        allr = []
        for r in range(a.rounds):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
            out = f"/tmp/ddp_host_{os.getpid()}.json"
            mp.spawn(entry, args=(ws, port, a.variants, a.steps, a.profile, out), nprocs=ws)
            allr.append(json.load(open(out)))
        print(f"== ws {ws} {a.tag} (ms; thread CPU of rank 0; variants interleaved step by step; min over {a.rounds} rounds of p50 and p10 of {a.steps} steps)")
        print(f"{'variant':18s} {'buckets':>7s} {'bw_med':>8s} {'bw_p10':>8s} {'step_med':>8s} {'step_p10':>8s} {'procCPU':>8s}")
        for v in a.variants:
            rs = [r[v] for r in allr]
            f = lambda k: min(r[k] for r in rs)
            print(f"{v:18s} {str(rs[0]['buckets']):>7s} {f('bw_med'):8.2f} {f('bw_min'):8.2f} {f('st_med'):8.2f} {f('st_min'):8.2f} {f('proc_med'):8.2f}")
        sys.stdout.flush()

if __name__ == "__main__":
    main()
