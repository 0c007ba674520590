"""The Kafka bus (`kafka://HOST:PORT/TOPIC`) over kafka-python.

One topic carries the announcements of every model. The message key is the model name, so the
default partitioner keeps one model's versions in one partition, in commit order; the value is
the announcement's JSON (docs/FORMAT.md section 6).

Both ends run with a broker that is down, restarting or unreachable:

- `KafkaAnnouncer.announce` only queues the announcement and returns; a background thread
  delivers it (acks=all, idempotent producer where the broker supports it). While Kafka is down
  the queue collapses to the newest announcement, retried with capped exponential backoff:
  subscribers that miss the older ones see the gap and reconcile from the store, so training
  never waits for the bus and memory stays bounded.
- `KafkaAnnouncementSource.poll` returns [] while the broker is unreachable and reconnects on a
  later call; it never raises.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, cast

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import AuthorizationError, PolicyViolationError, TopicAlreadyExistsError

from publisher.bus.base import AnnouncementSource, Announcer, KafkaAddress, StartAt
from publisher.bus.kafka_auth import kafka_python_config
from schemas.announcement import Announcement

log = logging.getLogger(__name__)


def _reachable(bootstrap: tuple[str, ...], timeout_s: float) -> bool:
    """True if a TCP connection to one bootstrap server opens.

    kafka-python clients start an IO thread before bootstrapping and leak it when bootstrapping
    fails, so the clients are built only once a broker answers at all.
    """
    per_host = max(0.05, timeout_s / max(1, len(bootstrap)))
    for server in bootstrap:
        host, _, port = server.rpartition(":")
        if not host:
            host, port = server, "9092"
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=per_host):
                return True
        except (OSError, ValueError):
            continue
    return False


def _no_auto_create(client: Any) -> Any:
    """Stop `client`'s metadata requests from creating topics; returns the client.

    kafka-python 3.0 builds the cluster metadata without passing `allow_auto_create_topics` on,
    so every client asks the broker to auto-create the topics it looks up, whatever its config
    says. On a broker with auto.create.topics.enable, a consumer would then recreate a deleted
    topic at once with the broker's default partition count. The flag lives in the metadata
    object's config (`producer._metadata`, `consumer._cluster`); absent attributes are skipped.
    """
    for attr in ("_metadata", "_cluster"):
        config = getattr(getattr(client, attr, None), "config", None)
        if isinstance(config, dict):
            config["allow_auto_create_topics"] = False
    return client


def _topic_id(consumer: Any, topic: str) -> object | None:
    """The topic's id (KIP-516) as the consumer's metadata knows it, or None if unknown.

    Offsets mean nothing across a delete + recreate, and only the id tells the two topics apart
    (kafka-python reads it from Metadata v10+, Kafka 2.8+, but does not expose it publicly).
    """
    lookup = getattr(getattr(consumer, "_cluster", None), "topic_id", None)
    if not callable(lookup):
        return None
    try:
        return cast(object | None, lookup(topic))
    except Exception:  # a private API: if it changes shape, recreation detection is just off
        return None


class _Backoff:
    """Capped exponential delays: 1x, 2x, 4x ... `initial_s`, at most `max_s`."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self.delay_s = initial_s

    def next(self) -> float:
        delay, self.delay_s = self.delay_s, min(self.max_s, self.delay_s * 2)
        return delay

    def reset(self) -> None:
        self.delay_s = self.initial_s


