"""The benchmarks' shared harness: options, the only timers, rank launching, tables and files.

Timers: :func:`bench` (``do_bench`` on CUDA), :func:`samples_ms` (synchronized wall clock per
call), :class:`Laps` (phases of one step), :func:`host_us` (host time per call, unsynchronized)
and :func:`profiled` (torch.profiler). Rows carry :func:`env_stamp` (docs/benchmarking.md).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import json
import os
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_flashsys.attention._precompile as _precompile
from torch_flashsys._ports import free_port


def env_stamp() -> dict[str, str]:
    """Device, versions, date and command of this run."""
    cpu = f"CPU ({os.cpu_count()} cores)"
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "none"
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else cpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "date": _dt.date.today().isoformat(),
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
    }


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    """Median with 20th/80th percentiles (milliseconds)."""
    xs = sorted(samples_ms)
    q = statistics.quantiles(xs, n=5, method="inclusive") if len(xs) > 1 else [xs[0]] * 4
    return {"median_ms": statistics.median(xs), "p20_ms": q[0], "p80_ms": q[3]}


def sync() -> None:
    """Wait for the GPU (when there is one) and for torch_flashsys's background compiles (the
    builds other lengths take, queued after a kind of problem's first call: a user's steady
    state has them done, and they would share the CPU with what is timed): every timer ends
    its warm-up and its measurement with this."""
    _precompile.wait()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def samples_ms(fn: Callable, warmup: int = 3, reps: int = 20, before: Callable | None = None):
    """Milliseconds of each of ``reps`` synchronized calls after ``warmup`` untimed ones;
    ``before`` (untimed) runs ahead of every timed call (e.g. a barrier)."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def bench(fn: Callable, device: str | torch.device, reps: int = 2, rep_ms: int = 100) -> dict:
    """:func:`percentiles` of ``fn``: ``triton.testing.do_bench`` on CUDA (``rep_ms`` of calls,
    L2 flushed between them), else :func:`samples_ms` with one warm-up and ``reps``."""
    if torch.device(device).type != "cuda":
        return percentiles(samples_ms(fn, warmup=1, reps=reps))
    from triton.testing import do_bench

    _precompile.wait()  # (see sync)
    p20, median, p80 = do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
    return {"median_ms": median, "p20_ms": p20, "p80_ms": p80}


class Laps:
    """Phase times of one step: ``lap(name)`` syncs and records the milliseconds since the last."""

    def __init__(self) -> None:
        sync()
        self.ms: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        sync()
        now = time.perf_counter()
        self.ms[name] = (now - self._t) * 1e3
        self._t = now


def host_us(fn: Callable, calls: int, warmup: int = 30,
            synchronized: bool = False) -> dict[str, float]:  # fmt: skip
    """Microseconds of wall and process CPU time per call of ``fn``, run ``calls`` times without
    synchronizing (autograd runs CUDA backwards on a worker thread); ``synchronized``: the wall
    time until the GPU has finished the calls too (the loop's time per call whichever of host
    and GPU bounds it)."""
    for _ in range(warmup):  # autotune, compile, fill the launch caches
        fn()
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    if synchronized:
        sync()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    sync()
    return {"wall_us": wall / calls * 1e6, "cpu_us": cpu / calls * 1e6}


