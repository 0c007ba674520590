"""Part `transport`: S3 upload throughput and announcement latency, against the running services.

    source ~/.cache/checknrun/services/env        # or: eval "$(scripts/services.sh env)"
    checknrun bench transport [--quick] [--json OUT]

What it measures (medians over repeats; every figure is wall-clock, client included):

- `put` / `get` MiB/s of one object of 1, 16 and 64 MiB through S3Store (16 MiB parts, so the
  64 MiB object is a 4-part multipart upload);
- one version's blobs uploaded in parallel like VersionWriter does (`upload_concurrency`
  threads), and a whole commit through VersionWriter (blobs, manifest, HEAD compare-and-swap);
- announcement latency from `announce()` to the message coming out of a source's `poll`, one
  message at a time (no queueing), over Kafka and over the embedded file log; p50 and p99.

Objects go to bucket `checknrun-bench` under a fresh prefix and are deleted afterwards; the Kafka
topic is fresh and deleted too.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from bench.machine import describe_machine
from publisher.bus import kafka_python_config
from publisher.bus.base import AnnouncementSource, Announcer, parse_kafka_url
from publisher.bus.file_log import FileLogAnnouncer, FileLogSource
from publisher.cli import CommandError
from publisher.store.s3_store import S3Settings, S3Store
from publisher.tunables import DEFAULT_TUNABLES
from publisher.write.version_writer import TableBlob, VersionDraft, VersionWriter
from schemas.announcement import Announcement
from schemas.manifest import Position

MiB = 1024 * 1024
BENCH_BUCKET = "checknrun-bench"


@dataclass
class Throughput:
    what: str
    bytes: int
    repeats: int
    seconds: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def mib_per_s(self) -> float:
        return self.bytes / MiB / self.median_s


@dataclass
class Latency:
    what: str
    samples_ms: list[float] = field(default_factory=list)
    announce_call_ms: list[float] = field(default_factory=list)

    def percentile(self, q: float, values: Sequence[float] | None = None) -> float:
        data = sorted(self.samples_ms if values is None else values)
        # Nearest rank: p99 of 200 samples is the 198th value, an observed latency.
        rank = max(1, min(len(data), int(-(-q * len(data) // 100))))
        return data[rank - 1]


def _timed(op: Callable[[], object]) -> float:
    started = time.perf_counter()
    op()
    return time.perf_counter() - started


def bench_s3(store: S3Store, quick: bool) -> list[Throughput]:
    results: list[Throughput] = []
    repeats = 3 if quick else 7
    for size_mib in (1, 16, 64):
        data = os.urandom(size_mib * MiB)  # incompressible, so nothing on the path shortcuts
        put = Throughput(f"put {size_mib} MiB", len(data), repeats)
        get = Throughput(f"get {size_mib} MiB", len(data), repeats)
        for i in range(repeats):
            key = f"obj/{size_mib}/{i}"
            put.seconds.append(_timed(partial(store.put, key, data)))
            get.seconds.append(_timed(partial(store.get, key)))
        results += [put, get]

    # One version's blobs: 8 tables of 8 MiB and a 4 MiB dense blob, in parallel.
    blobs = [os.urandom(8 * MiB) for _ in range(8)] + [os.urandom(4 * MiB)]
    total = sum(len(b) for b in blobs)
    workers = DEFAULT_TUNABLES.upload_concurrency
    parallel = Throughput(f"version blobs ({len(blobs)}, {workers} threads)", total, repeats)

    def upload(prefix: str) -> None:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(store.put, f"{prefix}/{j}", b) for j, b in enumerate(blobs)]
            for future in futures:
                future.result()  # re-raises an upload's error here

    for i in range(repeats):
        parallel.seconds.append(_timed(partial(upload, f"ver/{i}")))
    results.append(parallel)

    commit = Throughput("VersionWriter.commit (same blobs)", total, repeats)
    tables = [
        TableBlob(f"emb.t{j}", 1 << 20, 2, "fp32", 1 << 20, 0, b) for j, b in enumerate(blobs[:8])
    ]
    with VersionWriter(store, "bench") as writer:
        for i in range(repeats):
            draft = VersionDraft(
                kind="full",
                relative_to=None,
                policy="bench",
                position=Position(step=i, samples_seen=i),
                tables=tables,
                dense=blobs[8],
            )
            commit.seconds.append(_timed(partial(writer.commit, draft)))
    results.append(commit)
    return results


def _announcement(version: int) -> Announcement:
    return Announcement(
        model="bench",
        version=version,
        parent=version - 1 if version > 1 else None,
        kind="full" if version == 1 else "delta",
        manifest_key=f"bench/manifests/{version:012d}-bench.json",
        created_at=datetime.now(UTC),
        total_bytes=version,
    )


def bench_latency(what: str, announcer: Announcer, source: AnnouncementSource, n: int) -> Latency:
    result = Latency(what)
    for version in range(1, n + 1):
        started = time.perf_counter()
        announcer.announce(_announcement(version))
        result.announce_call_ms.append((time.perf_counter() - started) * 1000)
        deadline = time.monotonic() + 30
        while True:
            got = [Announcement.from_json(m).version for m in source.poll(1.0)]
            if version in got:
                result.samples_ms.append((time.perf_counter() - started) * 1000)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: announcement {version} not received within 30 s")
    return result


def bench_kafka(bootstrap: str, n: int) -> Latency:
    from kafka import KafkaAdminClient

    from publisher.bus.kafka_bus import KafkaAnnouncementSource, KafkaAnnouncer

    address = parse_kafka_url(f"kafka://{bootstrap}/checknrun-bench-{uuid.uuid4().hex[:8]}")
    announcer = KafkaAnnouncer(address, "bench")
    source = KafkaAnnouncementSource(address)
    try:
        announcer.announce(_announcement(1))  # creates the topic
        if not announcer.flush(60):
            raise RuntimeError(f"Kafka at {bootstrap} did not take a message within 60 s")
        deadline = time.monotonic() + 60
        while not source.positions:  # assigned at the end of the topic
            source.poll(0.2)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no partition of {address.topic} assigned within 60 s")
        for v in range(2, 12):  # warm-up: connections, metadata, fetch sessions
            announcer.announce(_announcement(v))
        while len(source.poll(1.0)) and time.monotonic() < deadline:
            pass
        return bench_latency("kafka announce -> poll", announcer, source, n)
    finally:
        announcer.close()
        source.close()
        admin = KafkaAdminClient(
            **kafka_python_config({"bootstrap_servers": list(address.bootstrap)})
        )
        try:
            admin.delete_topics([address.topic])
        finally:
            admin.close()


def bench_file_log(n: int) -> Latency:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "announcements.log"
        return bench_latency(
            "file log announce -> poll", FileLogAnnouncer(path, "bench"), FileLogSource(path), n
        )


def _cleanup(store: S3Store) -> None:
    for info in list(store.list("")):
        store.delete(info.key)


def run(quick: bool) -> dict[str, Any]:
    """Uploads, then announcement latency over Kafka and the file log; prints the tables."""
    settings = S3Settings.from_env()
    bootstrap = os.environ.get("CHECKNRUN_KAFKA_BOOTSTRAP", "").strip()
    if not bootstrap:
        raise CommandError(
            "CHECKNRUN_KAFKA_BOOTSTRAP is not set: start the services and source their env file "
            '(eval "$(scripts/services.sh up)")'
        )
    n = 50 if quick else 200
    store = S3Store(BENCH_BUCKET, f"run-{uuid.uuid4().hex[:8]}", settings=settings)
    try:
        uploads = bench_s3(store, quick)
    finally:
        _cleanup(store)
        store.close()
    latencies = [bench_kafka(bootstrap, n), bench_file_log(n)]
    doc: dict[str, Any] = {
        "part": "transport",
        "quick": quick,
        "machine": describe_machine(),
        "s3_endpoint": f"{'https' if settings.secure else 'http'}://{settings.endpoint}",
        "kafka_bootstrap": bootstrap,
        "uploads": [
            {**asdict(t), "median_s": t.median_s, "mib_per_s": t.mib_per_s} for t in uploads
        ],
        "latency": [
            {
                "what": lat.what,
                "messages": len(lat.samples_ms),
                "p50_ms": lat.percentile(50),
                "p99_ms": lat.percentile(99),
                "max_ms": max(lat.samples_ms),
                "announce_call_p99_ms": lat.percentile(99, lat.announce_call_ms),
            }
            for lat in latencies
        ],
    }
    print(render(doc))
    return doc


def render(report: dict[str, Any]) -> str:
    """The figures as two text tables."""
    lines = [
        f"S3 {report['s3_endpoint']}   Kafka {report['kafka_bootstrap']}",
        "",
        f"{'upload':44} {'MiB':>6} {'median s':>9} {'MiB/s':>8}",
    ]
    for t in report["uploads"]:
        lines.append(
            f"{t['what']:44} {t['bytes'] / MiB:6.0f} {t['median_s']:9.3f} {t['mib_per_s']:8.1f}"
        )
    lines += ["", f"{'announcement latency':30} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"]
    for lat in report["latency"]:
        lines.append(
            f"{lat['what']:30} {lat['messages']:5d} {lat['p50_ms']:8.2f} {lat['p99_ms']:8.2f} "
            f"{lat['max_ms']:8.2f}   (announce() call p99 {lat['announce_call_p99_ms']:.3f} ms)"
        )
    return "\n".join(lines)
