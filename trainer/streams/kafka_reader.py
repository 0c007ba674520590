"""Consume and parse a Kafka event topic in a child process; hand columnar batches over.

Why a process: parsing one JSON event and checking it costs a few microseconds of Python,
about what a training step spends per sample, so on the training thread it would halve the
throughput. In a child process it runs beside training on the other core; the training thread
only maps each batch's distinct ids (trainer/id_space.py). Why librdkafka (confluent-kafka)
rather than kafka-python, which the announcement bus uses: measured here, kafka-python decodes
~25k records/s per core (~60k without CRC checks), below the ~76k samples/s the trainer
trains; librdkafka consumes ~350k/s, leaving the core to the parsing.

The child is `python -m trainer.streams.kafka_reader FD` on a socket pair, as the publisher
process is (publisher/write/process_publisher.py)::

    parent -> child   ReaderConfig                  (first message)
    child -> parent   ("ready", starts, ends) | ("error", exception)
    child -> parent   ("batch", RawEvents) ...      (blocks while the socket is full:
                                                     the child reads ahead a few batches)

The parent ends it by closing its end and killing it.

Partitions are assigned (every partition of the topic, or the given ones), never subscribed:
no consumer group joins, nothing is committed, and the offsets the parent keeps in each
manifest are the only position (docs/FORMAT.md section 8.3). librdkafka requires a `group.id`
even so; it names the trainer and is never used. A partition the config gives no start offset
for starts at its beginning; `ready` reports every partition's start and end offsets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast
from urllib.parse import parse_qsl

from publisher.bus import confluent_config
from publisher.bus.base import BusError, parse_kafka_url
from publisher.child_process import parent_connection, receive, start_child
from schemas.errors import BadDataError, UnavailableError
from schemas.events import EventFields
from trainer.streams.event_columns import RawEvents, RawEventsBuilder
from trainer.streams.kafka_log import KafkaLog

log = logging.getLogger(__name__)

#: how long start-up (imports, metadata) may take before the parent gives up.
START_TIMEOUT_S = 60.0
#: how long the broker may take to answer a metadata or offsets request.
METADATA_TIMEOUT_S = 10.0
#: the default `--max-batch-wait-ms`, in seconds.
MAX_BATCH_WAIT_S = 1.0
#: how often a reader asks the broker whether partitions were added to its topic.
PARTITION_CHECK_S = 5.0
#: librdkafka's codes for a topic the broker does not know (KafkaError.UNKNOWN_TOPIC_OR_PART,
#: KafkaError._UNKNOWN_TOPIC).
_UNKNOWN_TOPIC = (3, -188)


class EventStreamError(BadDataError):
    """The event source cannot be read as configured (no such topic or partition, offsets
    the topic no longer holds); the message says what to change."""


class EventStreamUnavailableError(UnavailableError):
    """The broker could not be reached, or the reader process died."""


@dataclass(frozen=True)
class EventSource:
    """What `--data kafka://HOST:PORT/TOPIC[?partitions=0,1]` names."""

    bootstrap: tuple[str, ...]
    topic: str
    #: the partitions to read; None: every partition of the topic.
    partitions: tuple[int, ...] | None = None

    @property
    def servers(self) -> str:
        return ",".join(self.bootstrap)

    @classmethod
    def parse(cls, url: str) -> EventSource:
        """Parse the URL (an empty host list takes CHECKNRUN_KAFKA_BOOTSTRAP, as --bus does);
        EventStreamError names what is wrong."""
        base, _, query = url.partition("?")
        try:
            address = parse_kafka_url(base)
        except BusError as exc:
            raise EventStreamError(str(exc)) from exc
        options = dict(parse_qsl(query, keep_blank_values=True))
        unknown = set(options) - {"partitions"}
        if unknown:
            raise EventStreamError(f"{url!r}: unknown options {sorted(unknown)} (partitions=0,1)")
        partitions = None
        if "partitions" in options:
            try:
                partitions = tuple(sorted({int(p) for p in options["partitions"].split(",")}))
            except ValueError as exc:
                raise EventStreamError(
                    f"{url!r}: partitions must be a list of partition numbers like 0,1"
                ) from exc
            if not partitions or partitions[0] < 0:
                raise EventStreamError(f"{url!r}: partitions must be numbers >= 0")
        return cls(address.bootstrap, address.topic, partitions)


@dataclass(frozen=True)
class ReaderConfig:
    """What the reader process needs."""

    source: EventSource
    fields: EventFields
    batch_size: int
    #: partition -> offset of the next record to read (a resume); others start at the beginning.
    starts: dict[int, int] = field(default_factory=dict)
    #: a batch is handed over full, or once its first record waited this long (a quiet
    #: stream), so the same events make the same batches at any arrival rate faster than
    #: `batch_size` per wait (`--max-batch-wait-ms`).
    max_batch_wait_s: float = MAX_BATCH_WAIT_S
    client_id: str = "checknrun-trainer"


class KafkaReader:
    """The parent's handle on the reader process."""

    def __init__(self, config: ReaderConfig) -> None:
        self.config = config
        self._process, self._conn = start_child("trainer.streams.kafka_reader")
        try:
            self._conn.send(config)
            if not self._conn.poll(START_TIMEOUT_S):
                raise EventStreamUnavailableError(
                    f"the Kafka reader did not start within {START_TIMEOUT_S:.0f} s"
                )
            reply = self._recv()
            if reply[0] == "error":
                raise reply[1]
        except BaseException:
            self.close()
            raise
        #: partition -> first offset read, and the partition's end when reading started.
        self.starts: dict[int, int] = reply[1]
        self.ends_at_start: dict[int, int] = reply[2]

    def next(self, timeout_s: float) -> RawEvents | None:
        """The next batch, or None if none arrived within `timeout_s`."""
        if not self._conn.poll(timeout_s):
            return None
        reply = self._recv()
        if reply[0] == "error":
            raise reply[1]
        batch: RawEvents = reply[1]
        return batch

    def close(self) -> None:
        """Stop the reader process."""
        self._conn.close()
        # Nothing in the child needs an orderly end (no group to leave, nothing committed),
        # and closing its consumer takes ~0.7 s here: it is killed.
        self._process.kill()
        self._process.wait(timeout=10)

    def _recv(self) -> tuple[Any, ...]:
        return receive(self._conn, self._process, EventStreamUnavailableError, "Kafka reader")


