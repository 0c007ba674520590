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

A full baseline copies every row: 1.1 GB takes 100 ms to over a second on this class of
machine, too long for one stop. `begin(..., chunk_bytes=N)` therefore copies a full in chunks
of about N bytes, one chunk per `copy_chunk` call (the checkpointer makes one per training
step), while the tracker keeps marking. `finish` then stops once more to copy the rows changed
since `begin` over their chunk copies, plus the dense state. The version is the model at that
last stop, exactly: a row not changed since `begin` holds the same value now as when its chunk
was copied, and every row changed since was marked and is copied again at the stop. Those rows
are also taken off the tracker, so the next delta (relative to this baseline) holds the rows
changed after it. The policy planned the full at `begin` and never sees them: it counts the
next interval from the baseline, which is right, the baseline holding their current values.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
    #: `time.thread_time()` then: the stall's CPU time is what a shared machine cannot inflate.
    started_cpu: float
    #: milliseconds: "bitmaps_and_plan" (swap + policy), "copy" (rows and dense state), and
    #: with id maps "id_maps" (their entries of the copied rows); for a full copied in chunks
    #: also "chunk_pauses" (every stop before the last, `begin`'s included) and
    #: "longest_chunk_pause", while "copy" is the last stop's (rows changed meanwhile, dense).
    breakdown_ms: dict[str, float]
    #: milliseconds of each stop before the last one (`begin` and each `copy_chunk`) of a
    #: full copied in chunks; empty for a capture taken in one stop.
    pauses_ms: tuple[float, ...] = ()


@dataclass
class _ChunkedFull:
    """A full baseline's copy buffers, filled chunk by chunk in table order."""

    chunk_bytes: int
    layouts: dict[str, list[RowState]]
    values: dict[str, np.ndarray]
    aux: dict[str, np.ndarray]
    #: where the next chunk starts: the table's position in table order, and its row.
    table: int = 0
    row: int = 0


