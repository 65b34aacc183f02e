"""Memory snapshots for pytorch.org/memory_viz: record one, write it, and check that it will load.

Private: ``benchmarks/model.py --memory-profile`` records and checks its snapshots with it (the
snapshot tests, tests/test_memory_snapshot.py, check it here, in the package).

A snapshot is the dict ``torch.cuda.memory._snapshot()`` returns (documented there)::

    {"segments": [{"device", "address", "total_size", "stream", "blocks": [{"size", "state",
                   "requested_size", "frames": [{"filename", "line", "name"}], ...}], ...}],
     "device_traces": [[{"action", "addr", "size", "stream", "frames", ...}, ...], ...]}

memory_viz (torch/utils/viz/MemoryViz.js) reads it with its own small unpickler (pickle protocols
2-4 and a subset of opcodes only), places each block at its segment's address plus the sizes of
the blocks before it, and replays ``device_traces[device]`` backwards from the final state: a
``free_requested`` must find its block live, and every allocation must lie inside a segment.
:func:`validate_snapshot` checks exactly those things and raises :class:`SnapshotError` naming
the offending path (``segments[3].blocks[7].size``); :func:`validate_snapshot_file` also checks
the pickle's protocol and opcodes.

Example:
    >>> with record_memory("snapshot.pickle", torch.device("cuda")):
    ...     train_step()
    >>> validate_snapshot_file("snapshot.pickle")["n_events"]
    5120
"""

from __future__ import annotations

import contextlib
import io
import pickle
import pickletools
from collections.abc import Iterator
from typing import Any

import torch

# Opcodes MemoryViz.js's unpickle() implements; anything else makes the page throw.
VIZ_PICKLE_OPCODES = frozenset({
    "PROTO", "FRAME", "MEMOIZE", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "EMPTY_DICT",
    "EMPTY_LIST", "EMPTY_TUPLE", "MARK", "APPEND", "APPENDS", "LIST", "TUPLE", "TUPLE1", "TUPLE2",
    "TUPLE3", "DICT", "SETITEM", "SETITEMS", "NEWTRUE", "NEWFALSE", "NONE", "BININT", "BININT1",
    "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "STOP",
})  # fmt: skip
VIZ_PICKLE_PROTOCOLS = (2, 3, 4)  # MemoryViz.js: "Unhandled version" outside this range
PICKLE_PROTOCOL = 4
BLOCK_STATES = frozenset(
    {"active_allocated", "active_pending_free", "active_awaiting_free", "inactive"}
)
ACTIVE_STATES = frozenset({"active_allocated", "active_pending_free", "active_awaiting_free"})
TRACE_ACTIONS = frozenset(
    {
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "oom",
        "snapshot",
    }
)
# Keys torch's CUDA caching allocator writes beyond what memory_viz needs (checked if strict).
ALLOCATOR_SEGMENT_KEYS = ("allocated_size", "active_size", "segment_type")


class SnapshotError(ValueError):
    """A memory snapshot that memory_viz would not load or would draw wrongly."""


def _fail(path: str, rule: str, got: Any) -> None:
    shown = repr(got)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise SnapshotError(f"validate_snapshot: {path} {rule}, got {shown}")


def _need(d: dict, key: str, path: str, kind: type | tuple[type, ...]) -> Any:
    if key not in d:
        _fail(path, f"must have key {key!r}", sorted(d))
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        _fail(f"{path}.{key}", f"must be {names}", value)
    return value


def _check_frames(frames: Any, path: str) -> None:
    if not isinstance(frames, list):
        _fail(path, "must be a list of frames", frames)
    for i, f in enumerate(frames):
        fp = f"{path}[{i}]"
        if not isinstance(f, dict):
            _fail(fp, "must be a dict", f)
        _need(f, "filename", fp, str)
        _need(f, "name", fp, str)
        _need(f, "line", fp, int)


