"""How every `checknrun` command reports an error: the exception's branch picks the exit status
(1 bad input or state, 2 usage, 3 unavailable), its message goes to stderr in one line, with
`--json` the error document goes to stdout, and a bug (a bare ValueError, TypeError...) is not
swallowed but propagates with its traceback."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from publisher.cli import (
    EXIT_ERROR,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
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


def failing(exc: BaseException, *, as_json: bool = False) -> argparse.Namespace:
    """The parsed args of a command `ls` (with `--json` if `as_json`) that raises `exc`."""

    def func(args: argparse.Namespace) -> int:
        raise exc

    return argparse.Namespace(command="ls", func=func, json=as_json)


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
        (MemoryError(), EXIT_ERROR),
        (RecursionError("maximum recursion depth exceeded"), EXIT_ERROR),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_each_branch_has_its_exit_status(
    exc: BaseException, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_status(exc) == status
    assert run_command(failing(exc)) == status
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("checknrun ls: ") and str(exc) in err
    assert ("unavailable: " in err) == (status == EXIT_UNAVAILABLE)
    assert err.count("\n") == 1

    # With --json: the same line on stderr, and the error document (only it) on stdout.
    assert run_command(failing(exc, as_json=True)) == status
    out, json_err = capsys.readouterr()
    assert json_err == err
    error = json.loads(out)["error"]
    assert error == {"type": type(exc).__name__, "message": error["message"], "exit_status": status}
    assert str(exc) in error["message"] and error["message"] in err


def test_memory_and_recursion_errors_name_their_cause(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(failing(MemoryError())) == EXIT_ERROR
    assert capsys.readouterr().err == "checknrun ls: out of memory\n"
    assert run_command(failing(RecursionError("maximum recursion depth exceeded"))) == EXIT_ERROR
    assert "nested too deeply" in capsys.readouterr().err


def test_a_multi_line_message_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(failing(ManifestError("3 validation errors\n  version\n    bad"))) == 1
    assert capsys.readouterr().err == "checknrun ls: 3 validation errors version bad\n"


@pytest.mark.parametrize("exc", [ValueError("a bug"), TypeError("a bug"), KeyError("a bug")])
def test_a_bug_is_not_swallowed(exc: Exception, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(type(exc)):
        run_command(failing(exc))
    assert capsys.readouterr().err == ""


def test_interrupted(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(failing(KeyboardInterrupt())) == 130
    assert "interrupted" in capsys.readouterr().err
    assert run_command(failing(KeyboardInterrupt(), as_json=True)) == 130
    assert json.loads(capsys.readouterr().out)["error"]["exit_status"] == 130


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


def test_bad_arguments_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Checked by argparse (exit status 2), not left to a ValueError deep inside the command.
    with pytest.raises(SystemExit) as info:
        main(["gc", "--store", f"file://{tmp_path}", "--model", "m", "--keep-baselines", "0"])
    assert info.value.code == EXIT_USAGE
    out, err = capsys.readouterr()
    # One line naming the cause, like every other failure (no usage block).
    assert out == "" and err.count("\n") == 1 and err.startswith("checknrun: ")
    assert "--keep-baselines: must be >= 1, got 0" in err and "checknrun gc --help" in err

    with pytest.raises(SystemExit) as info:
        main(["ls", "--store", f"file://{tmp_path}", "--json"])  # --model is missing
    assert info.value.code == EXIT_USAGE
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]
    assert error["type"] == "UsageError" and error["exit_status"] == EXIT_USAGE
    assert "--model" in error["message"] and err.count("\n") == 1


@pytest.mark.parametrize("grace", ["-5", "nan", "inf", "-inf"])
def test_gc_grace_is_a_finite_non_negative_number(
    tmp_path: Path, grace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A negative grace would delete a publish in progress; nan would keep every orphan.
    with pytest.raises(SystemExit) as info:
        main(["gc", "--store", f"file://{tmp_path}", "--model", "m", f"--grace={grace}"])
    assert info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--grace: must be a finite number >= 0" in err


def test_bench_json_names_a_file_not_the_error_document(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `bench --json OUT` writes its results to OUT: a usage error prints no JSON on stdout.
    for argv in (["bench", "--json"], ["bench", "nosuchpart", "--json", "out.json"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == EXIT_USAGE
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("checknrun: ")


def test_python_m_bench_cli_reports_like_checknrun(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cli import main as bench_main

    with pytest.raises(SystemExit) as info:
        bench_main(["--json"])  # OUT is missing
    assert info.value.code == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--json" in err
    # A part's own options: a usage error of the part's parser, reported by run_command.
    assert bench_main(["codec", "--no-such-option"]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--no-such-option" in err
    assert bench_main(["--quick", "report"]) == EXIT_ERROR
    assert capsys.readouterr().err == "checknrun bench: report takes only --dir\n"
