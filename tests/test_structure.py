"""The package's layering holds: no import cycles, no long functions.

Read from the source with ``ast`` (imports inside functions count: a lazy import that breaks a
cycle is still a cycle). ``python -m tests.test_structure`` prints the measures of docs/design.md:
the cycles, the longest functions outside ``@triton.jit`` kernels, and the benchmarks' share of the
package + benchmark lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "torch_flashsys"
MAX_FUNCTION_LINES = 80  # STYLE.md: a function past ~80 lines is asking to be split


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (module-level or lazily)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[name].update(t for t in _imported(name, path, node) if t in modules)
        graph[name].discard(name)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def function_lengths() -> list[tuple[int, str]]:
    """(lines incl. decorators and docstring, where) of every function outside Triton kernels."""
    lengths = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if any("jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
            lengths.append((node.end_lineno - first + 1, where))
    return sorted(lengths, reverse=True)


def _line_count(folder: str) -> int:
    files = [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh")]
    return sum(len(p.read_text().splitlines()) for p in files)


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_functions_are_short():
    long = [(n, where) for n, where in function_lengths() if n > MAX_FUNCTION_LINES]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines: {long}"


if __name__ == "__main__":
    cycles = import_cycles(import_graph())
    print(f"import cycles: {len(cycles)}", *cycles, sep="\n  ")
    print("longest functions outside @triton.jit:")
    for n, where in function_lengths()[:5]:
        print(f"  {n:4d}  {where}")
    package, bench = _line_count(PACKAGE), _line_count("benchmarks")
    share = bench / (package + bench)
    print(f"lines (.py, .sh): package {package}, benchmarks {bench}; benchmarks' share {share:.2%}")
