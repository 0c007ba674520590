"""Part `shards`: a job of N ranks publishing row-range shards next to one writer of the same state.

    checknrun bench shards [--ranks 2 --tables 8 --rows 200000 --dim 64 --dirty 0.04
                            --codec int4 --repeats 4] [--quick] [--json OUT]

Per repeat, in fresh file stores, both arms publish the same two snapshots (a full, then a delta
touching `--dirty` of each table's rows), interleaved, the first arm alternating: one
`CheckpointPublisher` of the whole snapshot, and a job of `--ranks` ranks (threads of this
process: `ThreadCollective`, `JobPublisher`) each holding a row range of every table
(bench/sharded_run.py). It then times `restore()` of each arm's delta version (the sharded one
fetches and joins the shard blobs).

The ranks are threads of one process on this machine's cores, not trainers on their own hosts:
the figure is what the job's protocol (three collective calls, a blob per shard, the parts
joined into one manifest) costs next to one writer, and whether encoding and uploading the
shards in parallel pays here; per-rank write bytes show how the upload divides over ranks.
Medians of `--repeats` (an even number gives each arm the first place equally often).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.machine import describe_machine
from bench.sharded_run import job_publishers, on_ranks, row_wise, split_snapshot
from publisher.cli import CommandError
from publisher.read.restore import restore
from publisher.store import FileStore
from publisher.write.job_publishing import CheckpointPublisher, JobPublisher
from publisher.write.publishing import PublishResult
from publisher.write.snapshot import Snapshot, TableRows
from schemas.manifest import Manifest, Position

#: the sizes `--quick` shrinks: option -> (default, quick). Given options win.
SIZES: dict[str, tuple[int, int]] = {
    "tables": (8, 3),
    "rows": (200_000, 5_000),
    "repeats": (4, 1),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape, the job's ranks and the repeats."""
    for name, (full, quick) in SIZES.items():
        parser.add_argument(f"--{name}", type=int, help=f"{name} (default {full}; --quick {quick})")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the job (threads)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument(
        "--dirty", type=float, default=0.04, help="fraction of each table's rows the delta holds"
    )
    parser.add_argument("--codec", default="int4")


def _snapshots(
    tables: int, rows: int, dim: int, dirty: float, codec: str
) -> tuple[Snapshot, Snapshot]:
    """A full snapshot of `tables` tables and a delta of `dirty` of their rows (sequence 1, 2)."""
    rng = np.random.default_rng(0)
    full, delta = [], []
    for i in range(tables):
        weights = rng.normal(size=(rows, dim)).astype(np.float32)
        aux = rng.random((rows, 1), dtype=np.float32)
        every = np.arange(rows, dtype=np.int64)
        full.append(TableRows(f"emb.t{i:02d}", rows, codec, every, weights, aux))
        ids = np.unique(rng.integers(0, rows, int(rows * dirty))).astype(np.int64)
        delta.append(TableRows(f"emb.t{i:02d}", rows, codec, ids, weights[ids] + 1, aux[ids] + 1))
    dense = {"mlp.w": rng.normal(size=(256, 256)).astype(np.float32)}
    base = Snapshot(
        kind="full",
        relative_to=None,
        policy="consecutive",
        tables=tuple(full),
        position=Position(step=1, samples_seen=1000),
        dense=dense,
        sequence=1,
    )
    after = replace(
        base,
        kind="delta",
        relative_to="parent",
        tables=tuple(delta),
        position=Position(step=2, samples_seen=2000),
        sequence=2,
    )
    return base, after


def _publish_job(publishers: list[JobPublisher], parts: list[Snapshot]) -> PublishResult:
    """Every rank's `publish` of its part at once; the committed version."""
    results = on_ranks(len(publishers), lambda r: publishers[r].publish(parts[r]), 600)
    for result in results:
        if not isinstance(result, PublishResult):
            raise RuntimeError(f"the job's publish failed: {result!r}")
    first = results[0]
    assert isinstance(first, PublishResult)
    return first


def _bytes_per_rank(manifest: Manifest, ranks: int) -> list[int]:
    """Blob bytes each rank wrote for `manifest` (by the rRRRR/ segment of the keys)."""
    per_rank = [0] * ranks
    for blob in manifest.blobs:
        for rank in range(ranks):
            if f"/r{rank:04d}/" in blob.key:
                per_rank[rank] += blob.size
    return per_rank


