"""The Kafka bus against a real broker: order, content, keys, topic recreation, broker outage."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from publisher.bus import open_announcer, open_source
from publisher.bus.base import KafkaAddress
from publisher.bus.kafka_bus import KafkaAnnouncementSource, KafkaAnnouncer
from schemas.announcement import Announcement

T = TypeVar("T")


def announcement(model: str, version: int) -> Announcement:
    return Announcement(
        model=model,
        version=version,
        parent=version - 1 if version > 1 else None,
        kind="full" if version == 1 else "delta",
        manifest_key=f"{model}/manifests/{version:012d}-tok.json",
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        total_bytes=version,
    )


def wait_for(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def collect(source: KafkaAnnouncementSource, count: int, timeout_s: float = 30.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got.extend(source.poll(0.5))
    return got


def ready(source: KafkaAnnouncementSource, timeout_s: float = 30.0) -> None:
    """Poll until the source has its partitions assigned (a `latest` start is then fixed)."""
    wait_for(lambda: source.poll(0.2) == [] and source._assigned, timeout_s, "assignment")


@pytest.fixture
def topic(unique_name: str) -> str:
    return unique_name


@pytest.fixture
def admin(services: Any) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=services.kafka_bootstrap)
    yield client
    client.close()


def create_topic(admin: KafkaAdminClient, topic: str, partitions: int = 1) -> None:
    admin.create_topics({topic: {"num_partitions": partitions, "replication_factor": 1}})


def test_announcements_arrive_in_order_with_their_content(services: Any, topic: str) -> None:
    url = f"kafka://{services.kafka_bootstrap}/{topic}"
    announcer = open_announcer(url, "m")
    assert isinstance(announcer, KafkaAnnouncer)
    announcer.announce(announcement("m", 1))  # creates the topic
    assert announcer.flush(30.0)
    source = open_source(url)  # starts at the end: version 1 is history
    assert isinstance(source, KafkaAnnouncementSource)
    ready(source)
    sent = [announcement("m", v) for v in range(2, 52)]
    started = time.monotonic()
    for a in sent:
        announcer.announce(a)
    assert time.monotonic() - started < 0.5  # announce only queues
    got = collect(source, len(sent))
    assert got == [a.to_json() for a in sent]
    assert [Announcement.from_json(m) for m in got] == sent
    assert announcer.flush(10.0) and announcer.delivered == 51 and announcer.skipped == 0
    announcer.close()
    assert source.poll(0.3) == []
    source.close()


def test_key_is_the_model_so_each_model_keeps_one_partition(
    services: Any, topic: str, admin: KafkaAdminClient
) -> None:
    url = f"kafka://{services.kafka_bootstrap}/{topic}?partitions=4"
    models = ["alpha", "beta", "gamma"]
    announcers = [open_announcer(url, m) for m in models]
    for v in range(1, 11):
        for a in announcers:
            a.announce(announcement(a.model, v))
    for a in announcers:
        assert a.flush(30.0)
        a.close()
    wait_for(lambda: len(admin.describe_topics([topic])[0]["partitions"]) == 4, 10, "partitions")
    consumer = KafkaConsumer(bootstrap_servers=services.kafka_bootstrap, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in range(4)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        records: list[Any] = []
        deadline = time.monotonic() + 20
        while len(records) < 30 and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
    finally:
        consumer.close()
    assert len(records) == 30
    for model in models:
        mine = [r for r in records if r.key == model.encode()]
        assert len({r.partition for r in mine}) == 1
        assert [Announcement.from_json(r.value).version for r in mine] == list(range(1, 11))
    # A source reading from the earliest offsets sees every model's messages, each in order.
    source = open_source(url, start="earliest")
    got = [Announcement.from_json(m) for m in collect(source, 30)]
    source.close()
    for model in models:
        assert [a.version for a in got if a.model == model] == list(range(1, 11))


def test_source_follows_a_recreated_topic(
    services: Any, topic: str, admin: KafkaAdminClient
) -> None:
    create_topic(admin, topic)
    address = KafkaAddress((services.kafka_bootstrap,), topic)
    source = KafkaAnnouncementSource(address, metadata_refresh_s=0.5)
    announcer = KafkaAnnouncer(
        address, "m", delivery_timeout_s=5.0, initial_backoff_s=0.1, max_backoff_s=1.0
    )
    try:
        ready(source)
        for v in (1, 2, 3):
            announcer.announce(announcement("m", v))
        assert len(collect(source, 3)) == 3
        admin.delete_topics([topic])
        # The source notices the topic is gone and waits; the announcer recreates it on failure.
        wait_for(lambda: topic not in admin.list_topics(), 30, "topic deletion")
        time.sleep(1.5)  # let the source's refresh see the topic gone
        assert source.poll(0.5) == []
        for v in (4, 5):
            announcer.announce(announcement("m", v))
        assert announcer.flush(60.0), "the announcer should recreate the topic and deliver"
        got: list[int] = []
        deadline = time.monotonic() + 30
        while 5 not in got and time.monotonic() < deadline:
            got += [Announcement.from_json(m).version for m in source.poll(0.5)]
        # The announcer may have collapsed 4 into 5 while the topic was missing; 5 always arrives.
        assert got in ([4, 5], [5])
    finally:
        announcer.close()
        source.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_broker_unreachable_neither_blocks_nor_raises() -> None:
    url = f"kafka://127.0.0.1:{closed_port()}/announcements"
    announcer = open_announcer(url, "m")
    started = time.monotonic()
    for v in range(1, 201):
        announcer.announce(announcement("m", v))
    assert time.monotonic() - started < 0.5
    time.sleep(0.5)
    assert isinstance(announcer, KafkaAnnouncer)
    assert announcer.pending == 1  # the outage collapsed the queue to the newest
    assert not announcer.flush(0.2)
    started = time.monotonic()
    announcer.close(timeout_s=1.0)
    assert time.monotonic() - started < 5.0
    assert announcer.delivered == 0 and announcer.failures >= 1
    assert announcer.skipped == 199

    source = open_source(url)
    started = time.monotonic()
    for _ in range(5):
        assert source.poll(0.3) == []
    assert time.monotonic() - started < 10.0
    source.close()


def test_source_reconnects_when_the_broker_appears(services: Any, topic: str) -> None:
    """A source built while nothing answers starts reading once a broker does (simulated by
    pointing the same source at the real broker after failures)."""
    dead = KafkaAddress((f"127.0.0.1:{closed_port()}",), topic)
    source = KafkaAnnouncementSource(dead, initial_backoff_s=0.05, max_backoff_s=0.2)
    assert source.poll(0.2) == [] and source.poll(0.2) == []
    source.address = KafkaAddress((services.kafka_bootstrap,), topic)
    announcer = KafkaAnnouncer(source.address, "m")
    try:
        announcer.announce(announcement("m", 1))
        assert announcer.flush(30.0)
        wait_for(lambda: source.poll(0.3) == [] and source._assigned, 30, "reconnect")
        assert source.reconnects == 1
        announcer.announce(announcement("m", 2))
        got = collect(source, 1)
        assert [Announcement.from_json(m).version for m in got] == [2]
    finally:
        announcer.close()
        source.close()


def test_start_reading_fixes_latest_before_the_first_poll(services: Any, topic: str) -> None:
    """What a server does before it reads HEAD: after `start_reading`, an announcement sent
    before the first poll is delivered (without it, a `latest` start is fixed at the first poll
    and that announcement would be skipped)."""
    url = f"kafka://{services.kafka_bootstrap}/{topic}"
    announcer = open_announcer(url, "m")
    source = open_source(url)
    try:
        announcer.announce(announcement("m", 1))  # creates the topic; history for the source
        assert announcer.flush(30.0)
        assert source.start_reading(30.0)
        announcer.announce(announcement("m", 2))
        assert announcer.flush(30.0)
        got = collect(source, 1)
        assert [Announcement.from_json(m).version for m in got] == [2]
    finally:
        announcer.close()
        source.close()


def test_start_reading_an_unreachable_broker_returns_false() -> None:
    source = open_source(f"kafka://127.0.0.1:{closed_port()}/announcements")
    try:
        assert source.start_reading(1.0) is False
        assert source.poll(0.2) == []  # and the source keeps working as before
    finally:
        source.close()
