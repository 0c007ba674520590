"""A job of several ranks simulated by threads of one process: for tests of sharded publishing.

A sharded trainer hands each rank's publisher the rows of the tables (or row ranges) that rank
holds, and rank 0 the dense state. `split_snapshot` cuts one process's snapshot
(bench/synthetic_run.py) that way, so the job's versions can be compared with what one writer
publishing the whole snapshot commits. `on_ranks` runs one function per rank on its own thread,
as the ranks' processes would, and returns each rank's result or error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Literal, TypeVar

import numpy as np

from bench.synthetic_run import SyntheticRun
from publisher.store import ObjectStore
from publisher.write.job_publishing import JobPublisher, ThreadCollective
from publisher.write.snapshot import Snapshot, TableRows
from schemas.announcement import Announcement
from schemas.manifest import Position

T = TypeVar("T")

#: table -> the (rank, row range) pieces it is held in; a range of None: the whole table.
Layout = dict[str, list[tuple[int, tuple[int, int] | None]]]


def table_wise(tables: Sequence[str], ranks: int) -> Layout:
    """Each table whole on one rank, round robin."""
    return {name: [(i % ranks, None)] for i, name in enumerate(tables)}


def row_wise(table_rows: Mapping[str, int], ranks: int) -> Layout:
    """Each table cut into `ranks` row ranges as even as the rows allow, rank r holding the
    r-th (a table of fewer rows than ranks goes to the first ones)."""
    layout: Layout = {}
    for name, rows in table_rows.items():
        bounds = np.linspace(0, rows, ranks + 1).round().astype(int)
        layout[name] = [
            (r, (int(bounds[r]), int(bounds[r + 1])))
            for r in range(ranks)
            if bounds[r] < bounds[r + 1]
        ]
    return layout


def split_snapshot(snapshot: Snapshot, layout: Layout, ranks: int) -> list[Snapshot]:
    """Each rank's part of `snapshot`: the rows of its tables and row ranges (global row ids),
    the dense state on rank 0 only, and its share of the samples seen."""
    parts: list[list[TableRows]] = [[] for _ in range(ranks)]
    for table in snapshot.tables:
        for rank, row_range in layout[table.name]:
            if row_range is None:
                parts[rank].append(table)
                continue
            start, end = row_range
            keep = (table.row_ids >= start) & (table.row_ids < end)
            parts[rank].append(
                replace(
                    table,
                    row_ids=table.row_ids[keep],
                    values=table.values[keep],
                    aux=table.aux[keep],
                    row_range=row_range,
                )
            )
    position = snapshot.position
    share = np.diff(np.linspace(0, position.samples_seen, ranks + 1).round().astype(int))
    return [
        replace(
            snapshot,
            tables=tuple(parts[rank]),
            position=Position(
                step=position.step,
                samples_seen=int(share[rank]),
                reader={"rank": rank, "offset": int(share[:rank].sum())},
            ),
            dense=snapshot.dense if rank == 0 else {},
            optimizer=snapshot.optimizer if rank == 0 else {},
            optimizer_meta=snapshot.optimizer_meta if rank == 0 else {},
        )
        for rank in range(ranks)
    ]


def on_ranks(ranks: int, work: Callable[[int], T], timeout_s: float = 60.0) -> list[T | Exception]:
    """`work(rank)` for every rank at once, each on its own thread: each rank's result or the
    exception it raised."""
    results: list[T | Exception] = [TimeoutError(f"rank {r} did not finish") for r in range(ranks)]

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return results


def job_publishers(
    store: ObjectStore,
    model: str,
    ranks: int,
    timeout_s: float = 30.0,
    announce: Callable[[Announcement], None] | None = None,
) -> list[JobPublisher]:
    """One `JobPublisher` per rank of a job of `ranks` threads (built together: taking rank 0's
    lease is the job's first collective call); rank 0 announces with `announce`."""
    collectives = ThreadCollective.group(ranks, timeout_s)
    built = on_ranks(ranks, lambda r: JobPublisher(store, model, collectives[r], announce=announce))
    publishers = []
    for item in built:
        if isinstance(item, Exception):
            raise item
        publishers.append(item)
    return publishers


def publish_step(
    run: SyntheticRun, publishers: Sequence[JobPublisher], layout: Layout, index: int
) -> None:
    """Version `index + 1` of the same state twice: `run` trains 2 steps and publishes it as
    one writer (a full first, then deltas), and the job of `publishers` (one per rank, as
    threads) publishes it cut by `layout`; a rank's failure is raised."""
    run.train(2)
    kind: Literal["full", "delta"] = "full" if index == 0 else "delta"
    parts = split_snapshot(replace(run.snapshot(kind), sequence=index + 1), layout, len(publishers))
    run.publish(kind)
    for result in on_ranks(len(publishers), lambda r: publishers[r].publish(parts[r])):
        if isinstance(result, Exception):
            raise result