def profiled(step: Callable, iters: int, warmup: int = 1, record: bool = True):
    """``warmup`` calls of ``step``, then ``iters`` under ``torch.profiler`` (not recorded with
    ``record=False``): (the profile or None, synchronized wall milliseconds per call)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    prof = profile(activities=activities) if record else None
    with prof if prof is not None else contextlib.nullcontext():
        ms = samples_ms(lambda: [step() for _ in range(iters)], 0, 1)[0] / iters
    return prof, ms


def kernel_ms(step: Callable, iters: int = 5) -> float:
    """CUDA time per call of ``step``: every kernel it launches, summed (torch.profiler with
    CUDA activity only, so that no CPU op counts its kernels' time again)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        sync()
    return sum(e.device_time_total for e in prof.key_averages()) / iters / 1000


def _merged(intervals) -> list[list[float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint ``[start, end]`` pairs."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _common(a: list[list[float]], b: list[list[float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
    return total


def comm_overlap(kernels, iters: int, is_comm: Callable[[str], bool]) -> dict[str, float]:
    """How much of one GPU's communication ran beside computation, per iteration (ms).

    ``kernels``: ``(name, start_us, end_us)`` of the GPU activity in a profile (torch.profiler's
    CUDA events). Communication is the union of the ``is_comm`` kernels (NCCL's, including their
    wait for the other ranks), computation the union of the rest; ``hidden_ms`` is the time both
    ran, ``exposed_comm_ms`` the communication time with no computation beside it."""
    comm = _merged((s, e) for n, s, e in kernels if is_comm(n))
    compute = _merged((s, e) for n, s, e in kernels if not is_comm(n))
    total, hidden = sum(e - s for s, e in comm), _common(comm, compute)
    ms = lambda us: us / 1e3 / iters
    return {"compute_ms": ms(sum(e - s for s, e in compute)), "comm_ms": ms(total),
            "hidden_ms": ms(hidden), "exposed_comm_ms": ms(total - hidden),
            "hidden_frac": hidden / total if total else float("nan")}  # fmt: skip


def device_kernels(prof) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every CUDA activity (kernels, copies, sets) in a
    torch.profiler profile; not the GPU-side spans of ``record_function`` ranges, which cover
    whole phases."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == cuda and not e.is_user_annotation]  # fmt: skip


def top_ops(events, key: str, iters: int, n: int = 4, scale: float = 1e-3) -> str:
    """The ``n`` profiler events with the largest ``key`` as "name time; ..." per iteration
    (microseconds times ``scale``: ms by default)."""
    top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:n]
    return "; ".join(
        f"{e.key} {getattr(e, key, 0) * scale / iters:.{1 if scale < 1 else 0}f}" for e in top
    )


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


OUT_SUFFIXES = (".json", ".csv")  # what write_results writes (--out)


def write_results(path: str | None, rows: Sequence[dict[str, Any]]) -> None:
    """Write rows (each stamped with :func:`env_stamp`) to ``path`` (.json or .csv); None: skip."""
    if not path:
        return
    if not path.endswith(OUT_SUFFIXES):
        raise ValueError(f"--out must end in .json or .csv, got {path!r}")
    stamped = [{**env_stamp(), **r} for r in rows]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        if path.endswith(".json"):
            json.dump(stamped, f, indent=2)
        else:
            fields = list(dict.fromkeys(k for r in stamped for k in r))
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(stamped)


def report(title: str, rows: Sequence[dict], columns: Sequence[str], out: str | None = None):
    """Write ``rows`` to ``out`` (when given) and print them as a table under the stamp."""
    write_results(out, rows)
    stamp = env_stamp()
    print(f"\n### {title}\n")
    print(f"{stamp['device']}, torch {stamp['torch']}, triton {stamp['triton']}, {stamp['date']}")
    print(f"`{stamp['command']}`\n")
    print(markdown_table(rows, columns))


def progress(iterable, desc: str, total: int | None = None):
    """tqdm progress bar when tqdm is installed, the bare iterable otherwise."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False)


def is_oom(exc: BaseException) -> bool:
    """True for CUDA out-of-memory errors (typed or as a RuntimeError message)."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def why(exc: BaseException, width: int = 80) -> str:
    """``Type: message`` (whitespace collapsed, cut at ``width``) for a row that could not run."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:width]}"


def nvtx_range(name: str, enabled: bool = True) -> contextlib.AbstractContextManager:
    """An NVTX range (visible in ``nsys``) when ``enabled`` and CUDA is available; else a no-op."""
    if enabled and torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every option's default."""


def parser(doc: str | None, smoke: str, plot: bool = False) -> argparse.ArgumentParser:
    """An ArgumentParser showing ``doc`` with the options every benchmark has: --smoke (``smoke``
    says what it runs), --out and, with ``plot``, --plot."""
    p = argparse.ArgumentParser(description=doc, formatter_class=_Help)
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--out", type=out_path, help="write the rows to a .json or .csv file")
    if plot:
        p.add_argument("--plot", help="save a PNG plot of the results to this path")
    return p


def out_path(value: str) -> str:
    """--out's type: a .json or .csv path, checked before anything runs (a multi-rank run writes
    it at its end, on rank 0)."""
    if not value.endswith(OUT_SUFFIXES):
        raise argparse.ArgumentTypeError(f"must end in .json or .csv, got {value!r}")
    return value


def csv_list(p: argparse.ArgumentParser, value: str, option: str, kind=str, choices=None) -> list:
    """``value`` split at commas and converted by ``kind``; a parser error naming ``option`` when
    an item does not convert, is not in ``choices`` or is not positive (numbers)."""
    try:
        items = [kind(v.strip()) for v in str(value).split(",") if v.strip()]
    except ValueError:
        items = []
    if not items or any(v not in (choices or [v]) or (kind is not str and v <= 0) for v in items):
        wanted = f"a subset of {list(choices)}" if choices else f"positive {kind.__name__}s"
        p.error(f"{option} takes comma-separated {wanted}, got {value!r}")
    return items


def under_torchrun() -> bool:
    """True in a process that torchrun (or another env:// launcher) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_ranks(fn, args, nproc: int, backend: str, timeout_s: float = 300.0):
    """``fn(args)`` in every rank of a process group: this process when torchrun started it, else
    ``nproc`` spawned ones. Returns rank 0's result (None on the other ranks of a torchrun world)."""
    if under_torchrun():
        return _in_group(fn, args, backend, timeout_s)
    port = free_port()  # for MASTER_PORT
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_spawned, args=(nproc, port, fn, args, backend, timeout_s, queue),
                       nprocs=nproc, start_method="spawn")  # fmt: skip
    return queue.get()


def _spawned(rank: int, world: int, port: int, fn, args, backend, timeout_s, queue) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    result = _in_group(fn, args, backend, timeout_s)
    if rank == 0:
        queue.put(result)


def _in_group(fn, args, backend: str, timeout_s: float):
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=_dt.timedelta(seconds=timeout_s))
    try:
        result = fn(args)
        dist.barrier()  # rank 0 reported: leave together
    except BaseException:
        # The other ranks may be waiting for this one in a collective: NCCL's
        # destroy_process_group would wait for them too (a hung job, this error never printed).
        # Print it and leave at once; the launcher (torchrun, multiprocessing) ends the others.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return result if rank == 0 else None


