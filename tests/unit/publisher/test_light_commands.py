"""The read-only commands and every `--help` answer without importing torch (issue 24.6).

`checknrun ls`, `inspect`, `gc --dry-run` and the help of every command run in a fresh
interpreter that reports, after each command, the heavy modules it imported: none may be torch,
TorchRec, FastAPI, uvicorn or matplotlib (torch alone takes 2-5 s to import on a 2-core machine).
A command line loads only the plugin it names (`build_parser`), and the lazy package faces keep
their names right however their modules load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from publisher.cli import BUILTIN_COMMANDS, build_parser, named_command
from publisher.store import FileStore
from tests.unit.publisher.test_retention import publish

HEAVY = ("torch", "torchrec", "fastapi", "uvicorn", "matplotlib")
PLUGINS = ("bench", "demo", "replay", "serve", "train")

#: run in a child: each command line of argv[1] (JSON) through `checknrun`'s main; prints
#: {command line: [exit status, the heavy modules loaded so far]}.
_CHILD = """
import contextlib, io, json, sys
from publisher.cli import main
heavy = {heavy!r}
loaded = {{}}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code
    loaded[" ".join(argv)] = [status, sorted(m for m in heavy if m in sys.modules)]
print(json.dumps(loaded))
"""


def heavy_imports(command_lines: list[list[str]]) -> dict[str, tuple[int, list[str]]]:
    """The exit status of each of `command_lines`, run in order in one interpreter, and the
    heavy modules loaded after it (a module stays loaded: the first line to list it loaded it)."""
    result = subprocess.run(
        [sys.executable, "-c", _CHILD.format(heavy=HEAVY), json.dumps(command_lines)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = json.loads(result.stdout.splitlines()[-1])
    return {line: (status, modules) for line, (status, modules) in loaded.items()}


def test_read_only_commands_and_every_help_import_no_torch(tmp_path: Path) -> None:
    publish(FileStore(tmp_path), "Fdd")
    store = ["--store", f"file://{tmp_path}", "--model", "m"]
    command_lines = [
        ["ls", *store],
        ["ls", *store, "--json"],
        ["inspect", *store],
        ["inspect", *store, "--version", "2", "--json"],
        ["gc", *store, "--dry-run"],
        ["gc", *store, "--dry-run", "--json"],
        ["--help"],
        *([command, "--help"] for command in (*BUILTIN_COMMANDS, *PLUGINS)),
    ]
    loaded = heavy_imports(command_lines)
    assert list(loaded) == [" ".join(argv) for argv in command_lines]
    assert {line: found for line, found in loaded.items() if found != (0, [])} == {}


def test_the_check_sees_a_command_that_imports_torch(tmp_path: Path) -> None:
    """The check can fail: `restore --help` is light, a restore (a torch file) is not, even one
    that then fails (this version's blobs are stand-ins)."""
    publish(FileStore(tmp_path / "store"), "F")
    restore = ["restore", "--store", f"file://{tmp_path / 'store'}", "--model", "m"]
    loaded = heavy_imports([[*restore, "--help"], [*restore, "--out", str(tmp_path / "m.pt")]])
    assert list(loaded.values()) == [(0, []), (1, ["torch"])]


def _commands(arguments: list[str] | None) -> set[str]:
    parser = build_parser(arguments)
    (sub,) = (a for a in parser._actions if a.dest == "command")
    assert sub.choices is not None
    return set(sub.choices)


@pytest.mark.parametrize(
    ("arguments", "plugins"),
    [
        (["ls", "--store", "x", "--model", "m"], set()),
        (["-v", "inspect", "--help"], set()),
        (["serve", "--help"], {"serve"}),
        (["--verbose", "replay", "--to", "kafka://h:1/t"], {"replay"}),
        (["--help"], set(PLUGINS)),
        (["-h", "ls"], set(PLUGINS)),  # the top-level help lists every command
        (["nosuch"], set(PLUGINS)),  # the usage error lists every command
        ([], set(PLUGINS)),
        (None, set(PLUGINS)),
    ],
)
def test_a_command_line_loads_only_the_plugin_it_names(
    arguments: list[str] | None, plugins: set[str]
) -> None:
    assert _commands(arguments) == {*BUILTIN_COMMANDS, *plugins}


@pytest.mark.parametrize(
    ("arguments", "command"),
    [
        (["ls", "--json"], "ls"),
        (["-v", "--verbose", "gc"], "gc"),
        (["-vh", "ls"], None),
        (["--he", "ls"], None),
        (["--", "ls"], None),
        ([], None),
    ],
)
def test_named_command(arguments: list[str], command: str | None) -> None:
    assert named_command(arguments) == command


def test_a_face_name_stays_its_own_after_its_submodule_loads() -> None:
    """publisher.read's `restore` is a function and a submodule: loading the submodule (as
    `checknrun restore` and the subscriber do, after the lazy face) must not shadow the
    function."""
    import publisher.read.module_state  # imports publisher.read.restore
    from publisher.read import Catalog, restore

    assert restore is sys.modules["publisher.read.restore"].restore
    assert callable(restore)
    assert Catalog is sys.modules["publisher.read.catalog"].Catalog
    assert publisher.read.module_state.__name__ == "publisher.read.module_state"
