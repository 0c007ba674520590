"""The embedded announcement bus (file:// log): what only it does (its line format, byte
offsets, torn, crashed, rotated and over-long lines, a log that is no regular file), and bus
URL parsing.

What every bus must do (order, wire bytes, where a source starts, models sharing the bus, one
model per announcer, a waiting poll, an unreachable bus) runs on it from
tests/contracts/test_bus_contract.py (its `file-log` parameter).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from publisher.bus import BusError, open_announcer, open_source, parse_kafka_url
from publisher.bus.file_log import FileLogAnnouncer, FileLogSource
from schemas.announcement import Announcement
from tests.contracts.test_bus_contract import announcement

_T = TypeVar("_T")


def versions(messages: list[bytes]) -> list[tuple[str, int]]:
    parsed = [Announcement.from_json(m) for m in messages]
    return [(a.model, a.version) for a in parsed]


def test_round_trip_two_sources_see_every_message(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bus/announcements.log"
    first = open_source(url)  # created before the log exists: starts at its beginning
    with open_announcer(url, "m") as announcer:
        for v in (1, 2, 3):
            announcer.announce(announcement("m", v))
        second = open_source(url, start="earliest")
        assert versions(first.poll(1.0)) == [("m", 1), ("m", 2), ("m", 3)]
        assert versions(second.poll(1.0)) == [("m", 1), ("m", 2), ("m", 3)]
        announcer.announce(announcement("m", 4))
    assert versions(first.poll(1.0)) == [("m", 4)]
    assert versions(second.poll(1.0)) == [("m", 4)]
    assert first.poll(0.05) == [] and second.poll(0.0) == []
    # The log holds exactly the announcements' wire bytes, one per line.
    lines = (tmp_path / "bus/announcements.log").read_bytes().splitlines()
    assert lines == [announcement("m", v).to_json() for v in (1, 2, 3, 4)]
    first.close()
    second.close()


def test_a_byte_offset_start_resumes_exactly_there(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    announcer = FileLogAnnouncer(path, "m")
    announcer.announce(announcement("m", 1))
    source = FileLogSource(path, start="latest")
    assert source.offset == path.stat().st_size
    announcer.announce(announcement("m", 2))
    resumed = FileLogSource(path, start=0)
    assert versions(resumed.poll(0.0)) == [("m", 1), ("m", 2)]
    assert resumed.offset == path.stat().st_size


def test_torn_last_line_waits_until_complete(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    source = FileLogSource(path, start="earliest")
    line = announcement("m", 1).to_json()
    with open(path, "ab") as f:
        f.write(line[:20])  # a writer mid-append
    assert source.poll(0.05) == []
    assert source.offset == 0
    with open(path, "ab") as f:
        f.write(line[20:] + b"\n")
    assert versions(source.poll(1.0)) == [("m", 1)]


def test_crashed_writer_fragment_is_terminated_by_the_next_writer(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    source = FileLogSource(path, start="earliest")
    with open(path, "ab") as f:
        f.write(announcement("m", 1).to_json()[:30])  # then the writer died
    FileLogAnnouncer(path, "m").announce(announcement("m", 2))
    messages = source.poll(1.0)
    # The fragment comes out as one bad line (the follower drops it), never glued to the next.
    assert messages[0] == announcement("m", 1).to_json()[:30]
    assert versions(messages[1:]) == [("m", 2)]


def test_replaced_or_truncated_log_is_read_from_the_start(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    announcer = FileLogAnnouncer(path, "m")
    source = FileLogSource(path, start="earliest")
    for v in (1, 2, 3):
        announcer.announce(announcement("m", v))
    assert len(source.poll(1.0)) == 3
    os.replace(path, tmp_path / "old.log")  # rotated away
    announcer.announce(announcement("m", 4))  # a new file, a new inode
    assert versions(source.poll(1.0)) == [("m", 4)]
    with open(path, "wb"):
        pass  # truncated in place
    announcer.announce(announcement("m", 5))
    assert versions(source.poll(1.0)) == [("m", 5)]


def test_overlong_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    source = FileLogSource(path, start="earliest", max_line_bytes=1000)
    with open(path, "ab") as f:
        f.write(b"x" * 2500 + b"\n\n   \n")
    messages = source.poll(0.05)
    assert messages == [b"x" * 1001]  # capped, still recognisably oversized; blanks skipped
    with open(path, "ab") as f:
        f.write(b"y" * 3000)  # over-long and not even finished
    assert source.poll(0.05) == [b"y" * 1001]
    with open(path, "ab") as f:
        f.write(b"yyyy\n" + announcement("m", 1).to_json() + b"\n")
    assert versions(source.poll(1.0)) == [("m", 1)]  # the rest of the long line was dropped


def test_announce_never_raises_when_the_log_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    announcer = FileLogAnnouncer(blocker / "a.log", "m")
    announcer.announce(announcement("m", 1))
    assert (announcer.sent, announcer.dropped) == (0, 1)
    assert FileLogSource(blocker / "a.log").poll(0.0) == []  # nor does reading it


def test_bus_urls() -> None:
    address = parse_kafka_url("kafka://h1:9092,h2:9093/announcements?partitions=3", environ={})
    assert address.bootstrap == ("h1:9092", "h2:9093")
    assert (address.topic, address.partitions, address.create_topic) == ("announcements", 3, True)
    env = {"CHECKNRUN_KAFKA_BOOTSTRAP": "127.0.0.1:1234"}
    address = parse_kafka_url("kafka:///t?create_topic=0", environ=env)
    assert (address.servers, address.topic, address.create_topic) == ("127.0.0.1:1234", "t", False)
    for bad in (
        "kafka:///t",  # no broker anywhere
        "kafka://h:1/",  # no topic
        "kafka://h:1/a/b",
        "kafka://h:1/t?partitions=zero",
        "kafka://h:1/t?partitions=0",
        "kafka://h:1/t?colour=red",
        "kafka://h:1/t%20t",
    ):
        with pytest.raises(BusError):
            parse_kafka_url(bad, environ={})
    for bad in ("mqtt://h/t", "file://"):
        with pytest.raises(BusError):
            open_announcer(bad, "m")
        with pytest.raises(BusError):
            open_source(bad)


def test_a_relative_log_path_is_the_working_directorys_as_a_stores_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "live-store").mkdir()
    url = "file://./live-store/announcements.log"
    with open_source(url, start="earliest") as source, open_announcer(url, "m") as announcer:
        announcer.announce(announcement("m", 1))
        monkeypatch.chdir("/")  # resolved when opened, not at each read
        assert versions(source.poll(1.0)) == [("m", 1)]
    assert (tmp_path / "live-store" / "announcements.log").exists()


def _within(seconds: float, action: Callable[[], _T]) -> _T:
    """`action()` run on a thread: its result or exception, or a failure if it blocks."""
    outcome: list[_T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(action())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if failure:
        raise failure[0]
    return outcome[0]


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_log_that_is_not_a_regular_file_is_refused_without_blocking(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.log"
    elsewhere = tmp_path / "elsewhere.log"
    elsewhere.write_bytes(announcement("m", 1).to_json() + b"\n")
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read waited for a writer: the follow loop hung
    else:
        path.symlink_to(elsewhere)
    try:
        with pytest.raises(BusError, match=f"announcement log {path} is"):
            _within(5.0, lambda: FileLogSource(path, start="latest"))
        # While following: nothing is read, the error is logged, HEAD polls go on.
        source = FileLogSource(path, start="earliest")
        assert _within(5.0, lambda: source.poll(0.1)) == []
        assert f"announcement log {path} is" in caplog.text
        source.close()
        announcer = FileLogAnnouncer(path, "m")
        _within(5.0, lambda: announcer.announce(announcement("m", 2)))
        assert (announcer.sent, announcer.dropped) == (0, 1)
        assert elsewhere.read_bytes() == announcement("m", 1).to_json() + b"\n"
    finally:
        if kind == "fifo":  # let a reader still blocked in open() (the old code) go
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
