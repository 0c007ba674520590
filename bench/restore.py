"""Part `restore`: baseline + chain, one thread vs one per core, next to `torch.load` of that state.

    checknrun bench restore [--tables 26 --rows 160000 --dim 64 --deltas 6
                             --dirty 0.04 --codec int4 --repeats 3] [--quick] [--json OUT]

Builds a chain in a temporary file store (a full baseline, then `--deltas` consecutive deltas
touching `--dirty` of each table's rows), then times, side by side in one run: `restore()` with
one worker, `restore()` with its default (one per core), and `torch.load` of the restored state
saved as one full fp32 file. All reads come from the page cache. Medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.machine import describe_machine
from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.read.restore import restore_chain
from publisher.store import FileStore
from publisher.write.publishing import CheckpointPublisher
from publisher.write.snapshot import Snapshot, TableRows
from schemas.manifest import Position

#: the sizes `--quick` shrinks: option -> (default, quick). Given options win.
SIZES: dict[str, tuple[int, int]] = {
    "tables": (26, 4),
    "rows": (160_000, 10_000),
    "deltas": (6, 2),
    "repeats": (3, 1),
}


@dataclass(frozen=True)
class ChainShape:
    """The chain restored: `tables` tables of `rows` x `dim`, a baseline and `deltas` deltas."""

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
        help = "deltas after the baseline" if name == "deltas" else name
        parser.add_argument(f"--{name}", type=int, help=f"{help} (default {full}; --quick {quick})")
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
    deltas: int | None = None,
    dirty: float = 0.04,
    codec: str = "int4",
    repeats: int | None = None,
) -> dict[str, Any]:
    """Build the chain, time the three arms, print the medians; the part's document."""

    def size(name: str, given: int | None) -> int:
        return given if given is not None else SIZES[name][quick]

    shape = ChainShape(
        size("tables", tables), size("rows", rows), dim, size("deltas", deltas), dirty, codec
    )
    doc = _measure(shape, size("repeats", repeats))
    print(
        f"restore of {shape.tables} x {shape.rows:,} x {shape.dim} {codec}, "
        f"{doc['chain_versions']} versions, median s: {doc['median_s']} "
        f"(one worker / load {doc['one_worker_over_load']}x, "
        f"default / load {doc['default_over_load']}x)"
    )
    return {"part": "restore", "quick": quick, **doc, "machine": describe_machine()}


def _measure(shape: ChainShape, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        store = build_chain(Path(tmp) / "store", shape)
        chain = restore_plan(Catalog(store, "bench"))
        timings: dict[str, list[float]] = {"one_worker": [], "default_workers": [], "load": []}
        state = restore_chain(store, chain)
        full = {f"{n}.weight": torch.from_numpy(t.weights) for n, t in state.tables.items()}
        full.update({f"{n}.aux": torch.from_numpy(t.aux) for n, t in state.tables.items()})
        path = Path(tmp) / "full_fp32.pt"
        torch.save(full, path)
        for _ in range(repeats):  # interleaved, so load drifts hit every arm alike
            timings["one_worker"].append(restore_chain(store, chain, workers=1).seconds)
            timings["default_workers"].append(restore_chain(store, chain).seconds)
            started = time.perf_counter()
            torch.load(path, weights_only=True)
            timings["load"].append(time.perf_counter() - started)
        med = {k: statistics.median(v) for k, v in timings.items()}
        return {
            "tables": shape.tables,
            "rows": shape.rows,
            "dim": shape.dim,
            "codec": shape.codec,
            "chain_versions": len(chain),
            "fp32_bytes": path.stat().st_size,
            "bytes_read": state.bytes_read,
            "median_s": {k: round(v, 4) for k, v in med.items()},
            "one_worker_over_load": round(med["one_worker"] / med["load"], 2),
            "default_over_load": round(med["default_workers"] / med["load"], 2),
        }
