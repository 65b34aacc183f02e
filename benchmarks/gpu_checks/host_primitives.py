"""Host microseconds of the primitives an eager attention call is made of, on this box's CPU
(issue 27: what a fwd+bwd call's host time is spent on, beside SDPA's and a trivial op's loop).

    PYTHONPATH=. python3 benchmarks/gpu_checks/host_primitives.py [--calls-only]

``--calls-only``: just the whole-call rows (an A/B of two library versions: run it once per
version, e.g. with ``PYTHONPATH=old:.`` for an exported older ``torch_flashsys``).

Each primitive runs in a loop of ``CALLS`` calls without synchronizing (the GPU keeps up: the
tensors are small), best of ``REPEATS`` loops; the whole-call rows at the end are the same
``fwd+bwd`` loop the peer grid times, on a (1, 4, 128, 64) problem and on (4, 16, 1024, 64).
"""

import sys

import torch

from benchmarks import _peers
from benchmarks._harness import host_us, markdown_table
from torch_flashsys import flash_attention

CALLS = 2000
REPEATS = 5


def us(fn, calls: int = CALLS) -> float:
    """Best-of-REPEATS wall microseconds per call of ``fn`` (the harness's loop; warm-up once)."""
    return min(host_us(fn, calls, warmup=20 if i == 0 else 0)["wall_us"] for i in range(REPEATS))


def primitives() -> list[dict]:
    q = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(1, 4, 128, 64, device="cuda")
    index = q.get_device()
    d = {(q.shape, q.stride(), q.dtype): 1}
    cases = {
        "q.shape": lambda: q.shape,
        "q.stride()": lambda: q.stride(),
        "q.data_ptr()": lambda: q.data_ptr(),
        "q.get_device()": lambda: q.get_device(),
        "key of 3 shapes/strides, dict get": lambda: d.get(
            (q.shape, q.stride(), q.shape, q.stride(), q.shape, q.stride(), q.dtype, True, 0)
        ),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "q.new_empty(lse shape, float32)": lambda: q.new_empty((1, 4, 128), dtype=torch.float32),
        "torch.empty(shape, dtype, device)": lambda: torch.empty(
            (1, 4, 128), dtype=torch.float32, device=q.device
        ),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "torch._C._cuda_getDevice()": torch._C._cuda_getDevice,
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "torch._C._cuda_isCurrentStreamCapturing()": torch._C._cuda_isCurrentStreamCapturing,
        "_cuda_getCurrentRawStream(index)": lambda: torch._C._cuda_getCurrentRawStream(index),
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled,
        "empty_like(q).copy_(acc) (a copy kernel)": lambda: torch.empty_like(q).copy_(acc),
        "acc.to(bf16) (a copy kernel)": lambda: acc.to(torch.bfloat16),
        "q.add_(0) (an elementwise kernel)": lambda: q.add_(0),
    }
    return [{"primitive": name, "us": us(fn)} for name, fn in cases.items()]


def calls() -> list[dict]:
    rows = []
    for shape in [(1, 4, 128, 64), (4, 16, 1024, 64)]:
        q, k, v, dout = _peers.inputs(shape, torch.bfloat16, "cuda", seed=1)
        impls = {
            "flash_attention": lambda q, k, v: flash_attention(q, k, v, is_causal=True),
            "sdpa cudnn": _peers.sdpa_call("CUDNN_ATTENTION", is_causal=True),
            "floor: q * 1.0": lambda q, k, v: q * 1.0,
        }
        for name, fn in impls.items():
            step = _peers.fwd_bwd(fn, (q, k, v), dout)
            with torch.no_grad():
                fwd = us(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), 300)
            rows.append({"shape": "x".join(map(str, shape)), "impl": name,
                         "fwd no_grad us": fwd, "fwd+bwd us": us(step, 300)})  # fmt: skip
    return rows


def main() -> None:
    import torch_flashsys

    print(f"torch_flashsys from {torch_flashsys.__file__}")
    if "--calls-only" not in sys.argv:
        print(markdown_table(primitives(), ["primitive", "us"]))
    rows = calls()
    print(markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
