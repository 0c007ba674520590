"""A manifest is checked against the memory budget before the server allocates the model it
declares: a forged 1 KiB manifest costs a counted rejection, not gigabytes, whether the server
is serving a version already or has nothing but the hostile HEAD."""

from __future__ import annotations

import json
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from bench.synthetic_run import SyntheticRun, small_config
from publisher.memory_budget import MemoryBudget, MemoryBudgetError
from publisher.read import Catalog, ModelCopy, Subscriber, SubscriberOptions
from publisher.read.version_fetch import fetch_version
from publisher.store import FileStore, IntegrityError
from server.app import create_app
from server.metrics import MetricsObserver, ServerMetrics, counted
from server.settings import ServerSettings
from tests.support import dlrm_live, dlrm_sink

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
    """Counts the model copies built (each allocates a whole model; the budget's probe on the
    meta device allocates none and makes no copy)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.built = 0
        original = ModelCopy.__init__

        def counting(buffer: ModelCopy, *args: Any, **kwargs: Any) -> None:
            self.built += 1
            original(buffer, *args, **kwargs)

        monkeypatch.setattr(ModelCopy, "__init__", counting)


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
    metrics = ServerMetrics()
    options = SubscriberOptions(
        poll_timeout_s=0.05, poll_head_after_s=0.05, retry_initial_s=0.05, retry_max_s=0.1
    )
    loop = Subscriber(
        store,
        "m",
        dlrm_sink(scheme, memory_budget=MemoryBudget(BUDGET)),
        options=options,
        observer=MetricsObserver(metrics),
    )
    live = loop.live
    try:
        run.train(2)
        run.publish("full")
        assert loop.run(max_versions=1, timeout=10) == [1]
        run.train(2)
        v2 = run.publish("full").ref.version
        _forge(store, tmp_path / "store", v2, FORGED_CONFIGS[case])
        spy = BuildSpy(monkeypatch)
        assert loop.run(timeout=0.5) == []
        assert live.version == 1
        assert spy.built == 0  # no model of the declared size, and no other
        assert counted(metrics.rejected, reason="budget") >= 2  # every retry is refused the same
        assert "over the memory budget" in (loop.last_error or "")
    finally:
        loop.close()


def test_a_genuine_model_over_the_budget_names_the_setting(run: SyntheticRun) -> None:
    run.train(1)
    run.publish("full")
    live = dlrm_live(run.store, "m", memory_budget=MemoryBudget(1024))
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
        loop = client.app.state.server.subscriber  # type: ignore[attr-defined]
        assert loop is not None and not loop.stopped  # still following, for a genuine HEAD
    assert spy.built == 0


class CopySpy:
    """The most model copies alive at once, each new one included (the peak copies held)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.alive: weakref.WeakSet[ModelCopy] = weakref.WeakSet()
        self.peak = 0
        original = ModelCopy.__init__

        def counting(buffer: ModelCopy, *args: Any, **kwargs: Any) -> None:
            original(buffer, *args, **kwargs)
            self.alive.add(buffer)
            self.peak = max(self.peak, len(self.alive))

        monkeypatch.setattr(ModelCopy, "__init__", counting)


@pytest.mark.parametrize("scheme", ["double-buffer", "rwlock"])
def test_the_budget_is_checked_against_the_peak_of_two_copies(
    run: SyntheticRun, scheme: Any
) -> None:
    # rwlock holds one copy between fulls but builds a full beside it: a budget of 1.5 copies
    # was accepted, and the first full after the bootstrap needed 2.
    run.train(1)
    run.publish("full")
    model_bytes = small_config().nbytes
    live = dlrm_live(run.store, "m", scheme, memory_budget=MemoryBudget(model_bytes * 3 // 2))
    try:
        with pytest.raises(MemoryBudgetError, match=r"\(2 model copies\)"):
            live.bootstrap()
        assert live.version is None
    finally:
        live.close()


@pytest.mark.parametrize("scheme", ["double-buffer", "rwlock"])
def test_a_rebuild_holds_no_more_copies_than_the_budget_counts(
    run: SyntheticRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: Any
) -> None:
    # A full (the rwlock's rebuild) and a new architecture (both schemes' rebuild), then a
    # failed rebuild and a delta on top of the version still served.
    run.train(1)
    run.publish("full")
    live = dlrm_live(run.store, "m", scheme, memory_budget=MemoryBudget(BUDGET))
    spy = CopySpy(monkeypatch)
    try:
        live.bootstrap()
        run.train(1)
        run.publish("full")
        live.catch_up()
        run.close()  # a new trainer takes over with a bigger model
        successor = SyntheticRun(run.store, "m", small_config(rows=(2000, 500), dim=4), seed=1)
        v3 = successor.train_and_publish("full", announce=False)
        live.catch_up()
        assert live.version == v3
        assert spy.peak == 2, spy.peak  # what the budget counts (ModelSlot.peak_copies)

        # A rebuild that fails (another architecture, a corrupt blob) leaves v3 served...
        other = SyntheticRun(FileStore(tmp_path / "other"), "m", small_config(), seed=2)
        other.train(1)
        ref = other.publish("full").ref
        blob = tmp_path / "other" / ref.manifest.tables[0].blob.key
        blob.write_bytes(bytes(blob.stat().st_size))
        with pytest.raises(IntegrityError):
            live.sink.update([ref], partial(fetch_version, other.store))
        other.close()
        assert live.version == v3
        # ...and a delta on top of it is still applied, within the same peak.
        v4 = successor.train_and_publish("delta", announce=False)
        successor.close()
        live.catch_up()
        assert live.version == v4
        served = live.sink.current()
        assert served is not None
        held = {"double-buffer": 2, "rwlock": 1}[scheme]  # the standby is back
        assert live.nbytes() == held * served.nbytes
        assert spy.peak == 2, spy.peak
    finally:
        live.close()
