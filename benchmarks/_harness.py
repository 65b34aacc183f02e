"""Small shared harness for the benchmark scripts: environment stamp, timing, tables, output files.

Every result row carries the device, torch/triton versions, date and command (``env_stamp()``), so
a table copied into docs/benchmarks.md says where it came from.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import json
import os
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import torch


def env_stamp() -> dict[str, str]:
    """Device, versions, date and command of this run."""
    cpu = f"CPU ({os.cpu_count()} cores)"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "none"
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": triton_version,
        "date": _dt.date.today().isoformat(),
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
    }


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    """Median with 20th/80th percentiles, plus mean and standard deviation (milliseconds)."""
    xs = sorted(samples_ms)
    q = statistics.quantiles(xs, n=5, method="inclusive") if len(xs) > 1 else [xs[0]] * 4
    return {
        "median_ms": statistics.median(xs),
        "p20_ms": q[0],
        "p80_ms": q[3],
        "mean_ms": statistics.fmean(xs),
        "std_ms": statistics.stdev(xs) if len(xs) > 1 else 0.0,
    }


def time_fn(fn: Callable[[], Any], warmup: int = 3, reps: int = 20) -> dict[str, float]:
    """Wall-clock timing with device synchronisation; returns :func:`percentiles` of ``reps`` runs.

    On CUDA prefer :func:`bench_gpu` (``triton.testing.do_bench``), which also flushes the L2 cache.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return percentiles(samples)


def bench_gpu(fn: Callable[[], Any], warmup_ms: int = 25, rep_ms: int = 100) -> dict[str, float]:
    """``triton.testing.do_bench``: median and 20th/80th percentiles in milliseconds."""
    from triton.testing import do_bench

    p20, median, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
    return {"median_ms": median, "p20_ms": p20, "p80_ms": p80}


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(path: str | None, rows: Sequence[dict[str, Any]]) -> None:
    """Write rows (each stamped with :func:`env_stamp`) to ``path`` (.json or .csv); None: skip."""
    if not path:
        return
    stamp = env_stamp()
    stamped = [{**stamp, **r} for r in rows]
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(stamped, f, indent=2)
    elif path.endswith(".csv"):
        keys = list(dict.fromkeys(k for r in stamped for k in r))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(stamped)
    else:
        raise ValueError(f"--out must end in .json or .csv, got {path!r}")


def progress(iterable, desc: str, total: int | None = None):
    """tqdm progress bar when tqdm is installed, the bare iterable otherwise."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False)


def print_report(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    stamp = env_stamp()
    print(f"\n### {title}\n")
    print(f"{stamp['device']}, torch {stamp['torch']}, triton {stamp['triton']}, {stamp['date']}")
    print(f"`{stamp['command']}`\n")
    print(markdown_table(rows, columns))


def is_oom(exc: BaseException) -> bool:
    """True for CUDA out-of-memory errors (typed or as a RuntimeError message)."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def nvtx_range(name: str, enabled: bool = True) -> contextlib.AbstractContextManager:
    """An NVTX range (visible in ``nsys``) when ``enabled`` and CUDA is available; else a no-op."""
    if enabled and torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for MASTER_PORT when spawning processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True in a process that torchrun (or another env:// launcher) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def set_spawn_env(rank: int, world_size: int, port: int) -> None:
    """Give a process started by ``mp.spawn`` the environment torchrun would have given it."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip


def add_lm_args(p, default_size: str = "xl") -> None:
    """The reference-LM options the distributed benchmarks share (--size, --batch, --context, ...)."""
    from torch_flashsys.models import ATTENTION_CHOICES, MODEL_SIZES

    p.add_argument(
        "--size", default=default_size, choices=list(MODEL_SIZES),
        help=f"reference LM size ({default_size})",
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step (4)")
    p.add_argument("--context", type=int, default=256, help="sequence length (256)")
    p.add_argument("--vocab", type=int, default=10_000, help="vocabulary size (10000)")
    p.add_argument(
        "--attention", default="sdpa", choices=list(ATTENTION_CHOICES),
        help="the LM's attention implementation (sdpa)",
    )  # fmt: skip


def line_plot(
    path: str,
    series: dict[str, Sequence[tuple[Any, float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    logy: bool = False,
    xtick_rotation: float = 0.0,
) -> None:
    """Save one line per ``series`` entry (label -> [(x, y), ...]) as a PNG (matplotlib, lazily).

    Without matplotlib (``pip install torch-flashsys[bench]``) this warns and writes nothing, so a
    long benchmark still prints its table.
    """
    try:
        import matplotlib
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; no plot written", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in series.items():
        if points:
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", rotation=xtick_rotation)
    stamp = env_stamp()
    ax.set_title(f"{title}\n{stamp['device']}, torch {stamp['torch']}, {stamp['date']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
