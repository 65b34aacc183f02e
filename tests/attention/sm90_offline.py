"""Compile the Hopper (Gluon) kernels for sm90 without a GPU (the forward, the dK/dV kernel and
the fused backward): a stand-in driver that reports a cuda:90 target, then ``warmup`` (compile,
no launch). Run as a script in a fresh process (the
test suite runs the Triton interpreter, and the stand-in driver must not leak into other tests).

    python -m tests.attention.sm90_offline            # one line per variant, exit 0 if all compile
    python -m tests.attention.sm90_offline backward   # the portable backward's compiles (counts)
    python -m tests.attention.sm90_offline spills 256 causal [dkdv=32x32x8x2,...]
        # the portable kernels' sm90 builds per tile: shared memory, register spills (SASS)
    python -m tests.attention.sm90_offline schedule   # pinned waits: the SASS order (counts)
    python -m tests.attention.sm90_offline precompile 64,1,bfloat16,2048 ...
        # per (head dim, causal, dtype, first length): compiles after the queued builds
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import GPUDriver


class _Sm90Target(GPUDriver):
    """Just enough driver for Triton to compile for an H100 (compute capability 9.0)."""

    def __init__(self):
        self.get_device_capability = lambda *a: (9, 0)
        self.get_current_stream = lambda *a: 0
        self.get_current_device = lambda: 0
        self.set_current_device = lambda d: None

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise NotImplementedError


def _problem(d: int, dtype: torch.dtype, seq: int, heads: int):
    """Zero ``(q, k, lse)`` of a ``(1, heads, seq, d)`` problem, GQA 2:1 (k also stands for v)."""
    q = torch.zeros(1, heads, seq, d, dtype=dtype)
    k = torch.zeros(1, heads // 2, seq, d, dtype=dtype)
    return q, k, torch.zeros(1, heads, seq)


def _warmup(d: int, causal: bool, dtype: torch.dtype, seq: int, heads: int = 8, **extra):
    """Compile (or find compiled) the kernel for a ``(1, heads, seq, d)`` problem, GQA 2:1, with
    the launch arguments the library builds (:func:`_sm90.launch_args`); ``extra``: constexprs
    other than the library's (variants, probes)."""
    from torch_flashsys.attention import _sm90
    from torch_flashsys.attention._sm90._fwd import attn_fwd_sm90

    q, k, lse = _problem(d, dtype, seq, heads)
    consumers = extra.get("CONSUMERS", 2)
    meta = {**_sm90.constexprs(d, causal, consumers=consumers), **extra,
            **_sm90.launch_options(consumers)}  # fmt: skip
    args = _sm90.launch_args(q, k, k, q, lse, 0.125)
    # The direct launch passes every parameter after the runtime arguments from ``meta``.
    missing = set(attn_fwd_sm90.arg_names[len(args) :]) - set(meta)
    assert not missing, f"constexprs lacks {sorted(missing)}"
    return attn_fwd_sm90.warmup(*args, **meta, grid=(1,))


def _warmup_bwd(d: int, causal: bool, dtype: torch.dtype, seq: int, pipeline: bool,
                heads: int = 8):  # fmt: skip
    """Compile the Hopper dK/dV kernel for a ``(1, heads, seq, d)`` problem, GQA 2:1."""
    from torch_flashsys.attention import _sm90
    from torch_flashsys.attention._sm90._bwd import attn_bwd_dkdv_sm90

    q, k, lse = _problem(d, dtype, seq, heads)
    return attn_bwd_dkdv_sm90.warmup(
        *_sm90.backward_launch_args(q, k, k, q, lse, lse, k, k, 0.125), CAUSAL=causal,
        STAGES=_sm90.BWD_STAGES[d], PIPELINE=pipeline, num_warps=_sm90.NUM_WARPS,
        maxnreg=_sm90.MAX_REGS, grid=(1,),
    )  # fmt: skip


