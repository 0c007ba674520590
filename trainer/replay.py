"""`checknrun replay`: any training source as a live event stream on a Kafka topic.

    checknrun replay --data movielens --to kafka://localhost:9092/events?partitions=3 \\
        --speedup 100000

Every sample becomes one event (docs/FORMAT.md section 8.1) in time order: its raw ids as the
source names them (MovieLens user ids, movie titles, genres; a file's values; the synthetic
stream's integer ids), a file's `--dense-cols` as numeric fields of the same names (left out
where missing: docs/FORMAT.md 8.4), its label, and its time (`ts`: the source's timestamp; the
synthetic stream has none and gets one event per millisecond from SYNTHETIC_EPOCH). The record
key is the user id (the `user` feature, else the first), so one user's events share a partition
and stay in order; keys are placed by the murmur2 partitioner the Java client uses, as the
announcement bus does (section 6). `--rate N` sends at most N events a second, `--speedup X`
paces them X times faster than their event times; by default they go as fast as the broker
takes them. `?partitions=N` in the URL is how many partitions a topic it creates gets.

Its options are trainer/replay_options.py's; the `checknrun.commands` entry point
`replay = "trainer.replay_command:register"` registers them without importing this module.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from publisher.bus import confluent_config
from publisher.bus.base import BusError, KafkaAddress, parse_kafka_url
from publisher.cli import CommandError, CommandParser, parse_command_line, run_command
from schemas.errors import UnavailableError
from schemas.events import encode_event
from trainer.progress import PROGRESS_EVERY_S
from trainer.replay_options import add_replay_parser
from trainer.signals import stop_on_signals
from trainer.sources import open_stream
from trainer.streams.base import ColumnarStream, InteractionStream

#: event time of the first synthetic event (2023-11-14), which then advance 1 ms each.
SYNTHETIC_EPOCH = 1_700_000_000.0
SYNTHETIC_STEP_S = 0.001
CHUNK = 4096
DELIVERY_TIMEOUT_S = 60.0


class ReplayError(UnavailableError):
    """Events that the broker did not take."""


@dataclass
class EventChunk:
    """A run of consecutive samples as events: record keys and values."""

    keys: list[bytes]
    values: list[bytes]
    ts: np.ndarray


def event_chunks(
    stream: InteractionStream, start: int, stop: int | None, chunk: int = CHUNK
) -> Iterator[EventChunk]:
    """The samples [start, stop) of `stream` as events, `chunk` at a time."""
    names = [f.name for f in stream.features]
    key_feature = "user" if "user" in names else names[0]
    if isinstance(stream, ColumnarStream):
        end = stream.num_samples if stop is None else min(stop, stream.num_samples)
        for lo in range(start, end, chunk):
            hi = min(lo + chunk, end)
            ids = {name: stream.column(name).raw(lo, hi) for name in names}
            ts = stream.timestamps[lo:hi] if stream.timestamps is not None else _clock(lo, hi)
            numbers = {name: column[lo:hi] for name, column in stream.numbers.items()}
            yield _chunk(ids, ts, stream.labels[lo:hi], key_feature, numbers)
        return
    for batch in stream.batches(chunk, start=start, stop=stop):
        lo, hi = batch.offset, batch.end
        ids = {}
        for name in names:
            values = batch.sparse[name].values.numpy().tolist()
            bounds = [*batch.sparse[name].offsets.numpy().tolist(), len(values)]
            bag = any(f.bag for f in stream.features if f.name == name)
            split = [values[a:b] for a, b in itertools.pairwise(bounds)]
            ids[name] = split if bag else [v[0] if v else None for v in split]
        yield _chunk(ids, _clock(lo, hi), batch.labels.numpy(), key_feature)


def _clock(lo: int, hi: int) -> np.ndarray:
    return SYNTHETIC_EPOCH + np.arange(lo, hi, dtype=np.float64) * SYNTHETIC_STEP_S


def _chunk(
    ids: dict[str, list[Any]],
    ts: np.ndarray,
    labels: np.ndarray,
    key: str,
    numbers: dict[str, np.ndarray] | None = None,
) -> EventChunk:
    """Events of a run of samples; `numbers`: their dense fields (NaN: left out, missing)."""
    n = len(ts)
    times = ts.tolist()
    label_list = labels.tolist()
    fields = {name: column.tolist() for name, column in (numbers or {}).items()}
    values = []
    for i in range(n):
        values.append(
            encode_event(
                ts=times[i],
                label=label_list[i],
                ids={name: _raw_id(column[i]) for name, column in ids.items()},
                extra={name: v[i] for name, v in fields.items() if v[i] == v[i]},  # not NaN
            )
        )
    keys = [str(_raw_id(v) or "").encode() for v in ids[key]]
    return EventChunk(keys, values, ts)


def _raw_id(value: Any) -> Any:
    """A source value as an event id: str and int as they are, a whole float as an int, other
    values as text, a bag as a list of ids (None: missing)."""
    if (
        value is None
        or isinstance(value, str)
        or (isinstance(value, int) and not isinstance(value, bool))
    ):
        return value
    if isinstance(value, list):
        return [_raw_id(v) for v in value if v is not None]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return str(value)


class _Producer:
    """A confluent-kafka producer that counts deliveries and failures."""

    def __init__(self, address: KafkaAddress) -> None:
        from confluent_kafka import Producer

        self.address = address
        self.delivered = 0
        self.failed = 0
        self.first_error: str | None = None
        self._producer = Producer(
            confluent_config(
                {
                    "bootstrap.servers": address.servers,
                    "client.id": "checknrun-replay",
                    "partitioner": "murmur2_random",  # the Java client's placement (module doc)
                    "linger.ms": 20,
                    "enable.idempotence": True,
                    "queue.buffering.max.messages": 500_000,
                    "socket.connection.setup.timeout.ms": 10_000,
                }
            )
        )

    def ensure_topic(self) -> int:
        """Create the topic (URL partitions) unless it exists; returns its partition count."""
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient
        from confluent_kafka.cimpl import NewTopic

        try:
            metadata = self._producer.list_topics(timeout=10)
        except KafkaException as exc:
            raise ReplayError(f"cannot reach Kafka at {self.address.servers}: {exc}") from exc
        topic = metadata.topics.get(self.address.topic)
        if topic is not None and topic.error is None and topic.partitions:
            return len(topic.partitions)
        if not self.address.create_topic:
            raise ReplayError(f"topic {self.address.topic!r} does not exist (create_topic=0)")
        admin = AdminClient(confluent_config({"bootstrap.servers": self.address.servers}))
        new = NewTopic(self.address.topic, self.address.partitions, self.address.replication_factor)
        for future in admin.create_topics([new]).values():
            try:
                future.result(timeout=30)
            except KafkaException as exc:
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise ReplayError(f"cannot create topic {self.address.topic!r}: {exc}") from exc
        return self.address.partitions

    def send(self, key: bytes, value: bytes) -> None:
        while True:
            try:
                self._producer.produce(self.address.topic, value, key, on_delivery=self._done)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                self._producer.poll(0.05)
        self._producer.poll(0)

    def _done(self, error: Any, _message: Any) -> None:
        if error is None:
            self.delivered += 1
        else:
            self.failed += 1
            self.first_error = self.first_error or str(error)

    def flush(self) -> None:
        left = self._producer.flush(DELIVERY_TIMEOUT_S)
        if left or self.failed:
            raise ReplayError(
                f"{self.failed + left} event(s) not delivered to {self.address.topic!r}"
                + (f" (first error: {self.first_error})" if self.first_error else "")
            )


def _poisoned(stream: InteractionStream, texts: list[str]) -> InteractionStream:
    """`stream` with the `--poison` stretches broken (trainer/streams/poison.py)."""
    from trainer.streams.poison import Poison, poisoned

    if not isinstance(stream, ColumnarStream):
        raise CommandError("--poison takes a data set or file held in memory (not synthetic)")
    try:
        return poisoned(stream, [Poison.parse(text) for text in texts])
    except ValueError as exc:
        raise CommandError(f"--poison: {exc}") from exc


def cmd_replay(args: argparse.Namespace) -> int:
    """Run `replay`; returns the exit status."""
    try:
        address = parse_kafka_url(args.to)
    except BusError as exc:
        raise CommandError(f"--to: {exc}") from exc
    if args.start < 0:
        raise CommandError(f"--start must be >= 0, got {args.start}")
    for name in ("rate", "speedup"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise CommandError(f"--{name} must be > 0, got {value}")
    stream = open_stream(args)
    if args.poison:
        stream = _poisoned(stream, args.poison)
    stop = None if args.max_events is None else args.start + args.max_events
    producer = _Producer(address)
    partitions = producer.ensure_topic()
    total = stream.num_samples
    end = total if stop is None else stop if total is None else min(stop, total)
    expected = None if end is None else max(0, end - args.start)
    stop_event = threading.Event()
    sent = 0
    started = time.monotonic()
    first_ts: float | None = None
    bar = tqdm(
        total=expected,
        unit="event",
        unit_scale=True,
        file=sys.stderr,
        disable=True if args.no_progress or args.json else None,
        desc=address.topic,
    )
    lines = not (args.no_progress or args.json) and bar.disable  # no terminal: lines instead
    if not args.json:
        pace = (
            f"{args.rate:g} events/s"
            if args.rate
            else f"{args.speedup:g}x event time"
            if args.speedup
            else "full speed"
        )
        print(
            f"replay: {'all' if expected is None else f'{expected:,}'} events to {address.topic} "
            f"({partitions} partition(s)) at {pace}",
            file=sys.stderr,
            flush=True,
        )
    next_line = started + PROGRESS_EVERY_S
    with bar, stop_on_signals(stop_event):
        for chunk in event_chunks(stream, args.start, stop):
            if first_ts is None and len(chunk.ts):
                first_ts = float(chunk.ts[0])
            for i, (key, value) in enumerate(zip(chunk.keys, chunk.values, strict=True)):
                if args.rate is not None:
                    _sleep_until(started + (sent + 1) / args.rate)
                elif args.speedup is not None and first_ts is not None:
                    _sleep_until(started + (float(chunk.ts[i]) - first_ts) / args.speedup)
                producer.send(key, value)
                sent += 1
            bar.update(len(chunk.values))
            if lines and time.monotonic() >= next_line:
                next_line += PROGRESS_EVERY_S
                line = _progress_line(address.topic, sent, expected, time.monotonic() - started)
                print(line, file=sys.stderr, flush=True)
            if stop_event.is_set():
                break
        producer.flush()
    seconds = time.monotonic() - started
    doc = {
        "topic": address.topic,
        "partitions": partitions,
        "events": sent,
        "start": args.start,
        "seconds": round(seconds, 3),
        "events_per_s": round(sent / seconds, 1) if seconds > 0 else None,
        "stopped": stop_event.is_set(),
    }
    if args.json:
        print(json.dumps(doc))
    else:
        print(
            f"replayed {sent:,} events to {address.topic} ({partitions} partition(s)) in "
            f"{seconds:.1f} s ({doc['events_per_s'] or 0:,.0f} events/s)"
        )
    return 0


def _progress_line(topic: str, sent: int, expected: int | None, seconds: float) -> str:
    """The line a replay without a terminal prints every PROGRESS_EVERY_S seconds."""
    of = "" if expected is None else f" of {expected:,}"
    rate = sent / seconds if seconds > 0 else 0.0
    return f"replay: {sent:,}{of} events to {topic} ({rate:,.0f} events/s)"


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.replay replay ...`: the command without the entry point installed."""
    parser: argparse.ArgumentParser = CommandParser(prog="python -m trainer.replay")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_replay_parser(sub).set_defaults(func=cmd_replay)
    return run_command(parse_command_line(parser, argv))


if __name__ == "__main__":
    sys.exit(main())
