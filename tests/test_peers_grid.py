"""The peer grid's worker protocol (benchmarks/_peers.py): cases dealt evenly, and no timing
starts before every worker has compiled its share (a timed call must not share the CPU with
another worker's compiles). Threads stand in for the worker processes, on CPU."""

from __future__ import annotations

import threading
import time
from unittest import mock

import torch

from benchmarks import _peers


def test_shares_deal_every_case_once_heaviest_first():
    cases = [(b, h, n, d, c) for (b, h, n) in _peers.SHAPES for d in _peers.DIMS
             for c in (True, False)]  # fmt: skip
    parts = _peers.shares(cases, 8)
    assert len(parts) == 8
    dealt = [case for part in parts for case in part]
    assert sorted(dealt) == sorted(cases)
    cost = lambda c: c[0] * c[2] * c[2] * c[3]
    assert [cost(part[0]) for part in parts] == sorted((cost(c) for c in cases), reverse=True)[:8]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert _peers.shares(cases[:3], 8) == [[c] for c in sorted(cases[:3], key=lambda c: -cost(c))]


def test_no_worker_times_before_every_worker_compiled():
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    prepare, time_case = _peers.prepare_case, _peers.time_case

    def logged(name, fn):
        """``fn`` that records a compile's end (after 0.2 s more: the worker with two cases ends
        its second one well after the other worker's only one) and a timing's start."""

        def run(first, *args, **kwargs):
            if name == "time":
                with lock:
                    events.append((name, threading.get_ident()))
            result = fn(first, *args, **kwargs)
            if name == "prepare":
                time.sleep(0.2)
                with lock:
                    events.append((name, threading.get_ident()))
            return result

        return run

    cases = [[(1, 2, 16, 8, True), (1, 2, 24, 8, False)], [(2, 1, 8, 8, True)]]
    results: dict[int, list] = {}
    with (
        mock.patch.object(_peers, "IMPLS", ("flash_attention", "sdpa efficient")),
        mock.patch.object(_peers, "_BARRIER", threading.Barrier(2)),
        mock.patch.object(_peers, "prepare_case", logged("prepare", prepare)),
        mock.patch.object(_peers, "time_case", logged("time", time_case)),
        mock.patch.object(_peers, "bench", lambda fn, device, reps=2: {"median_ms": 1.0}),
    ):
        workers = [
            threading.Thread(target=lambda i=i: results.__setitem__(
                i, _peers.run_share(cases[i], torch.float32, "cpu")))
            for i in range(2)
        ]  # fmt: skip
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
    names = [name for name, _ in events]
    assert names.count("prepare") == 3 and names.count("time") == 3
    assert names.index("time") > max(i for i, n in enumerate(names) if n == "prepare")
    for i, share in enumerate(cases):
        assert len(results[i]) == len(share)
        for case, rows in zip(share, results[i], strict=True):
            assert {(r["impl"], r["mode"]) for r in rows} == {
                (impl, mode) for impl in ("flash_attention", "sdpa efficient")
                for mode in _peers.MODES}  # fmt: skip
            assert all(r["seq"] == case[2] for r in rows)
            assert all(r["ms"] == 1.0 for r in rows if r["impl"] == "flash_attention")
