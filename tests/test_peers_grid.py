"""The peer grid's worker protocol (benchmarks/_peers.py): cases dealt evenly, and no timing
starts before every worker has compiled its share (a timed call must not share the CPU with
another worker's compiles). The benchmarks are not imported by the tests: each check runs as a
script in a subprocess (threads stand in for the worker processes, on CPU) and prints JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SHARES = textwrap.dedent(
    """
    import json
    from benchmarks import _peers
    cases = [(b, h, n, d, c) for (b, h, n) in _peers.SHAPES for d in _peers.DIMS
             for c in (True, False)]
    print(json.dumps({"cases": cases, "parts": _peers.shares(cases, 8),
                      "few": _peers.shares(cases[:3], 8)}))
    """
)

# Two threads run run_share on CPU; prepare_case logs its end (after 0.2 s more, so the worker
# with two cases ends its second well after the other's only one), time_case its start.
_BARRIER = textwrap.dedent(
    """
    import json, sys, threading, time
    from unittest import mock
    import torch
    from benchmarks import _peers

    events, lock, results = [], threading.Lock(), {}
    prepare, time_case = _peers.prepare_case, _peers.time_case

    def prepared(*args, **kwargs):
        out = prepare(*args, **kwargs)
        time.sleep(0.2)
        with lock:
            events.append("prepare")
        return out

    def timed(*args, **kwargs):
        with lock:
            events.append("time")
        return time_case(*args, **kwargs)

    cases = [[(1, 2, 16, 8, True), (1, 2, 24, 8, False)], [(2, 1, 8, 8, True)]]
    barrier = threading.Barrier(2) if sys.argv[1] == "barrier" else None
    with (
        mock.patch.object(_peers, "IMPLS", ("flash_attention", "sdpa efficient")),
        mock.patch.object(_peers, "_BARRIER", barrier),
        mock.patch.object(_peers, "prepare_case", prepared),
        mock.patch.object(_peers, "time_case", timed),
        mock.patch.object(_peers, "bench", lambda fn, device, reps=2, rep_ms=100: {"median_ms": 1.0}),
    ):
        workers = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, _peers.run_share(cases[i], torch.float32, "cpu"))) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
    print(json.dumps({"events": events, "cases": cases,
                      "rows": [results[i] for i in range(2)]}, default=str))
    """
)


def _run(code: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_shares_deal_every_case_once_heaviest_first():
    got = _run(_SHARES)
    cases, parts = [tuple(c) for c in got["cases"]], [[tuple(c) for c in p] for p in got["parts"]]
    assert len(parts) == 8
    assert sorted(case for part in parts for case in part) == sorted(cases)
    cost = lambda c: c[0] * c[2] * c[2] * c[3]
    assert [cost(part[0]) for part in parts] == sorted(map(cost, cases), reverse=True)[:8]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    few = [[tuple(c) for c in p] for p in got["few"]]
    assert few == [[c] for c in sorted(cases[:3], key=lambda c: -cost(c))]


def test_no_worker_times_before_every_worker_compiled():
    got = _run(_BARRIER, "barrier")
    names = got["events"]
    assert names.count("prepare") == 3 and names.count("time") == 3
    assert names.index("time") > max(i for i, n in enumerate(names) if n == "prepare"), names
    for share, rows_per_case in zip(got["cases"], got["rows"], strict=True):
        assert len(rows_per_case) == len(share)
        for case, rows in zip(share, rows_per_case, strict=True):
            assert {(r["impl"], r["mode"]) for r in rows} == {
                (impl, mode) for impl in ("flash_attention", "sdpa efficient")
                for mode in ("fwd", "fwd+bwd")}  # fmt: skip
            assert all(r["seq"] == case[2] for r in rows)
            assert all(r["ms"] == 1.0 for r in rows if r["impl"] == "flash_attention")
    # Without the barrier a worker times while the other still compiles (what the test catches).
    names = _run(_BARRIER, "none")["events"]
    assert names.index("time") < max(i for i, n in enumerate(names) if n == "prepare"), names


_SUMMARY = textwrap.dedent(
    """
    import json
    from benchmarks import _peers
    rows = []
    for seq, ours in ((1024, 4.0), (2048, 1.0), (4096, 0.25)):  # ours / fastest: 2, 0.5, 0.125
        for impl, ms in (("flash_attention", ours), ("sdpa cudnn", 2.0), ("sdpa flash", 3.0)):
            rows.append({"impl": impl, "batch": 1, "heads": 2, "seq": seq, "head_dim": 64,
                         "causal": True, "mode": "fwd", "ms": ms})
    print(json.dumps(_peers.summary(rows)[1]))
    """
)


def test_summary_gives_the_geomean_of_long_problems_beside_all():
    """The host-bound short problems get a geomean without them beside the overall one."""
    (fwd,) = _run(_SUMMARY)
    assert fwd["cases"] == 3 and fwd["worst"] == 2.0
    assert abs(fwd["geomean ours / fastest peer"] - 0.5) < 1e-12  # (2 * 0.5 * 0.125) ** (1/3)
    assert abs(fwd["geomean from 2048 tokens"] - 0.25) < 1e-12  # (0.5 * 0.125) ** (1/2)


# time_case with time_modes replaced: each call logs its impl and returns the next of a list of
# times (one per call, both modes alike); "flex" raises in its second round.
_ROUNDS = textwrap.dedent(
    """
    import json
    from unittest import mock
    import torch
    from benchmarks import _peers

    order, times = [], iter([1.0, 5.0, 9.0, 7.0, 2.0, 3.0, 4.0, 6.0, 8.0])

    def time_modes(fn, q, k, v, dout, device, modes, reps=2, rep_ms=100):
        order.append(fn)
        if fn == "flex" and order.count("flex") == 2:
            raise RuntimeError("no kernel")
        ms = next(times)
        return {mode: {"median_ms": ms} for mode in modes}

    q = torch.zeros(1, 2, 16, 8)
    impls = [("ours", "ours"), ("cudnn", "cudnn"), ("flex", "flex"), ("bad", ValueError("x"))]
    with mock.patch.object(_peers, "time_modes", time_modes):
        rows = _peers.time_case(((1, 2, 16, 8, True), (q, q, q, q), impls), "cpu", rounds=3)
    print(json.dumps({"order": order, "rows": rows}))
    """
)


def test_each_case_is_timed_in_rounds_of_alternating_order():
    """The impls of a case take turns in alternating order; each mode's row is the median of
    the rounds, with their spread; an impl failing in any round, or not runnable, gets no ms."""
    got = _run(_ROUNDS)
    assert got["order"] == ["ours", "cudnn", "flex", "flex", "cudnn", "ours", "ours", "cudnn"]
    rows = {(r["impl"], r["mode"]): r for r in got["rows"]}
    assert [r["impl"] for r in got["rows"]] == ["ours"] * 2 + ["cudnn"] * 2 + ["flex"] * 2 + [
        "bad"] * 2  # fmt: skip
    for mode in ("fwd", "fwd+bwd"):
        # ours: 1.0, 2.0, 3.0 (its rounds' times in call order); cudnn: 5.0, 7.0, 4.0
        assert rows[("ours", mode)]["ms"] == 2.0 and rows[("ours", mode)]["spread"] == 3.0
        assert rows[("cudnn", mode)]["ms"] == 5.0 and rows[("cudnn", mode)]["spread"] == 7.0 / 4.0
        assert rows[("flex", mode)]["ms"] is None and "no kernel" in rows[("flex", mode)]["note"]
        assert rows[("bad", mode)]["ms"] is None and "x" in rows[("bad", mode)]["note"]