def run(
    quick: bool,
    *,
    ranks: int = 2,
    tables: int | None = None,
    rows: int | None = None,
    dim: int = 64,
    dirty: float = 0.04,
    codec: str = "int4",
    repeats: int | None = None,
) -> dict[str, Any]:
    """Time both arms, print the medians and ratios; the part's document."""
    if ranks < 1:
        raise CommandError(f"--ranks must be >= 1, got {ranks}")
    n_tables = tables if tables is not None else SIZES["tables"][quick]
    n_rows = rows if rows is not None else SIZES["rows"][quick]
    n_repeats = repeats if repeats is not None else SIZES["repeats"][quick]
    full, delta = _snapshots(n_tables, n_rows, dim, dirty, codec)
    layout = row_wise({t.name: n_rows for t in full.tables}, ranks)
    parts = [split_snapshot(s, layout, ranks) for s in (full, delta)]
    arms = ("one_writer", "job")
    publish: dict[str, dict[str, list[float]]] = {
        a: {"full": [], "delta": []} for a in ("one_writer", "job")
    }
    restored: dict[str, list[float]] = {a: [] for a in arms}
    per_rank: dict[str, list[int]] = {}
    # One untimed round first: the codec kernels' first call (torch's lazy op loading) costs
    # seconds, which would land on whichever arm ran first.
    for repeat in range(-1, n_repeats):
        with tempfile.TemporaryDirectory() as tmp:
            stores = {a: FileStore(Path(tmp) / a) for a in arms}
            writer = CheckpointPublisher(stores["one_writer"], "bench")
            publishers = job_publishers(stores["job"], "bench", ranks, timeout_s=600)
            # Which arm goes first alternates: the first to allocate its copies pays page
            # faults the second finds mapped already (2x on the full here).
            order = arms if repeat % 2 == 0 else arms[::-1]
            try:
                for kind, snapshot, rank_parts in zip(
                    ("full", "delta"), (full, delta), parts, strict=True
                ):
                    for arm in order:
                        started = time.perf_counter()
                        if arm == "one_writer":
                            writer.publish(snapshot)
                        else:
                            result = _publish_job(publishers, rank_parts)
                            per_rank[kind] = _bytes_per_rank(result.manifest, ranks)
                        if repeat >= 0:
                            publish[arm][kind].append(time.perf_counter() - started)
            finally:
                writer.close()
                for publisher in publishers:
                    publisher.close()
            states = {}
            for arm in order:
                states[arm] = restore(stores[arm], "bench", 2)
                if repeat >= 0:
                    restored[arm].append(states[arm].seconds)
            for name, table in states["one_writer"].tables.items():
                if states["job"].tables[name].weights.tobytes() != table.weights.tobytes():
                    raise RuntimeError(f"table {name}: the job's version restores differently")
            del states
    med = {a: {k: statistics.median(v) for k, v in publish[a].items()} for a in arms}
    restore_med = {a: statistics.median(v) for a, v in restored.items()}
    ratios = {k: round(med["job"][k] / med["one_writer"][k], 2) for k in ("full", "delta")}
    doc = {
        "part": "shards",
        "quick": quick,
        "ranks": ranks,
        "tables": n_tables,
        "rows": n_rows,
        "dim": dim,
        "dirty": dirty,
        "codec": codec,
        "repeats": n_repeats,
        "publish_median_s": {a: {k: round(v, 4) for k, v in med[a].items()} for a in arms},
        "job_over_one_writer": ratios,
        "bytes_per_rank": per_rank,
        "restore_median_s": {a: round(v, 4) for a, v in restore_med.items()},
        "restore_sharded_over_whole": round(restore_med["job"] / restore_med["one_writer"], 2),
        "machine": describe_machine(),
    }
    for kind in ("full", "delta"):
        print(
            f"publish {kind} of {n_tables} x {n_rows:,} x {dim} {codec}: one writer "
            f"{med['one_writer'][kind]:.3f} s, job of {ranks} ranks {med['job'][kind]:.3f} s "
            f"({ratios[kind]}x); bytes per rank {per_rank[kind]}"
        )
    print(
        f"restore of the delta version: whole tables {restore_med['one_writer']:.3f} s, "
        f"{ranks} shards per table {restore_med['job']:.3f} s "
        f"({doc['restore_sharded_over_whole']}x)"
    )
    return doc
