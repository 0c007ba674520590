"""A manifest is checked against the memory budget before the server allocates the model it
declares: a forged 1 KiB manifest costs a counted rejection, not gigabytes, whether the server
is serving a version already or has nothing but the hostile HEAD."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.synthetic_run import SyntheticRun, small_config
from publisher.memory_budget import MemoryBudget, MemoryBudgetError
from publisher.read.catalog import Catalog
from publisher.read.follower import VersionFollower
from publisher.store import FileStore
from server.app import create_app
from server.follow_loop import FollowLoop
from server.live_model import LiveModel
from server.model_buffer import ModelBuffer
from server.settings import ServerSettings

with warnings.catch_warnings():  # starlette's notice about its httpx-based client
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

#: far above the test model (two copies of ~50 KB), far below what the forged configs declare.
BUDGET = 64 * 1024 * 1024


def _huge_table(config: dict[str, Any]) -> None:
    # The case: one table of 2^20 rows x 256, 1 GiB per model copy.
    config["sparse"][0]["rows"] = 2**20
    config["embedding_dim"] = 256


def _wide_mlp(config: dict[str, Any]) -> None:
    config["bottom_mlp"] = [2**16, 2**16]  # 16 GiB of weights in the second layer


def _many_tables(config: dict[str, Any]) -> None:
    # Tiny tables, but the feature pairs grow with the square of their count.
    config["sparse"] += [{"name": f"x{i}", "rows": 1, "bag": False} for i in range(3000)]


FORGED_CONFIGS: dict[str, Callable[[dict[str, Any]], None]] = {
    "huge table": _huge_table,
    "wide MLP": _wide_mlp,
    "many tables": _many_tables,
}


def _forge(
    store: FileStore, root: Path, version: int, change: Callable[[dict[str, Any]], None]
) -> None:
    """Rewrite `version`'s model_config in place (a writer with store access, no blob needed)."""
    key = Catalog(store, "m").find(version).key
    doc = json.loads((root / key).read_bytes())
    change(doc["model_config"])
    (root / key).write_text(json.dumps(doc))


class BuildSpy:
    """Counts the model buffers built (each allocates a whole model)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.built = 0
        original = ModelBuffer.__init__

        def counting(buffer: ModelBuffer, *args: Any, **kwargs: Any) -> None:
            self.built += 1
            original(buffer, *args, **kwargs)

        monkeypatch.setattr(ModelBuffer, "__init__", counting)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[SyntheticRun]:
    r = SyntheticRun(FileStore(tmp_path / "store"), "m", small_config(), codec="fp32")
    yield r
    r.close()


@pytest.mark.parametrize("scheme", ["double-buffer", "rwlock"])
@pytest.mark.parametrize("case", list(FORGED_CONFIGS))
def test_a_forged_model_config_is_rejected_before_allocating(
    run: SyntheticRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, scheme: Any
) -> None:
    store = run.store
    assert isinstance(store, FileStore)
    live = LiveModel(store, "m", scheme=scheme, memory_budget=MemoryBudget(BUDGET))
    follower = VersionFollower(live.catalog, None, poll_head_after_s=0.05)
    loop = FollowLoop(live, follower, poll_timeout_s=0.05, retry_initial_s=0.05, retry_max_s=0.1)
    try:
        run.train(2)
        run.publish("full")
        assert loop.run(max_messages=1, timeout=10) == [1]
        run.train(2)
        v2 = run.publish("full").ref.version
        _forge(store, tmp_path / "store", v2, FORGED_CONFIGS[case])
        spy = BuildSpy(monkeypatch)
        assert loop.run(timeout=0.5) == []
        assert live.version == 1
        assert spy.built == 0  # no model of the declared size, and no other
        assert live.metrics.rejected.value(["budget"]) >= 2  # every retry is refused the same
        assert "over the memory budget" in (loop.last_error or "")
    finally:
        follower.close()
        live.close()


def test_a_genuine_model_over_the_budget_names_the_setting(run: SyntheticRun) -> None:
    run.train(1)
    run.publish("full")
    live = LiveModel(run.store, "m", memory_budget=MemoryBudget(1024))
    try:
        over = r"needs [0-9,]+ bytes, over the memory budget of 1,024;"
        with pytest.raises(MemoryBudgetError, match=over):
            live.bootstrap()
        assert live.version is None
    finally:
        live.close()


def test_a_server_with_only_a_hostile_head_stays_up_not_ready(
    run: SyntheticRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run.train(1)
    run.publish("full")
    store = run.store
    assert isinstance(store, FileStore)
    _forge(store, tmp_path / "store", 1, _huge_table)
    spy = BuildSpy(monkeypatch)
    settings = ServerSettings(
        store=f"file://{tmp_path / 'store'}",
        model="m",
        poll_timeout_s=0.05,
        poll_head_after_s=0.05,
        retry_initial_s=0.05,
        retry_max_s=0.1,
        memory_budget_bytes=BUDGET,
    )
    with TestClient(create_app(settings)) as client:

        def rejections() -> float:
            for line in client.get("/metrics").text.splitlines():
                if line.startswith('checknrun_server_rejected_versions_total{reason="budget"}'):
                    return float(line.split()[-1])
            return 0.0

        deadline = time.monotonic() + 10
        while rejections() < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rejections() >= 3  # refused, retried from HEAD, refused again
        assert client.get("/healthz").status_code == 200
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["reason"] == "bootstrapping"
        assert client.get("/v1/model").status_code == 503
        loop = client.app.state.server.loop  # type: ignore[attr-defined]
        assert loop is not None and not loop.stopped  # still following, for a genuine HEAD
    assert spy.built == 0
