"""Imports flow one way: trainer/ and server/ stand on publisher/ and schemas/; only bench/ (the
measurement floor on top) imports trainer/ or server/, and nothing imports bench/. A module run as
a child process (`[python, "-m", "server.cli"]`, or "-m server.cli" in one string) counts as an
import: naming it in a string must not dodge the rule. And no modules import each other in a
circle, not even through an import inside a function."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "publisher", "trainer", "server", "bench")
#: package -> the project packages it must not import.
FORBIDDEN = {
    "schemas": {"publisher", "trainer", "server", "bench"},
    "publisher": {"trainer", "server", "bench"},
    "trainer": {"server", "bench"},
    "server": {"trainer", "bench"},
    "bench": set(),
}
_MODULE = re.compile(r"^({})(\.\w+)*$".format("|".join(PACKAGES)))
_DASH_M = re.compile(r"-m\s+({})\b".format("|".join(PACKAGES)))


def _strings(node: ast.AST) -> list[str | None]:
    """The elements of a list/tuple literal, None for anything that is not a string constant."""
    if isinstance(node, ast.List | ast.Tuple):
        return [
            e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None
            for e in node.elts
        ]
    return []


def imported_packages(source: str, name: str = "<test>") -> set[str]:
    """Top-level package of every absolute import in `source`, and of every module it runs with
    `-m` (a `"-m", "pkg.mod"` pair in a list or tuple literal, or `-m pkg.mod` inside a string)."""
    tops: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            tops.update(m.group(1) for m in _DASH_M.finditer(node.value))
        else:
            items = _strings(node)
            for flag, module in itertools.pairwise(items):
                if flag == "-m" and module is not None and _MODULE.match(module):
                    tops.add(module.split(".")[0])
    return tops


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_flow_one_way(package: str) -> None:
    bad = {
        str(path.relative_to(ROOT)): sorted(
            imported_packages(path.read_text(), str(path)) & FORBIDDEN[package]
        )
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: pkgs for path, pkgs in bad.items() if pkgs} == {}


def test_child_process_modules_count_as_imports() -> None:
    """The scan sees the two ways a module path hides in strings, and only those."""
    assert imported_packages('argv = [sys.executable, "-m", "server.cli", "serve"]') == {"server"}
    assert imported_packages('cmd = "python -m bench.cli paper"') == {"bench"}
    assert imported_packages('x = ["-m", "numpy.linalg"]; y = "server is up"') == set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` outside `if TYPE_CHECKING:` blocks (imports for annotations only)."""
    found: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports at run time, at any depth (a function's
    import counts: it runs when the function does)."""
    paths = {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in paths else node.module)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in paths and e != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
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
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    """No circle of modules, also through function-level imports (`trainer.cli` -> the sharded
    job -> back once hid one)."""
    assert import_cycles(import_graph()) == []


def test_cycle_finder_sees_a_function_level_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