def _warmup_fused(d: int, causal: bool, dtype: torch.dtype, seq: int, heads: int = 8,
                  deterministic: bool = False, **extra):  # fmt: skip
    """Compile the fused Hopper backward for a ``(1, heads, seq, d)`` problem, GQA 2:1
    (``deterministic``: with ordered dQ sums; ``extra``: constexprs over the library's)."""
    from torch_flashsys.attention import _sm90

    kernel = _sm90.fused_kernel(d)
    q, k, lse = _problem(d, dtype, seq, heads)
    dq_acc = torch.zeros(1, heads, seq, d)
    sem = (
        torch.zeros(1, heads, seq // _sm90.BWD_BLOCK, dtype=torch.int32) if deterministic else None
    )
    args = _sm90.fused_launch_args(q, k, k, q, lse, lse, k, k, dq_acc, 0.125, sem)
    meta = {**_sm90.fused_constexprs(d, causal, dtype, deterministic=deterministic), **extra}
    # The direct launch passes every parameter after the runtime arguments from ``meta``.
    missing = set(kernel.arg_names[len(args) :]) - set(meta)
    assert not missing, f"fused_constexprs lacks {sorted(missing)}"
    return kernel.warmup(*args, **meta, grid=(1,))


def compile_variants(variants) -> list[str]:
    """Compile ``(head_dim, causal, dtype[, extra constexprs])`` variants; one report line each
    (shared memory). Raises on the first that fails."""
    lines = []
    for d, causal, dtype, *extra in variants:
        extra = extra[0] if extra else {}
        kernel = _warmup(d, causal, dtype, 256, **extra)
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx, "not the warp-specialized kernel"
        lines.append(f"d={d} causal={causal} {dtype} {extra or ''}: shared memory "
                     f"{kernel.metadata.shared} bytes")  # fmt: skip
    return lines


def sass(kernel) -> str:
    """A compiled kernel's SASS, by the ``nvdisasm`` that Triton ships (its ``asm["sass"]``, from
    ``cuobjdump``, left out one consumer's loop of the causal forward)."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip


def exponentials_before_wait(sass: str) -> list[int]:
    """Per consumer loop of a kernel's SASS (:func:`sass`): how many ``MUFU.EX2`` come between
    the wait for the first of a step's two products (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the
    wait for the second (``0x0``): the exponentials that can overlap it."""
    counts, n = [], None
    for line in sass.splitlines():
        if "DEPBAR.LE gsb0, 0x1" in line:
            n = 0
        elif n is not None and "MUFU.EX2" in line:
            n += 1
        elif n is not None and "DEPBAR.LE gsb0, 0x0" in line:
            counts.append(n)
            n = None
    return counts


# (kernel, head dim, causal) -> a step's exponentials per thread: the forward's 64 x 128 scores
# over a warpgroup's 128 threads and the two rescale factors; the backward's 64 x 64.
SCHEDULE_EXPONENTIALS = {"fwd": 66, "fused": 32}


def schedule_lines() -> tuple[list[str], bool]:
    """Each Hopper kernel's exponentials before its step's second wait, without and with
    PIN_WAIT; ``ok``: pinned, every consumer loop has all of a step's exponentials there."""
    lines, ok = [], True
    for kind in ("fwd", "fused"):
        for d, causal in [(64, False), (64, True), (128, False), (128, True)]:
            counts = {}
            for pin in (False, True):
                warm = _warmup if kind == "fwd" else _warmup_fused
                counts[pin] = exponentials_before_wait(
                    sass(warm(d, causal, torch.bfloat16, 256, PIN_WAIT=pin))
                )
            want = SCHEDULE_EXPONENTIALS[kind]
            pinned_ok = len(counts[True]) >= 2 and all(n >= want for n in counts[True])
            ok &= pinned_ok
            lines.append(f"{kind} d={d} causal={causal}: exponentials before the second wait "
                         f"{counts[False]} unpinned, {counts[True]} pinned (a step has {want})"
                         f"{'' if pinned_ok else '  <- NOT ALL'}")  # fmt: skip
    return lines, ok


def kernels_for_lengths(d: int, causal: bool, dtype: torch.dtype, lengths) -> int:
    """How many distinct kernels the problems of these sequence lengths compile to: one, unless
    an integer argument is specialized (Triton recompiles per divisibility by 16 of each)."""
    return len({id(_warmup(d, causal, dtype, seq)) for seq in lengths})


LENGTHS = (256, 763, 2048, 4342, 6411)  # lengths, strides and L2 head groups of each kind


def backward_compiles(dtype: torch.dtype = torch.float16) -> tuple[int, int]:
    """Compiles of the portable backward's two kernels for a new problem: ``(during
    compile_together, during the launches' own warm-up after it)``; (2, 0) when they were
    compiled together before the launches."""
    from triton import knobs

    from torch_flashsys.attention._extras import CAUSAL
    from torch_flashsys.attention._launch import compile_together
    from torch_flashsys.attention._triton_bwd import backward_launches

    q, k, v, out, dout = (torch.zeros(1, 4, 200, 64, dtype=dtype) for _ in range(5))
    lse, delta = torch.zeros(1, 4, 200), torch.zeros(1, 4, 200)
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _, launches = backward_launches(dout, q, k, v, out, lse, None, 0.125, CAUSAL, *grads, delta)
    misses = []
    knobs.runtime.jit_cache_hook = lambda *a, **kw: misses.append(1) and None
    try:
        compile_together([(c, plan.grid, args, plan.constexprs) for c, plan, args in launches])
        together = len(misses)
        for cache, plan, args in launches:  # what each launch would compile on its own
            cache.kernel.warmup(*args, grid=plan.grid, **plan.constexprs)
    finally:
        knobs.runtime.jit_cache_hook = None
    return together, len(misses) - together


def _launches_at(n: int, d: int, causal: bool, dtype: torch.dtype, kv_heads: int = 2,
                 deterministic: bool = False, heads: int = 4) -> list[tuple]:  # fmt: skip
    """``(kernel, args, meta)`` of every kernel a fwd+bwd of a ``(1, heads, n, d)`` problem
    launches on an H100 (no dLSE; ``deterministic``: under deterministic algorithms), with the
    arguments the library builds from real (CPU) tensors: the forward's build by its length
    rules, then the fused backward (preprocessing, fused kernel and, deterministic, the sum of
    the dQ copies) or the portable one (dQ and dK/dV kernels)."""
    from torch_flashsys.attention import _sm90
    from torch_flashsys.attention._extras import CAUSAL, PLAIN
    from torch_flashsys.attention._sm90._fwd import attn_fwd_sm90
    from torch_flashsys.attention._triton_bwd import backward_launches

    ex = CAUSAL if causal else PLAIN
    q = torch.zeros(1, heads, n, d, dtype=dtype)
    k = torch.zeros(1, kv_heads, n, d, dtype=dtype)
    lse = torch.zeros(1, heads, n)
    dynamic = _sm90.dynamic_schedule(q, causal)
    counter = torch.zeros(1, dtype=torch.int32) if dynamic else None  # as _sm90.forward
    fwd = _sm90.forward_meta(q, causal, dynamic)
    launches = [(attn_fwd_sm90, _sm90.launch_args(q, k, k, q, lse, 0.125, counter), fwd)]
    if not _sm90.fused_rule(q, k, ex, deterministic):
        _, portable = backward_launches(q, q, k, k, q, lse, None, 0.125, ex, q, k, k, lse)
        return launches + [(c.kernel, args, plan.constexprs) for c, plan, args in portable]
    copies = _sm90.DETERMINISTIC_CHAINS if deterministic else 1
    kd = _sm90.kernel_dim(d)  # (a padded head dim: the next kernel's, dK, dV and dQ that wide)
    acc = torch.zeros(copies, heads, n, kd)
    dk = torch.zeros(1, kv_heads, n, kd, dtype=dtype)
    sem = torch.zeros(copies, heads, 1, dtype=torch.int32) if deterministic else None
    launches += [
        (_sm90.attn_bwd_prep, _sm90.prep_args((q, q, lse, lse, acc, acc if sem is None else sem),
                                              q, q, lse),
         _sm90.prep_meta(d, False, deterministic, copies)),
        (_sm90.fused_kernel(kd), _sm90.fused_launch_args(q, k, k, q, lse, lse, dk, dk, acc, 0.125,
                                                         sem),
         _sm90.fused_constexprs(kd, causal, dtype, deterministic)),
    ]  # fmt: skip
    if deterministic:
        launches.append((_sm90.attn_bwd_dq_sum, _sm90.dq_sum_args(acc, torch.empty_like(q)),
                         _sm90.dq_sum_meta(d, copies)))  # fmt: skip
    return launches


# Lengths a problem may have after the first call: every 97th from 1 to 20000 (crossing every
# bound of the length rules, at points that are not the bounds themselves), and the bounds.
LATER_LENGTHS = range(1, 20000, 97)


def precompile_misses(d: int, causal: bool, dtype: torch.dtype, first: int, kv_heads: int = 2,
                      deterministic: bool = False) -> tuple[int, int]:  # fmt: skip
    """Compiles ``(of the first call at `first` tokens and the builds it queues, of the calls at
    other lengths after them)``, on the H100 path with background precompiling (``_precompile``'s
    jobs run here in turn): later calls compile nothing when the queued builds are the ones the
    length rules pick, with stand-in arguments that Triton specializes as the calls' own."""
    from torch_flashsys.attention import _precompile, _sm90
    from torch_flashsys.attention._extras import CAUSAL, PLAIN
    from torch_flashsys.attention._triton_bwd import backward_builds

    _sm90.FUSED_ENABLED = True  # (on every Triton: the H100's rules)
    _sm90.fused_fits = lambda *args: True  # (CPU tensors: the kind's rule, not the device)
    kernels = set()

    def warm(kernel, args, meta) -> None:
        kernels.add(kernel)
        kernel.warmup(*args, grid=(1,), **meta)

    def compiled() -> int:  # builds in the JIT caches of the kernels seen
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    for launch in _launches_at(first, d, causal, dtype, kv_heads, deterministic):
        warm(*launch)
    q = torch.zeros(1, 4, first, d, dtype=dtype)
    k = torch.zeros(1, kv_heads, first, d, dtype=dtype)
    lse = torch.zeros(1, 4, first)
    ex = CAUSAL if causal else PLAIN
    jobs = _sm90.forward_jobs(q, k, k, q, lse, 0.125, causal, -1)  # as _sm90.forward queues them
    jobs += backward_builds(q, q, k, k, q, lse, None, 0.125, ex, deterministic)
    for job in jobs:
        assert _precompile.usable(job.kernel)
        warm(job.kernel, job.args, job.meta)
    at_first = compiled()
    for n in sorted({*LATER_LENGTHS, *_sm90.rule_lengths()}):
        for launch in _launches_at(n, d, causal, dtype, kv_heads, deterministic):
            warm(*launch)
    return at_first, compiled() - at_first


def portable_spills(d: int, causal: bool, tiles: dict | None = None) -> list[str]:
    """Per portable kernel (forward, dQ, dK/dV) and tile (the library's list for ``d``'s class,
    or ``tiles[kernel]``): the sm90 build's shared memory and its local-memory stores and loads
    (``STL``/``LDL`` in the SASS: register spills), for a (1, 4, 2048, d) bf16 problem."""
    import re

    from torch_flashsys.attention import _triton_bwd, _triton_fwd
    from torch_flashsys.attention._extras import CAUSAL, PLAIN
    from torch_flashsys.attention._kernel_config import dim_class
    from torch_flashsys.attention._launch import dot_precision
    from torch_flashsys.attention._triton_common import kernel_extras

    ex = CAUSAL if causal else PLAIN
    q, k, v, out, dout = (torch.zeros(1, 4, 2048, d, dtype=torch.bfloat16) for _ in range(5))
    lse, delta = torch.zeros(1, 4, 2048), torch.zeros(1, 4, 2048)
    tensors, runtime, flags = kernel_extras(ex, q)
    plan = _triton_fwd._plan(q, k, v, out, ex, runtime, flags, dot_precision(q.dtype), True)
    fwd_args = (q, k, v, out, lse, *tensors, *plan.ints, 0.125, 0.125, *runtime[6:])
    launches = [("fwd", _triton_fwd._launch_fwd, plan, fwd_args, _triton_fwd.FWD_SHAPES)]
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _, bwd = _triton_bwd.backward_launches(dout, q, k, v, out, lse, None, 0.125, ex, *grads, delta)
    shapes = (_triton_bwd.DQ_SHAPES, _triton_bwd.DKDV_SHAPES)
    launches += [(name, cache, p, args, table) for name, (cache, p, args), table
                 in zip(("dq", "dkdv"), bwd, shapes, strict=True)]  # fmt: skip
    lines = []
    for name, cache, p, args, table in launches:
        for bm, bn, warps, stages in (tiles or {}).get(name) or table[dim_class(d)]:
            meta = {**p.constexprs, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps,
                    "num_stages": stages}  # fmt: skip
            kernel = cache.kernel.warmup(*args, grid=p.grid, **meta)
            code = sass(kernel)
            stl, ldl = (len(re.findall(rf"\b{op}\b", code)) for op in ("STL", "LDL"))
            lines.append(f"{name} d={d} causal={causal} {bm}x{bn}x{warps}x{stages}: shared "
                         f"{kernel.metadata.shared} bytes, STL {stl}, LDL {ldl}")  # fmt: skip
    return lines


if __name__ == "__main__":
    triton.runtime.driver.set_active(_Sm90Target())
    if sys.argv[1:] == ["schedule"]:
        lines, ok = schedule_lines()
        print("\n".join(lines))
        sys.exit(0 if ok else 1)
    if sys.argv[1:2] == ["precompile"]:  # precompile D,CAUSAL,DTYPE,FIRST ...
        for family in sys.argv[2:]:  # D,CAUSAL,DTYPE,FIRST[,KV_HEADS[,det]] (4 query heads)
            d, causal, dtype, first, *rest = family.split(",")
            at_first, later = precompile_misses(int(d), causal == "1", getattr(torch, dtype),
                                                int(first), int(rest[0]) if rest else 2,
                                                rest[1:] == ["det"])  # fmt: skip
            print(f"{family}: compiles of the first call and its queued builds {at_first}, "
                  f"of later calls {later}")  # fmt: skip
        sys.exit(0)
    if sys.argv[1:2] == ["spills"]:  # spills D [causal] [KERNEL=BMxBNxWxS,...] ...
        d, causal = int(sys.argv[2]), "causal" in sys.argv[3:]
        picked: dict[str, list] = {}
        for item in (a for a in sys.argv[3:] if "=" in a):
            name, tiles = item.split("=")
            picked[name] = [tuple(map(int, t.split("x"))) for t in tiles.split(",")]
        print("\n".join(portable_spills(d, causal, picked)))
        sys.exit(0)
    if sys.argv[1:] == ["backward"]:
        together, after = backward_compiles()
        print(f"backward kernels compiled together, after: {together}, {after}")
        sys.exit(0)
    for line in compile_variants([(64, True, torch.float16), (128, False, torch.bfloat16),
                                  (64, False, torch.bfloat16, {"KV_SPLIT": False}),
                                  (128, True, torch.bfloat16, {"KV_SPLIT": False}),
                                  (128, True, torch.float16, {"PROBE": 3}),
                                  (128, True, torch.bfloat16, {"DYNAMIC": True}),
                                  (64, True, torch.float16, {"DYNAMIC": True, "PROBE": 3}),
                                  (64, False, torch.bfloat16, {"QBUF": 2}),
                                  (128, True, torch.bfloat16, {"DYNAMIC": True, "QBUF": 2}),
                                  (64, False, torch.bfloat16, {"CONSUMERS": 3, "QBUF": 2}),
                                  (64, True, torch.float16, {"CONSUMERS": 3, "DYNAMIC": True}),
                                  (128, False, torch.bfloat16, {"TREE_MAX": False}),
                                  (64, True, torch.float16, {"CONSUMERS": 3, "DYNAMIC": True,
                                                             "TREE_MAX": False})]):  # fmt: skip
        print(line)
    for d, causal, dtype, pipeline in [(64, True, torch.float16, True),
                                       (128, False, torch.bfloat16, False)]:  # fmt: skip
        kernel = _warmup_bwd(d, causal, dtype, 256, pipeline)
        assert "wgmma.mma_async" in kernel.asm["ptx"], "not the wgmma kernel"
        print(f"dK/dV d={d} causal={causal} {dtype} pipeline={pipeline}: shared memory "
              f"{kernel.metadata.shared} bytes")  # fmt: skip
    for d, causal, dtype in [(64, True, torch.bfloat16), (64, False, torch.float16),
                             (128, True, torch.float16), (128, False, torch.bfloat16)]:  # fmt: skip
        kernel = _warmup_fused(d, causal, dtype, 256)
        assert "cp.reduce.async.bulk.tensor" in kernel.asm["ptx"], "dQ not summed by TMA"
        print(f"fused d={d} causal={causal} {dtype}: shared memory {kernel.metadata.shared} bytes")
    for d, causal in [(64, True), (64, False), (128, True), (128, False)]:  # ordered dQ sums
        ptx = _warmup_fused(d, causal, torch.bfloat16, 256, deterministic=True).asm["ptx"]
        assert "cp.async.bulk.wait_group 0;" in ptx and "red.release.gpu" in ptx, "not ordered"
        print(f"fused deterministic d={d} causal={causal}: compiled")
    print(
        f"{kernels_for_lengths(64, True, torch.float16, LENGTHS)} kernel(s) for lengths {LENGTHS}"
    )
    sys.exit(0)
