"""Imports flow one way: trainer/ and server/ stand on publisher/ and schemas/; only bench/ (the
measurement floor on top) imports trainer/ or server/, and nothing imports bench/. A module run as
a child process (`[python, "-m", "server.cli"]`, or "-m server.cli" in one string) counts as an
import: naming it in a string must not dodge the rule."""

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
