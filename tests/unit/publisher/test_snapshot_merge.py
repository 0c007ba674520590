"""Merging a newer snapshot into a pending one: union of rows, newest values."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from publisher.write.snapshot import Snapshot, SnapshotMergeError, TableRows
from schemas.id_map_blob import IdEntries
from schemas.manifest import Position


def rows(ids: list[int], fill: float, name: str = "t") -> TableRows:
    n = len(ids)
    return TableRows(
        name=name,
        table_rows=10,
        codec="fp32",
        row_ids=np.array(ids, dtype=np.int64),
        values=np.full((n, 2), fill, dtype=np.float32),
        aux=np.full((n, 1), fill * 10, dtype=np.float32),
    )


def snap(kind: str, table: TableRows, step: int) -> Snapshot:
    return Snapshot(
        kind=kind,  # type: ignore[arg-type]
        relative_to=None if kind == "full" else "parent",
        policy="consecutive",
        tables=(table,),
        position=Position(step=step, samples_seen=step),
        dense={"w": np.full(3, step, dtype=np.float32)},
    )


def test_delta_into_delta_is_union_with_newest_values() -> None:
    merged = snap("delta", rows([1, 4, 7], 1.0), 1).merge(snap("delta", rows([4, 9], 2.0), 2))
    t = merged.tables[0]
    assert t.row_ids.tolist() == [1, 4, 7, 9]
    assert t.values[:, 0].tolist() == [1.0, 2.0, 1.0, 2.0]
    assert t.aux[:, 0].tolist() == [10.0, 20.0, 10.0, 20.0]
    assert merged.kind == "delta" and merged.merged == 2
    assert merged.position.step == 2 and merged.dense["w"][0] == 2


def test_delta_into_full_stays_full() -> None:
    full = snap("full", rows(list(range(10)), 1.0), 1)
    merged = full.merge(snap("delta", rows([3], 5.0), 2))
    assert merged.kind == "full" and merged.relative_to is None
    assert merged.tables[0].n_rows == 10 and merged.tables[0].values[3, 0] == 5.0


def test_full_replaces_pending() -> None:
    merged = snap("delta", rows([1], 1.0), 1).merge(snap("full", rows(list(range(10)), 3.0), 2))
    assert merged.kind == "full" and float(merged.tables[0].values.min()) == 3.0


def test_memory_stays_bounded_by_one_copy() -> None:
    pending = snap("delta", rows([0], 0.0), 0)
    rng = np.random.default_rng(0)
    for step in range(1, 200):
        ids = sorted(set(rng.integers(0, 10, size=4).tolist()))
        pending = pending.merge(snap("delta", rows(ids, float(step)), step))
    assert pending.tables[0].n_rows <= 10
    assert pending.merged == 200


def with_ids(table: TableRows, keys: list[str], count: int) -> TableRows:
    n = len(keys)
    entries = IdEntries(
        np.array([bool(k) for k in keys]),
        np.full(n, count, dtype=np.int64),
        np.full(n, float(count)),
        tuple(keys),
    )
    return replace(table, id_entries=entries)


def test_id_entries_merge_with_their_rows() -> None:
    older = with_ids(rows([1, 4, 7], 1.0), ["a", "b", "c"], 1)
    newer = with_ids(rows([4, 9], 2.0), ["", "b"], 2)  # b moved from row 4 to row 9
    merged = snap("delta", older, 1).merge(snap("delta", newer, 2)).tables[0]
    assert merged.row_ids.tolist() == [1, 4, 7, 9]
    assert merged.id_entries is not None
    assert merged.id_entries.keys == ("a", "", "c", "b")
    assert merged.id_entries.counts.tolist() == [1, 2, 1, 2]
    assert merged.id_entries.assigned.tolist() == [True, False, True, True]
    assert merged.nbytes > rows([1, 4, 7, 9], 0.0).nbytes


def test_rows_with_and_without_an_id_map_do_not_merge() -> None:
    mapped = with_ids(rows([1], 1.0), ["a"], 1)
    for older, newer in (
        (mapped, rows([2], 2.0)),
        (rows([2], 2.0), mapped),
        (mapped, replace(with_ids(rows([3], 2.0), [""], 1), id_map_hashed=True)),
    ):
        with pytest.raises(SnapshotMergeError, match="cannot be merged"):
            older.merge(newer)
