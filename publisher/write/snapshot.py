"""What a trainer hands to the publisher at an interval boundary: copies of the rows to write.

A `Snapshot` owns its arrays (they are copies taken during the stall), so the trainer can go on
training while the publisher quantizes, encodes and uploads in the background. When publishing
falls behind, `merge` folds a newer snapshot into a pending one (union of rows, newest values), so
memory stays bounded by one copy of the model however long the store is away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from schemas.manifest import Position


@dataclass(frozen=True)
class TableRows:
    """Copied rows of one embedding table: sorted unique ids, values and optimizer columns."""

    name: str
    table_rows: int
    codec: str
    row_ids: np.ndarray  # int64 (n,), strictly increasing
    values: np.ndarray  # float32 (n, dim)
    aux: np.ndarray  # float32 (n, aux_dim)

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    @property
    def n_rows(self) -> int:
        return int(self.row_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.row_ids.nbytes + self.values.nbytes + self.aux.nbytes)

    def merge(self, newer: TableRows) -> TableRows:
        """Union of both row sets; rows present in `newer` take its values."""
        ids = np.union1d(self.row_ids, newer.row_ids)
        values = np.empty((len(ids), self.values.shape[1]), dtype=np.float32)
        aux = np.empty((len(ids), self.aux.shape[1]), dtype=np.float32)
        old_pos = np.searchsorted(ids, self.row_ids)
        new_pos = np.searchsorted(ids, newer.row_ids)
        values[old_pos] = self.values
        aux[old_pos] = self.aux
        values[new_pos] = newer.values
        aux[new_pos] = newer.aux
        return replace(newer, row_ids=ids, values=values, aux=aux)


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

    @property
    def nbytes(self) -> int:
        """Memory the copied arrays hold."""
        dense = sum(a.nbytes for a in self.dense.values())
        dense += sum(a.nbytes for a in self.optimizer.values())
        return sum(t.nbytes for t in self.tables) + dense

    def merge(self, newer: Snapshot) -> Snapshot:
        """This pending snapshot with a newer one folded in.

        A newer full replaces everything. A newer delta adds its rows; the result keeps this
        snapshot's kind and reference point (it still follows the same committed version), and
        takes the newer dense state, position, metrics and time.
        """
        if newer.kind == "full":
            return replace(newer, merged=self.merged + newer.merged)
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
        )
