"""Part `restore`: baseline + chain, one thread vs one per core, next to `torch.load` of that state.

    checknrun bench restore [--tables 26 --rows 160000 --dim 64 --deltas 6 [19 ...]
                             --dirty 0.04 --codec int4 --repeats 3] [--quick] [--json OUT]

Builds one chain in a temporary file store (a full baseline, then consecutive deltas touching
`--dirty` of each table's rows), then times, side by side in one run, for each `--deltas` D
(the version D deltas after the baseline, a chain of D + 1 versions): `restore()` with one
worker, `restore()` with its default (one per core), and `torch.load` of that version's restored
state saved as one full fp32 file. `--deltas 1 19` compares a 2-version and a 20-version chain
in one run. All reads come from the page cache. Medians of `--repeats`, arms interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.machine import describe_machine
from publisher.cli import CommandError
from publisher.read.catalog import Catalog, VersionRef
from publisher.read.planner import restore_plan
from publisher.read.restore import restore_chain
from publisher.store import FileStore
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.snapshot import Snapshot, TableRows
from schemas.manifest import Position

#: the sizes `--quick` shrinks: option -> (default, quick). Given options win.
SIZES: dict[str, tuple[int, int]] = {
    "tables": (26, 4),
    "rows": (160_000, 10_000),
    "repeats": (3, 1),
}
#: the chains timed when `--deltas` is not given: (default, quick).
DELTAS: tuple[tuple[int, ...], tuple[int, ...]] = ((6,), (2,))


@dataclass(frozen=True)
class ChainShape:
    """The chain built: `tables` tables of `rows` x `dim`, a baseline and `deltas` deltas."""

    tables: int
    rows: int
    dim: int
    deltas: int
    dirty: float
    codec: str


def build_chain(root: Path, shape: ChainShape) -> FileStore:
    """Publish a baseline and `shape.deltas` deltas of random rows into a file store at `root`."""
    rng = np.random.default_rng(0)
    store = FileStore(root)
    names = [f"embeddings.t{i:02d}" for i in range(shape.tables)]
    weights = {n: rng.normal(size=(shape.rows, shape.dim)).astype(np.float32) for n in names}
    publisher = CheckpointPublisher(store, "bench")
    try:
        for version in range(shape.deltas + 1):
            tables = []
            for name in names:
                if version == 0:
                    ids = np.arange(shape.rows, dtype=np.int64)
                else:
                    ids = np.unique(rng.integers(0, shape.rows, int(shape.rows * shape.dirty)))
                    weights[name][ids] += 0.01
                tables.append(
                    TableRows(name, shape.rows, shape.codec, ids, weights[name][ids],
                              np.ones((len(ids), 1), dtype=np.float32))
                )  # fmt: skip
            publisher.publish(
                Snapshot(
                    kind="full" if version == 0 else "delta",
                    relative_to=None if version == 0 else "parent",
                    policy="consecutive",
                    tables=tuple(tables),
                    position=Position(step=version, samples_seen=version),
                )
            )
            print(f"published v{version + 1}", file=sys.stderr)
    finally:
        publisher.close()
    return store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The chain's shape and the repeats."""
    for name, (full, quick) in SIZES.items():
        parser.add_argument(f"--{name}", type=int, help=f"{name} (default {full}; --quick {quick})")
    parser.add_argument(
        "--deltas",
        type=int,
        nargs="+",
        help="restore the version this many deltas after the baseline; several values are timed "
        f"side by side on one chain (default {DELTAS[0][0]}; --quick {DELTAS[1][0]})",
    )
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument(
        "--dirty", type=float, default=0.04, help="fraction of each table's rows a delta touches"
    )
    parser.add_argument("--codec", default="int4")


def run(
    quick: bool,
    *,
    tables: int | None = None,
    rows: int | None = None,
    dim: int = 64,
    deltas: Sequence[int] | None = None,
    dirty: float = 0.04,
    codec: str = "int4",
    repeats: int | None = None,
) -> dict[str, Any]:
    """Build the chain, time the three arms per chain length, print the medians; the part's
    document."""

    def size(name: str, given: int | None) -> int:
        return given if given is not None else SIZES[name][quick]

    lengths = sorted(set(deltas if deltas else DELTAS[quick]))
    if lengths[0] < 0:
        raise CommandError(f"--deltas must be >= 0, got {lengths[0]}")
    shape = ChainShape(size("tables", tables), size("rows", rows), dim, lengths[-1], dirty, codec)
    doc = _measure(shape, lengths, size("repeats", repeats))
    for chain in doc["chains"]:
        print(
            f"restore of {shape.tables} x {shape.rows:,} x {shape.dim} {codec}, "
            f"{chain['chain_versions']} versions, median s: {chain['median_s']} "
            f"(one worker / load {chain['one_worker_over_load']}x, "
            f"default / load {chain['default_over_load']}x)"
        )
    return {"part": "restore", "quick": quick, **doc, "machine": describe_machine()}


def _measure(shape: ChainShape, lengths: list[int], repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        store = build_chain(Path(tmp) / "store", shape)
        catalog = Catalog(store, "bench")
        chains: dict[int, list[VersionRef]] = {}
        paths: dict[int, Path] = {}
        bytes_read: dict[int, int] = {}
        for d in lengths:
            chains[d] = restore_plan(catalog, d + 1)
            state = restore_chain(store, chains[d])
            full = {f"{n}.weight": torch.from_numpy(t.weights) for n, t in state.tables.items()}
            full.update({f"{n}.aux": torch.from_numpy(t.aux) for n, t in state.tables.items()})
            paths[d] = Path(tmp) / f"v{d + 1}_fp32.pt"
            torch.save(full, paths[d])
            bytes_read[d] = state.bytes_read
            del state, full
        arms = ("one_worker", "default_workers", "load")
        timings: dict[int, dict[str, list[float]]] = {d: {a: [] for a in arms} for d in lengths}
        for _ in range(repeats):  # interleaved, so load drifts hit every arm alike
            for d in lengths:
                timings[d]["one_worker"].append(restore_chain(store, chains[d], workers=1).seconds)
                timings[d]["default_workers"].append(restore_chain(store, chains[d]).seconds)
                started = time.perf_counter()
                torch.load(paths[d], weights_only=True)
                timings[d]["load"].append(time.perf_counter() - started)
        results = []
        for d in lengths:
            med = {k: statistics.median(v) for k, v in timings[d].items()}
            results.append(
                {
                    "chain_versions": len(chains[d]),
                    "bytes_read": bytes_read[d],
                    "median_s": {k: round(v, 4) for k, v in med.items()},
                    "one_worker_over_load": round(med["one_worker"] / med["load"], 2),
                    "default_over_load": round(med["default_workers"] / med["load"], 2),
                }
            )
        return {
            "tables": shape.tables,
            "rows": shape.rows,
            "dim": shape.dim,
            "codec": shape.codec,
            "dirty": shape.dirty,
            "fp32_bytes": paths[lengths[0]].stat().st_size,
            "chains": results,
        }