# --- the child -------------------------------------------------------------------------------


def topic_partitions(source: EventSource) -> tuple[int, ...]:
    """The partitions `source` reads, sorted: those the URL names, else every partition of the
    topic (asked of the broker, from this process). EventStreamError for a missing topic or
    partition, EventStreamUnavailableError when the broker cannot be reached."""
    from confluent_kafka import Consumer

    kafka_log = KafkaLog(log)
    consumer = Consumer(
        confluent_config(
            {
                "bootstrap.servers": source.servers,
                "group.id": "checknrun-trainer",  # required by librdkafka; never joined
                "allow.auto.create.topics": False,
                "socket.connection.setup.timeout.ms": int(METADATA_TIMEOUT_S * 1000),
                "logger": kafka_log,
                "error_cb": kafka_log.error,
            }
        )
    )
    try:
        return tuple(_partitions(consumer, source))
    finally:
        consumer.close()


def topic_id(source: EventSource) -> str | None:
    """The topic's id (KIP-516: a topic deleted and created again under its name gets a new
    one), asked of the broker from this process; None when the broker does not say (then a
    recreated topic is noticed only by its offsets). EventStreamError for a missing topic."""
    from confluent_kafka import KafkaException, TopicCollection
    from confluent_kafka.admin import AdminClient

    kafka_log = KafkaLog(log)
    config: dict[str, Any] = {
        "bootstrap.servers": source.servers,
        "socket.connection.setup.timeout.ms": int(METADATA_TIMEOUT_S * 1000),
        "logger": kafka_log,
        "error_cb": kafka_log.error,
    }
    admin = AdminClient(confluent_config(config))
    try:
        futures = admin.describe_topics(
            TopicCollection([source.topic]), request_timeout=METADATA_TIMEOUT_S
        )
        described = futures[source.topic].result(timeout=METADATA_TIMEOUT_S)
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if getattr(error, "code", lambda: None)() in _UNKNOWN_TOPIC:
            raise EventStreamError(
                f"topic {source.topic!r} does not exist on {source.servers}"
            ) from None
        log.warning("the id of topic %r is unknown (%s): not checked", source.topic, exc)
        return None
    except Exception as exc:  # a broker or client without KIP-516 descriptions
        log.warning("the id of topic %r is unknown (%s): not checked", source.topic, exc)
        return None
    found = getattr(described, "topic_id", None)
    return None if found is None else str(found)