@dataclass
class _Begun:
    """A capture between `begin` and `finish`."""

    plan: Plan
    policy: str
    dirty: dict[str, RowIds]
    started: float
    started_cpu: float
    plan_ms: float
    full: _ChunkedFull | None
    pauses_ms: list[float] = field(default_factory=list)
    copied: bool = False


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
        self._begun: _Begun | None = None

    def preallocate(self) -> None:
        """Allocate and touch one full copy of every table (rows and optimizer columns) now, so
        no stall pays page faults for it (one model copy of memory)."""
        for name, rows in self.table_rows.items():
            dim = int(self.tables[name].weight.shape[1])
            self._buffers.reserve(f"{name}/w", rows, dim)
            self._buffers.reserve(f"{name}/aux", rows, self._aux_width(name))
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
        """The stall in one stop: swap the tracker's bitmaps, plan with `policy`, copy what the
        plan names (`begin` then `finish`).

        Call between an optimizer step and the next forward (see publisher/write/tracker.py).
        """
        self.begin(tracker, policy, force_full=force_full)
        return self.finish(tracker, position, metrics, sequence=sequence)

    @property
    def in_progress(self) -> bool:
        """Whether a capture was begun and not finished."""
        return self._begun is not None

    @property
    def copying_full(self) -> bool:
        """Whether a full baseline is being copied in chunks, with rows left to copy."""
        return self._begun is not None and self._begun.full is not None and not self._begun.copied

    def begin(
        self,
        tracker: DirtyRowTracker,
        policy: Policy,
        *,
        force_full: bool = False,
        chunk_bytes: int | None = None,
    ) -> None:
        """Start a capture: swap the tracker's bitmaps and plan with `policy`.

        With `chunk_bytes`, a full plan is copied in chunks of about that many bytes: the first
        one now, the next ones by `copy_chunk`, the rest by `finish`. Call at a step boundary.
        """
        if self._begun is not None:
            raise CheckpointError("a capture is in progress: finish it before beginning another")
        started, started_cpu = time.perf_counter(), time.thread_time()
        dirty = tracker.snapshot_and_reset()
        if force_full:
            policy.force_full()
        plan = policy.plan(dirty)
        plan_ms = (time.perf_counter() - started) * 1e3
        full = None
        if chunk_bytes is not None and chunk_bytes < 1:
            raise CheckpointError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if plan.kind == "full" and chunk_bytes is not None and self._full_bytes() > chunk_bytes:
            full = self._chunked_full(chunk_bytes)
        begun = _Begun(plan, policy.name, dirty, started, started_cpu, plan_ms, full)
        self._begun = begun
        if full is not None:
            begun.copied = self._copy_next_chunk(full)
            begun.pauses_ms.append((time.perf_counter() - started) * 1e3)

    def copy_chunk(self) -> bool:
        """Copy the next chunk of the full being copied (a stop of the training thread, at a
        step boundary); True once every row has been copied and `finish` is due."""
        begun = self._begun
        if begun is None or begun.full is None:
            raise CheckpointError("no full baseline is being copied in chunks")
        if not begun.copied:
            started = time.perf_counter()
            begun.copied = self._copy_next_chunk(begun.full)
            begun.pauses_ms.append((time.perf_counter() - started) * 1e3)
        return begun.copied

    def finish(
        self,
        tracker: DirtyRowTracker,
        position: Position,
        metrics: Mapping[str, float],
        *,
        sequence: int,
    ) -> Capture:
        """The last stop of the capture `begin` started: the snapshot of the model now.

        Copies the rows the plan names (for a chunked full: the chunks left, then the rows
        changed since `begin` over their chunk copies) and the dense state.
        """
        begun = self._begun
        if begun is None:
            raise CheckpointError("finish() without begin()")
        self._begun = None
        started, started_cpu = begun.started, begun.started_cpu
        if begun.full is not None:  # the last stop is a stop of its own
            started, started_cpu = time.perf_counter(), time.thread_time()
        self._id_map_s = 0.0
        if begun.full is None:
            layouts = {name: self.layout.row_state(name) for name in self.tables}
            tables = tuple(
                self.rows(name, begun.plan.rows[name], layouts[name]) for name in self.tables
            )
        else:
            while not self._copy_next_chunk(begun.full):
                pass
            layouts, tables = self._changed_since_begin(tracker, begun.full)
        snapshot = self._snapshot(
            begun.plan, tables, layouts, begun.policy, position, metrics, sequence
        )
        copied = time.perf_counter()
        copy_started = started + (begun.plan_ms / 1e3 if begun.full is None else 0.0)
        breakdown = {
            "bitmaps_and_plan": begun.plan_ms,
            "copy": (copied - copy_started - self._id_map_s) * 1e3,
        }
        if begun.pauses_ms:
            breakdown["chunk_pauses"] = sum(begun.pauses_ms)
            breakdown["longest_chunk_pause"] = max(begun.pauses_ms)
        if self.id_maps:
            breakdown["id_maps"] = self._id_map_s * 1e3
        return Capture(
            snapshot, begun.dirty, started, started_cpu, breakdown, tuple(begun.pauses_ms)
        )

    def abandon(self) -> None:
        """Drop a capture in progress (its buffers go back to the pool)."""
        self._begun = None

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
        return self._snapshot(plan, tables, layouts, policy, position, metrics, sequence)

    def _snapshot(
        self,
        plan: Plan,
        tables: tuple[TableRows, ...],
        layouts: Mapping[str, Sequence[RowState]],
        policy: str,
        position: Position,
        metrics: Mapping[str, float] | None,
        sequence: int,
    ) -> Snapshot:
        """`tables` with copies of the dense parameters and the rest of the optimizer state."""
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

    def _full_bytes(self) -> int:
        """Bytes of every row and its optimizer columns."""
        return sum(
            4 * rows * (int(self.tables[name].weight.shape[1]) + self._aux_width(name))
            for name, rows in self.table_rows.items()
        )

    def _aux_width(self, name: str) -> int:
        return sum(s.width for s in self.layout.row_state(name))

    def _chunked_full(self, chunk_bytes: int) -> _ChunkedFull:
        layouts = {name: self.layout.row_state(name) for name in self.tables}
        values: dict[str, np.ndarray] = {}
        aux: dict[str, np.ndarray] = {}
        for name, rows in self.table_rows.items():
            dim = int(self.tables[name].weight.shape[1])
            aux_dim = sum(s.width for s in layouts[name])
            values[name] = self._buffers.take(f"{name}/w", rows, dim, exact=True)
            aux[name] = self._buffers.take(f"{name}/aux", rows, aux_dim, exact=True)
        return _ChunkedFull(chunk_bytes, layouts, values, aux)

    def _copy_next_chunk(self, full: _ChunkedFull) -> bool:
        """Copy about `full.chunk_bytes` of rows (weights and optimizer columns) from where the
        last chunk ended; True once every table is copied."""
        names = list(self.tables)
        budget = full.chunk_bytes
        while full.table < len(names) and budget > 0:
            name = names[full.table]
            rows = self.table_rows[name]
            weight = self.tables[name].weight.detach()
            row_bytes = 4 * (int(weight.shape[1]) + int(full.aux[name].shape[1]))
            n = min(rows - full.row, max(1, budget // row_bytes))
            part = slice(full.row, full.row + n)
            torch.from_numpy(full.values[name][part]).copy_(weight[part])
            self.layout.copy_row_state(name, full.layouts[name], part, full.aux[name][part])
            budget -= n * row_bytes
            full.row += n
            if full.row == rows:
                full.table, full.row = full.table + 1, 0
        return full.table == len(names)

    def _changed_since_begin(
        self, tracker: DirtyRowTracker, full: _ChunkedFull
    ) -> tuple[dict[str, list[RowState]], tuple[TableRows, ...]]:
        """The chunk copies brought to the model's state now: the rows marked since `begin`
        copied again (and taken off the tracker: this baseline holds them)."""
        changed = tracker.snapshot_and_reset()
        layouts = {name: self.layout.row_state(name) for name in self.tables}
        tables = []
        for name, rows in self.table_rows.items():
            weight = self.tables[name].weight.detach()
            values, aux = full.values[name], full.aux[name]
            index = torch.from_numpy(changed[name])
            torch.from_numpy(values).index_copy_(0, index, weight.index_select(0, index))
            if layouts[name] != full.layouts[name]:
                # Optimizer state created since `begin` (SparseAdam's, at its first step):
                # every row's columns are new.
                aux_dim = sum(s.width for s in layouts[name])
                aux = self._buffers.take(f"{name}/aux", rows, aux_dim, exact=True)
                self.layout.copy_row_state(name, layouts[name], None, aux)
            elif aux.shape[1] and index.numel():
                fresh = np.empty((index.numel(), aux.shape[1]), dtype=np.float32)
                self.layout.copy_row_state(name, layouts[name], index, fresh)
                torch.from_numpy(aux).index_copy_(0, index, torch.from_numpy(fresh))
            tables.append(self._table_rows(name, self._every_row(name), values, aux, None))
        return layouts, tuple(tables)

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
            row_ids = self._every_row(name)
        else:
            row_ids = np.ascontiguousarray(ids, dtype=np.int64)
            index = torch.from_numpy(row_ids)
            values = self._buffers.take(f"{name}/w", len(row_ids), weight.shape[1])
            torch.index_select(weight, 0, index, out=torch.from_numpy(values))
            aux = self._buffers.take(f"{name}/aux", len(row_ids), aux_dim)
            self.layout.copy_row_state(name, layout, index, aux)
        return self._table_rows(name, row_ids, values, aux, ids)

    def _every_row(self, name: str) -> np.ndarray:
        row_ids = self._all_rows.get(name)
        if row_ids is None:
            row_ids = self._all_rows[name] = np.arange(self.table_rows[name], dtype=np.int64)
        return row_ids

    def _table_rows(
        self,
        name: str,
        row_ids: np.ndarray,
        values: np.ndarray,
        aux: np.ndarray,
        ids: np.ndarray | None,
    ) -> TableRows:
        """Copied rows of `name` with, for a table with an id map, its entries of `ids` (None:
        every row), copied now."""
        id_map = self.id_maps.get(name)
        id_entries = None
        if id_map is not None:
            gather_started = time.perf_counter()
            id_entries = id_map.capture(None if ids is None else row_ids)
            self._id_map_s += time.perf_counter() - gather_started
        return TableRows(
            name=name,
            table_rows=self.table_rows[name],
            codec=self.codecs[name],
            row_ids=row_ids,
            values=values,
            aux=aux,
            id_entries=id_entries,
            id_map_hashed=id_map is not None and id_map.hashed,
        )

    def close(self) -> None:
        """Drop the free buffers and a capture in progress (those a snapshot still holds go
        when it is dropped)."""
        self._begun = None
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
