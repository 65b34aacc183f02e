"""Time (and record) the launch layer's CUDA fast path on CPU: tensors pose as CUDA, the compiled
launcher is a recorder. Usage: PYTHONPATH=<tree> python launch_harness.py [time|dump OUT]"""
import os, sys, time, types, pickle
os.environ["TRITON_INTERPRET"] = "1"
import torch
from torch_flashsys.attention import _launch, _triton_fwd, _triton_bwd, _extras
from torch_flashsys.attention._extras import make_extras

class FakeCuda(torch.Tensor):
    is_cuda = True
    def get_device(self): return 0
    __torch_function__ = torch._C._disabled_torch_function_impl

torch.cuda.current_device = lambda: 0
torch._C._cuda_getCurrentRawStream = lambda i: 7
_launch._fast_launch_allowed = lambda: True
RECORD = []
RECORDING = [True]
def fake_run(*a):
    if RECORDING[0]:
        RECORD.append(a)
_orig_remember = _launch.LaunchCache._remember
def remember(self, key, compiled, grid, args, constexprs):
    compiled = types.SimpleNamespace(run=fake_run, function="fn", packed_metadata="pk")
    return _orig_remember(self, key, compiled, grid, args, constexprs)
_launch.LaunchCache._remember = remember

def fc(t): return t.as_subclass(FakeCuda)

def make(B=1, H=4, Hk=4, L=128, S=128, E=64, Ev=64, dtype=torch.bfloat16, layout="bhle"):
    g = torch.Generator().manual_seed(0)
    def mk(h, n, e):
        if layout == "blhe":
            return torch.randn(B, n, h, e, generator=g, dtype=dtype).transpose(1, 2)
        return torch.randn(B, h, n, e, generator=g, dtype=dtype)
    return mk(H, L, E), mk(Hk, S, E), mk(Hk, S, Ev)

CASES = {
    "causal": (dict(), dict(is_causal=True)),
    "plain": (dict(), dict()),
    "gqa_blhe": (dict(H=8, Hk=2, layout="blhe", L=100, S=77), dict(is_causal=True)),
    "f32": (dict(dtype=torch.float32, E=32, Ev=32), dict(is_causal=True)),
    "dv": (dict(E=64, Ev=32), dict()),
    "window_softcap": (dict(), dict(window_size=(16, 8), softcap=30.0)),
    "boolmask": (dict(), dict(attn_mask="bool")),
    "floatmask_rows": (dict(), dict(attn_mask="float", is_causal=True)),
    "alibi_dropout": (dict(), dict(alibi_slopes="alibi", dropout_p=0.25)),
}

def extras_for(q, k, kw):
    kw = dict(kw)
    B, H, L, _ = q.shape; S = k.shape[2]
    m = kw.pop("attn_mask", None)
    if m == "bool": m = torch.rand(B, 1, 1, S, generator=torch.Generator().manual_seed(1)) > 0.3
    elif m == "float": m = torch.randn(B, 1, L, S, generator=torch.Generator().manual_seed(1))
    a = kw.pop("alibi_slopes", None)
    if a == "alibi": a = torch.rand(H, generator=torch.Generator().manual_seed(2))
    return make_extras(q.shape, S, q.device, m, kw.get("dropout_p", 0.0), kw.get("is_causal", False),
                       kw.get("window_size"), kw.get("softcap"), a)

def run_case(name, n_time=0):
    shape_kw, kw = CASES[name]
    q, k, v = make(**shape_kw)
    torch.manual_seed(0)
    ex = extras_for(q, k, kw)
    q, k, v = fc(q), fc(k), fc(v)
    out, lse = _triton_fwd.attention_forward(q, k, v, 0.125, ex)  # miss: interpreter
    dout = fc(torch.randn_like(out))
    _triton_bwd.attention_backward(dout, q, k, v, fc(out), lse, None, 0.125, ex)
    RECORD.clear()
    out2, lse2 = _triton_fwd.attention_forward(q, k, v, 0.125, ex)
    _triton_bwd.attention_backward(dout, q, k, v, fc(out2), lse2, None, 0.125, ex)
    _triton_bwd.attention_backward(dout, q, k, v, fc(out2), lse2, lse2, 0.125, ex)  # dlse (miss)
    _triton_bwd.attention_backward(dout, q, k, v, fc(out2), lse2, lse2, 0.125, ex)  # dlse (hit)
    named = {id(q): "q", id(k): "k", id(v): "v", id(dout): "dout"}
    if ex.mask is not None: named[id(ex.mask)] = "mask"
    if ex.alibi is not None: named[id(ex.alibi)] = "alibi"
    if ex.seed is not None: named[id(ex.seed)] = "seed"
    def desc(a):
        if isinstance(a, torch.Tensor):
            return ("T", named.get(id(a), "new"), tuple(a.shape), a.stride(), str(a.dtype), a.data_ptr() % 16 == 0)
        return a
    rec = [tuple(desc(x) for x in r) for r in RECORD]
    res = None
    RECORDING[0] = False
    if n_time:
        f = _triton_fwd.attention_forward; b = _triton_bwd.attention_backward
        fo = fc(out2)
        ts = []
        for _ in range(40):
            t0 = time.perf_counter()
            for _ in range(n_time): f(q, k, v, 0.125, ex)
            t1 = time.perf_counter()
            for _ in range(n_time): b(dout, q, k, v, fo, lse2, None, 0.125, ex)
            t2 = time.perf_counter()
            ts.append(((t1 - t0) / n_time * 1e6, (t2 - t1) / n_time * 1e6))
        res = (min(t[0] for t in ts), min(t[1] for t in ts))
    RECORDING[0] = True
    return rec, res

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "dump":
        out = {name: run_case(name)[0] for name in CASES}
        with open(sys.argv[2], "wb") as fh: pickle.dump(out, fh)
        print({k: len(v) for k, v in out.items()})
    else:
        for name in sys.argv[2:] or ["causal", "gqa_blhe", "boolmask"]:
            _, (tf, tb) = run_case(name, 300)
            print(f"{name:16s} attention_forward {tf:6.2f} us  attention_backward {tb:6.2f} us (hit path, launcher stubbed)")
