"""The announcement bus, selected by URL: `file:///PATH` (embedded log) or `kafka://HOST:PORT/TOPIC`."""

from __future__ import annotations

import os

from publisher.bus.base import (
    AnnouncementSource,
    Announcer,
    BusError,
    KafkaAddress,
    StartAt,
    parse_kafka_url,
)
from publisher.bus.kafka_auth import (
    KafkaAuth,
    KafkaAuthError,
    confluent_config,
    kafka_python_config,
)
from schemas.manifest import check_model_name


def _file_path(url: str) -> str:
    """The log's path: absolute (`file:///var/log.log`) or, as a store's may be, relative to
    the working directory (`file://./live-store/announcements.log`), made absolute here."""
    path = url.removeprefix("file://")
    if not path:
        raise BusError(f"{url!r}: expected file:///PATH of an announcement log")
    return os.path.abspath(path)


def open_announcer(url: str, model: str) -> Announcer:
    """The announcer a bus URL names, for one model."""
    check_model_name(model)
    if url.startswith("file://"):
        from publisher.bus.file_log import FileLogAnnouncer

        return FileLogAnnouncer(_file_path(url), model)
    if url.startswith("kafka://"):
        from publisher.bus.kafka_bus import KafkaAnnouncer  # only Kafka users import kafka

        return KafkaAnnouncer(parse_kafka_url(url), model)
    raise BusError(f"unsupported bus URL {url!r}: expected file:///PATH or kafka://HOST:PORT/TOPIC")


def open_source(url: str, *, start: StartAt = "latest") -> AnnouncementSource:
    """The source a bus URL names. `start`: read only new messages, or everything kept."""
    if url.startswith("file://"):
        from publisher.bus.file_log import FileLogSource

        return FileLogSource(_file_path(url), start=start)
    if url.startswith("kafka://"):
        from publisher.bus.kafka_bus import KafkaAnnouncementSource

        return KafkaAnnouncementSource(parse_kafka_url(url), start=start)
    raise BusError(f"unsupported bus URL {url!r}: expected file:///PATH or kafka://HOST:PORT/TOPIC")


__all__ = [
    "AnnouncementSource",
    "Announcer",
    "BusError",
    "KafkaAddress",
    "KafkaAuth",
    "KafkaAuthError",
    "StartAt",
    "confluent_config",
    "kafka_python_config",
    "open_announcer",
    "open_source",
    "parse_kafka_url",
]