def _partitions(consumer: Any, source: EventSource) -> list[int]:
    """The partitions of `source` that exist, sorted (see `topic_partitions`)."""
    from confluent_kafka import KafkaException

    try:
        metadata = consumer.list_topics(source.topic, timeout=METADATA_TIMEOUT_S)
    except KafkaException as exc:
        raise EventStreamUnavailableError(f"cannot reach Kafka at {source.servers}: {exc}") from exc
    topic = metadata.topics.get(source.topic)
    if topic is None or topic.error is not None or not topic.partitions:
        raise EventStreamError(
            f"topic {source.topic!r} does not exist on {source.servers}"
            + (f" ({topic.error})" if topic is not None and topic.error is not None else "")
        )
    existing = sorted(topic.partitions)
    wanted = list(source.partitions) if source.partitions is not None else existing
    missing = sorted(set(wanted) - set(existing))
    if missing:
        raise EventStreamError(f"topic {source.topic!r} has partitions {existing}, not {missing}")
    return wanted


def _open_consumer(
    config: ReaderConfig, kafka_log: KafkaLog
) -> tuple[Any, dict[int, int], dict[int, int]]:
    """A consumer assigned to the partitions to read at their start offsets, its librdkafka
    lines to `kafka_log`; with the start and end offset of each."""
    from confluent_kafka import Consumer, TopicPartition

    source = config.source
    consumer = Consumer(
        confluent_config(
            {
                "bootstrap.servers": source.servers,
                "group.id": config.client_id,  # required by librdkafka; never joined (assign)
                "client.id": config.client_id,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "error",  # a position the topic no longer holds is an error
                "enable.partition.eof": False,
                "fetch.max.bytes": 64 << 20,
                "max.partition.fetch.bytes": 8 << 20,
                "queued.min.messages": 200_000,
                "allow.auto.create.topics": False,
                "socket.connection.setup.timeout.ms": int(METADATA_TIMEOUT_S * 1000),
                "logger": kafka_log,
                "error_cb": kafka_log.error,
            }
        )
    )
    try:
        wanted = _partitions(consumer, source)
        starts: dict[int, int] = {}
        ends: dict[int, int] = {}
        for p in wanted:
            low, high = consumer.get_watermark_offsets(
                TopicPartition(source.topic, p), timeout=METADATA_TIMEOUT_S
            )
            start = config.starts.get(p, low)
            if not low <= start <= high:
                raise EventStreamError(
                    f"partition {p} of {source.topic!r} holds offsets {low}..{high}, but reading "
                    f"is to continue at {start}: "
                    + (
                        "the records before it were deleted (retention), so they cannot be "
                        "trained exactly once"
                        if start < low
                        else "the topic was recreated or truncated since that checkpoint"
                    )
                )
            starts[p], ends[p] = start, high
        consumer.assign([TopicPartition(source.topic, p, starts[p]) for p in wanted])
    except BaseException:
        consumer.close()
        raise
    return consumer, starts, ends


def _serve(conn: Connection) -> None:
    """The child's loop: parse what the consumer returns into batches and send them."""
    # The parent decides when to stop (it checkpoints first): Ctrl-C reaches the whole
    # process group, so the child ignores it and waits for the parent to end it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    config: ReaderConfig = conn.recv()
    kafka_log = KafkaLog(log)
    try:
        consumer, starts, ends = _open_consumer(config, kafka_log)
    except BaseException as exc:  # handed to the parent
        conn.send(("error", _picklable(exc)))
        return
    try:
        conn.send(("ready", starts, ends))
        _pump(conn, consumer, config, parent, kafka_log)
    except (BrokenPipeError, ConnectionError, EOFError):
        pass  # the parent is gone
    except BaseException as exc:  # handed to the parent
        with contextlib.suppress(BrokenPipeError, ConnectionError, OSError):
            conn.send(("error", _picklable(exc)))
    finally:
        consumer.close()


