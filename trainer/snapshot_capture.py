"""The short stall of a checkpoint: copies of what changed, taken on the training thread.

At an interval boundary the training thread stops only to: swap the dirty-row bitmaps, ask the
policy which rows to write, copy those rows (weights and their per-row optimizer columns, laid
out by `publisher.state_dicts.OptimizerStateLayout`) into reusable CPU buffers
(trainer/row_buffers.py), copy the id-map entries of the same rows for a table with an id map,
copy the dense parameters and the rest of the optimizer state, and build the publisher's
`Snapshot`. Nothing more: quantization, encoding, merging, upload, commit and announcement run
on the publisher's threads (or process), on copies training no longer touches.

Why the id-map entries of the copied rows only, and why now: every change to an id map touches
a row the tracker marks dirty (docs/FORMAT.md section 7), so the entries of the rows a version
carries are exactly what changed in the map since the version its rows are relative to; and
they must be the map's state at the same instant as the rows, so the capture runs here, after
the optimizer step and before the next batch's ids are mapped. Only the counts and last_seen
are copied now (`IdMap.capture`: vectorised gathers); the keys, Python objects, are gathered
by the publisher, which undoes from the map's log the few changed since (admissions and
evictions), so the training thread never copies keys (`checknrun bench idmap`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from publisher.id_map import IdMap
from publisher.state_dicts import OptimizerStateLayout, RowState, module_tensors, weight_key
from publisher.write.policies import Plan, Policy
from publisher.write.snapshot import Snapshot, TableRows
from publisher.write.tracker import DirtyRowTracker, EmbeddingModule, RowIds
from schemas.manifest import Position
from trainer.errors import CheckpointError
from trainer.row_buffers import RowBufferPool


@dataclass(frozen=True)
class Capture:
    """One stall's snapshot, the dirty rows its plan came from, and where the time went."""

    snapshot: Snapshot
    dirty: dict[str, RowIds]
    #: `time.perf_counter()` when the stall began.
    started: float
    #: milliseconds: "bitmaps_and_plan" (swap + policy), "copy" (rows and dense state), and
    #: with id maps "id_maps" (their entries of the copied rows).
    breakdown_ms: dict[str, float]


