"""`checknrun train --data kafka://...` on the real broker: consume -> publish with bad events
counted and skipped, SIGTERM ends with a final version, and SIGKILL at random points during
live training loses or repeats no event (checked from the committed manifests and the topic).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from publisher.read.catalog import Catalog, VersionRef
from publisher.read.restore import RestoredState, restore
from publisher.store import FileStore
from schemas.events import EventError, EventFields, encode_event, parse_event

from .conftest import Services

REPO = Path(__file__).resolve().parents[2]
FIELDS = EventFields(singles=("user", "item"), bags=("genres",))
#: a small model: the tests are about positions, not accuracy.
TRAIN = [
    "--features",
    "user,item,genres[]",
    "--embedding-dim",
    "4",
    "--bottom-mlp",
    "8",
    "--top-mlp",
    "8",
    "--batch-size",
    "64",
    "--id-capacity",
    "512",
    "--no-progress",
    "--json",
]
BAD_EVENTS: list[tuple[bytes, str]] = [
    (b"{broken", "not_json"),
    (b"[1, 2]", "not_object"),
    (b'{"label": 1, "user": "u1"}', "missing_ts"),
    (b'{"ts": -5, "label": 1}', "bad_ts"),
    (b'{"ts": 5, "user": "u1"}', "missing_label"),
    (b'{"ts": 5, "label": 3}', "bad_label"),
    (b'{"ts": 5, "label": 1, "user": 1.5}', "bad_id"),
    (b'{"ts": 5, "label": 1, "genres": ' + json.dumps(["g"] * 300).encode() + b"}", "too_many_ids"),
    (b'{"ts": 5, "label": 1, "pad": "' + b"x" * 70_000 + b'"}', "oversized"),
]


def good_event(i: int, rng: random.Random) -> tuple[bytes, bytes]:
    """(key, value) of the i-th good event: 150 users, 60 items, 0-3 genres."""
    user = f"u{rng.randrange(150)}"
    value = encode_event(
        ts=1_700_000_000.0 + i,
        label=float(rng.random() < 0.4),
        ids={
            "user": user,
            "item": rng.randrange(60),
            "genres": [f"g{rng.randrange(12)}" for _ in range(rng.randrange(4))],
        },
    )
    return user.encode(), value


def priced_event(i: int, rng: random.Random) -> tuple[bytes, bytes]:
    """(key, value) of an event whose label follows its `price` alone (the ids are noise): a
    click in 85% of the events priced over 100, in 10% of the others; a third have no price
    (missing, clicked at 40%), `affinity` is sent in half."""
    user = f"u{rng.randrange(150)}"
    price = rng.lognormvariate(4.6, 1.0) if rng.random() < 2 / 3 else None
    rate = 0.4 if price is None else (0.85 if price > 100 else 0.1)
    extra = {"price": price} | ({"affinity": rng.random()} if rng.random() < 0.5 else {})
    value = encode_event(
        ts=1_700_000_000.0 + i,
        label=float(rng.random() < rate),
        ids={"user": user, "item": rng.randrange(60), "genres": []},
        extra=extra,
    )
    return user.encode(), value


def create_topic(services: Services, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result(timeout=30)


def produce(services: Services, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    from confluent_kafka import Producer

    producer = Producer(
        {"bootstrap.servers": services.kafka_bootstrap, "partitioner": "murmur2_random"}
    )
    for key, value in records:
        producer.produce(topic, value, key)
        producer.poll(0)
    assert producer.flush(30) == 0


def read_topic(services: Services, topic: str) -> dict[int, list[bytes]]:
    """Every record of the topic: partition -> values in offset order (offsets from 0)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": services.kafka_bootstrap,
            "group.id": "checknrun-test-reader",
            "enable.auto.commit": False,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        out: dict[int, list[bytes]] = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            assert low == 0
            out[p] = []
            if high == 0:
                continue
            consumer.assign([TopicPartition(topic, p, 0)])
            while len(out[p]) < high:
                for message in consumer.consume(1000, timeout=5):
                    assert message.error() is None, message.error()
                    out[p].append(message.value())
        return out
    finally:
        consumer.close()


def good_before(records: dict[int, list[bytes]], offsets: dict[str, int]) -> list[Any]:
    """The good events before `offsets` (every partition of the topic must be named)."""
    assert sorted(offsets) == sorted(str(p) for p in records), offsets
    events = []
    for p, values in records.items():
        for value in values[: offsets[str(p)]]:
            try:
                events.append(parse_event(value, FIELDS))
            except EventError:
                continue
    return events


