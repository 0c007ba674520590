"""Part `livejob`: a live topic trained by a sharded job of N ranks next to one process.

    checknrun bench livejob [--samples 200000] [--nproc 2] [--partitions 4] [--rounds 1]
                            [--quick] [--json OUT]

Needs Kafka (CHECKNRUN_KAFKA_BOOTSTRAP; source ~/.cache/checknrun/services/env). MovieLens-1M's
first `--samples` ratings are replayed into a fresh topic of `--partitions` partitions
(`checknrun replay`, raw ids, keyed by user), then each round trains it from the start with
`--stop-at-end`, one arm after the other, in reverse order every other round:

- 1 process: `checknrun train --data kafka://.../TOPIC --id-space hash --count-features ''`;
- 1 process, dynamic: `--id-space dynamic` with the default count features (user, item);
- N ranks: the same with `--nproc N --sharding row_wise` (each rank reads its partitions,
  trainer/sharded/step_votes.py);
- N ranks, dynamic: `--nproc N --sharding row_wise --id-space dynamic` with the default count
  features (user, item): each id mapped by its owner rank, two all-gathers a step
  (trainer/sharded/owned_ids.py, docs/FORMAT.md 7.2).

The arms train tables of the sizes part `live` uses, the same global batch, and publish to a
file store at the end only (the default interval is longer than the run). Reported per arm:
samples/s (the training loop's wall clock: the job's samples over rank 0's loop time for an
N-rank arm), then the medians, N ranks / 1 process (hashed) and dynamic / hashed at N ranks and
in one process (what the exchange adds to what mapping raw ids costs anyway).
On this 2-core machine N ranks share the cores with their N reader processes and the broker:
the figure says what the split costs here, not what N machines gain.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.live import (
    ID_CAPACITY,
    MOVIELENS_SAMPLES,
    alternating_rounds,
    checknrun_json,
    kafka_bootstrap,
)
from bench.machine import describe_machine
from publisher.cli import positive_int

DEFAULT_SAMPLES = 200_000
BATCH = 512
ARMS = ("process", "process-dynamic", "job", "job-dynamic")
#: the hashed arms: no id map, no count feature.
HASHED = ["--id-space", "hash", "--count-features", ""]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Samples, ranks, the topic's partitions and rounds."""
    parser.add_argument(
        "--samples",
        type=positive_int,
        help=f"MovieLens ratings to replay and train on (default {DEFAULT_SAMPLES:,}; --quick "
        "20,000)",
    )
    parser.add_argument("--nproc", type=positive_int, default=2, help="ranks of the job arm")
    parser.add_argument("--partitions", type=positive_int, default=4, help="of the topic")
    parser.add_argument("--rounds", type=positive_int, default=1, help="default %(default)s")


def run(
    quick: bool,
    *,
    samples: int | None = None,
    nproc: int = 2,
    partitions: int = 4,
    rounds: int = 1,
) -> dict[str, Any]:
    """Measure (see the module docstring); progress to stderr, the table to stdout."""
    bootstrap = kafka_bootstrap("livejob")
    n = min(samples or (20_000 if quick else DEFAULT_SAMPLES), MOVIELENS_SAMPLES)
    _, arms = alternating_rounds(
        bootstrap,
        "livejob",
        n,
        partitions,
        ARMS,
        rounds,
        lambda arm, url, store, r: _train(arm, url, store, r, nproc),
    )
    process = statistics.median(a["samples_per_s"] for a in arms["process"])
    process_dynamic = statistics.median(a["samples_per_s"] for a in arms["process-dynamic"])
    job = statistics.median(a["samples_per_s"] for a in arms["job"])
    dynamic = statistics.median(a["samples_per_s"] for a in arms["job-dynamic"])
    doc = {
        "part": "livejob",
        "machine": describe_machine(),
        "samples": n,
        "partitions": partitions,
        "nproc": nproc,
        "batch_size": BATCH,
        "runs": arms,
        "process_samples_per_s": round(process, 1),
        "process_dynamic_samples_per_s": round(process_dynamic, 1),
        "job_samples_per_s": round(job, 1),
        "job_dynamic_samples_per_s": round(dynamic, 1),
        "ratio_job_to_process": round(job / process, 3),
        "ratio_dynamic_to_hashed_job": round(dynamic / job, 3),
        "ratio_dynamic_to_hashed_process": round(process_dynamic / process, 3),
    }
    print(f"live topic of {partitions} partitions, {n:,} MovieLens events, medians")
    print(f"{'arm':<18} {'samples/s':>10}")
    print(f"{'1 process':<18} {process:>10,.0f}")
    print(f"{'1 process, dynamic':<18} {process_dynamic:>10,.0f}")
    print(f"{f'{nproc} ranks':<18} {job:>10,.0f}")
    print(f"{f'{nproc} ranks, dynamic':<18} {dynamic:>10,.0f}")
    print(f"{nproc} ranks / 1 process: {doc['ratio_job_to_process']}x")
    print(f"dynamic / hashed at {nproc} ranks: {doc['ratio_dynamic_to_hashed_job']}x")
    print(f"dynamic / hashed in 1 process: {doc['ratio_dynamic_to_hashed_process']}x")
    return doc


def _train(arm: str, url: str, store: Path, r: int, nproc: int) -> dict[str, Any]:
    space = ["--id-space", "dynamic"] if arm.endswith("-dynamic") else HASHED
    command = [
        *("train", "--data", url, "--stop-at-end", *space),
        *("--id-capacity", ID_CAPACITY, "--batch-size", str(BATCH)),
        *("--store", f"file://{store}", "--model", f"{arm}-{r}", "--json", "--no-progress"),
    ]
    if arm.startswith("job"):
        command += ["--nproc", str(nproc), "--sharding", "row_wise"]
    doc = checknrun_json("trainer.cli", command)
    return {
        "samples": doc["samples"],
        "samples_per_s": doc["samples_per_s"],
        "bad_events": doc["stream"]["bad_events"],
    }
