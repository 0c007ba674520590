"""Publishing and following for real: VersionWriter over S3Store (MinIO), announcements over
Kafka, VersionFollower on the serving side. Missed announcements are caught up through the store."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import KafkaAdminClient

from publisher.bus.base import KafkaAddress
from publisher.bus.kafka_bus import KafkaAnnouncementSource, KafkaAnnouncer
from publisher.read.catalog import Catalog, VersionRef
from publisher.read.follower import OLD, VersionFollower
from publisher.store.s3_store import S3Settings, S3Store
from publisher.write.version_writer import TableBlob, VersionDraft, VersionWriter
from schemas.announcement import Announcement
from schemas.manifest import Position

MODEL = "ctr"


def s3_settings(services: Any) -> S3Settings:
    return S3Settings.from_env(
        {
            "CHECKNRUN_S3_ENDPOINT": services.s3_endpoint,
            "CHECKNRUN_S3_ACCESS_KEY": services.s3_access_key,
            "CHECKNRUN_S3_SECRET_KEY": services.s3_secret_key,
            "CHECKNRUN_S3_SECURE": "1" if services.s3_secure else "0",
            "CHECKNRUN_S3_REGION": services.s3_region or "us-east-1",
        }
    )


@pytest.fixture
def store(services: Any, unique_name: str) -> Iterator[S3Store]:
    s = S3Store(unique_name, "models", settings=s3_settings(services))
    yield s
    for info in list(s.list("")):
        s.delete(info.key)
    s.close()


@pytest.fixture
def address(services: Any, unique_name: str) -> KafkaAddress:
    return KafkaAddress((services.kafka_bootstrap,), unique_name)  # a topic, not the bucket


@pytest.fixture
def writer(store: S3Store) -> Iterator[VersionWriter]:
    with VersionWriter(store, MODEL) as w:
        yield w


@pytest.fixture
def announcer(address: KafkaAddress) -> Iterator[KafkaAnnouncer]:
    a = KafkaAnnouncer(
        address, MODEL, delivery_timeout_s=5.0, initial_backoff_s=0.1, max_backoff_s=1.0
    )
    yield a
    a.close()


def draft(kind: str, step: int) -> VersionDraft:
    return VersionDraft(
        kind=kind,  # type: ignore[arg-type]
        relative_to=None if kind == "full" else "parent",
        policy="test",
        position=Position(step=step, samples_seen=step),
        tables=[TableBlob("emb", 32, 4, "fp32", 32 if kind == "full" else 4, 0, b"r%d" % step)],
    )


_steps = itertools.count()


def publish(writer: VersionWriter, announcer: KafkaAnnouncer | None, kind: str) -> VersionRef:
    """Commit, then announce: the order of docs/FORMAT.md section 2."""
    ref = writer.commit(draft(kind, next(_steps)))
    if announcer is not None:
        announcer.announce(Announcement.of(ref.manifest, ref.key))
    return ref


class Replica:
    """A stand-in for a server: applies what the follower returns and checks each step."""

    def __init__(self, follower: VersionFollower) -> None:
        self.follower = follower
        self.version: int | None = None
        self.applied: list[int] = []

    def apply(self, ref: VersionRef) -> None:
        m = ref.manifest
        if m.kind == "delta":
            assert self.version is not None and m.applies_to is not None
            assert m.applies_to <= self.version < m.version, (m.applies_to, self.version, m.version)
        self.version = m.version
        self.applied.append(m.version)

    def follow_until(self, version: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (self.version or 0) < version:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"replica stuck at {self.version}, waiting for {version}"
            for ref in self.follower.poll(self.version, min(1.0, remaining)):
                self.apply(ref)


def source_ready(source: KafkaAnnouncementSource) -> None:
    deadline = time.monotonic() + 30
    while not source._assigned:
        assert time.monotonic() < deadline, "source never got its partitions"
        source.poll(2.0)  # a (re)connect inside poll gets the poll's timeout to bootstrap


def test_follow_announcements_then_a_late_subscriber_reconciles(
    store: S3Store, address: KafkaAddress, writer: VersionWriter, announcer: KafkaAnnouncer
) -> None:
    publish(writer, announcer, "full")
    assert announcer.flush(30)
    # No HEAD poll after the first (bootstrap) one: every later step comes through the bus.
    live = Replica(
        VersionFollower(
            Catalog(store, MODEL), KafkaAnnouncementSource(address), poll_head_after_s=3600
        )
    )
    live.follow_until(1)  # bootstrap from HEAD
    source_ready(live.follower.source)  # type: ignore[arg-type]
    for version in range(2, 6):
        publish(writer, announcer, "delta")
        live.follow_until(version)
    assert live.applied == [1, 2, 3, 4, 5]
    assert live.follower.stats.reconciles == 0  # every step was the announcement fast path

    # A subscriber started now, at the end of the topic, gets everything from the store.
    for kind in ("delta", "full", "delta"):
        publish(writer, announcer, kind)
    late = Replica(
        VersionFollower(
            Catalog(store, MODEL), KafkaAnnouncementSource(address), poll_head_after_s=3600
        )
    )
    late.follow_until(8)
    assert late.applied == [7, 8]  # from the newest full (7), not every version since 1
    assert late.follower.stats.head_polls == 1
    live.follow_until(8)
    # HEAD was past 6 when its announcement came: the catch-up plan starts at the full 7.
    assert live.applied == [1, 2, 3, 4, 5, 7, 8]
    for replica in (live, late):
        replica.follower.close()


def test_missed_announcements_are_caught_up_through_the_store(
    store: S3Store, address: KafkaAddress, writer: VersionWriter, announcer: KafkaAnnouncer
) -> None:
    publish(writer, announcer, "full")
    assert announcer.flush(30)
    # No HEAD poll after the bootstrap: each catch-up below is the bus's (a timed HEAD poll
    # could get there first on a slow run, and the count of reconciles would change).
    follower = VersionFollower(
        Catalog(store, MODEL), KafkaAnnouncementSource(address), poll_head_after_s=3600
    )
    replica = Replica(follower)
    replica.follow_until(1)
    source_ready(follower.source)  # type: ignore[arg-type]

    # 1. The consumer is replaced while versions are committed: the new one starts at the end
    #    of the topic, so 2..4 are never delivered to it; the announcement of 5 shows the gap.
    follower.source.close()  # type: ignore[union-attr]
    for _ in range(3):
        publish(writer, announcer, "delta")
    assert announcer.flush(30)
    follower.source = KafkaAnnouncementSource(address)
    source_ready(follower.source)
    publish(writer, announcer, "delta")
    replica.follow_until(5)
    assert replica.applied == [1, 2, 3, 4, 5]
    assert follower.stats.reconciles == 1

    # 2. The topic is deleted and recreated while versions are committed: the announcer
    #    recreates it, the source reads the new topic from its start.
    admin = KafkaAdminClient(bootstrap_servers=list(address.bootstrap))
    try:
        admin.delete_topics([address.topic])
        deadline = time.monotonic() + 30
        while address.topic in admin.list_topics():
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        admin.close()
    for _ in range(3):
        publish(writer, announcer, "delta")
    assert announcer.flush(60), "the announcer should recreate the topic"
    replica.follow_until(8, timeout_s=60)
    assert replica.applied == [1, 2, 3, 4, 5, 6, 7, 8]

    # 3. Late duplicates of what the store already gave are ignored.
    old = writer.catalog.find(6)
    announcer.announce(Announcement.of(old.manifest, old.key))
    assert announcer.flush(30)
    deadline = time.monotonic() + 30
    while follower.stats.ignored.get(OLD, 0) == 0 and time.monotonic() < deadline:
        assert follower.poll(replica.version, 1.0) == []
    assert follower.stats.ignored.get(OLD, 0) >= 1
    follower.close()


def test_dead_bus_only_delays(store: S3Store, writer: VersionWriter) -> None:
    """A follower whose bus points nowhere still follows, by polling HEAD."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = KafkaAddress((f"127.0.0.1:{port}",), "nowhere")
    dead_announcer = KafkaAnnouncer(dead, MODEL)
    follower = VersionFollower(
        Catalog(store, MODEL), KafkaAnnouncementSource(dead), poll_head_after_s=0.5
    )
    replica = Replica(follower)
    publish(writer, dead_announcer, "full")
    replica.follow_until(1, timeout_s=10)
    publish(writer, dead_announcer, "delta")
    publish(writer, dead_announcer, "delta")
    # Only delays: once committed, the versions are picked up by the next HEAD poll (<= 0.5 s
    # away) plus a few store reads; the dead source never holds the follower up for long.
    started = time.monotonic()
    replica.follow_until(3, timeout_s=10)
    assert time.monotonic() - started < 5
    assert replica.applied == [1, 2, 3]
    assert follower.stats.head_polls >= 2 and follower.stats.received == 0
    dead_announcer.close(timeout_s=0.5)
    follower.close()