def _pump(
    conn: Connection, consumer: Any, config: ReaderConfig, parent: int, kafka_log: KafkaLog
) -> None:
    from confluent_kafka import KafkaError, Message, TopicPartition

    builder = RawEventsBuilder(config.fields)
    topic = config.source.topic
    partitions = [tp.partition for tp in consumer.assignment()]
    size = config.batch_size
    first_at = 0.0

    def send() -> None:
        highwater = {}
        for p in partitions:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)
            if high >= 0:
                highwater[p] = high
        conn.send(("batch", builder.take(highwater)))

    unread: set[int] = set()  # partitions added that this reader was not told to read
    check_at = time.monotonic() + PARTITION_CHECK_S
    while True:
        if time.monotonic() >= check_at:
            _watch_partitions(consumer, config, partitions, builder, unread)
            check_at = time.monotonic() + PARTITION_CHECK_S
        if conn.poll():  # nothing is sent after the config: the parent closed its end
            return
        if os.getppid() != parent:  # the trainer died (SIGKILL): nothing will read this
            return
        wait = 0.2
        if builder.records:
            wait = max(0.0, min(wait, first_at + config.max_batch_wait_s - time.monotonic()))
        want = size - builder.n
        messages = consumer.consume(num_messages=want, timeout=wait)
        if messages and not builder.records:
            first_at = time.monotonic()
        errors = list(map(Message.error, messages))
        # `is not None`: a KafkaError compared with None (`==`, list.count) raises SystemError.
        if any(error is not None for error in errors):  # rare: keep the records, say the errors
            for error in errors:
                if error is None:
                    continue
                if error.fatal():
                    raise EventStreamUnavailableError(f"Kafka consumer failed: {error}")
                if error.code() == KafkaError._AUTO_OFFSET_RESET:
                    raise EventStreamError(f"reading {topic!r}: {error}")
                kafka_log.warning("Kafka: %s", error)
            messages = [m for m, error in zip(messages, errors, strict=True) if error is None]
        if messages:
            # Whole columns at once (RawEventsBuilder.add_records), each taken from the
            # messages at C speed.
            builder.add_records(
                list(map(Message.value, messages)),
                cast("list[int]", list(map(Message.partition, messages))),  # set on a record
                cast("list[int]", list(map(Message.offset, messages))),
            )
        kafka_log.tick()
        # At most `want` records came, so the batch is full only now; a partial one goes once
        # its first record waited `max_batch_wait_s` (not when the topic is drained for now,
        # which would make the batches follow the arrival rate).
        if builder.n >= size or (
            builder.records and time.monotonic() - first_at >= config.max_batch_wait_s
        ):
            send()


def _watch_partitions(
    consumer: Any,
    config: ReaderConfig,
    partitions: list[int],
    builder: RawEventsBuilder,
    unread: set[int],
) -> None:
    """Pick up partitions added to the topic while reading it (from their start, so each of
    their records is trained once), when the reader reads every partition; a reader of some
    (named in the URL, or one rank's share of a job) says loudly which it leaves unread."""
    from confluent_kafka import KafkaException, TopicPartition

    topic = config.source.topic
    try:
        metadata = consumer.list_topics(topic, timeout=METADATA_TIMEOUT_S)
    except KafkaException:
        return  # the broker is away: the consume loop says so
    found = metadata.topics.get(topic)
    if found is None or found.error is not None:
        return
    added = sorted(set(found.partitions) - set(partitions))
    if config.source.partitions is not None:
        for p in added:
            if p not in unread:
                log.warning(
                    "partition %d was added to %r while reading; this reader reads partitions "
                    "%s only, so its events are not trained: restart to read it",
                    p,
                    topic,
                    sorted(partitions),
                )
                unread.add(p)
        return
    for p in added:
        low, _ = consumer.get_watermark_offsets(
            TopicPartition(topic, p), timeout=METADATA_TIMEOUT_S
        )
        consumer.incremental_assign([TopicPartition(topic, p, low)])
        builder.start_partition(p, low)
        partitions.append(p)
        log.warning(
            "partition %d was added to %r while reading: reading it from its start", p, topic
        )


def _picklable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a stand-in of its branch."""
    import pickle

    try:
        again = pickle.loads(pickle.dumps(exc))
        if type(again) is type(exc) and str(again) == str(exc):
            return exc
    except Exception:  # any failure means: send a stand-in instead
        pass
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, BadDataError):
        return EventStreamError(text)
    if isinstance(exc, UnavailableError):
        return EventStreamUnavailableError(text)
    return RuntimeError(text)


if __name__ == "__main__":
    # Run the module's own copy (not __main__'s), so that the exceptions sent to the parent
    # pickle as trainer.streams.kafka_reader.* and unpickle there.
    from trainer.streams import kafka_reader

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    kafka_reader._serve(parent_connection())
