"""A Subscriber of the built-in DLRM against a real FileStore and file bus, for both consistency
schemes.

Covers bootstrap, following, gap fill, duplicate/old announcements, rejection of a corrupt delta
(and healing), skipping a broken delta via a newer full, pin/unpin, layout changes, and that no
prediction ever sees a torn model while versions are applied under load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.synthetic_run import SyntheticRun, model_scores, random_examples, small_config
from publisher.bus import open_announcer, open_source
from publisher.dlrm import DLRM, DLRMConfig
from publisher.read import (
    Catalog,
    ConsistencyScheme,
    NoVersionError,
    PinnedError,
    ShuttingDownError,
    Subscriber,
    SubscriberOptions,
    restore,
)
from publisher.read.follower import VersionFollower
from publisher.read.live_model import LiveModel
from publisher.read.version_fetch import FETCH_CONCURRENCY, fetch_version
from publisher.store import FileStore, StoreUnavailableError
from schemas.announcement import Announcement
from schemas.delta_blob import decode_delta_blob, encode_delta_blob
from schemas.tensor_blob import decode_tensors, encode_tensors
from server.metrics import MetricsObserver, ServerMetrics, counted
from tests.support import dlrm_scores, dlrm_sink

SCHEMES: list[ConsistencyScheme] = ["double-buffer", "rwlock"]


@dataclass
class World:
    """A store, a bus, a synthetic trainer publishing to both, and a server following them."""

    root: Path
    store: FileStore
    bus_url: str
    run: SyntheticRun
    loop: Subscriber
    metrics: ServerMetrics

    @property
    def live(self) -> LiveModel:
        return self.loop.live

    @property
    def follower(self) -> VersionFollower:
        return self.loop.follower

    def publish(self, kind: str = "delta", *, announce: bool = True, **kw: Any) -> int:
        return self.run.train_and_publish(kind, announce=announce, **kw)  # type: ignore[arg-type]

    def blob_path(self, version: int) -> Path:
        ref = self.live.catalog.find(version)
        return self.root / ref.manifest.tables[0].blob.key


def make_world(tmp_path: Path, scheme: ConsistencyScheme, codec: str = "fp32") -> World:
    store = FileStore(tmp_path / "store")
    bus_url = f"file://{tmp_path / 'bus.log'}"
    announcer = open_announcer(bus_url, "m")
    run = SyntheticRun(store, "m", small_config(), codec=codec, announce=announcer.announce)
    metrics = ServerMetrics()
    options = SubscriberOptions(
        poll_timeout_s=0.05, retry_initial_s=0.05, retry_max_s=0.2, poll_head_after_s=30.0
    )
    loop = Subscriber(
        store,
        "m",
        dlrm_sink(scheme),
        bus=open_source(bus_url, start="earliest"),
        options=options,
        observer=MetricsObserver(metrics),
    )
    return World(tmp_path / "store", store, bus_url, run, loop, metrics)


@pytest.fixture(params=SCHEMES)
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    w = make_world(tmp_path, request.param)
    yield w
    w.follower.close()
    w.loop.close()
    w.run.close()


def assert_matches_restore(live: LiveModel, store: FileStore, version: int) -> None:
    """The served tensors are bitwise those `restore()` rebuilds at `version`."""
    state = restore(store, "m", version)
    with live.reader() as buffer:
        assert buffer.served is not None and buffer.served.version == version
        for name, table in state.tables.items():
            assert np.array_equal(buffer.values(name).numpy(), table.weights), name
        for name, value in state.dense.items():
            assert np.array_equal(buffer.dense[name].numpy(), value), name


def served_scores(live: LiveModel, examples: list[dict[str, Any]]) -> tuple[int, np.ndarray]:
    with live.reader() as buffer:
        assert buffer.served is not None
        return buffer.served.version, dlrm_scores(buffer, examples)


def test_bootstrap_serves_head_bitwise_like_restore(world: World) -> None:
    world.publish("full")
    world.publish()
    world.publish()
    applied = world.loop.run(max_versions=1, timeout=5)
    assert applied == [1, 2, 3]
    assert world.live.version == 3
    assert_matches_restore(world.live, world.store, 3)
    assert world.live.versions_applied == 3
    assert world.live.bytes_fetched > 0


def test_bootstrap_waits_for_the_first_version(world: World) -> None:
    assert world.loop.run(timeout=0.2) == []
    assert world.live.version is None
    world.publish("full")
    assert world.loop.run(max_versions=1, timeout=5) == [1]


def test_follow_applies_announced_versions_in_order(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    v2, v3 = world.publish(), world.publish()
    assert world.loop.run(max_versions=2, timeout=5) == [v2, v3]
    assert_matches_restore(world.live, world.store, v3)
    assert world.live.staleness_s() == 0.0


def test_an_apply_records_when_each_stage_ended(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    boot = world.live.last_times
    assert boot is not None and boot.versions == (1,) and boot.heard_at is None
    v2 = world.publish()
    assert world.loop.run(max_versions=1, timeout=5) == [v2]
    t = world.live.last_times
    assert t is not None and t.versions == (v2,)
    assert t.heard_at is not None and t.planned_at is not None
    assert t.heard_at <= t.planned_at <= t.started_at <= t.served_at <= t.finished_at
    assert 0 < t.fetch_s <= t.finished_at - t.started_at
    assert t.served_at == world.live.served.applied_at.timestamp()  # type: ignore[union-attr]


class OverlapStore(FileStore):
    """A FileStore whose table-blob reads wait (up to 5 s) for the dense blob's read to start,
    and record whether it did: a dense read made after the tables would be seen as not."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.watch = False
        self.dense_started = threading.Event()
        self.overlapped: list[bool] = []

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if self.watch and key.endswith("dense.safetensors"):
            self.dense_started.set()
        elif self.watch and key.endswith(".cnrd"):
            self.overlapped.append(self.dense_started.wait(5.0))
        return super().get_range(key, start, length)


