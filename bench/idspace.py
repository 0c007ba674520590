"""Part `idspace`: open id spaces compared on MovieLens-1M through Kafka, and a new id's freshness.

    checknrun bench idspace [--samples N] [--new-ids K] [--quick] [--json OUT]

Needs the real Kafka (CHECKNRUN_KAFKA_BOOTSTRAP; source ~/.cache/checknrun/services/env); the
store is MinIO when CHECKNRUN_S3_ENDPOINT is set, else a file store. Every figure comes from the
product's own commands, run as child processes:

1. `checknrun replay --data movielens` puts the first N ratings on a fresh 3-partition topic
   (raw ids, time order, key = user id).
2. Id spaces on the same topic, each a whole live run: `dynamic` (the default: collision-free,
   a row per id) and `hash` at two table sizes; their progressive-validation AUC and log loss
   (every event scored before it is trained on), collisions, table memory, and the bytes each
   wrote against a full fp32 checkpoint with the id-map blobs counted. Next to them, the file
   replay's AUC (up-front vocabulary and its extra dense feature `movie_age`).
3. Freshness of a new id: a live trainer (`--interval-seconds 1`) follows the topic and
   announces on Kafka; a `checknrun serve` follows it. The bench sends events of user ids
   never seen before and asks the server for each (`POST /v1/predict` with the raw id) until
   the answer no longer counts it in `unknown_ids`: first event -> served, p50 / p99.

Training throughput from Kafka against the file replay is the `live` part's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kafka import KafkaProducer

from bench.child_server import REPO, ChildServer
from bench.machine import describe_machine, log
from publisher.bus import kafka_python_config
from publisher.read.catalog import Catalog
from publisher.store import open_store
from schemas.manifest import Manifest

MOVIELENS_EVENTS = 1_000_209
DIM = 16
BATCH = 512


class LiveBenchError(RuntimeError):
    """The live bench cannot run here (no Kafka) or a child command failed."""


def _checknrun(argv: list[str], *, timeout_s: float) -> dict[str, Any]:
    """Run `checknrun ARGV --json` in a child process; its JSON document."""
    cmd = [sys.executable, "-m", "publisher.cli", *argv, "--json"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        tail = done.stderr[-3000:]
        raise LiveBenchError(f"{' '.join(cmd)} exited {done.returncode}:\n{tail}")
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _store(tag: str, scratch: Path) -> str:
    if os.environ.get("CHECKNRUN_S3_ENDPOINT"):
        return f"s3://checknrun-bench/live-{tag}"
    return (scratch / f"store-{tag}").resolve().as_uri()


def _train_file(samples: int, store: str, model: str) -> dict[str, Any]:
    argv = ["train", "--data", "movielens", "--store", store, "--model", model]
    argv += ["--max-samples", str(samples), "--batch-size", str(BATCH), "--no-progress"]
    return _checknrun(argv, timeout_s=1800)


def _train_live(
    url: str, samples: int, store: str, model: str, extra: list[str] | None = None
) -> dict[str, Any]:
    argv = ["train", "--data", url, "--store", store, "--model", model, "--stop-at-end"]
    argv += ["--max-samples", str(samples), "--batch-size", str(BATCH), "--no-progress"]
    return _checknrun([*argv, *(extra or [])], timeout_s=1800)


def _rate(doc: dict[str, Any]) -> float:
    return float(doc["samples_per_s"])


#: tables a little over MovieLens-1M's ids (6,040 users, 3,706 items, 3,439 zip codes), and a
#: quarter of that for the small hashed arm.
FULL_CAPACITY = "256,user=6100,item=3800,zip_code=3500"
QUARTER_CAPACITY = "64,user=1525,item=950,zip_code=875"


def _head_manifest(store: str, model: str) -> Manifest:
    with open_store(store) as opened:
        latest = Catalog(opened, model).latest()
    if latest is None:
        raise LiveBenchError(f"{model} published no version")
    return latest.manifest


def _id_spaces(url: str, samples: int, scratch: Path) -> dict[str, Any]:
    arms: list[tuple[str, list[str]]] = [
        ("dynamic", ["--id-space", "dynamic", "--id-capacity", FULL_CAPACITY]),
        ("hash", ["--id-space", "hash", "--id-capacity", FULL_CAPACITY]),
        ("hash-quarter", ["--id-space", "hash", "--id-capacity", QUARTER_CAPACITY]),
    ]
    out: dict[str, Any] = {}
    for name, extra in arms:
        tag = uuid.uuid4().hex[:8]
        store = _store(f"ids-{name}-{tag}", scratch)
        log(f"idspace: {name} ({extra[-1]} rows) on {samples:,} events")
        doc = _train_live(url, samples, store, f"ids-{name}", extra)
        manifest = _head_manifest(store, f"ids-{name}")
        metrics, summary = doc.get("metrics", {}), doc.get("summary", {})
        rows = {t.name: t.rows for t in manifest.tables}
        held = {k: v for k, v in manifest.metrics.items() if k.startswith("ids_held_")}
        out[name] = {
            "auc": metrics.get("auc_cumulative"),
            "logloss": metrics.get("logloss_cumulative"),
            "samples_per_s": round(_rate(doc)),
            "table_rows": sum(rows.values()),
            "table_mib_fp32": round(sum(rows.values()) * DIM * 4 / 2**20, 2),
            "ids_held": {k.removeprefix("ids_held_"): int(v) for k, v in held.items()},
            "hash_collided_rows": manifest.metrics.get("hash_collided_rows"),
            "hash_collision_events": manifest.metrics.get("hash_collision_events"),
            "bytes_written": summary.get("bytes_written"),
            "full_fp32_bytes": summary.get("full_fp32_bytes"),
            "write_ratio": summary.get("ratio"),
            "versions": summary.get("versions"),
            "id_map_bytes_last_version": sum(
                t.id_map.size for t in manifest.tables if t.id_map is not None
            ),
        }
    log(f"idspace: file replay (up-front vocabulary) on {samples:,} samples")
    tag = uuid.uuid4().hex[:8]
    doc = _train_file(samples, _store(f"ids-file-{tag}", scratch), "ids-file")
    out["file-up-front"] = {
        "auc": doc["metrics"].get("auc_cumulative"),
        "logloss": doc["metrics"].get("logloss_cumulative"),
        "write_ratio": doc.get("summary", {}).get("ratio"),
    }
    return out


def _send(producer: KafkaProducer, topic: str, user: str, item: str) -> None:
    event = {"ts": time.time(), "label": 1, "user": user, "item": item, "genres": ["Drama"]}
    producer.send(topic, json.dumps(event).encode(), key=user.encode())
    producer.flush()


def _freshness(bootstrap: str, new_ids: int, scratch: Path) -> dict[str, Any]:
    """First event of a never-seen user id -> a server maps it (p50 / p99)."""
    tag = uuid.uuid4().hex[:8]
    topic = f"checknrun-bench-live-fresh-{tag}"
    bus = f"kafka://{bootstrap}/checknrun-bench-live-bus-{tag}"
    store = _store(f"fresh-{tag}", scratch)
    url = f"kafka://{bootstrap}/{topic}"
    # Warm traffic first, so the model exists before the server starts.
    replay = ["replay", "--data", "movielens", "--to", f"{url}?partitions=3"]
    _checknrun([*replay, "--max-events", "20000", "--no-progress"], timeout_s=600)
    train = [sys.executable, "-m", "publisher.cli", "train", "--data", url, "--store", store]
    train += ["--model", "fresh", "--interval-seconds", "1", "--bus", bus, "--no-progress"]
    train += ["--batch-size", "64"]
    trainer_log = (scratch / "fresh-trainer.log").open("wb")
    trainer = subprocess.Popen(
        train, cwd=REPO, stdin=subprocess.DEVNULL, stdout=trainer_log, stderr=subprocess.STDOUT
    )
    producer = KafkaProducer(**kafka_python_config({"bootstrap_servers": bootstrap}))
    latencies: list[float] = []
    try:
        deadline = time.monotonic() + 300
        while not _has_version(store, "fresh"):
            if time.monotonic() > deadline or trainer.poll() is not None:
                raise LiveBenchError("the live trainer published no version")
            time.sleep(0.5)
        with ChildServer(store, "fresh", scratch / "fresh-server.log", bus=bus) as server:
            server.wait_ready(180)
            for i in range(new_ids):
                user = f"bench-new-user-{tag}-{i}"
                sent = time.monotonic()
                _send(producer, topic, user, "Toy Story (1995)")
                while True:
                    body = {"examples": [{"user": user, "item": "Toy Story (1995)"}]}
                    answer = server.client.post("/v1/predict", json=body).json()
                    if not answer.get("unknown_ids", {}).get("user"):
                        latencies.append(time.monotonic() - sent)
                        break
                    if time.monotonic() - sent > 60:
                        raise LiveBenchError(f"new id {user} not served within 60 s")
                    time.sleep(0.02)
                log(f"idspace: new id {i + 1}/{new_ids} served after {latencies[-1] * 1e3:.0f} ms")
                time.sleep(0.3)
    finally:
        producer.close()
        trainer.terminate()
        try:
            trainer.wait(60)
        except subprocess.TimeoutExpired:
            trainer.kill()
        trainer_log.close()
    ordered = sorted(latencies)
    return {
        "new_ids": len(latencies),
        "checkpoint_interval_s": 1.0,
        "p50_ms": round(statistics.median(ordered) * 1e3, 1),
        "p99_ms": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3, 1),
        "max_ms": round(ordered[-1] * 1e3, 1),
    }


def _has_version(store: str, model: str) -> bool:
    with open_store(store) as opened:
        return Catalog(opened, model).head() is not None


def run(
    quick: bool,
    samples: int | None = None,
    new_ids: int | None = None,
) -> dict[str, Any]:
    """Every measurement of the module docstring (smaller and shorter with `quick`)."""
    samples = samples or (20_000 if quick else MOVIELENS_EVENTS)
    new_ids = new_ids or (3 if quick else 30)
    bootstrap = os.environ.get("CHECKNRUN_KAFKA_BOOTSTRAP")
    if not bootstrap:
        raise LiveBenchError(
            "the live part needs Kafka: start it with `bash scripts/services.sh up` and "
            "source ~/.cache/checknrun/services/env"
        )
    tag = uuid.uuid4().hex[:8]
    # ?partitions=N is how many a topic replay creates gets; train reads every partition.
    url = f"kafka://{bootstrap}/checknrun-bench-idspace-{tag}"
    with tempfile.TemporaryDirectory(prefix="checknrun-idspace-") as tmp:
        scratch = Path(tmp)
        log(f"idspace: replaying {samples:,} MovieLens ratings into {url}")
        argv = ["replay", "--data", "movielens", "--to", f"{url}?partitions=3"]
        argv += ["--max-events", str(samples), "--no-progress"]
        replay = _checknrun(argv, timeout_s=1800)
        id_spaces = _id_spaces(url, samples, scratch)
        freshness = _freshness(bootstrap, new_ids, scratch)
    return {
        "part": "idspace",
        "quick": quick,
        "machine": describe_machine(),
        "real_kafka": True,
        "store": "minio" if os.environ.get("CHECKNRUN_S3_ENDPOINT") else "file",
        "replay": replay,
        "id_spaces": id_spaces,
        "capacities": {"full": FULL_CAPACITY, "quarter": QUARTER_CAPACITY},
        "new_id_freshness": freshness,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The part's own options."""
    parser.add_argument("--samples", type=int, help="MovieLens ratings replayed (default all)")
    parser.add_argument("--new-ids", type=int, help="new ids timed to served (default 30)")
