"""The Hopper forward kernel's compile-time variants and its cycle timeline, SDPA's cuDNN forward
in the same run (H100/H200).

    python3 benchmarks/sm90_fwd.py [--shapes 1x16/16x16384x128c,...] [--out sm90_fwd_h100.csv]
    python3 benchmarks/sm90_fwd.py --timeline [--shapes ...]

Default: per shape (bf16), the kernel alone (``do_bench`` medians of the direct launch the library
makes, on the library's grid) for each variant in :data:`VARIANTS`, whether its output equals the
library's default bit for bit, and cuDNN's forward (``sdpa_kernel`` pinned, no grad) beside it;
three rounds in alternating order, their median and spread (max / min); ``kv_tb_s``: the keys
and values the kernel loads (whole tiles) per second of its time, TB/s (what it asks of L2).
``--timeline``: the ``PROBE == 3`` build's %clock64 cycles per key-tile step and phase of each
consumer warpgroup (summed over programs, divided by their steps), per variant.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import parser, report, why
from benchmarks._peers import sdpa_call
from benchmarks.sm90_bwd import _shapes
from torch_flashsys.attention import _sm90
from torch_flashsys.attention._tensors import empty_like_layout

SHAPES = [  # batch, query heads, key/value heads, length, head dim, causal
    (1, 16, 16, 16384, 128, True),
    (1, 16, 16, 16384, 128, False),
    (4, 16, 16, 4096, 128, True),
    (8, 16, 16, 2048, 128, True),
    (1, 16, 16, 16384, 64, True),
    (4, 16, 16, 4096, 64, False),
    (16, 16, 16, 1024, 64, True),
]
VARIANTS = {  # name: constexprs over the library's (earlier: KV_SPLIT, DYNAMIC, QBUF; git history)
    "default": {},
    "pinned P V wait": {"PIN_WAIT": True},  # _sm90.FWD_PIN_WAIT
    "unpinned": {"PIN_WAIT": False},
    "2 consumers": {"CONSUMERS": 2, "CONSUMER_REGS": 240},  # _sm90.FWD_CONSUMERS3_MIN
    "3 consumers": {"CONSUMERS": 3, "CONSUMER_REGS": 160},
    "Q in registers": {"Q_RS": True},  # S = Q K^T reads only K from shared memory
    "2 consumers + Q in registers": {"CONSUMERS": 2, "CONSUMER_REGS": 240, "Q_RS": True},
    "tree row max": {"TREE_MAX": True},  # each row's maximum as a tree, not a chain (same bits)
    "chain row max": {"TREE_MAX": False},  # (the default at head dim 64 without a causal mask)
    # the schedule and the rings (_sm90.forward_grid, FWD_DYNAMIC_MAX, STAGES, FWD_QBUF2_MAX);
    # GRID "tiles": one program per tile, the hardware's scheduler balancing them
    "one program per tile": {"DYNAMIC": False, "GRID": "tiles"},
    "persistent, fixed rounds": {"DYNAMIC": False},  # (past PERSISTENT_CAUSAL_MAX: per tile)
    "dynamic schedule": {"DYNAMIC": True},  # tiles from a counter (causal or not)
    "2 key/value stages": {"STAGES": 2},
    "4 key/value stages": {"STAGES": 4},
    "1 query buffer": {"QBUF": 1},
    "2 query buffers": {"QBUF": 2},
    # measurement-only cuts (wrong output): the consumers release each buffer once loaded, no
    # products (the key/value traffic alone); the load warp loads each ring stage once, then
    # only signals it (no key/value traffic)
    "loads only (probe)": {"PROBE": 4},
    "no K/V loads (probe)": {"PROBE": 5},
}
N_PROBES = 32  # floats per program the probe build stores (16 per consumer warpgroup)


def _problem(shape):
    b, h, hk, n, d, causal = shape
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    label = f"{b}x{h}/{hk}x{n}x{d}{' causal' if causal else ''}"
    return q, k, v, causal, label


def _launcher(q, k, v, causal: bool, extra: dict):
    """``(launch, out, lse, grid)``: the forward kernel with constexprs ``extra`` over the
    library's, launched the library's way (compiled on the first call, then directly); with
    ``DYNAMIC`` on the persistent grid, its counter zeroed once (each launch leaves it at zero,
    as the library's per-stream counter)."""
    from torch_flashsys.attention._sm90._fwd import attn_fwd_sm90

    d = q.shape[-1]
    extra = dict(extra)
    per_tile = extra.pop("GRID", None) == "tiles"
    out = empty_like_layout(q, d)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    dynamic = extra.get("DYNAMIC", _sm90.dynamic_schedule(q, causal))  # else the library's
    counter = q.new_zeros(1, dtype=torch.int32) if dynamic else None
    args = lambda descriptors: _sm90.launch_args(q, k, v, out, lse, d**-0.5, counter,
                                                 descriptors)  # fmt: skip
    consumers = extra.get("CONSUMERS", _sm90.forward_consumers(q, causal))
    grid = _sm90.forward_grid(q, causal, False if per_tile else None, dynamic, consumers)
    meta = {**_sm90.constexprs(_sm90.kernel_dim(d), causal, dynamic,
                               _sm90.query_buffers(q, causal), consumers),
            **extra, **_sm90.launch_options(consumers)}  # fmt: skip
    values = _sm90.launch_values(q, k, v, out, lse, d**-0.5, counter)
    plans: dict = {}

    def launch():
        _sm90._launch_planned(attn_fwd_sm90, plans, "variant", q.get_device(), values, args,
                              lambda: (grid, meta))  # fmt: skip

    return launch, out, lse, grid


def kv_bytes(shape, consumers: int, itemsize: int = 2) -> int:
    """Bytes of keys and values (bf16: ``itemsize`` 2) the kernel loads for ``shape``: every key
    tile of each query tile of ``consumers * BLOCK_M`` rows, whole tiles (TMA loads the box)."""
    b, h, _, n, d, causal = shape
    rows, cols = consumers * _sm90.BLOCK_M, _sm90.BLOCK_N
    tiles = sum(-(-min(n, m0 + rows) // cols) if causal else -(-n // cols)
                for m0 in range(0, n, rows))  # fmt: skip
    return b * h * tiles * 2 * cols * d * itemsize


def variant_rows(shape, rounds: int = 3, only: list[str] | None = None) -> list[dict]:
    """Per variant (and cuDNN): built and compared with the library's output once, then timed
    in ``rounds`` rounds that alternate the order of the variants (a long problem's later runs
    in one process can measure slower: the GPU's clocks), reporting the median of the rounds."""
    import statistics

    from triton.testing import do_bench

    b, h, hk, n, d, causal = shape
    q, k, v, causal, label = _problem(shape)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    ref, ref_lse = _sm90.forward(q, k, v, d**-0.5, causal)
    calls, rows = {}, {}
    for name, extra in VARIANTS.items():
        if only is not None and name not in only:
            continue
        if extra.get("CONSUMERS", 2) == 3 and d != 64:
            continue  # three consumers fit head dim 64 only (registers, shared memory)
        try:
            launch, out, lse, _ = _launcher(q, k, v, causal, extra)
            launch()
        except Exception as exc:  # (a variant that does not build for this problem)
            rows[name] = {"shape": label, "impl": name, "note": why(exc, 90)}
            continue
        same = torch.equal(out, ref) and torch.equal(lse, ref_lse)
        diff = (out.float() - ref.float()).abs().max().item()
        calls[name] = launch
        rows[name] = {"shape": label, "impl": name, "equal_to_default": same,
                      "max_diff_vs_default": diff}  # fmt: skip
    cudnn = sdpa_call("CUDNN_ATTENTION", is_causal=causal, enable_gqa=h != hk)

    def cudnn_fwd():
        with torch.no_grad():
            return cudnn(q, k, v)

    calls["sdpa cudnn"], rows["sdpa cudnn"] = cudnn_fwd, {"shape": label, "impl": "sdpa cudnn"}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in list(calls)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(do_bench(calls[name], warmup=25, rep=200))
    for name, row in rows.items():
        if name not in calls:
            continue
        ms = statistics.median(times[name])
        row.update(ms=ms, tflops=flops / ms / 1e9, spread=max(times[name]) / min(times[name]))
        if name in VARIANTS and VARIANTS[name].get("PROBE") != 5:  # (cuDNN's tiles: unknown)
            consumers = VARIANTS[name].get("CONSUMERS", _sm90.forward_consumers(q, causal))
            row["kv_tb_s"] = kv_bytes(shape, consumers) / ms / 1e9
    return list(rows.values())


def timeline_rows(shape) -> list[dict]:
    from torch_flashsys.attention._sm90._fwd import PROBE_PHASES

    q, k, v, causal, label = _problem(shape)
    rows = []
    for name, extra in VARIANTS.items():
        if extra.get("CONSUMERS", 2) != 2:
            continue  # the probes time two consumers
        launch, _, lse, grid = _launcher(q, k, v, causal, {**extra, "PROBE": 3})
        assert lse.numel() >= N_PROBES * grid[0], "lse too small for the probes"
        try:
            launch()
        except Exception:  # (a variant that does not build for this problem: no timeline)
            continue
        torch.cuda.synchronize()
        t = lse.reshape(-1)[: grid[0] * N_PROBES].reshape(grid[0], 2, 16).double()
        for wg in range(2):
            steps, tiles = t[:, wg, 8].sum().item(), t[:, wg, 9].sum().item()
            per = [steps] * (len(PROBE_PHASES) - 1) + [tiles]  # the last phase: per tile
            cycles = [t[:, wg, j].sum().item() / max(n, 1) for j, n in enumerate(per)]
            for phase, value in zip(PROBE_PHASES, cycles, strict=True):
                rows.append({"shape": label, "variant": name, "consumer": wg, "phase": phase,
                             "cycles": value})  # fmt: skip
            rows.append({"shape": label, "variant": name, "consumer": wg,
                         "phase": "step (the key-tile phases)", "cycles": sum(cycles[:-1])})  # fmt: skip
    return rows


def cpu_rows() -> list[dict]:
    """Without a Hopper GPU (--smoke): the PyTorch backend's forward of one tiny problem, so the
    script's table and --out still work."""
    from benchmarks._harness import bench
    from torch_flashsys import flash_attention

    q, k, v = (torch.randn(1, 2, 96, 64) for _ in range(3))
    with torch.no_grad():
        res = bench(lambda: flash_attention(q, k, v, is_causal=True, backend="torch"), "cpu")
    return [{"shape": "1x2/2x96x64 causal", "impl": "flash_attention (torch backend, CPU)",
             "ms": res["median_ms"]}]  # fmt: skip


def main() -> None:
    p = parser(__doc__, smoke="(no CPU mode: the Hopper kernels need an sm90 GPU)")
    p.add_argument("--shapes", type=_shapes,
                   help="these problems instead, e.g. 1x16/16x16384x128c (c: causal)")  # fmt: skip
    p.add_argument("--timeline", action="store_true",
                   help="cycles per key-tile step and phase of each consumer (PROBE == 3)")  # fmt: skip
    p.add_argument("--only", type=lambda text: text.split(","),
                   help="these variants alone (names, comma-separated; default: all)")  # fmt: skip
    args = p.parse_args()
    if args.only and set(args.only) - set(VARIANTS):
        p.error(f"--only: unknown variants {sorted(set(args.only) - set(VARIANTS))}; "
                f"the variants are {list(VARIANTS)}")  # fmt: skip
    if args.smoke or not (torch.cuda.is_available() and _sm90.enabled()):
        report("Hopper forward: no Hopper GPU here (the PyTorch backend's forward instead)",
               cpu_rows(), ("shape", "impl", "ms"), args.out)  # fmt: skip
        return
    shapes = args.shapes or SHAPES
    if args.timeline:
        rows = [r for shape in shapes for r in timeline_rows(shape)]
        report("Hopper forward: %clock64 cycles per key-tile step and phase", rows,
               ("shape", "variant", "consumer", "phase", "cycles"), args.out)  # fmt: skip
        return
    rows = [r for shape in shapes for r in variant_rows(shape, only=args.only)]
    report("Hopper forward: compile-time variants (kernel only) and cuDNN", rows,
           ("shape", "impl", "ms", "tflops", "kv_tb_s", "spread", "equal_to_default",
            "max_diff_vs_default", "note"),
           args.out)  # fmt: skip


if __name__ == "__main__":
    main()
