"""Every command block in the README runs as written, in a shell like a new user's.

The blocks and their tags are read by tests/readme_blocks.py (its docstring has the rules). The
commands run from the repository root, as the README says, with the virtualenv taken off PATH
(the README's own `source .../activate` puts it back); `./live-store` and `./tt-store`, which
they create, are removed before and after. The shared Kafka + MinIO the live pipeline starts are
stopped afterwards if they were not running before.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.readme_blocks import Block, Section, output_shape, sections

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
#: what the README's commands create in the repository root.
CREATED = ("live-store", "tt-store")
#: how long a command after a terminal is retried (the trainer's first version included).
RETRY_S = 300.0
#: how long a terminal gets to print its first line, and to stop on SIGTERM.
TERMINAL_START_S = 180.0
TERMINAL_STOP_S = 60.0
BLOCK_TIMEOUT_S = 900.0


class Shell:
    """One user's shell session: exported variables carry from block to block."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.exports = work / "exports.sh"
        venv_bin = str(Path(sys.executable).parent)
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKNRUN_")}
        env.pop("VIRTUAL_ENV", None)
        env["PATH"] = os.pathsep.join(path)
        self.env = env
        self.terminals: list[tuple[Block, subprocess.Popen[bytes], Path]] = []

    def _script(self, block: Block) -> str:
        if block.lang == "python":
            snippet = self.work / f"block_{block.line}.py"
            snippet.write_text(block.text)
            body = f"python {shlex.quote(str(snippet))}\n"
        else:
            body = block.text
        keep = "" if block.terminal else f"export -p > {shlex.quote(str(self.exports))}\n"
        prelude = f"[ -f {shlex.quote(str(self.exports))} ] && . {shlex.quote(str(self.exports))}\n"
        return f"set -eo pipefail\n{prelude}{body}{keep}"

    def run(self, block: Block, *, retry: bool) -> str:
        deadline = time.monotonic() + (RETRY_S if retry else 0.0)
        while True:
            done = subprocess.run(
                ["bash", "-c", self._script(block)],
                cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, capture_output=True,
                text=True, timeout=BLOCK_TIMEOUT_S, check=False,
            )  # fmt: skip
            if done.returncode == 0:
                return done.stdout
            if time.monotonic() >= deadline:
                self.fail(
                    block, f"exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
                )
            time.sleep(1.0)

    def start(self, block: Block) -> None:
        log = self.work / f"terminal_{block.line}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", self._script(block)],
                cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.terminals.append((block, proc, log))
        deadline = time.monotonic() + TERMINAL_START_S
        while log.stat().st_size == 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                self.fail(block, f"printed nothing (exit {proc.poll()})")
            time.sleep(0.2)

    def stop_terminals(self) -> None:
        """SIGTERM each terminal's process group, newest first; each must stop in time."""
        stuck: list[str] = []
        for block, proc, log in reversed(self.terminals):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=TERMINAL_STOP_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    stuck.append(f"line {block.line}: {log.read_text()[-2000:]}")
        self.terminals.clear()
        assert not stuck, f"terminals that did not stop on SIGTERM: {stuck}"

    def fail(self, block: Block, why: str) -> None:
        logs = "".join(
            f"\n--- terminal at line {b.line}:\n{log.read_text()[-3000:]}"
            for b, _, log in self.terminals
        )
        pytest.fail(f"README line {block.line}: {block.text.strip()}\n{why}{logs}")


def check_output(block: Block, printed: str) -> None:
    """A documented output block against what its command printed."""
    if block.lang == "json":
        documented, got = json.loads(block.text), json.loads(printed.strip().splitlines()[-1])
        assert set(got) == set(documented), (block.line, got)
        for key, value in documented.items():
            if isinstance(value, dict):
                assert set(got[key]) == set(value), (block.line, key, got[key])
    else:
        shapes = set(output_shape(printed))
        missing = [s for s in output_shape(block.text) if s not in shapes]
        assert not missing, (
            f"README line {block.line}: no line like {missing} in:\n{printed[-3000:]}"
        )


SERVICES = ("kafka", "minio")


def services_down() -> list[str]:
    """The shared services not running now (the README's `services.sh up` starts them)."""
    script = str(REPO / "scripts" / "services.sh")
    status = [
        subprocess.run(["bash", script, "status", name], capture_output=True, check=False)
        for name in SERVICES
    ]
    return [name for name, done in zip(SERVICES, status, strict=True) if done.returncode != 0]


def remove_created() -> None:
    for name in CREATED:
        shutil.rmtree(REPO / name, ignore_errors=True)


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[Shell]:
    remove_created()
    started = services_down()
    session = Shell(tmp_path)
    try:
        yield session
    finally:
        session.stop_terminals()
        if started:
            subprocess.run(
                ["bash", str(REPO / "scripts" / "services.sh"), "down", *started], check=False
            )
        remove_created()


def run_section(shell: Shell, section: Section) -> None:
    printed: str | None = None
    after_terminal = False
    for block in section.blocks:
        if block.terminal and block.runs:
            shell.start(block)
            after_terminal = True
            printed = None
        elif block.runs:
            printed = shell.run(block, retry=after_terminal)
        elif block.lang in ("json", "text") and printed is not None:
            check_output(block, printed)
    shell.stop_terminals()


def test_the_ci_block_is_what_ci_runs() -> None:
    (ci,) = [b for s in sections(README) for b in s.blocks if "ci" in b.tags]
    commands = [
        ln
        for ln in (REPO / ".ci" / "run").read_text().splitlines()
        if ln and not ln.startswith(("#", "set ", "cd "))
    ]
    assert commands == ci.text.strip().splitlines()


def test_every_command_block_runs_as_written(shell: Shell) -> None:
    ran = 0
    for section in sections(README):
        run_section(shell, section)
        ran += sum(b.runs for b in section.blocks)
    assert ran >= 8, "the README's commands were not found"