class KafkaAnnouncer(Announcer):
    """Announces one model's versions on a Kafka topic, from a background thread.

    `announce` appends to a bounded in-order queue and returns at once. The sender thread sends
    the oldest queued announcement and waits for its acknowledgement, so while Kafka is healthy
    every version is delivered, in order. When a delivery fails, the queue keeps only its newest
    announcement (the older ones are stale: a subscriber that misses them reconciles from the
    store), the producer is dropped, and the newest is retried after a backoff.
    """

    def __init__(
        self,
        address: KafkaAddress,
        model: str,
        *,
        max_pending: int = 64,
        connect_timeout_s: float = 5.0,
        delivery_timeout_s: float = 10.0,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
    ) -> None:
        self.address = address
        self.model = model
        self.connect_timeout_s = connect_timeout_s
        self.delivery_timeout_s = delivery_timeout_s
        self.delivered = 0
        self.skipped = 0  # older announcements dropped while the bus was down
        self.failures = 0
        self.last_delivered: int | None = None
        self._pending: deque[Announcement] = deque()
        self._max_pending = max(1, max_pending)
        self._cond = threading.Condition()
        self._inflight = False
        self._stop = False
        self._close_deadline = float("inf")
        self._backoff = _Backoff(initial_backoff_s, max_backoff_s)
        self._producer: Any = None
        self._idempotent = True
        self._topic_ready = not address.create_topic
        self._failing = False  # log the first failure of an outage loudly, the retries quietly
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"kafka-announcer-{model}"
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"KafkaAnnouncer({self.model!r}, {self.address.servers}/{self.address.topic})"

    def announce(self, announcement: Announcement) -> None:
        self._check_model(announcement)
        announcement.to_json()  # an oversized announcement fails here, in the caller
        with self._cond:
            if self._stop:
                log.warning(
                    "announcer of %s is closed; version %d not announced",
                    self.model,
                    announcement.version,
                )
                return
            self._pending.append(announcement)
            while len(self._pending) > self._max_pending:
                self._pending.popleft()
                self.skipped += 1
            self._cond.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    @property
    def pending(self) -> int:
        """Announcements queued and not yet acknowledged."""
        with self._cond:
            return len(self._pending)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._close_deadline = time.monotonic() + timeout_s
            self._cond.notify_all()
        self._thread.join(timeout_s + self.delivery_timeout_s + 1.0)
        with self._cond:
            if self._pending:
                log.warning(
                    "closing the announcer of %s with %d announcement(s) unsent (newest: version "
                    "%d); subscribers will find them in the store",
                    self.model,
                    len(self._pending),
                    self._pending[-1].version,
                )

    # --- sender thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._stop:
                        self._cond.wait()
                    if not self._pending or time.monotonic() >= self._close_deadline:
                        return
                    item = self._pending[0]
                    self._inflight = True
                ok = self._deliver(item)
                with self._cond:
                    self._inflight = False
                    if ok:
                        if self._pending and self._pending[0] is item:
                            self._pending.popleft()
                        self.delivered += 1
                        self.last_delivered = item.version
                        self._backoff.reset()
                        self._cond.notify_all()
                        continue
                    self.failures += 1
                    while len(self._pending) > 1:  # the bus is down: only the newest matters
                        self._pending.popleft()
                        self.skipped += 1
                    self._cond.notify_all()
                    wake = time.monotonic() + self._backoff.next()
                    while not self._stop and time.monotonic() < wake:
                        self._cond.wait(wake - time.monotonic())
                    if self._stop:  # closing: one more attempt at most, within the deadline
                        wake = min(wake, self._close_deadline)
                        while time.monotonic() < wake:
                            self._cond.wait(wake - time.monotonic())
        finally:
            self._drop_producer()

    def _deliver(self, item: Announcement) -> bool:
        try:
            if self._producer is None:
                self._producer = self._connect()
                if self._producer is None:
                    raise ConnectionError(f"no broker answers at {self.address.servers}")
            if not self._topic_ready:
                self._ensure_topic()
            future = self._producer.send(
                self.address.topic, key=self.model.encode(), value=item.to_json()
            )
            future.get(timeout=self.delivery_timeout_s)
        except Exception as exc:  # any failure means "retry later", never a dead thread
            self._on_failure(item, exc)
            return False
        if self._failing:
            log.info("announcements of %s reach Kafka again (version %d)", self.model, item.version)
            self._failing = False
        return True

    def _on_failure(self, item: Announcement, exc: BaseException) -> None:
        level = logging.DEBUG if self._failing else logging.WARNING
        log.log(
            level,
            "cannot announce version %d of %s on %s/%s: %s; retrying in the background",
            item.version,
            self.model,
            self.address.servers,
            self.address.topic,
            exc,
        )
        self._failing = True
        name = type(exc).__name__
        if self._idempotent and name in (
            "ClusterAuthorizationFailedError",
            "UnsupportedVersionError",
            "IncompatibleBrokerVersion",
        ):
            log.warning("the broker refuses idempotent producers (%s); producing without it", name)
            self._idempotent = False
        # The producer may hold the failed record and send it later; a fresh producer keeps the
        # retry the only copy. The topic may have been deleted: check it again too.
        self._drop_producer()
        self._topic_ready = not self.address.create_topic

    def _connect(self) -> Any:
        if not _reachable(self.address.bootstrap, self.connect_timeout_s):
            return None
        timeout_ms = int(self.connect_timeout_s * 1000)
        config: dict[str, Any] = {
            "bootstrap_servers": list(self.address.bootstrap),
            "client_id": f"checknrun-announcer-{self.model}",
            "acks": "all",
            "retries": 5,
            "linger_ms": 0,
            "max_block_ms": timeout_ms,
            "request_timeout_ms": timeout_ms,
            "delivery_timeout_ms": int(self.delivery_timeout_s * 1000),
            "bootstrap_timeout_ms": timeout_ms,
            "reconnect_backoff_max_ms": 2000,
            # A deleted topic is recreated by _ensure_topic with the configured partitions, never
            # implicitly by the broker with its defaults.
            "allow_auto_create_topics": False,
        }
        if not self._idempotent:
            config["enable_idempotence"] = False
        return _no_auto_create(KafkaProducer(**kafka_python_config(config)))

    def _ensure_topic(self) -> None:
        timeout_ms = int(self.connect_timeout_s * 1000)
        admin = KafkaAdminClient(
            **kafka_python_config(
                {
                    "bootstrap_servers": list(self.address.bootstrap),
                    "client_id": f"checknrun-admin-{self.model}",
                    "request_timeout_ms": timeout_ms,
                    "bootstrap_timeout_ms": timeout_ms,
                }
            )
        )
        try:
            admin.create_topics(
                {
                    self.address.topic: {
                        "num_partitions": self.address.partitions,
                        "replication_factor": self.address.replication_factor,
                    }
                },
                timeout_ms=timeout_ms,
            )
            log.info(
                "created topic %s with %d partition(s)", self.address.topic, self.address.partitions
            )
        except TopicAlreadyExistsError:
            pass
        except (AuthorizationError, PolicyViolationError) as exc:
            # Not allowed to create topics here: an operator manages them, so send anyway; if
            # the topic is missing, delivery fails and says so.
            log.warning("cannot create topic %s (%s); assuming it exists", self.address.topic, exc)
        finally:
            admin.close()
        self._topic_ready = True

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.close(timeout=1.0)
            except Exception as exc:  # closing a broken client must not raise
                log.debug("closing the Kafka producer: %s", exc)


