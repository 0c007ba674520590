"""Part `live`: training from a live Kafka event stream next to training from the file.

    checknrun bench live [--samples 1000209] [--rounds 3] [--partitions 1]
                         [--publish-in thread|process] [--quick] [--json OUT]

Needs Kafka (CHECKNRUN_KAFKA_BOOTSTRAP; source ~/.cache/checknrun/services/env). MovieLens-1M's
first `--samples` ratings are replayed into a fresh topic (`checknrun replay`, raw ids), then
each round runs, one after the other and alternating which goes first:

- file: `checknrun train --data movielens --max-samples N` (ids encoded up front, in memory);
- kafka: `checknrun train --data kafka://.../TOPIC --stop-at-end` (the reader process parses
  the events, the training thread maps the raw ids through the dynamic id space), tables sized
  a little over MovieLens' (`--id-capacity 64,user=6100,item=3800,zip_code=3500,
  release_year=128`).

Both publish to a file store with the default policy and codec, from a thread of the trainer
or (`--publish-in process`) from a child process (the kafka arm's publisher also gathers the
id maps' keys: Python work beside the training thread's). Reported per arm: samples/s
(the training loop's wall clock), CPU time of the training thread per sample, for kafka the
reader process's CPU per event and the largest consumer lag a checkpoint recorded, and the
progressive AUC; then the medians and kafka / file (the issue's target: >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.machine import describe_machine, log
from publisher.bus import confluent_config
from publisher.cli import CommandError, positive_int

MOVIELENS_SAMPLES = 1_000_209
ID_CAPACITY = "64,user=6100,item=3800,zip_code=3500,release_year=128"
REPO = Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Samples, rounds and the topic's partitions."""
    parser.add_argument(
        "--samples",
        type=positive_int,
        help=f"MovieLens ratings to replay and train on (default {MOVIELENS_SAMPLES:,}: all; "
        "--quick 50,000)",
    )
    parser.add_argument("--rounds", type=positive_int, help="default 3; --quick 1")
    parser.add_argument("--partitions", type=positive_int, default=1, help="of the topic")
    parser.add_argument(
        "--publish-in",
        choices=("thread", "process"),
        default="thread",
        help="where both arms publish (train --publish-in; default %(default)s)",
    )


def run(
    quick: bool,
    *,
    samples: int | None = None,
    rounds: int | None = None,
    partitions: int = 1,
    publish_in: str = "thread",
) -> dict[str, Any]:
    """Measure (see the module docstring); progress to stderr, the table to stdout."""
    bootstrap = kafka_bootstrap("live")
    n = min(samples or (50_000 if quick else MOVIELENS_SAMPLES), MOVIELENS_SAMPLES)
    n_rounds = rounds or (1 if quick else 3)
    replay, arms = alternating_rounds(
        bootstrap,
        "live",
        n,
        partitions,
        ("file", "kafka"),
        n_rounds,
        lambda arm, url, store, r: _train(arm, url, n, store, r, publish_in),
    )
    doc = {**_summary(arms, n, partitions, replay), "publish_in": publish_in}
    _print(doc)
    return doc


def _train(arm: str, url: str, n: int, store: Path, r: int, publish_in: str) -> dict[str, Any]:
    common = [
        *("--store", f"file://{store}", "--model", f"{arm}-{r}", "--publish-in", publish_in),
        *("--json", "--no-progress"),
    ]
    if arm == "file":
        data = ["--data", "movielens", "--max-samples", str(n)]
    else:
        data = ["--data", url, "--stop-at-end", "--id-capacity", ID_CAPACITY]
    doc = checknrun_json("trainer.cli", ["train", *data, *common])
    result = {
        "samples": doc["samples"],
        "samples_per_s": doc["samples_per_s"],
        "train_thread_cpu_us_per_sample": round(doc["cpu_seconds"] / doc["samples"] * 1e6, 2),
        "auc": doc["metrics"].get("auc_cumulative"),
        "bytes_written": doc["summary"]["bytes_written"],
    }
    if arm == "kafka":
        lags = [c["metrics"].get("consumer_lag", 0.0) for c in doc["checkpoints"]]
        result["reader_cpu_us_per_event"] = round(
            doc["reader_cpu_seconds"] / doc["samples"] * 1e6, 2
        )
        result["max_consumer_lag"] = max(lags, default=0.0)
        result["bad_events"] = doc["stream"]["bad_events"]
    return result


def kafka_bootstrap(part: str) -> str:
    """The broker a Kafka part runs against (CommandError when none is set)."""
    bootstrap = os.environ.get("CHECKNRUN_KAFKA_BOOTSTRAP", "").strip()
    if not bootstrap:
        raise CommandError(
            f"bench {part} needs Kafka: set CHECKNRUN_KAFKA_BOOTSTRAP=HOST:PORT "
            "(source ~/.cache/checknrun/services/env)"
        )
    return bootstrap