def test_the_dense_blob_downloads_beside_the_tables(tmp_path: Path) -> None:
    store = OverlapStore(tmp_path / "store")
    run = SyntheticRun(store, "m", small_config())
    ref = run.publish("full").ref
    run.close()
    store.watch = True
    with ThreadPoolExecutor(FETCH_CONCURRENCY) as pool:
        fetched = fetch_version(store, ref, pool)
    assert fetched.dense  # decoded, and verified against the manifest like the tables
    m = ref.manifest
    assert m.dense is not None
    assert fetched.bytes_fetched == sum(t.blob.size for t in m.tables) + m.dense.size
    assert len(store.overlapped) == len(m.tables) and all(store.overlapped)


def test_gap_is_filled_from_the_store(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    v2 = world.publish(announce=False)  # the bus never hears of v2
    v3 = world.publish()
    assert world.loop.run(max_versions=2, timeout=5) == [v2, v3]
    assert_matches_restore(world.live, world.store, v3)


def test_duplicate_and_old_announcements_are_ignored(world: World) -> None:
    world.publish("full")
    world.publish()
    world.loop.run(max_versions=2, timeout=5)
    assert world.live.version == 2
    announcer = open_announcer(world.bus_url, "m")
    for ref in world.live.catalog.versions():
        announcer.announce(Announcement.of(ref.manifest, ref.key))  # v1 and v2 again
    before = world.live.versions_applied
    assert world.loop.run(timeout=0.3) == []
    assert world.live.version == 2 and world.live.versions_applied == before
    assert world.follower.stats.ignored.get("old", 0) >= 2
    # Idempotent by version even when called directly.
    assert world.live.advance(world.live.catalog.find(1)) == []
    assert world.live.advance(world.live.catalog.find(2)) == []


def test_corrupt_delta_is_rejected_then_retried_once_healed(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    examples = random_examples(world.run.config, 8)
    _, before_scores = served_scores(world.live, examples)
    v2 = world.publish()
    path = world.blob_path(v2)
    good = path.read_bytes()
    path.write_bytes(good[:-8] + bytes(8))  # same size, wrong sha256

    assert world.loop.run(timeout=0.4) == []
    assert world.live.version == 1  # still serving the last good version
    assert world.loop.rejected >= 1
    assert counted(world.metrics.rejected, reason="integrity") >= 1
    version, scores = served_scores(world.live, examples)
    assert version == 1 and np.array_equal(scores, before_scores)
    assert_matches_restore(world.live, world.store, 1)  # nothing torn, in any buffer

    path.write_bytes(good)  # the store heals (e.g. a replica caught up)
    assert world.loop.run(max_versions=1, timeout=5) == [v2]
    assert_matches_restore(world.live, world.store, v2)


def test_a_manifest_without_a_utc_offset_is_never_served(world: World) -> None:
    # Once served, its created_at was subtracted from the aware clock: TypeError after the swap,
    # and /metrics and /v1/model (staleness) broken for as long as it was served.
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    v2 = world.publish()
    key = Catalog(world.store, "m").find(v2).key
    doc = json.loads((world.root / key).read_bytes())
    doc["created_at"] = datetime.fromisoformat(doc["created_at"]).replace(tzinfo=None).isoformat()
    (world.root / key).write_text(json.dumps(doc))

    assert world.loop.run(timeout=0.4) == []
    assert world.live.version == 1
    assert world.live.staleness_s() >= 0.0


def test_missing_blob_is_rejected_not_counted_as_an_outage(world: World) -> None:
    # A blob the manifest names but the store lacks is bad data (NotFoundError), not an outage.
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    v2 = world.publish()
    path = world.blob_path(v2)
    good = path.read_bytes()
    path.unlink()
    assert world.loop.run(timeout=0.3) == []
    assert world.live.version == 1
    assert counted(world.metrics.rejected, reason="restore") >= 1
    assert counted(world.metrics.follow_errors) == 0
    path.write_bytes(good)  # the store heals
    assert world.loop.run(max_versions=1, timeout=5) == [v2]


def _poison_rows(value: float) -> Callable[[bytes], bytes]:
    def change(data: bytes) -> bytes:
        blob = decode_delta_blob(data)
        assert blob.codec == "fp32" and blob.n_rows > 0
        codes = blob.codes.copy()
        codes.view(np.float32)[0, -1] = value
        return encode_delta_blob(dataclasses.replace(blob, codes=codes))

    return change


def _poison_dense(value: float) -> Callable[[bytes], bytes]:
    def change(data: bytes) -> bytes:
        tensors, meta = decode_tensors(data)
        name = sorted(tensors)[0]
        poisoned = tensors[name].copy()
        poisoned.reshape(-1)[0] = value
        return encode_tensors({**tensors, name: poisoned}, meta)

    return change


def poison(world: World, version: int, where: str, change: Callable[[bytes], bytes]) -> None:
    """Rewrite a blob of a committed `version` and its manifest entry to match (size, sha256),
    as a writer that published NaN or Inf would have: it passes every integrity check."""
    ref = Catalog(world.store, "m").find(version)  # not the server's: it must read it afresh
    doc = json.loads((world.root / ref.key).read_bytes())
    entry = doc["dense"] if where == "dense" else doc["tables"][0]["blob"]
    path = world.root / entry["key"]
    bad = change(path.read_bytes())
    path.write_bytes(bad)
    entry["size"], entry["sha256"] = len(bad), hashlib.sha256(bad).hexdigest()
    (world.root / ref.key).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("kind", "where", "value"),
    [
        ("delta", "rows", float("nan")),
        ("delta", "rows", float("inf")),
        ("delta", "dense", float("nan")),
        ("delta", "dense", float("-inf")),
        ("full", "rows", float("nan")),
        ("full", "dense", float("inf")),
    ],
)
def test_version_holding_nan_or_inf_is_rejected(
    world: World, kind: str, where: str, value: float
) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    examples = random_examples(world.run.config, 8)
    _, before_scores = served_scores(world.live, examples)
    version = world.publish(kind, announce=False)
    poison(world, version, where, (_poison_dense if where == "dense" else _poison_rows)(value))
    ref = Catalog(world.store, "m").find(version)
    open_announcer(world.bus_url, "m").announce(Announcement.of(ref.manifest, ref.key))

    assert world.loop.run(timeout=0.4) == []
    assert world.live.version == 1  # still serving the last good version
    assert counted(world.metrics.rejected, reason="non_finite") >= 1
    served, scores = served_scores(world.live, examples)
    assert served == 1 and np.array_equal(scores, before_scores)
    assert np.isfinite(scores).all()
    assert_matches_restore(world.live, world.store, 1)  # nothing torn, in any buffer
    newer = world.publish("full")  # a newer full skips the bad version
    assert world.loop.run(max_versions=1, timeout=5) == [newer]
    assert_matches_restore(world.live, world.store, newer)


def test_broken_delta_is_skipped_once_a_newer_full_exists(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    v2 = world.publish()
    world.blob_path(v2).write_bytes(b"garbage")  # wrong size: IntegrityError
    assert world.loop.run(timeout=0.3) == []
    assert world.live.version == 1
    v3 = world.publish("full")
    assert world.loop.run(max_versions=1, timeout=5) == [v3]
    assert_matches_restore(world.live, world.store, v3)


def test_pin_rebuilds_an_earlier_version_and_unpin_follows_again(world: World) -> None:
    world.publish("full")
    world.publish()
    world.publish()
    world.loop.run(max_versions=1, timeout=5)
    served = world.live.pin(2)
    assert served.version == 2 and world.live.pinned == 2
    assert_matches_restore(world.live, world.store, 2)

    v4 = world.publish()
    assert world.loop.run(timeout=0.3) == []  # pinned: nothing applied
    assert world.live.version == 2
    with pytest.raises(PinnedError):
        world.live.advance(world.live.catalog.find(v4))
    assert world.live.latest_known() == v4

    assert world.live.unpin() is True
    world.loop.request_catch_up()
    assert world.loop.run(max_versions=1, timeout=5)[-1] == v4
    assert_matches_restore(world.live, world.store, v4)
    assert world.live.unpin() is False


def test_pin_unknown_version(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    with pytest.raises(NoVersionError):
        world.live.pin(99)
    assert world.live.pinned is None


def test_one_shot_chain(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    v2 = world.publish(relative_to="baseline")
    assert world.loop.run(max_versions=1, timeout=5) == [v2]
    world.publish(relative_to="baseline")  # v3
    v4 = world.publish(relative_to="baseline")
    # v4 holds every row changed since the baseline, v3's too: a server behind skips v3.
    assert world.loop.run(max_versions=1, timeout=5) == [v4]
    assert world.live.catalog.find(v4).manifest.applies_to == 1
    assert_matches_restore(world.live, world.store, v4)


def test_new_architecture_arrives_with_a_full(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    world.run.close()  # release the lease: a "new trainer" takes over with a bigger model
    bigger = small_config(rows=(2000, 500), dim=4)
    world.run = SyntheticRun(world.store, "m", bigger, seed=1)
    v2 = world.publish("full")
    world.live.catch_up()
    assert world.live.version == v2
    with world.live.reader() as buffer:
        assert DLRMConfig.from_json(buffer.model_config) == bigger
    assert_matches_restore(world.live, world.store, v2)


def test_delta_of_another_layout_is_rejected(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    world.run.close()
    world.run = SyntheticRun(world.store, "m", small_config(rows=(7, 5), dim=3), seed=2)
    world.publish()
    assert world.loop.run(timeout=0.3) == []
    assert world.live.version == 1
    assert counted(world.metrics.rejected, reason="layout") >= 1


def test_store_outage_is_counted_and_retried(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    v2 = world.publish()
    real_get, real_range = world.store.get_with_etag, world.store.get_range

    def down(key: str, max_bytes: int | None = None) -> tuple[bytes, str]:
        if "/blobs/" in key:
            raise StoreUnavailableError("connection refused")
        return real_get(key, max_bytes)

    def range_down(key: str, start: int, length: int) -> bytes:
        if "/blobs/" in key:
            raise StoreUnavailableError("connection refused")
        return real_range(key, start, length)

    monkeypatch.setattr(world.store, "get_with_etag", down)
    monkeypatch.setattr(world.store, "get_range", range_down)
    assert world.loop.run(timeout=0.3) == []
    assert world.live.version == 1
    assert counted(world.metrics.follow_errors, kind="store") >= 1
    monkeypatch.setattr(world.store, "get_with_etag", real_get)
    monkeypatch.setattr(world.store, "get_range", real_range)
    assert world.loop.run(max_versions=1, timeout=5) == [v2]


def test_stop_returns_promptly(world: World) -> None:
    world.publish("full")
    thread = threading.Thread(target=world.loop.run)
    thread.start()
    world.loop.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_predictions_equal_restored_model_and_trainer_within_codec_error(tmp_path: Path) -> None:
    w = make_world(tmp_path, "double-buffer", codec="int8")
    try:
        w.publish("full")
        v = w.publish()
        w.loop.run(max_versions=1, timeout=5)
        examples = random_examples(w.run.config, 64)
        version, served = served_scores(w.live, examples)
        assert version == v
        # The trainer's model restored at the same version: the same decode, so equal.
        state = restore(w.store, "m", v)
        restored = DLRM(DLRMConfig.from_json(state.manifest.model_config_))
        weights = {
            f"{name}.weight": torch.from_numpy(t.weights) for name, t in state.tables.items()
        }
        restored.load_state_dict(
            {**weights, **{k: torch.from_numpy(a) for k, a in state.dense.items()}}
        )
        np.testing.assert_allclose(served, model_scores(restored, examples), rtol=0, atol=1e-6)
        # The trainer's live fp32 model: within int8 codec error.
        trainer = model_scores(w.run.model, examples)
        assert np.max(np.abs(served - trainer)) < 5e-3
    finally:
        w.follower.close()
        w.loop.close()
        w.run.close()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_no_torn_reads_while_versions_apply(tmp_path: Path, scheme: ConsistencyScheme) -> None:
    """Readers hammer the model while versions that rewrite every row are applied; every
    answer must equal exactly the trainer's answer at the version it names."""
    w = make_world(tmp_path, scheme)
    try:
        examples = random_examples(w.run.config, 32, seed=3)
        expected: dict[int, np.ndarray] = {}

        def publish_all_rows(kind: str = "delta") -> None:
            for name in ("embeddings.f0", "embeddings.f1", "embeddings.tags"):
                w.run.touch_rows(name, w.run.table(name).shape[0])  # every row changes
            with torch.no_grad():
                for p in w.run.model.top.parameters():
                    p.add_(0.05)
            version = w.run.publish(kind).ref.version  # type: ignore[arg-type]
            expected[version] = model_scores(w.run.model, examples)

        publish_all_rows("full")
        w.loop.run(max_versions=1, timeout=5)
        stop = threading.Event()
        seen: list[tuple[int, np.ndarray]] = []
        errors: list[BaseException] = []

        def read() -> None:
            try:
                while not stop.is_set():
                    seen.append(served_scores(w.live, examples))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        readers = [threading.Thread(target=read) for _ in range(3)]
        for t in readers:
            t.start()
        for _ in range(6):
            publish_all_rows()
            w.loop.run(max_versions=1, timeout=5)
        stop.set()
        for t in readers:
            t.join()
        assert not errors
        versions = {v for v, _ in seen}
        assert len(versions) >= 3, versions
        for version, scores in seen:
            np.testing.assert_allclose(scores, expected[version], rtol=0, atol=1e-6)
    finally:
        w.follower.close()
        w.loop.close()
        w.run.close()


def test_interrupt_abandons_an_apply_without_tearing(world: World) -> None:
    world.publish("full")
    world.loop.run(max_versions=1, timeout=5)
    v2 = world.publish()
    world.live.interrupt()
    with pytest.raises(ShuttingDownError):
        world.live.advance(world.live.catalog.find(v2))
    assert world.live.version == 1
    assert_matches_restore(world.live, world.store, 1)
    assert world.loop.run(timeout=0.2) == []  # the loop treats it as "stopping", not an error
    assert counted(world.metrics.follow_errors) == 0