class SnapshotCapture:
    """Copies a model's planned table rows, dense parameters and optimizer state into snapshots.

    Row copies go into buffers recycled once the publisher drops a snapshot, so a steady
    stream of checkpoints allocates nothing (see trainer/row_buffers.py for why that matters).
    """

    def __init__(
        self,
        model: nn.Module,
        tables: Mapping[str, EmbeddingModule],
        optimizers: Sequence[torch.optim.Optimizer],
        codecs: Mapping[str, str],
        model_config: Mapping[str, Any],
        id_maps: Mapping[str, IdMap] | None = None,
    ) -> None:
        """
        Args:
            model: the live model; `tables` are its embedding modules by state_dict prefix.
            optimizers: every optimizer that updates the model.
            codecs: table -> codec the snapshot's rows are to be encoded with.
            model_config: what the serving side needs to rebuild the model.
            id_maps: table -> its id map, for the tables of an open id space (the caller's
                objects: their state at each stall is what is copied).
        """
        self.model = model
        self.tables = dict(tables)
        self.table_rows = {name: int(t.num_embeddings) for name, t in self.tables.items()}
        self.id_maps = dict(id_maps or {})
        for name, id_map in self.id_maps.items():
            if name not in self.tables:
                raise CheckpointError(
                    f"id map for {name!r}, which is not a table; tables: {sorted(self.tables)}"
                )
            if id_map.rows != self.table_rows[name]:
                raise CheckpointError(
                    f"table {name!r} has {self.table_rows[name]} rows, its id map {id_map.rows}"
                )
        #: seconds spent copying id-map entries since `take` began (its breakdown's "id_maps").
        self._id_map_s = 0.0
        self.codecs = dict(codecs)
        self.model_config = dict(model_config)
        #: table -> the state_dict key of its weight (what the dense copy leaves out).
        self.weight_keys = _weight_keys(model, self.tables)
        self.layout = OptimizerStateLayout(
            optimizers, {name: t.weight for name, t in self.tables.items()}
        )
        self._buffers = RowBufferPool()
        self._all_rows: dict[str, np.ndarray] = {}

    def preallocate(self) -> None:
        """Allocate and touch one full copy of every table (rows and optimizer columns) now, so
        no stall pays page faults for it (one model copy of memory)."""
        for name, rows in self.table_rows.items():
            dim = int(self.tables[name].weight.shape[1])
            aux_dim = sum(s.width for s in self.layout.row_state(name))
            self._buffers.reserve(f"{name}/w", rows, dim)
            self._buffers.reserve(f"{name}/aux", rows, aux_dim)
            self._all_rows[name] = np.arange(rows, dtype=np.int64)

    def take(
        self,
        tracker: DirtyRowTracker,
        policy: Policy,
        position: Position,
        metrics: Mapping[str, float],
        *,
        sequence: int,
        force_full: bool = False,
    ) -> Capture:
        """The stall: swap the tracker's bitmaps, plan with `policy`, copy what the plan names.

        Call between an optimizer step and the next forward (see publisher/write/tracker.py).
        """
        started = time.perf_counter()
        dirty = tracker.snapshot_and_reset()
        if force_full:
            policy.force_full()
        plan = policy.plan(dirty)
        planned = time.perf_counter()
        self._id_map_s = 0.0
        snapshot = self.copy(
            plan, policy=policy.name, position=position, metrics=metrics, sequence=sequence
        )
        copied = time.perf_counter()
        breakdown = {
            "bitmaps_and_plan": (planned - started) * 1e3,
            "copy": (copied - planned - self._id_map_s) * 1e3,
        }
        if self.id_maps:
            breakdown["id_maps"] = self._id_map_s * 1e3
        return Capture(snapshot, dirty, started, breakdown)

    def copy(
        self,
        plan: Plan,
        *,
        policy: str,
        position: Position,
        metrics: Mapping[str, float] | None = None,
        sequence: int = 0,
    ) -> Snapshot:
        """A snapshot of the rows `plan` names, the dense parameters and all optimizer state."""
        layouts = {name: self.layout.row_state(name) for name in self.tables}
        tables = tuple(self.rows(name, plan.rows[name], layouts[name]) for name in self.tables)
        dense = module_tensors(self.model, set(self.weight_keys.values()))
        optimizer, optimizer_meta = self.layout.dense_state(layouts)
        return Snapshot(
            kind=plan.kind,
            relative_to=plan.relative_to,
            policy=policy,
            tables=tables,
            position=position,
            dense=dense,
            optimizer=optimizer,
            optimizer_meta=optimizer_meta,
            model_config=self.model_config,
            metrics=dict(metrics or {}),
            taken_at=time.time(),
            sequence=sequence,
        )

    def rows(
        self, name: str, ids: np.ndarray | None, layout: Sequence[RowState] | None = None
    ) -> TableRows:
        """Copies of rows `ids` (None: every row) of table `name`, of their optimizer columns
        (`layout`: the table's `row_state`, read now when not given) and, when the table has
        an id map, of its entries for those rows."""
        weight = self.tables[name].weight.detach()
        rows = self.table_rows[name]
        layout = self.layout.row_state(name) if layout is None else layout
        aux_dim = sum(s.width for s in layout)
        if ids is None:
            values = self._buffers.take(f"{name}/w", rows, weight.shape[1], exact=True)
            torch.from_numpy(values).copy_(weight)
            aux = self._buffers.take(f"{name}/aux", rows, aux_dim, exact=True)
            self.layout.copy_row_state(name, layout, None, aux)
            row_ids = self._all_rows.get(name)
            if row_ids is None:
                row_ids = self._all_rows[name] = np.arange(rows, dtype=np.int64)
        else:
            row_ids = np.ascontiguousarray(ids, dtype=np.int64)
            index = torch.from_numpy(row_ids)
            values = self._buffers.take(f"{name}/w", len(row_ids), weight.shape[1])
            torch.index_select(weight, 0, index, out=torch.from_numpy(values))
            aux = self._buffers.take(f"{name}/aux", len(row_ids), aux_dim)
            self.layout.copy_row_state(name, layout, index, aux)
        id_map = self.id_maps.get(name)
        id_entries = None
        if id_map is not None:
            gather_started = time.perf_counter()
            id_entries = id_map.capture(None if ids is None else row_ids)
            self._id_map_s += time.perf_counter() - gather_started
        return TableRows(
            name=name,
            table_rows=rows,
            codec=self.codecs[name],
            row_ids=row_ids,
            values=values,
            aux=aux,
            id_entries=id_entries,
            id_map_hashed=id_map is not None and id_map.hashed,
        )

    def close(self) -> None:
        """Drop the free buffers (those a snapshot still holds go when it is dropped)."""
        self._buffers.clear()


def _weight_keys(model: nn.Module, tables: Mapping[str, EmbeddingModule]) -> dict[str, str]:
    keys: dict[str, str] = {}
    state_keys = set(model.state_dict())
    for name in tables:
        key = weight_key(name)
        if key not in state_keys:
            raise CheckpointError(f"table {name!r}: state_dict has no {key!r}")
        keys[name] = key
    return keys
