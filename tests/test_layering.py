"""Imports flow one way: trainer/ and server/ stand on publisher/ and schemas/; nothing imports
trainer/ or server/, and schemas/ imports none of the others."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: package -> the project packages it must not import.
FORBIDDEN = {
    "schemas": {"publisher", "trainer", "server"},
    "publisher": {"trainer", "server"},
    "trainer": {"server"},
    "server": {"trainer"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level package of every absolute import in `path`."""
    tops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_flow_one_way(package: str) -> None:
    bad = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: pkgs for path, pkgs in bad.items() if pkgs} == {}
