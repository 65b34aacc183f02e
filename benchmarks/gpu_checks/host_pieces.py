"""Host microseconds of each piece of the Hopper path's eager forward and backward (issue 27), with
the repeat launches through Triton's launcher and through ``_rawlaunch.RawLaunch``, in one
process; and whether the two launches give the same results.

    PYTHONPATH=. python3 benchmarks/gpu_checks/host_pieces.py
"""

import torch

import torch_flashsys.attention._sm90 as sm
from benchmarks import _peers
from benchmarks._harness import bench, host_us, markdown_table
from torch_flashsys import flash_attention
from torch_flashsys.attention import _ops
from torch_flashsys.attention._extras import CAUSAL, PLAIN


def us(fn, calls: int = 200) -> float:
    """Wall microseconds per call of ``fn`` over ``calls`` calls (the GPU keeps up)."""
    return host_us(fn, calls, warmup=5)["wall_us"]


def clear_plans() -> None:
    for plans in (sm._PLANS, sm._FUSED_PLANS, sm._BWD_PLANS, sm._PREP_PLANS):
        plans.clear()


def pieces(shape, causal: bool, raw: bool) -> dict:
    sm.RAW_LAUNCH = raw
    clear_plans()
    q, k, v, dout = _peers.inputs(shape, torch.bfloat16, "cuda", seed=1)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    ex, scale = (CAUSAL if causal else PLAIN), shape[-1] ** -0.5
    out, lse = sm.forward(qd, kd, vd, scale, causal)
    delta, dq_acc, sem = sm.backward_prep(out, dout, lse, None)
    dk, dv = torch.empty_like(kd), torch.empty_like(vd)
    fargs = lambda desc: sm.launch_args(qd, kd, vd, out, lse, scale, None, desc)
    bargs = lambda desc: sm.fused_launch_args(qd, kd, vd, dout, lse, delta, dk, dv, dq_acc, scale,
                                              sem, desc)  # fmt: skip
    fvals = sm.launch_values(qd, kd, vd, out, lse, scale)
    bvals = sm.fused_launch_values(qd, kd, vd, dout, lse, delta, dk, dv, dq_acc, scale, sem)
    fkey, bkey = next(iter(sm._PLANS)), None
    sm.backward(dout, qd, kd, vd, out, lse, None, scale, causal)
    bkey = next(iter(sm._FUSED_PLANS))
    index = q.get_device()
    fused = sm.fused_kernel(shape[-1])
    step = _peers.fwd_bwd(lambda q, k, v: flash_attention(q, k, v, is_causal=causal), (q, k, v),
                          dout)  # fmt: skip
    row = {"raw launch": raw}
    row["fwd+bwd loop"] = host_us(step, calls=200)["wall_us"]
    row["do_bench fwd+bwd ms"] = bench(step, "cuda")["median_ms"]
    row["_ops._forward"] = us(lambda: _ops._forward(qd, kd, vd, scale, ex))
    row["forward_takes"] = us(lambda: sm.forward_takes(qd, kd, vd, scale, ex))
    row["sm.forward"] = us(lambda: sm.forward(qd, kd, vd, scale, causal))
    row["fwd outputs"] = us(lambda: (torch.empty_like(qd), qd.new_empty(lse.shape,
                                                                         dtype=torch.float32)))  # fmt: skip
    row["launch_values"] = us(lambda: sm.launch_values(qd, kd, vd, out, lse, scale))
    row["fwd launch"] = us(lambda: sm._launch_planned(None, sm._PLANS, fkey, index, fvals, fargs,
                                                      None))  # fmt: skip
    row["_ops._backward"] = us(lambda: _ops._backward(dout, qd, kd, vd, out, lse, None, scale, ex))
    row["fused_takes"] = us(lambda: sm.fused_takes(qd, kd, vd, dout, scale, ex))
    row["sm.backward"] = us(lambda: sm.backward(dout, qd, kd, vd, out, lse, None, scale, causal))
    row["backward_prep"] = us(lambda: sm.backward_prep(out, dout, lse, None))
    row["fused_launch_values"] = us(lambda: sm.fused_launch_values(qd, kd, vd, dout, lse, delta,
                                                                   dk, dv, dq_acc, scale, sem))  # fmt: skip
    row["bwd launch"] = us(lambda: sm._launch_planned(fused, sm._FUSED_PLANS, bkey, index, bvals,
                                                      bargs, None))  # fmt: skip
    row["dq convert"] = us(lambda: torch.empty_like(qd).copy_(dq_acc))
    row["dk, dv empty"] = us(lambda: (torch.empty_like(kd), torch.empty_like(vd)))
    return row


def same_results(shape, causal: bool) -> dict:
    """Forward outputs and dK/dV bitwise, dQ close, Triton's launcher against RawLaunch."""
    q, k, v, dout = _peers.inputs(shape, torch.bfloat16, "cuda", seed=2)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    res = []
    for raw in (False, True):
        sm.RAW_LAUNCH = raw
        clear_plans()
        outs = []
        for _ in range(3):  # the first call compiles/plans; later ones take the direct launch
            out, lse = sm.forward(qd, kd, vd, 0.125, causal)
            outs = [out, lse, *sm.backward(dout, qd, kd, vd, out, lse, None, 0.125, causal)]
        res.append(outs)
    a, b = res
    return {"shape": "x".join(map(str, shape)), "causal": causal,
            "out, lse, dk, dv equal": all(torch.equal(x, y) for x, y in
                                          zip(a[:2] + a[3:], b[:2] + b[3:], strict=True)),
            "dq max diff": (a[2].float() - b[2].float()).abs().max().item()}  # fmt: skip


def main() -> None:
    checks = [same_results(s, c) for s in [(2, 4, 1024, 64), (1, 4, 2048, 128), (1, 3, 777, 64)]
              for c in (True, False)]  # fmt: skip
    rows = []
    for shape, causal in [((4, 16, 1024, 64), True), ((4, 16, 1024, 128), False)]:
        for raw in (False, True, False, True):
            rows.append({"shape": "x".join(map(str, shape)), "causal": causal,
                         **pieces(shape, causal, raw)})  # fmt: skip
    sm.RAW_LAUNCH = True
    print(markdown_table(checks, list(checks[0])))
    cols = list(rows[0])
    half = len(cols) // 2 + 2
    print(markdown_table(rows, cols[:half]))
    print(markdown_table(rows, cols[:3] + cols[half:]))


if __name__ == "__main__":
    main()
