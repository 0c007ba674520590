"""How every `checknrun` command reports an error: the exception's branch picks the exit status
(1 bad input or state, 3 unavailable), its message goes to stderr, and a bug (a bare ValueError,
TypeError...) is not swallowed but propagates with its traceback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from publisher.cli import (
    EXIT_ERROR,
    EXIT_UNAVAILABLE,
    CommandError,
    exit_status,
    main,
    run_command,
)
from publisher.read.catalog import NoVersionError
from publisher.store import FileStore, IntegrityError, StoreError, StoreUnavailableError
from publisher.write.version_writer import HeadConflictError, LeaseHeldError, VersionWriter
from schemas.errors import (
    BadDataError,
    CheckNRunError,
    ConflictError,
    ManifestError,
    UnavailableError,
)


def failing(exc: BaseException) -> argparse.Namespace:
    """The parsed args of a command `ls` that raises `exc`."""

    def func(args: argparse.Namespace) -> int:
        raise exc

    return argparse.Namespace(command="ls", func=func)


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (BadDataError("bad"), EXIT_ERROR),
        (ManifestError("bad manifest"), EXIT_ERROR),
        (IntegrityError("sha256 mismatch"), EXIT_ERROR),
        (NoVersionError("no version 9"), EXIT_ERROR),
        (CommandError("fix it"), EXIT_ERROR),
        (ConflictError("held"), EXIT_ERROR),
        (LeaseHeldError("held"), EXIT_ERROR),
        (HeadConflictError("moved"), EXIT_ERROR),
        (StoreError("access denied"), EXIT_ERROR),
        (CheckNRunError("other"), EXIT_ERROR),
        (OSError("cannot write out.pt"), EXIT_ERROR),
        (UnavailableError("timed out"), EXIT_UNAVAILABLE),
        (StoreUnavailableError("connection refused"), EXIT_UNAVAILABLE),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_each_branch_has_its_exit_status(
    exc: CheckNRunError | OSError, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_status(exc) == status
    assert run_command(failing(exc)) == status
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("checknrun ls: ") and str(exc) in err
    assert ("unavailable: " in err) == (status == EXIT_UNAVAILABLE)


@pytest.mark.parametrize("exc", [ValueError("a bug"), TypeError("a bug"), KeyError("a bug")])
def test_a_bug_is_not_swallowed(exc: Exception, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(type(exc)):
        run_command(failing(exc))
    assert capsys.readouterr().err == ""


def test_interrupted(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(failing(KeyboardInterrupt())) == 130
    assert "interrupted" in capsys.readouterr().err


def test_held_lease_prints_its_own_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with VersionWriter(FileStore(tmp_path), "m"), pytest.raises(LeaseHeldError) as held:
        VersionWriter(FileStore(tmp_path), "m")
    assert run_command(failing(held.value)) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err == f"checknrun ls: {held.value}\n"
    assert "being published by" in err and "store error" not in err


def test_a_real_command_reports_bad_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}"
    assert main(["inspect", "--store", url, "--model", "nothing"]) == EXIT_ERROR
    assert "has no committed version" in capsys.readouterr().err
    assert main(["ls", "--store", url, "--model", "../x"]) == EXIT_ERROR  # a bad model name
    assert "model name" in capsys.readouterr().err
    out = tmp_path / "missing" / "m.pt"
    assert main(["restore", "--store", url, "--model", "m", "--out", str(out)]) == EXIT_ERROR
    assert "no such directory" in capsys.readouterr().err


def test_bad_arguments_are_usage_errors(tmp_path: Path) -> None:
    # Checked by argparse (exit status 2), not left to a ValueError deep inside the command.
    with pytest.raises(SystemExit) as info:
        main(["gc", "--store", f"file://{tmp_path}", "--model", "m", "--keep-baselines", "0"])
    assert info.value.code == 2
