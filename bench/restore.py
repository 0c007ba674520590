"""Restore of baseline + chain, one thread vs one per core, next to `torch.load` of that state.

    python -m bench.restore [--tables 26 --rows 160000 --dim 64 --deltas 6
                                       --dirty 0.04 --codec int4 --repeats 3 --json OUT]

Builds a chain in a temporary file store (a full baseline, then `--deltas` consecutive deltas
touching `--dirty` of each table's rows), then times, side by side in one run: `restore()` with
one worker, `restore()` with its default (one per core), and `torch.load` of the restored state
saved as one full fp32 file. All reads come from the page cache. Medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.read.restore import restore_chain
from publisher.store import FileStore
from publisher.write.publishing import CheckpointPublisher
from publisher.write.snapshot import Snapshot, TableRows
from schemas.manifest import Position


def build_chain(root: Path, args: argparse.Namespace) -> FileStore:
    """Publish a baseline and `args.deltas` deltas of random rows into a file store at `root`."""
    rng = np.random.default_rng(0)
    store = FileStore(root)
    names = [f"embeddings.t{i:02d}" for i in range(args.tables)]
    weights = {n: rng.normal(size=(args.rows, args.dim)).astype(np.float32) for n in names}
    publisher = CheckpointPublisher(store, "bench")
    try:
        for version in range(args.deltas + 1):
            tables = []
            for name in names:
                if version == 0:
                    ids = np.arange(args.rows, dtype=np.int64)
                else:
                    ids = np.unique(rng.integers(0, args.rows, int(args.rows * args.dirty)))
                    weights[name][ids] += 0.01
                tables.append(
                    TableRows(name, args.rows, args.codec, ids, weights[name][ids],
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        store = build_chain(Path(tmp) / "store", args)
        chain = restore_plan(Catalog(store, "bench"))
        timings: dict[str, list[float]] = {"one_worker": [], "default_workers": [], "load": []}
        state = restore_chain(store, chain)
        full = {f"{n}.weight": torch.from_numpy(t.weights) for n, t in state.tables.items()}
        full.update({f"{n}.aux": torch.from_numpy(t.aux) for n, t in state.tables.items()})
        path = Path(tmp) / "full_fp32.pt"
        torch.save(full, path)
        for _ in range(args.repeats):  # interleaved, so load drifts hit every arm alike
            timings["one_worker"].append(restore_chain(store, chain, workers=1).seconds)
            timings["default_workers"].append(restore_chain(store, chain).seconds)
            started = time.perf_counter()
            torch.load(path, weights_only=True)
            timings["load"].append(time.perf_counter() - started)
        med = {k: statistics.median(v) for k, v in timings.items()}
        return {
            "tables": args.tables,
            "rows": args.rows,
            "dim": args.dim,
            "codec": args.codec,
            "chain_versions": len(chain),
            "fp32_bytes": path.stat().st_size,
            "bytes_read": state.bytes_read,
            "median_s": {k: round(v, 4) for k, v in med.items()},
            "one_worker_over_load": round(med["one_worker"] / med["load"], 2),
            "default_over_load": round(med["default_workers"] / med["load"], 2),
            "machine": {
                "cpus": os.cpu_count(),
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "torch": torch.__version__,
                "numpy": np.__version__,
            },
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.restore")
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=160_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--deltas", type=int, default=6)
    parser.add_argument("--dirty", type=float, default=0.04)
    parser.add_argument("--codec", default="int4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    doc = run(args)
    print(json.dumps(doc, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
