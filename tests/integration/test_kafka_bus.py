"""The Kafka bus against a real broker: what only Kafka does (a sending thread, keys and
partitions, topic deletion and recreation, reconnecting, the queue collapsing in an outage).

What every bus must do runs here too, from tests/contracts/test_bus_contract.py (its `kafka`
parameter).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from publisher.bus import open_announcer, open_source
from publisher.bus.base import KafkaAddress
from publisher.bus.kafka_bus import KafkaAnnouncementSource, KafkaAnnouncer
from schemas.announcement import Announcement
from tests.contracts.test_bus_contract import announcement
from tests.support import wait_for

# A source (re)connecting inside `poll` gets at most the poll's timeout to bootstrap, so polls
# that may connect are long enough for a loaded machine; `poll` returns as soon as messages come.
CONNECT_POLL_S = 2.0


def collect(source: KafkaAnnouncementSource, count: int, timeout_s: float = 30.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got.extend(source.poll(CONNECT_POLL_S))
    return got


def ready(source: KafkaAnnouncementSource, timeout_s: float = 30.0) -> None:
    """Poll until the source has its partitions assigned (a `latest` start is then fixed)."""
    wait_for(
        lambda: source.poll(CONNECT_POLL_S) == [] and source._assigned, timeout_s, "assignment"
    )


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


def test_announce_only_queues_and_the_sender_delivers_in_order(
    services: Any, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"kafka://{services.kafka_bootstrap}/{topic}"
    announcer = open_announcer(url, "m")
    assert isinstance(announcer, KafkaAnnouncer)
    announcer.announce(announcement("m", 1))  # creates the topic
    assert announcer.flush(30.0)
    source = open_source(url)  # starts at the end: version 1 is history
    assert isinstance(source, KafkaAnnouncementSource)
    ready(source)
    # Announce only queues: with the sender thread held in its next delivery, all 50 calls
    # still return, and none of them has been delivered.
    release = threading.Event()
    deliver = announcer._deliver

    def held_delivery(item: Announcement) -> bool:
        release.wait(30.0)
        return deliver(item)

    monkeypatch.setattr(announcer, "_deliver", held_delivery)
    sent = [announcement("m", v) for v in range(2, 52)]
    try:
        for a in sent:
            announcer.announce(a)
        assert announcer.delivered == 1 and announcer.pending == len(sent)
    finally:
        release.set()
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
        # The source's metadata refresh sees the topic gone: it drops the assignment and the
        # old topic's offsets (a dropped consumer would empty the assignment only).
        wait_for(
            lambda: (
                source.poll(CONNECT_POLL_S) == [] and not source._assigned and not source.positions
            ),
            30,
            "the source to drop the deleted topic",
        )
        for v in (4, 5):
            announcer.announce(announcement("m", v))
        assert announcer.flush(60.0), "the announcer should recreate the topic and deliver"
        got: list[int] = []
        deadline = time.monotonic() + 30
        while 5 not in got and time.monotonic() < deadline:
            got += [Announcement.from_json(m).version for m in source.poll(CONNECT_POLL_S)]
        # The announcer may have collapsed 4 into 5 while the topic was missing; 5 always
        # arrives. Announcements are hints that may repeat (a retried send, a reseek to the new
        # topic's start; the follower ignores versions it has): compare them without repeats.
        assert list(dict.fromkeys(got)) in ([4, 5], [5]), got
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
    assert time.monotonic() - started < 2.5  # ~0.01 s unloaded: the caller never waits
    assert isinstance(announcer, KafkaAnnouncer)
    # The outage collapses the queue to the newest at the next failed retry (backoff 0.2 s,
    # 0.4 s, ...).
    wait_for(lambda: announcer.pending == 1, 10, "the queue to collapse to the newest")
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
    assert source.reconnects == 0
    source.address = KafkaAddress((services.kafka_bootstrap,), topic)
    announcer = KafkaAnnouncer(source.address, "m")
    try:
        announcer.announce(announcement("m", 1))
        assert announcer.flush(30.0)
        wait_for(lambda: source.poll(CONNECT_POLL_S) == [] and source._assigned, 30, "reconnect")
        # Never connected to the dead address; a metadata timeout on a loaded machine may cost
        # another reconnect to the live one.
        assert source.reconnects >= 1
        announcer.announce(announcement("m", 2))
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


def test_topic_recreated_while_the_source_was_disconnected(
    services: Any, topic: str, admin: KafkaAdminClient
) -> None:
    """The old topic's offsets mean nothing in its successor: after a reconnect the source reads
    the recreated topic from its start, even when it already holds more messages than the
    offset the source had reached."""
    create_topic(admin, topic)
    address = KafkaAddress((services.kafka_bootstrap,), topic)
    source = KafkaAnnouncementSource(address, initial_backoff_s=0.05, max_backoff_s=0.2)
    announcer = KafkaAnnouncer(address, "m")
    try:
        ready(source)
        for v in (1, 2):
            announcer.announce(announcement("m", v))
        assert len(collect(source, 2)) == 2  # the source is at offset 2 of the old topic
        source._drop_consumer()  # what a broker failure does; offsets and topic id are kept
        admin.delete_topics([topic])
        wait_for(lambda: topic not in admin.list_topics(), 30, "topic deletion")
        create_topic(admin, topic)
        for v in (3, 4, 5):
            announcer.announce(announcement("m", v))
        assert announcer.flush(60.0)
        got: list[int] = []
        deadline = time.monotonic() + 30
        while 5 not in got and time.monotonic() < deadline:
            got += [Announcement.from_json(m).version for m in source.poll(CONNECT_POLL_S)]
        assert list(dict.fromkeys(got)) == [3, 4, 5], got  # not [5] (read from offset 2)
    finally:
        announcer.close()
        source.close()
