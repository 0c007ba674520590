"""Read-only commands create nothing (issue 11.13): `ls`, `inspect`, `restore` and `gc` on a
store directory that does not exist, or for a model the store holds nothing of, fail with exit
status 1 and a message, and leave no directory behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from publisher.cli import EXIT_ERROR, main
from publisher.read.catalog import Catalog, ModelNotFoundError
from publisher.store import FileStore, StoreMissingError, open_store
from publisher.write.version_writer import VersionWriter
from tests.unit.publisher.test_retention import publish


@pytest.mark.parametrize("command", ["ls", "inspect", "restore", "gc"])
@pytest.mark.parametrize("scheme", ["file://", ""])
def test_a_missing_store_directory_is_an_error_and_is_not_created(
    tmp_path: Path, command: str, scheme: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "typo" / "run1"
    extra = ["--out", str(tmp_path / "m.pt")] if command == "restore" else []
    argv = [command, "--store", f"{scheme}{missing}", "--model", "m", *extra]
    assert main(argv) == EXIT_ERROR
    assert f"store directory {missing} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()


def test_read_only_open_creates_nothing_but_a_writer_open_does(tmp_path: Path) -> None:
    with pytest.raises(StoreMissingError):
        open_store(f"file://{tmp_path / 'a'}", create=False)
    assert not (tmp_path / "a").exists()
    open_store(f"file://{tmp_path / 'a'}").close()  # train: creates it
    assert (tmp_path / "a").is_dir()
    open_store(f"file://{tmp_path / 'a'}", create=False).close()


@pytest.mark.parametrize("command", ["ls", "inspect"])
def test_a_model_the_store_holds_nothing_of_is_an_error(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    publish(FileStore(tmp_path), "F")  # model "m" exists; "typo" does not
    assert main([command, "--store", f"file://{tmp_path}", "--model", "typo"]) == EXIT_ERROR
    assert f"file://{tmp_path} holds nothing of it" in capsys.readouterr().err
    with pytest.raises(ModelNotFoundError):
        Catalog(FileStore(tmp_path), "typo").find(3)


def test_a_model_whose_trainer_has_not_committed_yet_lists_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}"
    with VersionWriter(FileStore(tmp_path), "m"):  # the lease is taken, nothing committed
        assert main(["ls", "--store", url, "--model", "m", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["versions"] == []
        assert main(["inspect", "--store", url, "--model", "m"]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert "has no committed version" in err and "holds nothing" not in err
