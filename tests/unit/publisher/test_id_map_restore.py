"""Restore's id maps against hostile stores: every blob verified and decoded as hostile, the
chain rebuilt newest first, and anything wrong a typed error with no map returned."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from publisher.id_map import IdMap
from publisher.memory_budget import ID_MAP_ROW_BYTES, MemoryBudget
from publisher.read.catalog import Catalog
from publisher.read.id_map_rows import NewestIdEntries, read_id_entries
from publisher.read.restore import RestoreError, restore
from publisher.store import FileStore, IntegrityError
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.snapshot import Snapshot, TableRows
from schemas.id_map_blob import IdEntries, IdMapBlobError, encode_id_entries
from schemas.manifest import Position

ROWS = 10


def publish(store: FileStore, steps: list[tuple[str, IdMap, list[int] | None]]) -> None:
    """One version per step: (kind, the map, the rows it carries: None for all)."""
    publisher = CheckpointPublisher(store, "m")
    try:
        for step, (kind, id_map, ids) in enumerate(steps):
            row_ids = np.arange(ROWS) if ids is None else np.array(ids, dtype=np.int64)
            table = TableRows(
                name="users",
                table_rows=ROWS,
                codec="fp32",
                row_ids=row_ids,
                values=np.full((len(row_ids), 2), step, dtype=np.float32),
                aux=np.zeros((len(row_ids), 0), dtype=np.float32),
                id_entries=id_map.entries(None if ids is None else row_ids),
                id_map_hashed=id_map.hashed,
            )
            publisher.publish(
                Snapshot(
                    kind=kind,  # type: ignore[arg-type]
                    relative_to=None if kind == "full" else "parent",
                    policy="consecutive",
                    tables=(table,),
                    position=Position(step=step, samples_seen=step),
                )
            )
    finally:
        publisher.close()


def three_versions(store: FileStore) -> list[IdMap]:
    """v1 full; v2 moves "b" from row 2 to row 6 and admits "d"; v3 counts "a" again."""
    m = IdMap(ROWS)
    for key, row in (("a", 1), ("b", 2), ("c", 3)):
        m.assign(key, row)
        m.counts[row] = row
    states = [m.copy()]
    steps: list[tuple[str, IdMap, list[int] | None]] = [("full", states[0], None)]
    m.release(2)
    m.assign("b", 6)
    m.assign("d", 2)
    m.counts[[2, 6]] = [1, 1]
    states.append(m.copy())
    steps.append(("delta", states[1], [2, 6]))
    m.counts[1] += 1
    m.last_seen[1] = 1.7e9
    states.append(m.copy())
    steps.append(("delta", states[2], [1]))
    publish(store, steps)
    return states


def same_map(a: IdMap, b: IdMap) -> bool:
    x, y = a.entries(), b.entries()
    return (
        x.keys == y.keys
        and np.array_equal(x.counts, y.counts)
        and np.array_equal(x.last_seen, y.last_seen)
        and a.hashed == b.hashed
        and len(a) == len(b)
    )


def test_each_version_restores_its_map(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    states = three_versions(store)
    for version, expected in enumerate(states, start=1):
        state = restore(store, "m", version)
        assert same_map(state.id_maps["users"], expected), version
    restored = restore(store, "m").id_maps["users"]
    assert (restored.row_of("b"), restored.row_of("d"), restored.counts[1]) == (6, 2, 2)
    # Its bytes are part of what restore read.
    manifests = [r.manifest for r in Catalog(store, "m").versions()]
    assert restore(store, "m").bytes_read == sum(m.total_bytes for m in manifests)


def test_a_table_without_an_id_map_restores_none(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    publisher = CheckpointPublisher(store, "m")
    rows = TableRows(
        "t", 3, "fp32", np.arange(3), np.zeros((3, 1), np.float32), np.zeros((3, 0), np.float32)
    )
    publisher.publish(Snapshot("full", None, "full", (rows,), Position(step=0, samples_seen=0)))
    publisher.close()
    assert restore(store, "m").id_maps == {}


def _rewrite(
    store: FileStore, root: Path, version: int, change: Callable[[dict[str, Any]], bytes | None]
) -> None:
    """Rewrite version's manifest (and, if `change` returns bytes, its id-map blob, with the
    manifest made to agree: size and sha256), as a buggy or malicious writer would."""
    ref = Catalog(store, "m").find(version)
    doc = json.loads((root / ref.key).read_bytes())
    entry = doc["tables"][0]
    data = change(entry)
    if data is not None:
        (root / entry["id_map"]["key"]).write_bytes(data)
        entry["id_map"]["size"], entry["id_map"]["sha256"] = (
            len(data),
            hashlib.sha256(data).hexdigest(),
        )
    (root / ref.key).write_text(json.dumps(doc))


def _entries(keys: list[str], counts: list[int] | None = None) -> IdEntries:
    n = len(keys)
    return IdEntries(
        np.array([bool(k) for k in keys]),
        np.array(counts or [0] * n, dtype=np.int64),
        np.zeros(n),
        tuple(keys),
    )


FORGED: dict[str, tuple[Callable[[dict[str, Any]], bytes | None], str]] = {
    # v2 carries rows 2 and 6.
    "an id on two rows": (
        lambda e: encode_id_entries(_entries(["x", "x"]), hashed=False),
        "rows 2 and 6",
    ),
    "an id a row outside the delta holds": (
        lambda e: encode_id_entries(_entries(["d", "a"]), hashed=False),
        "is assigned to rows 1 and 6",
    ),
    "another row count": (
        lambda e: encode_id_entries(_entries(["d"]), hashed=False),
        "1 rows, not 2",
    ),
    "a hashed blob in a dynamic chain": (
        lambda e: encode_id_entries(_entries(["", ""]), hashed=True),
        "disagree on whether its map is hashed",
    ),
    "negative counts": (
        lambda e: encode_id_entries(_entries(["d", "b"], counts=[-1, 0]), hashed=False),
        "counts must be >= 0",
    ),
    "garbage": (lambda e: b"\x00" * 64, "not a zstd frame"),
    "no id map in one version": (lambda e: e.pop("id_map") and None, "carry no id map"),
    "a declared size past the cap": (
        lambda e: e["id_map"].update(size=4096 + 2 * 281 + 1) or None,
        "is at most 4658 bytes",
    ),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_id_map_is_a_restore_error(tmp_path: Path, case: str) -> None:
    store = FileStore(tmp_path)
    three_versions(store)
    change, message = FORGED[case]
    _rewrite(store, tmp_path, 2, change)
    with pytest.raises(RestoreError, match=message):
        restore(store, "m", 3)
    with pytest.raises(RestoreError, match=message):
        restore(store, "m", 2)
    restore(store, "m", 1)  # the versions before it are untouched


def test_unassigned_row_zero_is_fine_but_an_id_on_it_is_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    three_versions(store)

    def on_row_zero(entry: dict[str, Any]) -> bytes:
        e = IdMap(ROWS).entries(np.arange(entry["rows_in_checkpoint"]))  # rows 0, 1, ...
        forged = IdEntries(e.assigned.copy(), e.counts, e.last_seen, ("zero", *e.keys[1:]))
        forged.assigned[0] = True
        return encode_id_entries(forged, hashed=False)

    _rewrite(store, tmp_path, 1, on_row_zero)
    with pytest.raises(RestoreError, match="row 0 cannot be assigned"):
        restore(store, "m", 1)


def test_bytes_that_disagree_with_the_manifest_are_an_integrity_error(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    three_versions(store)
    entry = Catalog(store, "m").find(2).manifest.table("users")
    assert entry.id_map is not None
    path = tmp_path / entry.id_map.key
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        restore(store, "m", 2)


def test_an_oversized_entry_is_refused_before_any_fetch(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    three_versions(store)
    _rewrite(store, tmp_path, 2, lambda e: e["id_map"].update(size=10**9) or None)
    entry = Catalog(store, "m").find(2).manifest.table("users")
    fetched: list[str] = []

    class Watching(FileStore):
        def get_range(self, key: str, start: int, length: int) -> bytes:
            fetched.append(key)
            return super().get_range(key, start, length)

    with pytest.raises(IdMapBlobError, match="at most"):
        read_id_entries(Watching(tmp_path), entry)
    assert fetched == []


def test_the_memory_budget_counts_the_id_maps(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    three_versions(store)
    catalog = Catalog(store, "m")
    target = catalog.find(3).manifest
    chain_id_map_bytes = sum(
        r.manifest.table("users").id_map.size  # type: ignore[union-attr]
        for r in catalog.versions()
    )
    needed = target.full_fp32_bytes + ROWS * ID_MAP_ROW_BYTES + chain_id_map_bytes
    restore(store, "m", budget=MemoryBudget(needed))
    with pytest.raises(RestoreError, match="memory budget"):
        restore(store, "m", budget=MemoryBudget(needed - 1))


def test_a_table_with_an_id_map_restores_whole_not_a_row_range(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    states = three_versions(store)
    with pytest.raises(
        RestoreError, match=r"carries an id map: it restores whole, not rows \[0, 5\)"
    ):
        restore(store, "m", rows={"users": (0, 5)})
    every = restore(store, "m", rows={"users": (0, ROWS)})
    assert same_map(every.id_maps["users"], states[-1])


def test_newest_id_entries_needs_every_row_of_a_hashed_map_and_frees_a_dynamic_ones() -> None:
    hashed = NewestIdEntries(4)
    assert hashed.add(np.array([1, 2]), _entries(["", ""]), hashed=True) == 2
    with pytest.raises(IdMapBlobError, match="no id-map entry for 2 rows"):
        hashed.build()
    rows = NewestIdEntries(4)
    assert rows.add(np.array([1, 2]), _entries(["a", "b"]), hashed=False) == 2
    assert rows.add(np.array([2, 3]), _entries(["zzz", "c"]), hashed=False) == 1  # 2 taken
    # a dynamic map's full may leave free rows out (docs/FORMAT.md 7.1): row 0 is free
    assert [rows.build().key_of(r) for r in range(4)] == [None, "a", "b", "c"]
    assert rows.add(np.arange(4), _entries(["", "x", "y", "z"]), hashed=False) == 1
    built = rows.build()
    assert [built.key_of(r) for r in range(4)] == [None, "a", "b", "c"]
    with pytest.raises(IdMapBlobError, match="3 id-map entries for 2 table rows"):
        NewestIdEntries(4).add(np.array([1, 2]), _entries(["a", "b", "c"]), hashed=False)


def test_a_full_leaving_rows_out_restores_them_as_zero_unless_its_map_is_hashed(
    tmp_path: Path,
) -> None:
    """docs/FORMAT.md 7.1: only a dynamic map's full may leave (free) rows out."""
    for hashed in (False, True):
        store = FileStore(tmp_path / str(hashed))
        publisher = CheckpointPublisher(store, "m")
        id_map = IdMap(4, hashed=hashed)
        if not hashed:
            id_map.assign("a", 2)
        ones = np.ones((2, 1), np.float32)
        rows = TableRows(
            "t", 4, "fp32", np.array([0, 2]), ones, ones.copy(),
            id_entries=id_map.entries(np.array([0, 2])), id_map_hashed=hashed,
        )  # fmt: skip
        publisher.publish(Snapshot("full", None, "full", (rows,), Position(step=0, samples_seen=0)))
        publisher.close()
        if hashed:
            with pytest.raises(RestoreError, match="no id-map entry for 2 rows"):
                restore(store, "m")
            continue
        table = restore(store, "m").tables["t"]
        assert table.weights[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
        assert table.aux[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
        assert table.unwritten.tolist() == [1, 3]


def test_a_full_leaving_out_the_unknown_row_is_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    publisher = CheckpointPublisher(store, "m")
    id_map = IdMap(4)
    id_map.assign("a", 2)
    ones = np.ones((1, 1), np.float32)
    rows = TableRows(
        "t", 4, "fp32", np.array([2]), ones, ones.copy(), id_entries=id_map.entries(np.array([2]))
    )
    publisher.publish(Snapshot("full", None, "full", (rows,), Position(step=0, samples_seen=0)))
    publisher.close()
    with pytest.raises(RestoreError, match="never row 0"):
        restore(store, "m")