def versions(store_dir: Path, model: str) -> list[VersionRef]:
    with FileStore(store_dir) as store:
        return Catalog(store, model).versions()


def train_command(services: Services, topic: str, store_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer.cli",
        "train",
        "--data",
        f"kafka://{services.kafka_bootstrap}/{topic}",
        "--store",
        f"file://{store_dir}",
        "--model",
        "live",
        *TRAIN,
        *extra,
    ]


def run(command: list[str], timeout: float = 240) -> dict[str, Any]:
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=_env()
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_consume_publish_and_bad_events_counted_and_skipped(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    rng = random.Random(1)
    records = [good_event(i, rng) for i in range(2000)]
    for n, (value, _) in enumerate(BAD_EVENTS):
        records.insert(150 * n + 7, (b"u1", value))
    create_topic(services, unique_name, 3)
    produce(services, unique_name, records)

    report = run(
        train_command(services, unique_name, tmp_path, "--stop-at-end", "--interval-samples", "500")
    )
    assert report["samples"] == report["samples_seen"] == 2000
    stream = report["stream"]
    for _, reason in BAD_EVENTS:
        assert stream[f"bad_events_{reason}"] == 1, reason
    assert stream["bad_events"] == len(BAD_EVENTS)
    assert stream["consumer_lag"] == 0

    topic = read_topic(services, unique_name)
    refs = versions(tmp_path, "live")
    # four snapshots at least; on a busy machine some wait behind the publisher and are folded
    # into a later version, so the versions are the snapshots less the merged ones.
    summary = report["summary"]
    assert len(report["checkpoints"]) >= 4
    assert len(refs) == summary["versions"] == len(report["checkpoints"]) - summary["merged"]
    last = refs[-1].manifest
    reader = last.position.reader
    assert reader["source"] == "kafka" and reader["topic"] == unique_name
    assert reader["offsets"] == {str(p): len(v) for p, v in topic.items()}
    assert last.position.samples_seen == 2000
    assert last.metrics["bad_events"] == len(BAD_EVENTS)
    for ref in refs:  # every version: its samples are the good events before its offsets
        assert ref.manifest.position.samples_seen == len(
            good_before(topic, ref.manifest.position.reader["offsets"])  # type: ignore[arg-type]
        )
    live = last.model_config_["extra"]["live"]
    assert [f["name"] for f in live["features"]] == ["user", "item", "genres"]
    assert live["id_space"] == "dynamic" and live["count_features"] == ["user", "item"]


def test_dense_features_are_model_inputs_and_a_bad_value_is_skipped(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    rng = random.Random(5)
    records = [priced_event(i, rng) for i in range(3000)]
    records.insert(100, (b"u1", b'{"ts": 5, "label": 1, "user": "u1", "price": "12"}'))
    create_topic(services, unique_name, 2)
    produce(services, unique_name, records)

    dense = (
        "--dense-features",
        "price,affinity:raw",
        "--dense-lr",
        "0.01",
        "--interval-samples",
        "1000",
    )
    report = run(train_command(services, unique_name, tmp_path, "--stop-at-end", *dense))
    assert report["samples"] == 3000
    assert report["stream"]["bad_events_bad_dense"] == report["stream"]["bad_events"] == 1
    last = versions(tmp_path, "live")[-1].manifest
    assert last.model_config_["extra"]["live"]["dense_features"] == [
        {"name": "price", "transform": "log1p"},
        {"name": "affinity", "transform": "raw"},
    ]
    assert last.model_config_["dense"][-4:] == [
        "price_log1p",
        "price_missing",
        "affinity_raw",
        "affinity_missing",
    ]
    # the ids carry no signal: only a model that reads the price ranks the clicks
    assert last.metrics["auc"] > 0.6, last.metrics  # 0.68 measured; 0.50 without the prices


def test_an_unknown_topic_or_a_foreign_position_is_refused(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    def refused(command: list[str]) -> str:
        done = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=120, env=_env()
        )
        assert done.returncode == 1, done.stderr[-3000:]
        return done.stderr + done.stdout

    assert "does not exist" in refused(
        train_command(services, unique_name, tmp_path, "--stop-at-end")
    )
    rng = random.Random(5)
    other = f"{unique_name}-b"
    for topic in (unique_name, other):
        create_topic(services, topic, 1)
        produce(services, topic, [good_event(i, rng) for i in range(200)])
    run(train_command(services, unique_name, tmp_path, "--stop-at-end"))
    text = refused(train_command(services, other, tmp_path, "--stop-at-end", "--resume"))
    assert "fingerprint" in text and other in text


def test_a_given_set_of_partitions_is_read_and_only_it(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    rng = random.Random(9)
    create_topic(services, unique_name, 2)
    produce(services, unique_name, [good_event(i, rng) for i in range(600)])
    topic = read_topic(services, unique_name)
    command = train_command(services, f"{unique_name}?partitions=1", tmp_path, "--stop-at-end")
    report = run(command)
    assert report["samples"] == len(topic[1]) < 600
    reader = versions(tmp_path, "live")[-1].manifest.position.reader
    assert reader["offsets"] == {"1": len(topic[1])}


@pytest.fixture
def feeder(services: Services, unique_name: str) -> Iterator[threading.Event]:
    """A producer that feeds 2 partitions with ~1500 good events a second (and a bad one now
    and then) until the returned event is set; then every event is in the topic."""
    create_topic(services, unique_name, 2)
    done = threading.Event()
    stop = threading.Event()

    def feed() -> None:
        rng = random.Random(7)
        i = 0
        while not stop.is_set():
            chunk = [good_event(i + j, rng) for j in range(150)]
            chunk.append((b"u0", BAD_EVENTS[i // 150 % len(BAD_EVENTS)][0]))
            produce(services, unique_name, chunk)
            i += 150
            time.sleep(0.1)
        done.set()

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    yield stop
    stop.set()
    assert done.wait(60)


def test_sigkill_at_random_points_then_resume_trains_each_event_exactly_once(
    services: Services, unique_name: str, tmp_path: Path, feeder: threading.Event
) -> None:
    rng = random.Random(int(time.time()))
    command = train_command(services, unique_name, tmp_path, "--interval-samples", "256")
    kills = 0
    for attempt in range(4):
        args = command if attempt == 0 else [*command, "--resume"]
        process = subprocess.Popen(
            args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env()
        )
        before = len(versions(tmp_path, "live"))
        deadline = time.monotonic() + 120
        while len(versions(tmp_path, "live")) < before + 2:  # trained and committed meanwhile
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 1.5))
        process.send_signal(signal.SIGKILL)
        assert process.wait(30) == -signal.SIGKILL
        kills += 1
    feeder.set()  # stop producing; the last run catches up with the topic and ends
    time.sleep(1.0)
    report = run([*command, "--resume", "--stop-at-end"])
    assert report["stream"]["consumer_lag"] == 0

    topic = read_topic(services, unique_name)
    refs = versions(tmp_path, "live")
    assert kills == 4 and len(refs) >= 9
    for ref in refs:
        position = ref.manifest.position
        trained = good_before(topic, position.reader["offsets"])  # type: ignore[arg-type]
        assert position.samples_seen == len(trained), (ref.version, position)
        # The id map counts each user's events: exactly those before the offsets, each once
        # (512 rows hold the 150 users: nothing is evicted, so counts run from the first one).
        users = restored(tmp_path, ref.version).id_maps["embeddings.user"]
        expected = Counter(event.ids[0] for event in trained)
        assert len(users) == len(expected)
        assert {key: int(users.counts[users.row_of(key)]) for key in expected} == expected
    final = refs[-1].manifest.position
    assert final.reader["offsets"] == {str(p): len(v) for p, v in topic.items()}
    bad = sum(1 for values in topic.values() for v in values if _is_bad(v))
    assert final.samples_seen == sum(len(v) for v in topic.values()) - bad


def test_sigterm_finishes_the_step_publishes_and_exits_0(
    services: Services, unique_name: str, tmp_path: Path, feeder: threading.Event
) -> None:
    command = train_command(services, unique_name, tmp_path, "--interval-samples", "512")
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    deadline = time.monotonic() + 120
    while not versions(tmp_path, "live"):  # training is under way
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    report = json.loads(stdout)
    assert report["stopped"] is True and report["samples"] > 0
    feeder.set()
    topic = read_topic(services, unique_name)
    final = versions(tmp_path, "live")[-1].manifest.position
    # The final version holds every sample trained, and they are the topic's up to its offsets.
    assert final.samples_seen == report["samples"] == report["samples_seen"]
    assert final.samples_seen == len(good_before(topic, final.reader["offsets"]))  # type: ignore[arg-type]


def restored(store_dir: Path, version: int) -> RestoredState:
    with FileStore(store_dir) as store:
        return restore(store, "live", version)


def test_evicted_rows_are_reinitialised_and_published_with_their_new_ids(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    rng = random.Random(3)
    create_topic(services, unique_name, 1)
    produce(services, unique_name, [good_event(i, rng) for i in range(3000)])
    # 16 user rows (15 ids) for 150 users: the least recently seen are evicted all the time.
    command = train_command(
        services, unique_name, tmp_path, "--stop-at-end", "--interval-samples", "256"
    )
    report = run([*command, "--id-capacity", "512,user=16"])
    assert report["stream"]["id_evictions"] > 100

    topic = read_topic(services, unique_name)
    refs = versions(tmp_path, "live")
    previous = restored(tmp_path, refs[0].version)
    reused = 0
    for ref in refs[1:]:
        state = restored(tmp_path, ref.version)
        users, before = state.id_maps["embeddings.user"], previous.id_maps["embeddings.user"]
        assert len(users) <= 15
        trained = good_before(topic, ref.manifest.position.reader["offsets"])  # type: ignore[arg-type]
        events_of = Counter(event.ids[0] for event in trained)
        weights = state.tables["embeddings.user"].weights
        old_weights = previous.tables["embeddings.user"].weights
        for row in range(1, users.rows):
            key, old_key = users.key_of(row), before.key_of(row)
            if key is not None:
                # counted since the id got its row: never more than its events so far
                assert 0 < users.counts[row] <= events_of[key]
            if key != old_key:
                # the row changed hands: the version carries it, re-initialised and trained
                # for its new id (restoring it from older versions would leave the old values)
                assert not np.array_equal(weights[row], old_weights[row]), (ref.version, row)
                reused += 1
        previous = state
    # ~15 of the 15 rows change hands between two versions (>= 256 events of 150 users apart);
    # how many versions there are depends on how many snapshots waited behind a busy publisher
    # and were folded into one (trainer/checkpoint_records.py)
    assert len(refs) >= 2 and reused >= 8 * (len(refs) - 1), (reused, len(refs))


def _is_bad(value: bytes) -> bool:
    try:
        parse_event(value, FIELDS)
    except EventError:
        return True
    return False


def test_hostile_event_times_neither_evict_the_stream_nor_keep_rows(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    """Events at 1e300 and 3 days ahead (docs/FORMAT.md 8.1) among 2,000 real ones of a day:
    with a day's eviction span, no real id is evicted and the hostile times are lowered to the
    reader's clock, counted in the manifest."""
    rng = random.Random(5)
    create_topic(services, unique_name, 1)
    events = [good_event(i, rng) for i in range(2000)]
    now = time.time()
    hostile = [
        (b"h", encode_event(ts=ts, label=1.0, ids={"user": f"h{j}", "item": 1, "genres": []}))
        for j, ts in enumerate([1e300, now + 3 * 86_400.0] * 10)
    ]
    for j, event in enumerate(hostile):
        events.insert(100 * (j + 1), event)
    produce(services, unique_name, events)
    command = train_command(
        services, unique_name, tmp_path, "--stop-at-end", "--interval-samples", "512"
    )
    report = run([*command, "--evict-after-s", "86400"])
    assert report["stream"]["id_evictions"] == 0  # the real ids span 2,000 s of one day
    final = versions(tmp_path, "live")[-1].manifest
    assert final.metrics["event_time_clamped"] == 20
    users = restored(tmp_path, final.version).id_maps["embeddings.user"]
    real = {parse_event(value, FIELDS).ids[0] for _, value in events} - {f"h{j}" for j in range(20)}
    assert len(real) == 150 and all(users.row_of(str(user)) is not None for user in real)
    # no hostile id's recency runs past the reader's clock by more than the lead
    late = time.time() + 300.0
    rows = [users.row_of(f"h{j}") for j in range(20)]
    assert all(row is not None and users.last_seen[row] <= late for row in rows)


def _recreate_topic(services: Services, topic: str) -> None:
    """Delete the topic and create it again under its name (a new topic id)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    for future in admin.delete_topics([topic]).values():
        future.result(timeout=30)
    deadline = time.monotonic() + 60
    while True:  # the broker refuses the name while the old topic is being deleted
        try:
            create_topic(services, topic, 1)
            return
        except KafkaException:
            assert time.monotonic() < deadline, "the topic could not be created again"
            time.sleep(0.5)


def test_a_resume_on_a_recreated_topic_is_refused_or_reads_the_new_one_from_its_start(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    rng = random.Random(7)
    create_topic(services, unique_name, 1)
    produce(services, unique_name, [good_event(i, rng) for i in range(600)])
    command = train_command(
        services, unique_name, tmp_path, "--stop-at-end", "--interval-samples", "256"
    )
    run(command)
    first = versions(tmp_path, "live")[-1].manifest
    old_id = first.position.reader["topic_id"]
    assert first.position.reader["offsets"] == {"0": 600}
    _recreate_topic(services, unique_name)
    produce(services, unique_name, [good_event(i, rng) for i in range(1000)])
    # the new topic holds more records than the checkpoint's offset: by offsets alone it
    # would resume at 600 and skip the new topic's first 600 records
    refused = subprocess.run(
        [*command, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=240, env=_env()
    )
    assert refused.returncode != 0
    assert "was deleted and created again" in refused.stderr, refused.stderr[-2000:]
    assert "--from-topic-start" in refused.stderr
    assert versions(tmp_path, "live")[-1].manifest.version == first.version  # nothing written
    report = run([*command, "--resume", "--from-topic-start"])
    assert report["samples"] == 1000
    last = versions(tmp_path, "live")[-1].manifest
    assert last.position.reader["offsets"] == {"0": 1000}
    assert last.position.reader["topic_id"] not in (None, old_id)
    assert last.position.samples_seen == 1600  # the old topic's 600, then the new one's 1000


def test_a_partition_added_while_training_is_read_from_its_start(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewPartitions

    rng = random.Random(11)
    create_topic(services, unique_name, 1)
    produce(services, unique_name, [good_event(i, rng) for i in range(300)])
    command = train_command(
        services, unique_name, tmp_path, "--max-samples", "600", "--interval-samples", "128"
    )
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        deadline = time.monotonic() + 120
        while not versions(tmp_path, "live"):  # the first partition is being trained
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
        for future in admin.create_partitions([NewPartitions(unique_name, 2)]).values():
            future.result(timeout=30)
        producer = Producer({"bootstrap.servers": services.kafka_bootstrap})
        for i in range(300):
            key, value = good_event(300 + i, rng)
            producer.produce(unique_name, value, key, partition=1)
        assert producer.flush(30) == 0
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr[-3000:]
    assert "partition 1 was added" in stderr
    final = versions(tmp_path, "live")[-1].manifest
    assert final.position.reader["offsets"] == {"0": 300, "1": 300}
    assert final.position.samples_seen == 600
    assert final.metrics["consumer_lag"] == 0.0


def test_the_same_events_give_the_same_model_at_two_arrival_rates(
    services: Services, unique_name: str, tmp_path: Path
) -> None:
    """Batches are full unless the stream stays quieter than --max-batch-wait-ms: a backlog and
    a trickle of the same 640 events train the same 10 steps, to the same model."""
    rng = random.Random(13)
    events = [good_event(i, rng) for i in range(640)]
    models = []
    for arm, rate in (("backlog", None), ("trickle", 400.0)):
        topic = f"{unique_name}-{arm}"
        create_topic(services, topic, 1)
        store = tmp_path / arm
        command = train_command(
            services,
            topic,
            store,
            "--max-samples",
            "640",
            "--max-batch-wait-ms",
            "5000",
            "--codec",
            "fp32",
        )
        if rate is None:
            produce(services, topic, events)
            report = run(command)
        else:
            process = subprocess.Popen(
                command,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(),
            )
            for start in range(0, len(events), 8):  # 8 events every 20 ms
                produce(services, topic, events[start : start + 8])
                time.sleep(8 / rate)
            stdout, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, stderr[-3000:]
            report = json.loads(stdout)
        assert report["steps"] == 10, (arm, report["steps"])
        models.append(restored(store, versions(store, "live")[-1].version))
    for name, table in models[0].tables.items():
        np.testing.assert_array_equal(models[1].tables[name].weights, table.weights, name)
