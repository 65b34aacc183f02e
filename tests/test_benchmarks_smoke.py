"""Every script in benchmarks/ runs in --smoke mode, prints a markdown table last, writes --out
and documents every option in --help; so does every mode a script has beside its default one
(MODES). Scripts are found by globbing, so a new one is covered the day it lands.

Each script runs in its own process (as a user would start it) on CPU. TRITON_INTERPRET is
removed from the children's environment: the smoke runs check the scripts, not the kernels
(tests/attention runs those through the interpreter), and interpreting them would take minutes.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
SMOKE_TIMEOUT_S = 180
REQUIRED_OPTIONS = ("--smoke", "--out")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


# Runs every script's main() with ArgumentParser.parse_args replaced by a recorder, in ONE
# process (a torch import costs seconds): prints, per script, each option with its help text
# and whether `--help` output mentions it.
_INTROSPECT = textwrap.dedent(
    """
    import argparse, json, runpy, sys
    class Captured(Exception):
        pass
    seen = {}
    def record(self, args=None, namespace=None):
        seen["parser"] = self
        raise Captured
    argparse.ArgumentParser.parse_args = record
    argparse.ArgumentParser.parse_known_args = record
    report = {}
    for path in sys.argv[1:]:
        seen.clear()
        sys.argv = [path, "--help"]
        try:
            runpy.run_path(path, run_name="__main__")
        except Captured:
            pass
        parser = seen.get("parser")
        if parser is None:
            report[path] = None
            continue
        text = parser.format_help()
        report[path] = [
            {"flags": a.option_strings, "help": a.help if a.help != argparse.SUPPRESS else None,
             "in_help": all(f in text for f in a.option_strings)}
            for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
        ]
    print("JSON" + json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def options() -> dict:
    paths = [str(BENCH / s) for s in SCRIPTS]
    proc = subprocess.run(
        [sys.executable, "-c", _INTROSPECT, *paths],
        capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))
    return {Path(p).name: v for p, v in json.loads(line[4:]).items()}


# The other entry points: every mode that runs other code than the script's default.
MODES = [
    ("flash.py", ["--profile", "--features", "causal,key-padding,float-mask,dropout"]),
    ("flash.py", ["--preset", "peers", "--host-overhead"]),
    ("flash.py", ["--preset", "features"]),
    ("flash.py", ["--preset", "varlen"]),
    ("flash.py", ["--host-overhead", "--profile-host"]),
    ("tune_attention.py", ["--kernels", "decode"]),
    (
        "ddp.py",
        ["--preset", "sharded", "--variants", "torch-ddp,torch-ddp-zero-view,torch-ddp-sharded"],
    ),
    ("ddp.py", ["--profile", "PROFILE_DIR", "--variants", "plain,ours-ddp"]),
    ("context_parallel.py", ["--parts", "attention"]),
    ("model.py", ["--preset", "e2e"]),
    ("sm90_fwd.py", ["--timeline"]),
]


def test_scripts_found():
    # The scripts 1-4 (3 is flash.py's sweep; 5, mixed precision, was removed) plus the
    # feature benchmarks.
    for name in ("model.py", "allreduce.py", "flash.py", "ddp.py"):
        assert name in SCRIPTS
    for name, _ in MODES:
        assert name in SCRIPTS, name


