"""The announcement bus contract (publisher/bus/base.py), run on every bus: a source that has
started reading gets every later announcement in order as its wire bytes, an `earliest` source
gets what the bus kept, models share one bus, an announcer speaks for its own model only, a poll
waits for the next message, and an unreachable bus neither raises nor hangs either end.

To add a backend: write a factory like `file_log_bus` below and add it to `BUSES`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from publisher.bus import AnnouncementSource, BusError, open_announcer, open_source
from schemas.announcement import Announcement

#: how long a poll that may have to (re)connect waits; `poll` returns as soon as messages come.
CONNECT_POLL_S = 2.0
#: the most a test waits for messages it expects (a loaded machine, a broker's first fetch).
DELIVERY_S = 30.0


@dataclass(frozen=True)
class Bus:
    """A bus under test: one only this test uses, and one that cannot be reached."""

    url: str
    unreachable_url: str


BusFactory = Callable[[pytest.FixtureRequest], Iterator[Bus]]


def file_log_bus(request: pytest.FixtureRequest) -> Iterator[Bus]:
    """A log in a fresh directory; unreachable: a log whose directory is a regular file."""
    tmp_path = request.getfixturevalue("tmp_path")
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    yield Bus(f"file://{tmp_path}/bus/announcements.log", f"file://{blocker}/announcements.log")


def kafka_bus(request: pytest.FixtureRequest) -> Iterator[Bus]:
    """A fresh topic on the test broker; unreachable: a loopback port nobody listens on."""
    services = request.getfixturevalue("services")
    topic = request.getfixturevalue("unique_name")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield Bus(
        f"kafka://{services.kafka_bootstrap}/{topic}", f"kafka://127.0.0.1:{port}/announcements"
    )


BUSES = [
    pytest.param(file_log_bus, id="file-log"),
    pytest.param(kafka_bus, id="kafka", marks=pytest.mark.integration),
]


@pytest.fixture(params=BUSES)
def bus(request: pytest.FixtureRequest) -> Iterator[Bus]:
    factory: BusFactory = request.param
    yield from factory(request)


def announcement(model: str, version: int) -> Announcement:
    """Version `version` of `model`: the full version 1, then deltas on their parents."""
    return Announcement(
        model=model,
        version=version,
        parent=version - 1 if version > 1 else None,
        kind="full" if version == 1 else "delta",
        manifest_key=f"{model}/manifests/{version:012d}-tok.json",
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        total_bytes=100 * version,
    )


def collect(source: AnnouncementSource, count: int) -> list[bytes]:
    """Poll until `count` messages came or DELIVERY_S passed; what came."""
    got: list[bytes] = []
    deadline = time.monotonic() + DELIVERY_S
    while len(got) < count and time.monotonic() < deadline:
        got.extend(source.poll(CONNECT_POLL_S))
    return got


def versions(messages: list[bytes]) -> list[tuple[str, int]]:
    return [(a.model, a.version) for a in map(Announcement.from_json, messages)]


def test_a_started_source_gets_every_later_announcement_in_order_as_its_wire_bytes(
    bus: Bus,
) -> None:
    with open_announcer(bus.url, "m") as announcer:
        announcer.announce(announcement("m", 1))  # history for a `latest` source
        assert announcer.flush(DELIVERY_S)
        with open_source(bus.url) as source:
            # Started before anything is polled: what follows is delivered, what was is not.
            assert source.start_reading(DELIVERY_S)
            sent = [announcement("m", v) for v in range(2, 12)]
            for a in sent:
                announcer.announce(a)
            assert announcer.flush(DELIVERY_S)
            got = collect(source, len(sent))
            assert got == [a.to_json() for a in sent]
            assert [Announcement.from_json(m) for m in got] == sent
            assert source.poll(0.3) == []


def test_an_earliest_source_gets_what_the_bus_kept(bus: Bus) -> None:
    with open_announcer(bus.url, "m") as announcer:
        for v in (1, 2, 3):
            announcer.announce(announcement("m", v))
        assert announcer.flush(DELIVERY_S)
    with open_source(bus.url, start="earliest") as source:
        assert versions(collect(source, 3)) == [("m", 1), ("m", 2), ("m", 3)]


def test_models_announcing_at_once_share_one_bus_and_each_keeps_its_order(bus: Bus) -> None:
    models = [f"m{i}" for i in range(4)]

    def announce_all(model: str) -> None:
        with open_announcer(bus.url, model) as announcer:
            for v in range(1, 26):
                announcer.announce(announcement(model, v))
            assert announcer.flush(DELIVERY_S)

    threads = [threading.Thread(target=announce_all, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open_source(bus.url, start="earliest") as source:
        got = versions(collect(source, 100))
    assert len(got) == 100
    for model in models:  # every model's versions, none lost or torn, in order
        assert [v for m, v in got if m == model] == list(range(1, 26))


def test_an_announcer_speaks_for_its_own_model_only(bus: Bus) -> None:
    announcer = open_announcer(bus.url, "alpha")
    try:
        with pytest.raises(BusError, match="'alpha' was given an announcement of 'beta'"):
            announcer.announce(announcement("beta", 1))
    finally:
        announcer.close()


def test_a_poll_waits_for_the_next_announcement(bus: Bus) -> None:
    with open_announcer(bus.url, "m") as announcer:
        announcer.announce(announcement("m", 1))
        assert announcer.flush(DELIVERY_S)
        source = open_source(bus.url)
        assert source.start_reading(DELIVERY_S)
        assert source.poll(0.3) == []  # 1 came before the start: nothing to read
        timer = threading.Timer(0.2, lambda: announcer.announce(announcement("m", 2)))
        timer.start()
        try:
            assert versions(source.poll(DELIVERY_S)) == [("m", 2)]  # one poll, not a loop
        finally:
            timer.join()
            source.close()


def test_an_unreachable_bus_neither_raises_nor_hangs(bus: Bus) -> None:
    announcer = open_announcer(bus.unreachable_url, "m")
    for v in range(1, 51):
        announcer.announce(announcement("m", v))  # queued or dropped, never raised
    announcer.close(timeout_s=1.0)
    with open_source(bus.unreachable_url, start="earliest") as source:
        for _ in range(3):
            assert source.poll(0.2) == []
