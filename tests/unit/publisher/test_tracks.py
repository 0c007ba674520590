"""Tracks (docs/FORMAT.md 9.4): a released follower serves the version RELEASED names, forward
and back (a rollback rebuilds the earlier version), and HEAD's while the model has no RELEASED;
a candidate follower serves HEAD whatever RELEASED says. Announcements of either kind are hints;
the store decides."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from publisher.bus import open_announcer
from publisher.read import Subscriber, SubscriberOptions, TensorSink
from publisher.read.catalog import Catalog
from publisher.read.tracks import Track
from publisher.release import ReleaseLog
from publisher.store import FileStore
from schemas.announcement import Announcement
from tests.example_training import ExampleTrainer

FAST = SubscriberOptions(poll_timeout_s=0.05, poll_head_after_s=0.05, retry_initial_s=0.05)


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    """Five committed versions of the two-tower example, no gate (a full, then deltas)."""
    trainer = ExampleTrainer("two_tower")
    with trainer.checkpointer(f"file://{tmp_path}", interval_samples=256, codec="int4") as ckpt:
        trainer.train(20, ckpt)
    assert Catalog(FileStore(tmp_path), "two_tower").find().version == 5
    return tmp_path


def _served(
    store: Path, track: Track, bus: str | None = None, *, timeout: float = 5.0, until: int
) -> Subscriber:
    sub = Subscriber(
        f"file://{store}",
        "two_tower",
        TensorSink(),
        bus=bus,
        options=replace(FAST, track=track),
    )
    sub.start()
    sub.wait_for_version(timeout=timeout)
    _wait_for(sub, until, timeout)
    return sub


def _wait_for(sub: Subscriber, version: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while sub.version != version and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sub.version == version, f"serving v{sub.version}, waiting for v{version}"


def test_without_a_gate_the_released_track_serves_head(store: Path) -> None:
    with _served(store, "released", until=5) as sub:
        assert sub.version == 5


def test_the_released_track_follows_released_forward_and_back(store: Path) -> None:
    fs = FileStore(store)
    log = ReleaseLog(fs, "two_tower")
    catalog = Catalog(fs, "two_tower")
    log.move(catalog.find(2), action="release", by="person", reason="first")
    bus = f"file://{store}/announcements.log"
    announcer = open_announcer(bus, "two_tower")
    with (
        _served(store, "released", bus, until=2) as released,
        _served(store, "candidate", bus, until=5) as candidate,
    ):
        moved = log.move(catalog.find(4), action="release", by="person", reason="forward")
        announcer.announce(
            Announcement.of_release(catalog.find(4).manifest, moved.pointer.manifest)
        )
        _wait_for(released, 4)
        # A rollback: back to v2, whose chain is rebuilt from its full.
        log.move(catalog.find(2), action="rollback", by="person", reason="back")
        announcer.announce(Announcement.of_release(catalog.find(2).manifest, catalog.find(2).key))
        _wait_for(released, 2)
        assert candidate.version == 5  # HEAD's follower is not moved by releases
        stats = candidate.follower.stats
        assert stats.ignored.get("other_track", 0) >= 1
    announcer.close()


def test_a_silent_bus_still_brings_a_release(store: Path) -> None:
    fs = FileStore(store)
    log = ReleaseLog(fs, "two_tower")
    catalog = Catalog(fs, "two_tower")
    log.move(catalog.find(3), action="release", by="person", reason="first")
    with _served(store, "released", until=3) as sub:
        log.move(catalog.find(1), action="rollback", by="person", reason="no announcement")
        _wait_for(sub, 1)  # found by the HEAD poll's read of RELEASED


def test_a_move_to_an_uncommitted_version_is_refused(store: Path) -> None:
    fs = FileStore(store)
    log = ReleaseLog(fs, "two_tower")
    ref = Catalog(fs, "two_tower").find(5)
    forged = ref.__class__(ref.manifest, "two_tower/manifests/000000000005-forged.json")
    with pytest.raises(Exception, match="not the committed v5"):
        log.move(forged, action="release", by="person", reason="x")
    assert log.released() is None


def test_a_gated_model_is_not_served_before_its_first_release(tmp_path: Path) -> None:
    from publisher.release import GateConfig

    trainer = ExampleTrainer("two_tower")
    url = f"file://{tmp_path}"
    with trainer.checkpointer(
        url, interval_samples=256, codec="int4", gate=GateConfig(), score=trainer.score
    ) as ckpt:
        trainer.train(4, ckpt)  # one version: not judged yet (its window is still open)
    fs = FileStore(tmp_path)
    v1 = Catalog(fs, "two_tower").find(1)
    assert v1.manifest.metrics["release_gate"] == 1.0
    assert ReleaseLog(fs, "two_tower").released() is None
    with _served(tmp_path, "candidate", until=1) as candidate:
        assert candidate.version == 1
    released = Subscriber(url, "two_tower", TensorSink(), options=replace(FAST, track="released"))
    with released:
        released.start()
        time.sleep(0.3)  # several polls: nothing may be served
        assert released.version is None
        ReleaseLog(fs, "two_tower").move(v1, action="release", by="person", reason="by hand")
        assert released.wait_for_version(timeout=5.0) == 1