def alternating_rounds(
    bootstrap: str,
    part: str,
    n: int,
    partitions: int,
    arms: tuple[str, ...],
    rounds: int,
    train: Callable[[str, str, Path, int], dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """MovieLens' first `n` ratings replayed into a fresh topic of `partitions`, then `rounds`
    rounds of the arms, in reverse order every other round, each trained by `train(arm, url, store,
    round)` into a store of its own; the topic is deleted at the end. The replay's report and
    each arm's runs."""
    topic = f"bench-{part}-{uuid.uuid4().hex[:10]}"
    url = f"kafka://{bootstrap}/{topic}"
    log(f"{part}: replaying {n:,} MovieLens ratings into {topic} ({partitions} partition(s))")
    replay = checknrun_json(
        "trainer.replay",
        [
            *("replay", "--data", "movielens", "--to", f"{url}?partitions={partitions}"),
            *("--max-events", str(n), "--json", "--no-progress"),
        ],
    )
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    try:
        with tempfile.TemporaryDirectory(prefix=f"bench-{part}-") as tmp:
            for r in range(rounds):
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    log(f"{part}: round {r + 1}/{rounds}, {arm}")
                    runs[arm].append(train(arm, url, Path(tmp) / f"{arm}-{r}", r))
    finally:
        delete_topic(bootstrap, topic)
    return replay, runs


def checknrun_json(module: str, argv: list[str]) -> dict[str, Any]:
    """`python -m MODULE ARGV` in the repository; its JSON report (CommandError on failure)."""
    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    if done.returncode != 0:
        raise CommandError(f"{module} {argv[0]} failed: {done.stderr.strip()[-2000:]}")
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def delete_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(confluent_config({"bootstrap.servers": bootstrap}))
    for future in admin.delete_topics([topic]).values():
        try:
            future.result(timeout=30)
        except Exception as exc:  # a leftover topic is not worth failing the measurement
            log(f"live: could not delete topic {topic}: {exc}")


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(float(r[key]) for r in runs), 2)


def _summary(
    arms: dict[str, list[dict[str, Any]]], n: int, partitions: int, replay: dict[str, Any]
) -> dict[str, Any]:
    file_rate = _median(arms["file"], "samples_per_s")
    kafka_rate = _median(arms["kafka"], "samples_per_s")
    per_round = [
        k["samples_per_s"] / f["samples_per_s"]
        for k, f in zip(arms["kafka"], arms["file"], strict=True)
    ]
    return {
        "part": "live",
        "machine": describe_machine(),
        "samples": n,
        "partitions": partitions,
        "replay_events_per_s": replay.get("events_per_s"),
        "runs": arms,
        "file_samples_per_s": file_rate,
        "kafka_samples_per_s": kafka_rate,
        "ratio_kafka_to_file": round(kafka_rate / file_rate, 3),
        "ratio_per_round_median": round(statistics.median(per_round), 3),
        "train_thread_cpu_ratio": round(
            _median(arms["kafka"], "train_thread_cpu_us_per_sample")
            / _median(arms["file"], "train_thread_cpu_us_per_sample"),
            3,
        ),
        "reader_cpu_us_per_event": _median(arms["kafka"], "reader_cpu_us_per_event"),
        "max_consumer_lag": max(r["max_consumer_lag"] for r in arms["kafka"]),
        "auc_file": _median(arms["file"], "auc"),
        "auc_kafka": _median(arms["kafka"], "auc"),
    }


def _print(doc: dict[str, Any]) -> None:
    print(
        f"live training on MovieLens ({doc['samples']:,} samples, publishing from a "
        f"{doc['publish_in']}), medians of each arm"
    )
    print(f"{'arm':<6} {'samples/s':>10} {'train cpu us/sample':>20} {'auc':>8}")
    for arm in ("file", "kafka"):
        runs = doc["runs"][arm]
        print(
            f"{arm:<6} {_median(runs, 'samples_per_s'):>10,.0f} "
            f"{_median(runs, 'train_thread_cpu_us_per_sample'):>20.2f} "
            f"{_median(runs, 'auc'):>8.4f}"
        )
    print(
        f"kafka / file: {doc['ratio_kafka_to_file']}x (per round, median "
        f"{doc['ratio_per_round_median']}x); training-thread CPU {doc['train_thread_cpu_ratio']}x;"
        f" reader {doc['reader_cpu_us_per_event']} us CPU an event; max consumer lag at a "
        f"checkpoint {doc['max_consumer_lag']:,.0f}"
    )