def _check_segments(segments: list, n_devices: int, strict: bool) -> dict[int, list]:
    """Per device: [(address, total_size)] and the set of live block addresses."""
    live: dict[int, list] = {}
    for i, seg in enumerate(segments):
        sp = f"segments[{i}]"
        if not isinstance(seg, dict):
            _fail(sp, "must be a dict", seg)
        device = _need(seg, "device", sp, int)
        if not 0 <= device < n_devices:
            _fail(f"{sp}.device", f"must index device_traces (0..{n_devices - 1})", device)
        address = _need(seg, "address", sp, int)
        total = _need(seg, "total_size", sp, int)
        _need(seg, "stream", sp, int)
        blocks = _need(seg, "blocks", sp, list)
        if strict:
            for key in ALLOCATOR_SEGMENT_KEYS:
                _need(seg, key, sp, str if key == "segment_type" else int)
        intervals, active = live.setdefault(device, ([], set()))
        intervals.append((address, total))
        addr = address
        for j, b in enumerate(blocks):
            bp = f"{sp}.blocks[{j}]"
            if not isinstance(b, dict):
                _fail(bp, "must be a dict", b)
            size = _need(b, "size", bp, int)
            state = _need(b, "state", bp, str)
            if size < 0:
                _fail(f"{bp}.size", "must be >= 0", size)
            if state not in BLOCK_STATES:
                _fail(f"{bp}.state", f"must be one of {sorted(BLOCK_STATES)}", state)
            if "address" in b and b["address"] != addr:
                _fail(f"{bp}.address", f"must be the segment address plus earlier sizes {addr}", b)
            if "frames" in b:
                _check_frames(b["frames"], f"{bp}.frames")
                # memory_viz draws requested_size of live blocks only; CUDA leaves a stale
                # value (it can exceed size) on free blocks that were split since.
                if state in ACTIVE_STATES:
                    req = _need(b, "requested_size", bp, int)
                    if not 0 <= req <= size:
                        _fail(f"{bp}.requested_size", f"must be in [0, size={size}]", req)
            elif "history" not in b and state in ACTIVE_STATES and "requested_size" not in b:
                _fail(bp, "an active block needs 'frames' and 'requested_size'", sorted(b))
            if state in ACTIVE_STATES:
                active.add(addr)
            addr += size
        if addr - address != total:
            _fail(f"{sp}.blocks", f"sizes must add up to total_size={total}", addr - address)
    return live


def _check_trace(trace: list, dev: int, intervals: list, active: set) -> None:
    tp = f"device_traces[{dev}]"
    for k, e in enumerate(trace):
        ep = f"{tp}[{k}]"
        if not isinstance(e, dict):
            _fail(ep, "must be a dict", e)
        action = _need(e, "action", ep, str)
        if action not in TRACE_ACTIONS:
            _fail(f"{ep}.action", f"must be one of {sorted(TRACE_ACTIONS)}", action)
        if action == "snapshot":
            continue
        _need(e, "size", ep, int)
        if action == "oom":
            _need(e, "device_free", ep, int)
        else:
            _need(e, "addr", ep, int)
            _need(e, "stream", ep, int)
        if "frames" in e:
            _check_frames(e["frames"], f"{ep}.frames")
    # Replay backwards from the final state, as MemoryViz.js does.
    segs = set(intervals)
    check_segments = not any(e.get("action") in ("segment_map", "segment_unmap") for e in trace)
    live = set(active)
    for k in range(len(trace) - 1, -1, -1):
        e = trace[k]
        action = e["action"]
        if action == "free_completed":
            live.add(e["addr"])
        elif action == "free_requested" and e["addr"] not in live:
            _fail(f"{tp}[{k}]", "frees a block that is not live at that point of the trace", e)
        elif action == "alloc":
            live.discard(e["addr"])
            if check_segments and not any(
                a <= e["addr"] and e["addr"] + e["size"] <= a + s for a, s in segs
            ):
                _fail(f"{tp}[{k}]", "allocates outside every segment live at that point", e)
        elif action == "segment_free":
            segs.add((e["addr"], e["size"]))
        elif action == "segment_alloc":
            if (e["addr"], e["size"]) not in segs:
                _fail(f"{tp}[{k}]", "allocates a segment the final state does not explain", e)
            segs.discard((e["addr"], e["size"]))


