"""Server processes against hostile announcements, a corrupt blob, SIGKILL; two trainers.

The follower's validation of each bad announcement is unit-tested in
tests/unit/publisher/test_follower.py; here the bytes travel through a real Kafka topic into a real
`checknrun serve`, whose `follower_events_total{reason}` must count each while it keeps serving its
version.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from datetime import UTC, datetime

from kafka import KafkaProducer

from bench.child_server import ChildServer
from publisher.faults import ENV_VAR
from publisher.read.catalog import Catalog
from publisher.store import open_store
from schemas.manifest import Head

from .conftest import (
    PrivateServices,
    Processes,
    examples_for,
    kafka_url,
    metric_value,
    s3_url,
    train_args,
)

MODEL = "srv"


def _announcement(version: int, key: str, model: str = MODEL, **extra: object) -> bytes:
    doc = {
        "schema_version": 1,
        "model": model,
        "version": version,
        "parent": version - 1 if version > 1 else None,
        "kind": "delta",
        "manifest_key": key,
        "created_at": datetime.now(UTC).isoformat(),
        "total_bytes": 1,
        **extra,
    }
    return json.dumps(doc).encode()


def _events(metrics: str, reason: str) -> float:
    return metric_value(metrics, "follower_events_total", f'reason="{reason}"')


def _send_until_received(
    server: ChildServer, producer: KafkaProducer, topic: str, probe: bytes, timeout: float = 60
) -> int:
    """Send `probe` until the server has read one from the topic; returns how many were sent.

    The server fixes where it starts reading (the end of the topic) before it reads HEAD, but if
    the broker does not answer within a few seconds it does so only at its first successful
    poll, which may come after /readyz: whatever is sent before then is never read. Once it has
    read one probe it reads every later message; the probes before that one may never be read.
    """
    start = _events(server.metrics(), "received")
    deadline = time.monotonic() + timeout
    sent = 0
    while True:
        producer.send(topic, probe)
        producer.flush(timeout=30)
        sent += 1
        retry_at = time.monotonic() + 1
        while time.monotonic() < retry_at:
            if _events(server.metrics(), "received") > start:
                return sent
            time.sleep(0.1)
        assert time.monotonic() < deadline, f"{sent} probes, none read:\n{server.log.read_text()}"


def test_hostile_announcements_and_corrupt_blob(
    private_services: PrivateServices, procs: Processes, unique_name: str, s3_env: None
) -> None:
    store_url, topic = s3_url(unique_name), unique_name
    bus = kafka_url(private_services, topic)
    first = procs.run(train_args(store_url, MODEL, bus=bus, max_samples=4 * 2048), "train")
    assert first.returncode == 0, first.stderr[-3000:]
    # Announcements only (HEAD polled once a minute): what the server does is the bus's doing.
    server = procs.server(store_url, MODEL, "server", bus=bus, poll_head_after="60")
    server.wait_ready()
    with open_store(store_url) as store:
        v4 = Catalog(store, MODEL).find()
    assert server.info()["version"] == v4.version
    examples = examples_for(server.info()["features"], 4)
    hostile = {
        "bad_json": [b"{not json", b"\xff\xfe", b"[1, 2]"],
        "unknown_schema": [json.dumps({"schema_version": 2, "model": MODEL}).encode()],
        "other_model": [_announcement(9, "other/manifests/000000000009-x.json", model="other")],
        "bad_key": [
            _announcement(9, "http://169.254.169.254/latest/meta-data.json"),
            _announcement(9, f"{MODEL}/manifests/../../../etc/passwd.json"),
            _announcement(9, "/etc/passwd"),
        ],
        "old": [_announcement(v4.version, v4.key), _announcement(1, v4.key)],
        "oversized": [b'{"pad": "' + b"x" * 5000 + b'"}'],
        "invalid": [_announcement(9, f"{MODEL}/manifests/000000000009-x.json", kind="half")],
        # Well-formed and next in line, but HEAD does not reach it: never fetched nor served.
        "uncommitted": [
            _announcement(
                v4.version + 1,
                f"{MODEL}/manifests/{v4.version + 1:012d}-deadbeef.json",
                parent=v4.version,
            )
        ],
    }
    before = server.metrics()
    producer = KafkaProducer(bootstrap_servers=private_services.kafka_bootstrap)
    try:
        # The server reads the topic from here on; the probes it read count as "old".
        probes = _send_until_received(server, producer, topic, _announcement(v4.version, v4.key))
        for messages in hostile.values():
            for message in messages:
                producer.send(topic, message)
        producer.flush(timeout=30)
    finally:
        producer.close()
    sent = sum(len(m) for m in hostile.values())
    deadline = time.monotonic() + 60  # counters only: HEAD polls (every 60 s) move none of them
    while True:
        after = server.metrics()
        # One partition: every probe the server reads comes before the hostile messages, so once
        # those are all read, `received` counts exactly the probes read + the hostile messages.
        probed = _events(after, "received") - _events(before, "received") - sent
        short = {
            reason: _events(after, f"ignored_{reason}") - _events(before, f"ignored_{reason}")
            for reason in hostile
        }
        short["old"] -= probed
        if all(short[r] >= len(m) for r, m in hostile.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert 1 <= probed <= probes, (probed, probes)
    assert short == {r: len(m) for r, m in hostile.items()}
    assert server.proc.poll() is None
    assert server.info()["version"] == v4.version
    assert (
        server.client.post("/v1/predict", json={"examples": examples}).json()["version"]
        == v4.version
    )

    # A committed version whose blob is corrupt: written by a trainer killed after its manifest,
    # one byte flipped, then HEAD moved to it by hand and announced.
    killed = procs.run(
        train_args(store_url, MODEL, max_samples=6 * 2048, resume=True),
        "killed",
        env={ENV_VAR: "manifest_written"},
    )
    assert killed.returncode == -9
    with open_store(store_url) as store:
        manifest_key = next(
            i.key for i in store.list(f"{MODEL}/manifests/") if f"/{v4.version + 1:012d}-" in i.key
        )
        manifest = Catalog(store, MODEL).manifest(manifest_key)
        blob_key = manifest.tables[0].blob.key
        data = bytearray(store.get(blob_key))
        data[len(data) // 2] ^= 0x01
        store.put(blob_key, bytes(data))
        head = Head(model=MODEL, version=v4.version + 1, manifest=manifest_key)
        store.put(f"{MODEL}/HEAD", head.model_dump_json().encode())
    producer = KafkaProducer(bootstrap_servers=private_services.kafka_bootstrap)
    try:
        producer.send(
            topic,
            _announcement(
                v4.version + 1,
                manifest_key,
                parent=v4.version,
                kind=manifest.kind,
                total_bytes=manifest.total_bytes,
            ),
        )
        producer.flush(timeout=30)
    finally:
        producer.close()
    deadline = time.monotonic() + 30  # < the HEAD poll interval: the announcement must do it
    while metric_value(server.metrics(), "rejected_versions_total", 'reason="integrity"') < 1:
        assert time.monotonic() < deadline, server.log.read_text()[-3000:]
        time.sleep(0.2)
    assert server.info()["version"] == v4.version
    assert server.client.post("/v1/predict", json={"examples": examples}).status_code == 200
    assert server.proc.poll() is None
    print(
        f"RELIABILITY hostile announcements counted: {short} (after {probed:.0f} of {probes} "
        f"probe(s) read); "
        f"corrupt blob rejected, kept v{v4.version}"
    )


def _head(store_url: str) -> int:
    with open_store(store_url) as store:
        head = Catalog(store, MODEL).head()
    return 0 if head is None else head.version


def test_server_sigkill_and_restart(
    private_services: PrivateServices, procs: Processes, unique_name: str, s3_env: None
) -> None:
    store_url, bus = s3_url(unique_name), kafka_url(private_services, unique_name)
    trained = procs.run(train_args(store_url, MODEL, bus=bus, max_samples=4 * 2048), "train-1")
    assert trained.returncode == 0, trained.stderr[-3000:]
    server = procs.server(store_url, MODEL, "server-1", bus=bus, poll_head_after="60")
    server.wait_ready()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    # Versions committed while no server runs: the restarted one must bootstrap to the latest.
    more = procs.run(
        train_args(store_url, MODEL, bus=bus, max_samples=8 * 2048, resume=True), "train-2"
    )
    assert more.returncode == 0, more.stderr[-3000:]
    restarted = procs.server(
        store_url, MODEL, "server-2", bus=bus, poll_head_after="60", port=server.port
    )
    ready_s = restarted.wait_ready()
    latest = _head(store_url)
    assert restarted.info()["version"] == latest
    # ... and follow again (announcements only: HEAD polls are a minute away).
    last = procs.run(
        train_args(store_url, MODEL, bus=bus, max_samples=10 * 2048, resume=True), "train-3"
    )
    assert last.returncode == 0, last.stderr[-3000:]
    final = _head(store_url)
    assert final > latest
    follow_s = restarted.wait_version(final, timeout_s=30)
    print(
        f"RELIABILITY server SIGKILL: restart -> ready at v{latest} (latest) in {ready_s:.1f} s; "
        f"following again (v{final} {follow_s:.1f} s after the trainer exited)"
    )


def test_second_trainer_refused(
    private_services: PrivateServices, procs: Processes, unique_name: str, s3_env: None
) -> None:
    store_url = s3_url(unique_name)
    # More samples than the test can take even on a loaded machine: it SIGKILLs the trainer.
    first = procs.spawn(
        train_args(store_url, MODEL, max_samples=5_000_000, extra=["--interval-seconds", "0.5"]),
        "first",
    )
    heads: list[int] = []

    def head() -> int:
        with open_store(store_url) as store:
            h = Catalog(store, MODEL).head()
        heads.append(0 if h is None else h.version)
        return heads[-1]

    deadline = time.monotonic() + 60
    while head() < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    second = procs.run(train_args(store_url, MODEL, max_samples=4096, resume=True), "second")
    assert second.returncode != 0
    assert "is being published by" in second.stderr, second.stderr[-2000:]
    # The first trainer goes on publishing: HEAD moves on after the refusal (>= 10 polls).
    at_refusal = head()
    deadline = time.monotonic() + 60
    for polls in itertools.count(1):
        if head() > at_refusal and polls >= 10:
            break
        assert time.monotonic() < deadline, f"HEAD stuck: {heads}"
        time.sleep(0.3)
    assert first.poll() is None, "the first trainer must go on"
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert heads == sorted(heads) and heads[-1] > heads[0]
    print(f"RELIABILITY second trainer refused (exit {second.returncode}); HEAD {heads}")