class KafkaAnnouncementSource(AnnouncementSource):
    """Every announcement on the topic, for one server instance.

    Partitions are assigned manually (every partition of the topic, no consumer group, nothing
    committed) instead of subscribing with a group: the servers are replicas that each need every
    announcement, not workers sharing a stream, and a group would hand each message to one member
    only, rebalance whenever a server comes or goes, and keep offsets nobody needs. Nothing is
    lost by starting at the end of the log either: announcements are hints and the store is the
    source of truth, so a server that starts (or restarts) reads HEAD and reconciles from there,
    and from then on only new announcements matter.

    The partition set is re-read every `metadata_refresh_s`: new partitions are read from their
    start; a deleted topic drops the assignment, and when it is recreated every partition is read
    from its start (all of it is new). A topic deleted and recreated between two refreshes is
    recognised by its changed topic id and read from its start as well (a position out of range
    would also be reset to the earliest offset). Messages may repeat after such a reseek; the
    follower ignores versions it has. While the broker is unreachable, `poll` returns [] and
    reconnects with backoff on later calls.
    """

    def __init__(
        self,
        address: KafkaAddress,
        *,
        start: StartAt | Mapping[int, int] = "latest",
        metadata_refresh_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        max_records: int = 500,
    ) -> None:
        self.address = address
        self.start = start
        self.metadata_refresh_s = metadata_refresh_s
        self.connect_timeout_s = connect_timeout_s
        self.max_records = max_records
        self.reconnects = 0
        self.reassignments = 0
        self._consumer: Any = None
        self._assigned: frozenset[int] = frozenset()
        self._positions: dict[int, int] = dict(start) if isinstance(start, Mapping) else {}
        self._first_assignment = True
        self._topic_id: object | None = None
        self._next_connect = 0.0
        self._next_refresh = 0.0
        self._backoff = _Backoff(initial_backoff_s, max_backoff_s)
        self._failing = False

    def __repr__(self) -> str:
        hosts = self.address.servers
        return f"KafkaAnnouncementSource({hosts}/{self.address.topic})"

    @property
    def positions(self) -> dict[int, int]:
        """The next offset to read per partition (pass as `start` to resume here)."""
        return dict(self._positions)

    def start_reading(self, timeout_s: float = 5.0) -> bool:
        """Connect and resolve the start offsets (`latest`: the current end of each partition)."""
        self._next_refresh = 0.0  # resolve the assignment now, not at the next refresh
        try:
            return self._connect_and_assign(time.monotonic() + max(0.0, timeout_s))
        except Exception as exc:  # a source never raises (module docstring)
            self._on_failure(exc)
            return False

    def poll(self, timeout_s: float) -> list[bytes]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            if not self._connect_and_assign(deadline):
                return []
            if not self._assigned:
                # The topic does not exist (yet): nothing to read, and no reason to spin.
                self._sleep_until(min(deadline, self._next_refresh))
                return []
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            batches = self._consumer.poll(timeout_ms=remaining_ms, max_records=self.max_records)
            messages: list[bytes] = []
            for tp in sorted(batches, key=lambda tp: tp.partition):
                for record in batches[tp]:
                    messages.append(record.value if record.value is not None else b"")
                    self._positions[tp.partition] = record.offset + 1
            # After the batch: a reseek to the start must win over the batch's positions.
            self._check_topic_id()
        except Exception as exc:  # a source never raises (module docstring)
            self._on_failure(exc)
            return []
        if self._failing:
            log.info("announcement source %r is reading again", self)
            self._failing = False
        self._backoff.reset()
        return messages

    def _connect_and_assign(self, deadline: float) -> bool:
        """Connect if needed and re-read the partition set when a refresh is due; False while
        the broker cannot be reached (raises on a failure after connecting)."""
        if self._consumer is None and not self._reconnect(deadline):
            return False
        now = time.monotonic()
        if now >= self._next_refresh:
            self._refresh_assignment()
            self._next_refresh = now + self.metadata_refresh_s
        return True

    def _reconnect(self, deadline: float) -> bool:
        now = time.monotonic()
        if now < self._next_connect:
            self._sleep_until(min(deadline, self._next_connect))
            if time.monotonic() < self._next_connect:
                return False
        budget = min(self.connect_timeout_s, max(0.2, deadline - time.monotonic()))
        if not _reachable(self.address.bootstrap, budget):
            raise ConnectionError(f"no broker answers at {self.address.servers}")
        timeout_ms = max(200, int(budget * 1000))
        self._consumer = _no_auto_create(
            KafkaConsumer(
                **kafka_python_config(
                    {
                        "bootstrap_servers": list(self.address.bootstrap),
                        "client_id": "checknrun-follower",
                        "group_id": None,  # manual assignment, see the class docstring
                        "enable_auto_commit": False,
                        # Only used when a position is out of range, i.e. the topic was recreated
                        # or truncated: everything in it is then newer than this source has read.
                        "auto_offset_reset": "earliest",
                        "allow_auto_create_topics": False,
                        "bootstrap_timeout_ms": timeout_ms,
                        "request_timeout_ms": max(timeout_ms, 5000),
                        "fetch_max_wait_ms": 200,
                        # kafka-python sleeps this long when it has no fetch in flight; the
                        # default 100 ms showed up as the p99 of announcement latency.
                        "retry_backoff_ms": 20,
                        "reconnect_backoff_max_ms": 2000,
                        "max_partition_fetch_bytes": 1024 * 1024,
                    }
                )
            )
        )
        self.reconnects += 1
        self._assigned = frozenset()
        self._next_refresh = 0.0
        return True

    def _check_topic_id(self) -> None:
        """Read a recreated topic from its start: none of it was seen under the old id.

        The consumer's own reaction to a recreated topic is to treat it as a truncated log and
        seek to the "first diverging offset", which can skip the new topic's first messages.
        """
        topic_id = _topic_id(self._consumer, self.address.topic)
        if topic_id is None:
            return
        if self._topic_id is not None and topic_id != self._topic_id:
            log.warning("topic %s was recreated; reading it from its start", self.address.topic)
            if not self._assigned:
                # Recreated while this source had no consumer (an outage): the kept offsets
                # belong to the old topic. Forget them; the next assignment reads the start.
                self._positions.clear()
                self._first_assignment = False
            else:
                tps = [TopicPartition(self.address.topic, p) for p in sorted(self._assigned)]
                starts = self._consumer.beginning_offsets(
                    tps, timeout_ms=int(self.connect_timeout_s * 1000)
                )
                for tp in tps:
                    self._positions[tp.partition] = int(starts.get(tp, 0))
                    self._consumer.seek(tp, self._positions[tp.partition])
            self.reassignments += 1
        self._topic_id = topic_id

    def _refresh_assignment(self) -> None:
        topic = self.address.topic
        consumer = self._consumer
        topics = consumer.topics()  # a fresh metadata request: notices deleted topics
        self._check_topic_id()
        partitions = (
            frozenset(consumer.partitions_for_topic(topic) or ())
            if topic in topics
            else frozenset()
        )
        if partitions == self._assigned:
            return
        if not partitions:
            if self._assigned:
                log.warning("topic %s disappeared; waiting for it to come back", topic)
            consumer.assign([])
            self._assigned = frozenset()
            self._positions.clear()  # offsets of a deleted topic mean nothing in its successor
            self._first_assignment = False
            self._topic_id = None
            return
        new = [TopicPartition(topic, p) for p in sorted(partitions - self._positions.keys())]
        if new:
            timeout_ms = int(self.connect_timeout_s * 1000)
            if self._first_assignment and self.start == "latest":
                starts = consumer.end_offsets(new, timeout_ms=timeout_ms)
            else:
                # Partitions that appear later (added, or a recreated topic) hold only new data.
                starts = consumer.beginning_offsets(new, timeout_ms=timeout_ms)
            for tp, offset in starts.items():
                self._positions[tp.partition] = int(offset)
        for gone in set(self._positions) - partitions:
            del self._positions[gone]
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, self._positions[tp.partition])
        self._assigned = partitions
        self._first_assignment = False
        self.reassignments += 1
        log.info("reading %s partitions %s from %s", topic, sorted(partitions), self._positions)

    def _on_failure(self, exc: BaseException) -> None:
        level = logging.DEBUG if self._failing else logging.WARNING
        log.log(level, "announcement source %r: %s; reconnecting in the background", self, exc)
        self._failing = True
        self._drop_consumer()
        self._next_connect = time.monotonic() + self._backoff.next()

    def _sleep_until(self, when: float) -> None:
        delay = when - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _drop_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        self._assigned = frozenset()
        if consumer is not None:
            try:
                consumer.close(timeout_ms=1000)
            except Exception as exc:  # closing a broken client must not raise
                log.debug("closing the Kafka consumer: %s", exc)

    def close(self) -> None:
        self._drop_consumer()