def validate_snapshot(obj: Any, *, strict: bool = False) -> dict[str, int]:
    """Check a memory snapshot dict against what memory_viz needs; return a summary.

    strict: also require the keys torch's CUDA caching allocator writes on each segment
    (``allocated_size``, ``active_size``, ``segment_type``): a real ``_snapshot()``, not a
    converted profile.

    Returns ``{"n_segments", "n_blocks", "n_events", "n_devices", "reserved_bytes",
    "allocated_bytes", "trace_peak_bytes"}``: reserved/allocated in the final state, and the peak
    of live requested bytes over the trace (replayed forwards from the start of the trace). CUDA's
    trace entries and the final blocks' ``requested_size`` are the sizes asked for, so on CUDA this
    is ``torch.cuda.memory_stats()["requested_bytes.all.peak"]`` over the recorded span, not
    ``max_memory_allocated``: that one counts whole blocks, rounded up to 512 bytes and, where the
    allocator hands out a cached block whose rest (up to 1 MiB) it does not split off, larger by
    that rest, so it depends on what the cache held before.
    Raises :class:`SnapshotError` (a ValueError) naming the first offending field.
    """
    if not isinstance(obj, dict):
        _fail("snapshot", "must be a dict with 'segments' and 'device_traces'", type(obj))
    segments = _need(obj, "segments", "snapshot", list)
    traces = _need(obj, "device_traces", "snapshot", list)
    for d, t in enumerate(traces):
        if not isinstance(t, list):
            _fail(f"device_traces[{d}]", "must be a list of trace entries", t)
    live = _check_segments(segments, len(traces), strict)
    for dev, trace in enumerate(traces):
        intervals, active = live.get(dev, ([], set()))
        _check_trace(trace, dev, intervals, active)

    allocated = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] in ACTIVE_STATES)
    # Forward replay for the peak: live bytes at the trace's start = final - (allocs - frees),
    # in requested bytes as the trace's sizes are (a converted CPU profile has no requested size:
    # its blocks are what was asked for).
    peak = 0
    for dev, trace in enumerate(traces):
        final = sum(
            b.get("requested_size", b["size"])
            for s in segments
            if s["device"] == dev
            for b in s["blocks"]
            if b["state"] in ACTIVE_STATES
        )
        delta = [
            e["size"] if e["action"] == "alloc" else -e["size"]
            for e in trace
            if e["action"] in ("alloc", "free_completed")
        ]
        cur = final - sum(delta)
        dev_peak = cur
        for d in delta:
            cur += d
            dev_peak = max(dev_peak, cur)
        peak = max(peak, dev_peak)
    return {
        "n_segments": len(segments),
        "n_blocks": sum(len(s["blocks"]) for s in segments),
        "n_events": sum(len(t) for t in traces),
        "n_devices": len(traces),
        "reserved_bytes": sum(s["total_size"] for s in segments),
        "allocated_bytes": allocated,
        "trace_peak_bytes": peak,
    }


def check_pickle_bytes(data: bytes) -> None:
    """Raise :class:`SnapshotError` unless memory_viz's unpickler can read ``data``."""
    protocol = None
    for op, arg, pos in pickletools.genops(io.BytesIO(data)):
        if op.name == "PROTO":
            protocol = arg
            if arg not in VIZ_PICKLE_PROTOCOLS:
                _fail(
                    "pickle", f"protocol must be one of {VIZ_PICKLE_PROTOCOLS} for memory_viz", arg
                )
        elif op.name not in VIZ_PICKLE_OPCODES:
            _fail(
                "pickle", f"uses opcode {op.name} at byte {pos}, which memory_viz cannot read", arg
            )
    if protocol is None:
        _fail("pickle", f"must start with PROTO (protocol {VIZ_PICKLE_PROTOCOLS})", data[:2])


def validate_snapshot_file(path: str, *, strict: bool = False) -> dict[str, int]:
    """:func:`check_pickle_bytes` then :func:`validate_snapshot` on the file's contents."""
    with open(path, "rb") as f:
        data = f.read()
    check_pickle_bytes(data)
    return validate_snapshot(pickle.loads(data), strict=strict)


def dump_snapshot(obj: dict, path: str) -> None:
    """Pickle a snapshot with protocol 4 (memory_viz reads 2-4; Python 3.14 defaults to 5)."""
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=PICKLE_PROTOCOL)


@contextlib.contextmanager
def record_memory(path: str, device: torch.device, *, max_entries: int = 100_000) -> Iterator[None]:
    """Record allocations in the ``with`` body and write a memory_viz snapshot to ``path``.

    CUDA: ``torch.cuda.memory._record_memory_history`` (Python stacks, the last ``max_entries``
    events) and ``_snapshot()``. CPU: ``torch.profiler`` memory profiling converted with torch's
    own ``torch.cuda._memory_viz._profile_to_snapshot`` (one pseudo-segment, no allocator state).
    On CUDA the snapshot is written even if the body raises (an OOM is worth looking at).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
        try:
            yield
        finally:
            torch.cuda.synchronize(device)
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            dump_snapshot(snapshot, path)
        return
    from torch.cuda._memory_viz import _profile_to_snapshot
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    with profile(
        activities=activities, profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        yield
    dump_snapshot(_profile_to_snapshot(prof), path)
