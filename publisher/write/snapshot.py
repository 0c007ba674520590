"""What a trainer hands to the publisher at an interval boundary: copies of the rows to write.

A `Snapshot` owns its arrays (they are copies taken during the stall), so the trainer can go on
training while the publisher quantizes, encodes and uploads in the background. When publishing
falls behind, `merge` folds a newer snapshot into a pending one (union of rows, newest values), so
memory stays bounded by one copy of the model however long the store is away.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from publisher.id_map import IdCapture
from publisher.served_loss import KeptSample
from schemas.errors import BadDataError
from schemas.id_map_blob import IdEntries
from schemas.manifest import Position

#: elements per step of the finite check (4 MB of float32: cache-sized, few Python steps).
_CHECK_CHUNK_ELEMENTS = 1 << 20


class NonFiniteSnapshotError(BadDataError):
    """A snapshot holds NaN or inf: it is refused, so no reader serves or resumes from it."""


class SnapshotMergeError(BadDataError):
    """Two snapshots of one table that cannot be folded into one (one carries an id map, the
    other not, the maps' modes differ, or they hold other row ranges): they are not of the
    same model or shard."""


@dataclass(frozen=True)
class TableRows:
    """Copied rows of one embedding table: sorted unique ids, values and optimizer columns,
    and, for a table with an id map (an open id space), the map's entries of the same rows."""

    name: str
    table_rows: int
    codec: str
    row_ids: np.ndarray  # int64 (n,), strictly increasing
    values: np.ndarray  # float32 (n, dim)
    aux: np.ndarray  # float32 (n, aux_dim)
    #: the id map's state of exactly `row_ids`, in their order (docs/FORMAT.md section 7): as
    #: the stall took it (an IdCapture, whose keys are gathered off the training thread), or
    #: resolved. Read it with `id_map_entries()`.
    id_entries: IdEntries | IdCapture | None = None
    #: whether that map is hashed (publisher/id_map.py); written in the id-map blob.
    id_map_hashed: bool = False
    #: the global rows [start, end) of the shard a job's rank holds (docs/FORMAT.md 3.3); None:
    #: the whole table. `row_ids` stay global row numbers, within the range.
    row_range: tuple[int, int] | None = None
    #: the rows are the table's (a shard's: its range's) whole state: a row not among them is
    #: free and zero
    #: (docs/FORMAT.md 7.1; `held_rows`).
    whole: bool = False

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    @property
    def n_rows(self) -> int:
        return int(self.row_ids.shape[0])

    @property
    def nbytes(self) -> int:
        arrays = int(self.row_ids.nbytes + self.values.nbytes + self.aux.nbytes)
        e = self.id_entries
        if e is None:
            return arrays
        if isinstance(e, IdCapture):
            return arrays + e.nbytes
        # The keys are shared with the live map (str objects are immutable): a tuple slot each.
        return arrays + e.assigned.nbytes + e.counts.nbytes + e.last_seen.nbytes + 8 * e.n

    def id_map_entries(self) -> IdEntries | None:
        """The id-map entries of these rows (resolving a capture: not on the training thread)."""
        e = self.id_entries
        return e.entries() if isinstance(e, IdCapture) else e

    def held_rows(self) -> TableRows:
        """Every row of a table with a dynamic id map (or of a job's shard of one) cut to those
        a full carries (docs/FORMAT.md 7.1): row 0, the unknown row, and the rows an id holds,
        `whole` (the rest of the table, or of the shard, free and zero). Any other rows (a
        delta's, a table without a dynamic map) are returned as they are. Resolves the id-map
        capture: not on the training thread.
        """
        start, end = self.row_range or (0, self.table_rows)
        if self.id_entries is None or self.id_map_hashed or self.n_rows != end - start:
            return self
        entries = self.id_map_entries()
        assert entries is not None
        keep = entries.assigned.copy()  # every row of the range is here: position == row - start
        if start == 0:
            keep[0] = True
        if keep.all():
            return self
        positions = np.flatnonzero(keep)
        return replace(
            self,
            row_ids=self.row_ids[positions],
            values=self.values[positions],
            aux=self.aux[positions],
            id_entries=entries.take(positions),
            whole=True,
        )

    def merge(self, newer: TableRows) -> TableRows:
        """Union of both row sets; rows present in `newer` take its values (and id entries).
        (Snapshots are merged before `held_rows` cuts them: neither is `whole`.)"""
        if self.row_range != newer.row_range:
            raise SnapshotMergeError(
                f"table {self.name!r}: a snapshot of rows {self.row_range} cannot take one of "
                f"rows {newer.row_range} (None: the whole table)"
            )
        if (self.id_entries is None) != (newer.id_entries is None) or (
            self.id_map_hashed != newer.id_map_hashed
        ):
            raise SnapshotMergeError(
                f"table {self.name!r}: snapshots with and without an id map (or of a hashed and "
                "a dynamic one) cannot be merged"
            )
        ids = np.union1d(self.row_ids, newer.row_ids)
        values = np.empty((len(ids), self.values.shape[1]), dtype=np.float32)
        aux = np.empty((len(ids), self.aux.shape[1]), dtype=np.float32)
        old_pos = np.searchsorted(ids, self.row_ids)
        new_pos = np.searchsorted(ids, newer.row_ids)
        values[old_pos] = self.values
        aux[old_pos] = self.aux
        values[new_pos] = newer.values
        aux[new_pos] = newer.aux
        entries = None
        older_entries, newer_entries = self.id_map_entries(), newer.id_map_entries()
        if older_entries is not None and newer_entries is not None:
            entries = IdEntries.merge(
                ids, older_entries, self.row_ids, newer_entries, newer.row_ids
            )
        return replace(newer, row_ids=ids, values=values, aux=aux, id_entries=entries)


@dataclass(frozen=True)
class Snapshot:
    """One checkpoint's state, copied out of the trainer."""

    kind: Literal["full", "delta"]
    relative_to: Literal["parent", "baseline"] | None
    policy: str
    tables: tuple[TableRows, ...]
    position: Position
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer_meta: dict[str, Any] = field(default_factory=dict)
    model_config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    #: wall-clock time of the snapshot (what freshness is measured from).
    taken_at: float = field(default_factory=time.time)
    #: the producer's number for this snapshot (the trainer's record index, 1, 2, ...); a merged
    #: snapshot carries the newest one's, so a result names the last snapshot it holds.
    sequence: int = 0
    #: how many snapshots were merged into this one (1 = none).
    merged: int = 1
    #: the trainer's most recent progressive-validation samples, to score this version on
    #: (publisher/served_loss.py); a merged snapshot carries the newer one's.
    scored: tuple[KeptSample, ...] = ()
    #: how many of the newest `scored` batches were kept after the previous snapshot was
    #: taken: events no earlier version trained on (the release gate's window); a merged
    #: snapshot counts the older one's too, as far as the newer window still holds them.
    fresh: int = 0

    @property
    def nbytes(self) -> int:
        """Memory the copied arrays hold."""
        dense = sum(a.nbytes for a in self.dense.values())
        dense += sum(a.nbytes for a in self.optimizer.values())
        return sum(t.nbytes for t in self.tables) + dense

    def check_finite(self) -> dict[str, float]:
        """NonFiniteSnapshotError naming the first NaN or inf: in a table's rows or optimizer
        columns, a dense tensor or an optimizer tensor. Returns each table's largest weight
        magnitude, which the same reads give (`encode_rows(..., max_abs=)` uses it).

        One min and one max per chunk (NaN propagates through both), no temporary copy: 55 ms
        for 1.1 GB of rows (4.2M x 64), on the publisher's thread; a rejection costs the same.
        """
        largest: dict[str, float] = {}
        for t in self.tables:
            for part, values in (("weights", t.values), ("optimizer columns", t.aux)):
                row, magnitude = _scan(values)
                if row is not None:
                    self._refuse(f"table {t.name!r} row {int(t.row_ids[row])} ({part})")
                if part == "weights":
                    largest[t.name] = magnitude
        for kind, tensors in (("dense", self.dense), ("optimizer", self.optimizer)):
            for name, array in tensors.items():
                if _first_non_finite_row(array) is not None:
                    self._refuse(f"{kind} tensor {name!r}")
        return largest

    def _refuse(self, where: str) -> None:
        raise NonFiniteSnapshotError(
            f"the snapshot at step {self.position.step} ({self.position.samples_seen:,} samples) "
            f"holds NaN or inf in {where}: refused, nothing committed"
        )

    def held_rows(self) -> Snapshot:
        """A full snapshot with each table cut to the rows a full carries (`TableRows.held_rows`:
        a table with a dynamic id map, to its held rows); a delta as it is."""
        if self.kind != "full":
            return self
        return replace(self, tables=tuple(t.held_rows() for t in self.tables))

    def merge(self, newer: Snapshot) -> Snapshot:
        """This pending snapshot with a newer one folded in.

        A newer full replaces everything. A newer delta adds its rows; the result keeps this
        snapshot's kind and reference point (it still follows the same committed version), and
        takes the newer dense state, position, metrics and time.
        """
        fresh = min(len(newer.scored), newer.fresh + self.fresh)
        if newer.kind == "full":
            return replace(newer, merged=self.merged + newer.merged, fresh=fresh)
        old_tables = {t.name: t for t in self.tables}
        tables = tuple(
            old_tables[t.name].merge(t) if t.name in old_tables else t for t in newer.tables
        )
        return replace(
            newer,
            kind=self.kind,
            relative_to=self.relative_to,
            tables=tables,
            merged=self.merged + newer.merged,
            fresh=fresh,
        )


def _first_non_finite_row(array: np.ndarray) -> int | None:
    """The first index along axis 0 (0 for a scalar) holding NaN or inf; None if none does."""
    return _scan(array)[0]


def _scan(array: np.ndarray) -> tuple[int | None, float]:
    """The first index along axis 0 (0 for a scalar) holding NaN or inf (None if none does),
    and the largest magnitude of the elements read (all of them when none is non-finite).

    Chunk by chunk, so finding the row allocates one chunk's mask, not one for the whole table;
    the magnitude comes from the same min and max.
    """
    if array.size == 0 or not np.issubdtype(array.dtype, np.floating):
        return None, 0.0
    rows = array.reshape(array.shape[0] if array.ndim else 1, -1)
    step = max(1, _CHECK_CHUNK_ELEMENTS // max(rows.shape[1], 1))
    largest = 0.0
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step]
        low, high = float(chunk.min()), float(chunk.max())
        if not (math.isfinite(low) and math.isfinite(high)):
            return start + int(np.flatnonzero(~np.isfinite(chunk).all(axis=1))[0]), largest
        largest = max(largest, -low, high)
    return None, largest