def _pyplot(what: str):
    """matplotlib.pyplot on the Agg backend, or None (after a warning naming ``what``) without
    matplotlib (``pip install torch-flashsys[bench]``)."""
    try:
        import matplotlib
    except ImportError:
        print(f"{what}: matplotlib is not installed; no plot written", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: str, title: str) -> None:
    """Title ``ax`` with ``title`` and this run's device, torch and date; write ``fig`` to ``path``."""
    stamp = env_stamp()
    ax.set_title(f"{title}\n{stamp['device']}, torch {stamp['torch']}, {stamp['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def line_plot(path: str, series: dict, xlabel: str, ylabel: str, title: str, log: str = "") -> None:
    """Save one line per ``series`` entry (label -> [(x, y), ...]) as a PNG, axes in ``log`` on a
    log scale ("x", "y", "xy"). Without matplotlib this warns and writes nothing."""
    plt = _pyplot(f"--plot {path}")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in series.items():
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, **{f"{axis}scale": "log" for axis in log})
    text_x = any(isinstance(x, str) for points in series.values() for x, _ in points)
    ax.tick_params(axis="x", rotation=60 if text_x else 0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, ax, path, title)


def timeline_plot(path: str, timelines: dict, is_comm: Callable[[str], bool], title: str) -> None:
    """One row pair per ``timelines`` entry (label -> ``(name, start_us, end_us)`` kernels):
    computation above, communication below, milliseconds from the entry's first kernel. Without
    matplotlib this warns and writes nothing."""
    plt = _pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(timelines) + 1.5))
    labels = []
    for row, (label, kernels) in enumerate(timelines.items()):
        t0 = min((s for _, s, _ in kernels), default=0.0)
        for comm in (False, True):
            spans = _merged((s, e) for n, s, e in kernels if is_comm(n) == comm)
            bars = [((s - t0) / 1e3, (e - s) / 1e3) for s, e in spans]
            y = 2 * (len(timelines) - 1 - row) + (0 if comm else 1)
            ax.broken_barh(bars, (y + 0.1, 0.8), color="tab:red" if comm else "tab:blue")
            labels.append((y + 0.5, f"{label} {'comm' if comm else 'compute'}"))
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels], fontsize=7)
    ax.set_xlabel("ms from the first profiled kernel")
    ax.grid(True, axis="x", alpha=0.3)
    _save(plt, fig, ax, path, title)
