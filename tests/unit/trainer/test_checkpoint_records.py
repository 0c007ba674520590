"""Records are filled from publishing results by sequence number: a version settles its own
record and marks every earlier unpublished one as merged into it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from publisher.store import FileStore
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.publishing import PublishResult
from publisher.write.snapshot import Snapshot, TableRows
from schemas.manifest import Position
from trainer.checkpoint_records import CheckpointRecord, CheckpointRecords

TABLE_ROWS = {"t": 10}


def snapshot(sequence: int, ids: list[int], kind: str = "delta") -> Snapshot:
    n = len(ids)
    rows = TableRows(
        name="t",
        table_rows=10,
        codec="fp32",
        row_ids=np.array(ids, dtype=np.int64),
        values=np.full((n, 2), float(sequence), dtype=np.float32),
        aux=np.zeros((n, 1), dtype=np.float32),
    )
    return Snapshot(
        kind=kind,  # type: ignore[arg-type]
        relative_to=None if kind == "full" else "parent",
        policy="consecutive",
        tables=(rows,),
        position=Position(step=sequence, samples_seen=100 * sequence),
        metrics={"auc": 0.5},
        # Equal clocks must not matter: records are found by sequence, not by time.
        taken_at=1234.5,
        sequence=sequence,
    )


def take(ledger: CheckpointRecords, ids: list[int], kind: str = "delta") -> Snapshot:
    snap = snapshot(ledger.next_index, ids, kind)
    dirty = {"t": np.array(ids, dtype=np.int64)}
    ledger.add(CheckpointRecord.of(snap, dirty, TABLE_ROWS))
    return snap


def test_record_of_a_snapshot() -> None:
    snap = snapshot(3, [1, 4, 5, 9])
    record = CheckpointRecord.of(snap, {"t": np.array([1, 4], dtype=np.int64)}, TABLE_ROWS)
    assert (record.index, record.kind, record.step, record.samples_seen) == (3, "delta", 3, 300)
    assert record.dirty_fraction == {"t": 0.2} and record.dirty_fraction_total == 0.2
    assert record.rows_copied == 4 and record.snapshot_bytes == snap.nbytes
    assert record.metrics == {"auc": 0.5} and not record.published and record.ratio is None


def test_settle_by_sequence_marks_merged_snapshots(tmp_path: Path) -> None:
    publisher = CheckpointPublisher(FileStore(tmp_path), "ledger")
    ledger = CheckpointRecords()
    results: list[PublishResult] = []
    try:
        first = take(ledger, list(range(10)), "full")
        results.append(publisher.publish(first))
        # Two snapshots waited behind a busy publisher and went out folded into one.
        second, third = take(ledger, [1, 2]), take(ledger, [2, 3])
        results.append(publisher.publish(second.merge(third)))
        take(ledger, [7])  # taken, not yet published
    finally:
        publisher.close()
    assert [r.sequence for r in results] == [1, 3]

    ledger.settle(results[:1])
    ledger.settle(results[:1])  # idempotent
    records = ledger.records
    assert [r.version for r in records] == [1, None, None, None]
    ledger.settle(results)
    assert [r.version for r in records] == [1, None, 2, None]
    assert [r.merged_into for r in records] == [None, 2, None, None]
    assert [r.published for r in records] == [True, True, True, False]
    assert records[2].published_kind == "delta" and records[2].bytes == results[1].bytes_written
    assert records[2].full_fp32_bytes == results[1].full_fp32_bytes
    assert ledger.get(0) is None and ledger.get(5) is None and ledger.get(4) is records[3]
