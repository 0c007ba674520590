"""The live stream without a broker: its options, its reader position and how a parsed batch
becomes a training batch (rows through the id space, dense inputs by LiveSpec.dense)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, cast

import numpy as np
import pytest
from confluent_kafka import KafkaError, Message, TopicPartition

from publisher.cli import CommandError
from publisher.live_features import LiveFeature, LiveSpec
from schemas.events import encode_event
from trainer.live_options import live_spec, table_rows
from trainer.options import add_live_args
from trainer.streams.base import DataError
from trainer.streams.event_columns import RawEventsBuilder
from trainer.streams.kafka_events import KafkaEventStream, TopicRecreatedError
from trainer.streams.kafka_log import KafkaLog
from trainer.streams.kafka_reader import EventSource, EventStreamError, ReaderConfig, _pump

SPEC = LiveSpec(
    features=(LiveFeature("user"), LiveFeature("item"), LiveFeature("genres", bag=True)),
    count_features=("user",),
)


def stream() -> KafkaEventStream:
    source = EventSource.parse("kafka://127.0.0.1:9/events")
    return KafkaEventStream(source, SPEC, {"user": 8, "item": 8, "genres": 4})


def test_event_source_urls() -> None:
    assert EventSource.parse("kafka://h:1,h:2/t?partitions=1,0") == EventSource(
        ("h:1", "h:2"), "t", (0, 1)
    )
    assert EventSource.parse("kafka://h:1/t").partitions is None
    for bad in ("kafka://h:1/", "kafka://h:1/t?partitions=a", "kafka://h:1/t?x=1", "http://h/t"):
        with pytest.raises(EventStreamError):
            EventSource.parse(bad)


def test_id_capacity_and_features_options() -> None:
    parser = argparse.ArgumentParser()
    add_live_args(parser)
    parser.add_argument("--rating-threshold", type=float, default=4.0)
    args = parser.parse_args(["--features", "user,genres[]", "--id-capacity", "50,user=9"])
    spec = live_spec(args)
    assert spec.names == ("user", "genres") and spec.count_features == ("user",)
    assert table_rows(spec, args.id_capacity) == {"user": 9, "genres": 50}
    with pytest.raises(CommandError, match="not --features"):
        table_rows(spec, "item=5")
    with pytest.raises(CommandError, match="rows"):
        table_rows(spec, "1")
    with pytest.raises(CommandError):
        live_spec(parser.parse_args(["--features", "ts,user"]))


def test_reader_position_round_trip_and_refusals() -> None:
    s = stream()
    assert s.resume_offset({**s.reader_state(0), "offsets": {"0": 5, "3": 9}}) == 0
    assert s.reader_state(0)["offsets"] == {"0": 5, "3": 9}
    assert s.reader_state(0)["topic"] == "events"
    with pytest.raises(DataError, match="fingerprint"):
        s.resume_offset({**s.reader_state(0), "fingerprint": "0" * 16})
    for bad in ({"0": -1}, {"x": 1}, [1], {"0": "1"}):
        with pytest.raises(DataError, match="offsets"):
            s.resume_offset({**s.reader_state(0), "offsets": bad})  # type: ignore[dict-item]
    other = KafkaEventStream(
        EventSource.parse("kafka://h:1/events"), SPEC, {"user": 8, "item": 8, "genres": 5}
    )
    assert other.fingerprint != s.fingerprint


def _known_topic(s: KafkaEventStream, topic_id: str) -> KafkaEventStream:
    s._topic_id, s._topic_id_read = topic_id, True  # what the broker would say
    return s


def test_a_resume_on_a_recreated_topic_is_refused_unless_asked_to_read_it_from_its_start() -> None:
    s = _known_topic(stream(), "new-id")
    checkpoint = {**s.reader_state(0), "offsets": {"0": 5}, "topic_id": "old-id"}
    assert s.reader_state(0)["topic_id"] == "new-id"
    with pytest.raises(TopicRecreatedError, match="--from-topic-start") as refused:
        s.resume_offset(checkpoint)
    assert isinstance(refused.value, DataError) and "old-id" in str(refused.value)
    fresh = _known_topic(stream(), "new-id")
    fresh.from_topic_start = True
    assert fresh.resume_offset(checkpoint) == 0
    assert fresh.reader_state(0)["offsets"] == {}  # every partition from its start
    same = _known_topic(stream(), "old-id")
    same.from_topic_start = True
    with pytest.raises(TopicRecreatedError, match="twice"):
        same.resume_offset(checkpoint)
    # the same topic resumes at its offsets; a checkpoint without an id (older) is not checked
    assert _known_topic(stream(), "old-id").resume_offset(checkpoint) == 0
    older = stream()
    assert older.resume_offset({**older.reader_state(0), "offsets": {"0": 5}}) == 0
    assert not older._topic_id_read  # no broker asked


def test_a_parsed_batch_becomes_rows_and_dense_inputs() -> None:
    s = stream()
    builder = RawEventsBuilder(s.fields)
    for i, user in enumerate(["u1", "u2", "u1"]):
        value = encode_event(
            ts=3600.0 * i, label=i % 2, ids={"user": user, "item": 7, "genres": ["a"] * i}
        )
        builder.add(value, partition=0, offset=i)
    batch = s._batch(builder.take(), offset=0)
    # cold start: each id's first event trains the unknown row (0), the later ones its row
    assert batch.sparse["user"].values.tolist() == [0, 0, 1]
    assert batch.sparse["item"].values.tolist() == [0, 1, 1]
    assert batch.sparse["genres"].values.tolist() == [0, 1, 1]
    assert batch.sparse["genres"].offsets.tolist() == [0, 0, 1]
    assert batch.labels.tolist() == [0.0, 1.0, 0.0]
    prior = {"user": np.array([0, 0, 1])}
    expected = SPEC.dense(np.array([0.0, 3600.0, 7200.0]), prior)
    assert np.allclose(batch.dense.numpy(), expected)
    assert s.id_maps["embeddings.user"].counts[1] == 2
    assert s.metrics()["ids_held"] == 4.0 and s.admissions == 4


class _OneFetch:
    """A consumer whose one fetch holds an event and a consumer error (as a group authorization
    failure comes), and nothing after."""

    def __init__(self, value: bytes, error: KafkaError) -> None:
        self.fetches = [
            [
                Message(topic="events", partition=0, offset=0, value=value),
                Message(topic="events", error=error),
            ]
        ]

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition("events", 0)]

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        return self.fetches.pop(0) if self.fetches else []

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool = False) -> tuple[int, int]:
        return 0, 1


class _Parent:
    """The reader's end of its pipe: records what is sent, closes once a batch came."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, ...]] = []

    def send(self, message: tuple[object, ...]) -> None:
        self.sent.append(message)

    def poll(self) -> bool:
        return bool(self.sent)


def test_a_consumer_error_beside_records_is_logged_and_the_records_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    value = encode_event(ts=0.0, label=1, ids={"user": "u1", "item": 7, "genres": ["a"]})
    consumer = _OneFetch(value, KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED))
    config = ReaderConfig(EventSource.parse("kafka://h:9/events"), stream().fields, batch_size=1)
    parent = _Parent()
    _pump(cast(Any, parent), consumer, config, os.getppid(), KafkaLog(logging.getLogger("t")))
    assert [m[0] for m in parent.sent] == ["batch"]
    assert parent.sent[0][1].n == 1  # type: ignore[attr-defined]
    assert "Group authorization failed" in caplog.text