def test_gpu_checks_live_in_their_folder():
    """Device scripts sit in benchmarks/gpu_checks/, not among the benchmarks, and parse."""
    assert not list(BENCH.glob("*.sh")), "GPU check scripts belong in benchmarks/gpu_checks/"
    for script in (BENCH / "gpu_checks").glob("*.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_tests_never_import_benchmarks():
    """tests/ checks the package; the benchmarks are run as scripts (subprocesses), not imported."""
    for path in Path(__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            bad = [n for n in names if n == "benchmarks" or n.startswith("benchmarks.")]
            assert not bad, f"{path.relative_to(ROOT)}:{node.lineno} imports {bad}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_documents_every_option(options, script):
    opts = options[script]
    assert opts is not None, f"{script}: main() never called ArgumentParser.parse_args"
    flags = {f for o in opts for f in o["flags"]}
    missing = [f for f in REQUIRED_OPTIONS if f not in flags]
    assert not missing, f"{script}: every benchmark needs {REQUIRED_OPTIONS}, missing {missing}"
    undocumented = [o["flags"][0] for o in opts if not (o["help"] or "").strip()]
    assert not undocumented, f"{script}: options without help text in --help: {undocumented}"
    assert all(o["in_help"] for o in opts), f"{script}: --help does not list every option"


def _last_table(stdout: str) -> list[str]:
    """The trailing markdown table (header, separator, >= 1 row) or []."""
    lines = [ln.rstrip() for ln in stdout.strip().splitlines()]
    table = []
    for ln in reversed(lines):
        if not ln.startswith("|"):
            break
        table.insert(0, ln)
    ok = len(table) >= 3 and set(table[1].replace("|", "").replace("-", "").strip()) <= {":", ""}
    return table if ok else []


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=_env(), cwd=tmp_path
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke(options, script, tmp_path):
    out = tmp_path / "new_dir" / "rows.json"  # --out's folder is made when missing
    cmd = [sys.executable, str(BENCH / script), "--smoke", "--out", str(out)]
    flags = {f for o in options[script] or [] for f in o["flags"]}
    plot = tmp_path / "plot.png"
    if "--plot" in flags and _has_matplotlib():
        cmd += ["--plot", str(plot)]
    proc = _run(cmd, tmp_path)
    table = _last_table(proc.stdout)
    assert table, f"{script}: no markdown table at the end of stdout:\n{proc.stdout[-1500:]}"
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and rows, f"{script}: --out wrote no rows"
    for key in ("device", "torch", "triton", "date", "command"):
        assert all(key in r for r in rows), f"{script}: rows lack the {key!r} stamp"
    if "--plot" in cmd:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{script}: --plot wrote no PNG"


@pytest.mark.parametrize("script", ["ddp.py", "model.py"])
def test_a_bad_out_path_stops_before_anything_runs(script, tmp_path):
    """--out's suffix is checked when the options are parsed: ddp.py's rank 0 writing the rows
    at the end of a multi-GPU run was the first to notice, and on NCCL its failure left the job
    hung (the other rank in a collective) with the error never printed."""
    cmd = [sys.executable, str(BENCH / script), "--smoke", "--out", str(tmp_path / "rows.txt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
                          env=_env(), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]  # argparse's usage error
    assert "--out" in proc.stderr and "must end in .json or .csv" in proc.stderr
    assert "round 1/" not in proc.stderr and not proc.stdout.strip()  # nothing ran


@pytest.mark.parametrize(
    ("script", "extra"), MODES, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_smoke_modes(script, extra, tmp_path):
    out = tmp_path / "rows.json"
    extra = [str(tmp_path / "profile") if a == "PROFILE_DIR" else a for a in extra]
    cmd = [sys.executable, str(BENCH / script), "--smoke", *extra, "--out", str(out)]
    proc = _run(cmd, tmp_path)
    assert _last_table(proc.stdout), f"{cmd}: no markdown table at the end:\n{proc.stdout[-1500:]}"
    rows = json.loads(out.read_text())
    assert rows and all("device" in r and "command" in r for r in rows), rows[:2]


def test_allreduce_under_torchrun(tmp_path):
    """The launcher path the GPU box uses: torchrun sets RANK/WORLD_SIZE, rank 0 reports."""
    out = tmp_path / "ar.csv"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(BENCH / "allreduce.py"), "--smoke", "--world-sizes", "3", "--out", str(out)]  # fmt: skip
    proc = _run(cmd, tmp_path)
    table = _last_table(proc.stdout)
    assert len(table) == 4, proc.stdout[-1500:]  # header, separator, one row per smoke size
    header = [c.strip() for c in table[0].strip("|").split("|")]
    for line in table[2:]:
        row = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        assert row["world_size"] == "2", row  # the launched world, not --world-sizes
        assert row["correct"] == "True", row
        algbw, busbw = float(row["algbw_GBps"]), float(row["busbw_GBps"])
        assert busbw == pytest.approx(algbw * 2 * (2 - 1) / 2, rel=1e-2), row
    assert out.read_text().count("\n") == 3  # CSV header + 2 rows


def test_first_call_rows_cover_both_impls(tmp_path):
    """flash.py --first-call: fresh processes for ours and SDPA, first/new-length/warm rows."""
    out = tmp_path / "startup.json"
    cmd = [sys.executable, str(BENCH / "flash.py"), "--first-call", "--smoke", "--out", str(out)]
    proc = _run(cmd, tmp_path)
    assert _last_table(proc.stdout), proc.stdout[-1500:]
    rows = json.loads(out.read_text())
    for impl in ("flash_attention", "sdpa"):
        cases = [r["case"] for r in rows if r["impl"] == impl]
        assert cases[0] == "first call" and cases[-1] == "warm call", cases
        assert any(c.startswith("first call at length") for c in cases), cases
        assert all(r["seconds"] > 0 for r in rows if r["impl"] == impl), rows


def test_plots_go_through_the_harness():
    """Only _harness.line_plot imports matplotlib: it warns when matplotlib is missing, so a
    long run still prints its table and writes --out (a script's own import would crash)."""
    for script in SCRIPTS:
        text = (BENCH / script).read_text()
        assert "import matplotlib" not in text, f"{script}: plot through _harness.line_plot"


def test_plot_without_matplotlib_still_prints_the_table(tmp_path):
    out, plot = tmp_path / "rows.json", tmp_path / "plot.png"
    script = BENCH / "flash.py"
    argv = [str(script), "--smoke", "--out", str(out), "--plot", str(plot)]
    no_matplotlib = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "  # import raises ImportError
        f"sys.argv = {argv!r}; runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    proc = _run([sys.executable, "-c", no_matplotlib], tmp_path)
    assert _last_table(proc.stdout), f"no table at the end of stdout:\n{proc.stdout[-1500:]}"
    assert json.loads(out.read_text()), "--out wrote no rows"
    assert "matplotlib is not installed; no plot written" in proc.stderr, proc.stderr[-1500:]
    assert not plot.exists()


def test_help_examples_keep_their_line_continuations():
    """A ``\\`` ending a line of a docstring (--help shows it) must stay: in a non-raw string it
    joins the lines, and the example printed by --help loses its line break."""
    for script in SCRIPTS:
        source = (BENCH / script).read_text()
        doc = ast.get_docstring(ast.parse(source), clean=False) or ""
        written = source.split('"""')[1] if '"""' in source else ""
        assert doc.count("\\\n") == written.count("\\\n"), f"{script}: make the docstring r'''"


# The harness's overlap arithmetic (ddp.py --profile: how much NCCL time ran beside computation),
# run in a child process like the scripts, on random kernel timelines against a brute-force count
# over unit time slots.
_OVERLAP = textwrap.dedent(
    """
    import json, sys
    from benchmarks._harness import comm_overlap
    cases = json.load(sys.stdin)
    out = [comm_overlap(c, 1, lambda n: n.startswith("nccl")) for c in cases]
    print("JSON" + json.dumps(out))
    """
)


def test_comm_overlap_counts_what_ran_beside_computation():
    import random

    rng = random.Random()
    cases = []
    for _ in range(200):
        kernels = []
        for _ in range(rng.randint(0, 12)):
            start = rng.randint(0, 60)
            name = rng.choice(["ncclDevKernel_AllReduce", "ampere_gemm", "triton_mm", "nccl:x"])
            kernels.append((name, start, start + rng.randint(0, 15)))
        cases.append(kernels)
    proc = subprocess.run(
        [sys.executable, "-c", _OVERLAP], input=json.dumps(cases), capture_output=True,
        text=True, timeout=SMOKE_TIMEOUT_S, env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))[4:])
    for kernels, row in zip(cases, got, strict=True):
        busy = {"comm": set(), "compute": set()}  # unit slots [t, t+1) each kind occupies
        for name, start, end in kernels:
            busy["comm" if name.startswith("nccl") else "compute"].update(range(start, end))
        comm, hidden = len(busy["comm"]), len(busy["comm"] & busy["compute"])
        assert row["comm_ms"] * 1e3 == pytest.approx(comm), kernels
        assert row["compute_ms"] * 1e3 == pytest.approx(len(busy["compute"])), kernels
        assert row["hidden_ms"] * 1e3 == pytest.approx(hidden), kernels
        assert row["exposed_comm_ms"] * 1e3 == pytest.approx(comm - hidden), kernels
