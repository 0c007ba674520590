"""`serve` fails like every other command (issue 11 item 8): a bad bus URL, an invalid setting
or a bad command line is one line on stderr and its exit status, before uvicorn starts (uvicorn
turns a lifespan failure into a traceback and exit status 3); and a lifespan that fails half-way
closes what it had opened."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from publisher.bus.file_log import FileLogSource
from publisher.store import FileStore
from server.app import create_app
from server.cli import check_bus_url
from server.cli import main as serve_main
from server.settings import ServerSettings


def serve(tmp_path: Path, *flags: str) -> int:
    return serve_main(["serve", "--store", f"file://{tmp_path}", "--model", "m", *flags])


@pytest.mark.timeout(60)  # the code before the fix started uvicorn
@pytest.mark.parametrize("bus", ["http://x", "kafka://"])
def test_a_bad_bus_url_is_one_line_before_listening(
    tmp_path: Path, bus: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve(tmp_path, "--bus", bus) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("checknrun serve: ") and repr(bus) in err


@pytest.mark.timeout(60)
def test_an_unreachable_kafka_is_waited_on_like_an_unreachable_store() -> None:
    # Only the URL is checked before listening: the follow loop waits for the broker.
    check_bus_url("kafka://127.0.0.1:1/announcements", "latest")


def test_an_invalid_setting_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert serve(tmp_path, "--port", "99999", "--max-batch", "0") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("checknrun serve: invalid configuration: ")
    assert "port: Input should be less than or equal to 65535" in err
    assert "; max_batch: " in err


def test_a_bad_command_line_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        serve(tmp_path, "--consistency", "lockfree")
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--consistency" in err


def test_a_failed_start_closes_what_was_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []
    store_close, source_close = FileStore.close, FileLogSource.close
    monkeypatch.setattr(FileStore, "close", lambda s: (closed.append("store"), store_close(s)))
    monkeypatch.setattr(
        FileLogSource, "close", lambda s: (closed.append("source"), source_close(s))
    )

    def no_model(*args: object, **kwargs: object) -> None:
        raise MemoryError("no room for the model")

    monkeypatch.setattr("server.app.Subscriber", no_model)
    bus = f"file://{tmp_path}/announcements.log"
    app = create_app(ServerSettings(store=f"file://{tmp_path}", model="m", bus=bus))
    with pytest.raises(MemoryError), TestClient(app):
        pass
    assert closed == ["source", "store"]
