"""The announcement bus: how a publisher tells the servers that a version is committed.

An announcement is a hint (docs/FORMAT.md section 6): the store is the source of truth, so the bus
may lose, repeat or reorder messages, and a subscriber that misses some catches up from HEAD
(publisher/read/follower.py). That is why both ends are forgiving:

- `Announcer.announce` never raises because the bus is down and never blocks training for long;
  at worst a version is announced late or not at all.
- `AnnouncementSource.poll` never raises because the bus is down; it returns raw messages,
  unvalidated (the follower validates and counts them), possibly from every model on the bus.

Backends are chosen by URL:

    file:///path/to/announcements.log      the embedded default: one local append-only log
    kafka://HOST:PORT[,HOST:PORT...]/TOPIC  Apache Kafka
    kafka:///TOPIC                          Kafka, bootstrap servers from CHECKNRUN_KAFKA_BOOTSTRAP

Kafka URLs take options as a query: `?partitions=3&replication_factor=1&create_topic=0`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl

from schemas.announcement import Announcement
from schemas.errors import BadDataError

#: where a new source starts reading: only what is announced from now on, or everything kept.
StartAt = Literal["latest", "earliest"]


class BusError(BadDataError):
    """A bus URL or setting that cannot work (never raised for a transient outage)."""


class Announcer(ABC):
    """Sends the announcements of one model's committed versions."""

    model: str

    @abstractmethod
    def announce(self, announcement: Announcement) -> None:
        """Send `announcement`, or queue it for sending. Never raises for an unreachable bus.

        Raises BusError only when the announcement is for another model than this announcer's.
        """

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything announced so far is sent; False if the timeout expired first."""
        return True

    def close(self, timeout_s: float = 10.0) -> None:  # noqa: B027 - optional hook
        """Send what is pending (waiting at most `timeout_s`) and release connections."""

    def _check_model(self, announcement: Announcement) -> None:
        if announcement.model != self.model:
            raise BusError(
                f"announcer of model {self.model!r} was given an announcement of "
                f"{announcement.model!r}"
            )

    def __enter__(self) -> Announcer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AnnouncementSource(ABC):
    """Receives raw announcement messages of every model on the bus."""

    @abstractmethod
    def poll(self, timeout_s: float) -> list[bytes]:
        """Messages received since the last poll, oldest first, waiting up to `timeout_s` for one.

        Never raises for an unreachable bus: returns [] and reconnects on a later call.
        """

    def start_reading(self, timeout_s: float = 5.0) -> bool:
        """Fix where reading starts now, without reading: everything announced after this call
        returns is delivered by later polls. A replica calls it before it reads HEAD, so no
        announcement falls between its bootstrap and its first poll.

        Returns False if the bus could not be reached within `timeout_s` (the start is then
        fixed at the first successful poll, and HEAD polls cover the gap). Never raises.
        """
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def __enter__(self) -> AnnouncementSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class KafkaAddress:
    """What a `kafka://` URL names."""

    bootstrap: tuple[str, ...]
    topic: str
    partitions: int = 1
    replication_factor: int = 1
    create_topic: bool = True

    @property
    def servers(self) -> str:
        """The bootstrap servers as one comma-separated string."""
        return ",".join(self.bootstrap)


def parse_kafka_url(url: str, environ: Mapping[str, str] | None = None) -> KafkaAddress:
    """Split `kafka://HOST:PORT[,HOST:PORT]/TOPIC[?options]`; an empty host list takes
    CHECKNRUN_KAFKA_BOOTSTRAP."""
    env = os.environ if environ is None else environ
    if not url.startswith("kafka://"):
        raise BusError(f"not a kafka:// URL: {url!r}")
    rest, _, query = url.removeprefix("kafka://").partition("?")
    hosts, _, topic = rest.partition("/")
    if not hosts:
        hosts = env.get("CHECKNRUN_KAFKA_BOOTSTRAP", "").strip()
        if not hosts:
            raise BusError(
                f"{url!r} names no broker and CHECKNRUN_KAFKA_BOOTSTRAP is not set: use "
                "kafka://HOST:PORT/TOPIC or set CHECKNRUN_KAFKA_BOOTSTRAP=HOST:PORT"
            )
    bootstrap = tuple(h.strip() for h in hosts.split(",") if h.strip())
    if not topic or "/" in topic or not _valid_topic(topic):
        raise BusError(
            f"{url!r}: topic {topic!r} must be 1-249 characters of [A-Za-z0-9._-] "
            "(kafka://HOST:PORT/TOPIC)"
        )
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(options) - {"partitions", "replication_factor", "create_topic"}
    if unknown:
        raise BusError(f"{url!r}: unknown options {sorted(unknown)}")
    try:
        partitions = int(options.get("partitions", "1"))
        replication = int(options.get("replication_factor", "1"))
    except ValueError as exc:
        raise BusError(f"{url!r}: partitions and replication_factor must be integers") from exc
    if partitions < 1 or replication < 1:
        raise BusError(f"{url!r}: partitions and replication_factor must be >= 1")
    create = options.get("create_topic", "1").lower() not in ("0", "false", "no")
    return KafkaAddress(bootstrap, topic, partitions, replication, create)


def _valid_topic(topic: str) -> bool:
    return (
        0 < len(topic) <= 249
        and topic not in (".", "..")
        and all(c.isascii() and (c.isalnum() or c in "._-") for c in topic)
    )
