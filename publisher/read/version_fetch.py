"""A version's blobs fetched and verified, before anything is written to a model copy.

`fetch_version` reads every blob of a version through `publisher.read.restore.read_blob` (the
restore path's own fetch, size + sha256 check, hostile-input decode and manifest cross-check)
and the dense tensor blob through `get_verified` + `decode_tensors`, so a subscriber verifies
exactly what a restore verifies. A table a job stored in row-range shards (docs/FORMAT.md 3.3)
comes back from `read_blob` as one blob of global rows (its shards fetched in parallel and
joined), so everything downstream reads it like any table. Nothing is written to a copy before
every blob of the version has passed.

A table with an id map (an open id space, docs/FORMAT.md section 7) also carries an id-map blob
beside its table blob; it is fetched, verified and decoded with the table's, by the restore
path's own `publisher.read.id_map_rows.read_id_entries`, and a bad one rejects the version like
a bad table blob.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from publisher.read.catalog import VersionRef
from publisher.read.errors import NonFiniteError
from publisher.read.id_map_rows import read_id_entries
from publisher.read.restore import read_blob
from publisher.store import ObjectStore
from schemas.delta_blob import DeltaBlob
from schemas.id_map_blob import IdEntries
from schemas.manifest import Manifest, TableEntry
from schemas.tensor_blob import decode_tensors

#: blobs of one version fetched at once (network-bound on S3; hashing releases the GIL).
FETCH_CONCURRENCY = 4


@dataclass(frozen=True)
class IdMapRows:
    """Id-map entries of some rows of one table, in row order: what a version writes to the
    table's map, kept so that the write can be repeated on the second copy or made later."""

    ids: npt.NDArray[np.int64]  # (n,), strictly increasing
    entries: IdEntries

    @staticmethod
    def merge(older: IdMapRows, newer: IdMapRows) -> IdMapRows:
        """The entries of both row sets, `newer`'s where both hold a row (a later version)."""
        ids = np.union1d(older.ids, newer.ids)
        entries = IdEntries.merge(ids, older.entries, older.ids, newer.entries, newer.ids)
        return IdMapRows(ids, entries)


@dataclass(frozen=True)
class FetchedTable:
    """One table's verified, parsed blob (codes still encoded), and its id-map entries (a
    model trained from raw events)."""

    entry: TableEntry
    blob: DeltaBlob
    id_entries: IdEntries | None = None
    #: whether the id-map blob says its map is hashed (checked against the copy's map).
    id_map_hashed: bool = False

    @property
    def name(self) -> str:
        return self.entry.name

    def id_rows(self) -> IdMapRows | None:
        """The id-map write of this table (its blob's rows), if it carries one."""
        if self.id_entries is None:
            return None
        # The blob's ids are a view of the fetched bytes: an own copy does not keep them alive.
        return IdMapRows(self.blob.row_ids.copy(), self.id_entries)


@dataclass(frozen=True)
class FetchedVersion:
    """Every blob of one version, fetched and verified against its manifest."""

    ref: VersionRef
    tables: tuple[FetchedTable, ...]
    dense: Mapping[str, np.ndarray] | None
    bytes_fetched: int

    @property
    def manifest(self) -> Manifest:
        return self.ref.manifest


def merge_id_rows(versions: Sequence[FetchedVersion]) -> dict[str, IdMapRows]:
    """Per table, the id-map entries `versions` (in order) leave on the rows they carry: what
    applying them one after the other writes to a map."""
    merged: dict[str, IdMapRows] = {}
    for fetched in versions:
        for table in fetched.tables:
            rows = table.id_rows()
            if rows is None or not rows.ids.size:
                continue
            older = merged.get(table.name)
            merged[table.name] = rows if older is None else IdMapRows.merge(older, rows)
    return merged


def check_finite(manifest: Manifest, what: str, values: np.ndarray) -> None:
    """NonFiniteError unless every value of `values` is finite.

    A float64 sum is finite exactly when every float32 term is (float32's largest value times
    any array size that fits in memory stays far below float64's), and NaN or Inf propagate
    through it; it costs one pass and no temporary array (37 ms for 1M x 64, where
    `isfinite().all()` allocates a 64 MB mask).
    """
    if not np.isfinite(np.sum(values, dtype=np.float64)):
        raise NonFiniteError(
            f"version {manifest.version} ({manifest.kind}): {what} hold NaN or Inf; serving them "
            "would answer NaN scores"
        )


def fetch_version(
    store: ObjectStore, ref: VersionRef, pool: Executor | None = None
) -> FetchedVersion:
    """Fetch, verify (size, sha256) and parse every blob of `ref`, on `pool` if given.

    Raises IntegrityError, FormatError (and its subclasses) or RestoreError on the first blob
    that fails; nothing is returned half-verified. The optimizer blob is not fetched: serving
    needs no optimizer state. A table's id-map blob is fetched when its entry names one (the
    copy's `check_manifest` has checked that the model expects it; its `check` that the
    blob's mode is the model's).
    """
    manifest = ref.manifest
    entries = list(manifest.tables)

    def read(entry: TableEntry) -> FetchedTable:
        blob = read_blob(store, entry)
        if not entry.has_id_map:
            return FetchedTable(entry, blob)
        id_entries, hashed = read_id_entries(store, entry)
        return FetchedTable(entry, blob, id_entries, hashed)

    d = manifest.dense
    # The dense blob downloads beside the tables, not after them: one store round trip less
    # between an announcement and the version served.
    dense_read = (
        None
        if d is None or pool is None
        else pool.submit(store.get_verified, d.key, d.size, d.sha256)
    )
    if pool is not None and len(entries) > 1:
        tables = tuple(pool.map(read, entries))
    else:
        tables = tuple(read(e) for e in entries)
    fetched = sum(e.stored_bytes for e in entries)
    dense: dict[str, np.ndarray] | None = None
    if d is not None:
        data = (
            store.get_verified(d.key, d.size, d.sha256)
            if dense_read is None
            else dense_read.result()
        )
        dense, _ = decode_tensors(data)
        fetched += d.size
    return FetchedVersion(ref=ref, tables=tables, dense=dense, bytes_fetched=fetched)


FetchFn = Callable[[VersionRef], FetchedVersion]
