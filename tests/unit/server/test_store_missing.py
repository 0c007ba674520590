"""`serve` never creates the store (issue 11.13): a missing store directory stops it before it
listens (exit 1), while an existing store with no version yet is waited on."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from publisher.store import StoreMissingError
from server.app import create_app
from server.cli import check_store_exists
from server.cli import main as serve_main
from server.settings import ServerSettings


@pytest.mark.timeout(120)  # the code before the fix served forever
def test_serve_refuses_a_missing_store_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "typo"
    assert serve_main(["serve", "--store", f"file://{missing}", "--model", "m"]) == 1
    assert f"store directory {missing} does not exist" in capsys.readouterr().err
    assert not missing.exists()
    # create_app without the CLI: the lifespan refuses it too, and creates nothing either.
    app = create_app(ServerSettings(store=f"file://{missing}", model="m"))
    with pytest.raises(StoreMissingError), TestClient(app):
        pass
    assert not missing.exists()


def test_serve_on_an_empty_existing_store_starts_and_waits(tmp_path: Path) -> None:
    check_store_exists(f"file://{tmp_path}", "m")
    app = create_app(ServerSettings(store=f"file://{tmp_path}", model="m", poll_timeout_s=0.05))
    with TestClient(app) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 503  # waiting for the first version
    assert list(tmp_path.iterdir()) == []
