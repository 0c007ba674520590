"""The server sets its C heap policy when it starts. That the policy returns large freed blocks
to the operating system is measured in a fresh interpreter:
tests/multiprocess/server/test_heap_policy_probe.py."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from bench.synthetic_run import SyntheticRun, small_config
from publisher.store import FileStore
from server import app as app_module
from server.app import create_app
from server.settings import ServerSettings

with warnings.catch_warnings():  # starlette's notice about its httpx-based client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


def test_the_server_sets_the_policy_when_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    SyntheticRun(FileStore(tmp_path / "store"), "m", small_config()).publish("full")
    calls: list[int] = []
    monkeypatch.setattr(app_module, "return_large_blocks", lambda: calls.append(1) or True)
    settings = ServerSettings(store=f"file://{tmp_path / 'store'}", model="m", follow=False)
    with TestClient(create_app(settings)):
        assert calls == [1]
