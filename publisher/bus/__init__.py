"""The announcement bus, selected by URL: `file:///PATH` (embedded log) or `kafka://HOST:PORT/TOPIC`."""

from __future__ import annotations

from publisher.bus.base import (
    AnnouncementSource,
    Announcer,
    BusError,
    KafkaAddress,
    StartAt,
    open_announcer,
    open_source,
    parse_kafka_url,
)

__all__ = [
    "AnnouncementSource",
    "Announcer",
    "BusError",
    "KafkaAddress",
    "StartAt",
    "open_announcer",
    "open_source",
    "parse_kafka_url",
]
