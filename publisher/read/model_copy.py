"""One servable copy of a model: its tables, dense tensors and id maps by name, the version it
holds, and (for a module sink) the module whose forward reads them.

A `ModelCopy` is any model's state as checkpoints name it: each table under its module path
(`embeddings.user`, `bags.embedding_bags.user`: what `find_embedding_tables` finds and the
trainer's manifests name), the rest of the module's state_dict as dense tensors, and one
`IdMap` per table whose versions carry an id map (docs/FORMAT.md section 7). Each copy holds its
own maps, written with its rows, so that swapping a copy in swaps rows and maps together and a
reader maps its ids with the version whose rows it reads. Copies are built by a
`publisher.read.copy_builders.CopyBuilder`: from a module factory or template (a module sink),
or from the manifest alone (a tensor sink, no module).

Each table is a `publisher.read.held_tables.HeldTable`: float32, written by decoding rows
through `publisher.read.blob_rows`, the restore path's own blob-to-rows code (a full table
decodes in place, a delta's rows are scattered in by one vectorised assignment per table); or,
with quantized tables on, FBGEMM's fused int8/int4/int2 rows, written by copying the blob's
codes, scale and bias into place and looked up by torch's quantized embedding-bag kernels
through a module that takes the call of the one it replaces. A table starts in the format of
the codec the model's first full version brings and widens exactly when a version brings a
finer one (held_tables.py says why and how). Writing a version also applies the id-map entries
of those rows (`IdMap.check` + `write`, atomic), and records what it touched, so a second copy
can be brought level by repeating only those writes (publisher/read/consistency.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
import torch
from torch import nn

from publisher.id_map import IdMap, IdMapWrite
from publisher.read.blob_rows import BlobRows
from publisher.read.catalog import VersionRef
from publisher.read.errors import ApplyError
from publisher.read.held_tables import (
    Float32Table,
    HeldFormat,
    HeldTable,
    Lookup,
    TableRows,
    held_format,
)
from publisher.read.version_fetch import FetchedVersion, IdMapRows, check_finite
from schemas.manifest import Manifest


@dataclass(frozen=True)
class ServedVersion:
    """The version a copy holds and when it became servable."""

    ref: VersionRef
    applied_at: datetime

    @property
    def version(self) -> int:
        return self.ref.version

    @property
    def manifest(self) -> Manifest:
        return self.ref.manifest


@dataclass
class Touched:
    """What writing a plan changed in a copy: whole tables (with their id maps; a table whose
    format widened is one), and per table the row writes (ids and the rows in the table's
    format, in order) and the id-map writes after the last whole-table write; dense or not.

    Keeping the written rows and entries lets the second copy of a double buffer replay the
    same writes (no gather from the live copy, no second allocation of the rows).
    """

    whole: set[str] = field(default_factory=set)
    rows: dict[str, list[TableRows]] = field(default_factory=dict)
    id_writes: dict[str, list[IdMapWrite]] = field(default_factory=dict)
    dense: bool = False

    def add_whole(self, name: str) -> None:
        self.whole.add(name)
        # The whole table (and map) is copied; earlier row writes are moot.
        self.rows.pop(name, None)
        self.id_writes.pop(name, None)

    def add_rows(self, name: str, rows: TableRows) -> None:
        if rows.ids.size:
            self.rows.setdefault(name, []).append(rows)

    def add_id_write(self, name: str, write: IdMapWrite) -> None:
        if write.rows.size and name not in self.whole:
            self.id_writes.setdefault(name, []).append(write)

    def row_ids(self, name: str) -> np.ndarray:
        return _union(rows.ids for rows in self.rows[name])

    def id_row_ids(self, name: str) -> np.ndarray:
        return _union(write.rows for write in self.id_writes[name])


def _union(parts_iter: Iterable[np.ndarray]) -> np.ndarray:
    parts = list(parts_iter)
    return parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))


@dataclass
class StagedWrite:
    """Deltas made ready to write to a copy (`ModelCopy.stage`), so that writing them
    (`ModelCopy.commit`, the reader-writer scheme's critical section) only copies: per table
    the rows in its format, in order; tables that widen, built whole beside the served ones; and
    the dense tensors."""

    rows: list[tuple[str, TableRows]] = field(default_factory=list)
    replaced: dict[str, HeldTable] = field(default_factory=dict)
    dense: list[Mapping[str, np.ndarray]] = field(default_factory=list)


class ModelCopy:
    """One copy of a model for serving: its tables, dense tensors and id maps by name, and the
    version it holds (see the module docstring).

    Readers use `module` (a module sink) or the tensors (a tensor sink) under the sink's
    reader; writers go through `write`, `copy_from`, `replay` and `commit`, which the
    consistency schemes call only while no reader can see this copy (double buffer) or under
    the write lock (reader-writer).
    """

    def __init__(
        self,
        *,
        model_config: Mapping[str, Any],
        tables: dict[str, HeldTable],
        dense: dict[str, torch.Tensor],
        mapped: frozenset[str],
        module: nn.Module | None = None,
        adopts_dense: bool = False,
        config_bound: bool = False,
    ) -> None:
        """Built by a `CopyBuilder`. `mapped`: the tables whose versions carry an id map.
        `adopts_dense`: a full version brings the dense tensors (a tensor sink holds whatever
        dense state the model has), else they are the module's and must match it.
        `config_bound`: the module was built from `model_config` (a factory), so a version of
        another config is another model (rebuilt, as a new architecture is)."""
        self.model_config: dict[str, Any] = dict(model_config)
        self.config_bound = config_bound
        self.module = module
        self.tables = tables
        self.dense = dense
        self.mapped = mapped
        self.adopts_dense = adopts_dense
        #: one map per table of `mapped`, made by the first version that writes its entries
        #: (the blob says whether the map is hashed).
        self.id_maps: dict[str, IdMap] = {}
        self.served: ServedVersion | None = None
        #: readers of this copy now (double buffer only; guarded by the slot's lock).
        self.readers = 0

    @property
    def version(self) -> int | None:
        """The version this copy holds (None before its first write)."""
        return None if self.served is None else self.served.version

    @property
    def manifest(self) -> Manifest:
        """The manifest of the version this copy holds."""
        if self.served is None:
            raise ApplyError("this copy holds no version yet")
        return self.served.manifest

    @property
    def formats(self) -> dict[str, HeldFormat]:
        """The format each table is held in."""
        return {name: table.format for name, table in self.tables.items()}

    @property
    def lookups(self) -> dict[str, Lookup]:
        """What each table's module computes."""
        return {name: table.lookup for name, table in self.tables.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of the tables, the dense tensors and (approximately) the id maps."""
        dense = sum(t.numel() * t.element_size() for t in self.dense.values())
        maps = sum(m.nbytes for m in self.id_maps.values())
        return sum(t.nbytes for t in self.tables.values()) + dense + maps

    def share_memory(self) -> None:
        """Move every table and dense tensor to shared memory, in place (`checknrun serve
        --workers`: each worker process maps the same copy, pickled to it with torch's
        multiprocessing reductions, which then pass the memory, not its bytes)."""
        for table in self.tables.values():
            table.share_memory()
        for tensor in self.dense.values():
            tensor.share_memory_()  # type: ignore[no-untyped-call]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["readers"] = 0  # this process's readers; none in another
        return state

    def values(self, name: str) -> torch.Tensor:
        """Table `name` as float32 (rows, dim): what a lookup of one row returns."""
        return self.tables[name].values()

    def _install(self, name: str, table: HeldTable) -> None:
        """Hold `table` as table `name`, looked up by the module in place of the old one."""
        self.tables[name] = table
        if self.module is not None:
            install_module(self.module, name, table.module)

    def _widen_for(self, name: str, codec: str) -> HeldTable | None:
        """Table `name` converted to the format rows of `codec` need, or None if it holds them."""
        table = self.tables[name]
        fmt = held_format(codec, table.dim, table.format, table.lookup)
        return None if fmt == table.format else table.converted(fmt)

    # --- checks ---------------------------------------------------------------------------------

    def fits(self, manifest: Manifest) -> bool:
        """True if `manifest` is of this copy's model: its model_config (for a copy built from
        it) and every table one of this copy's, of the same shape."""
        if self.config_bound and dict(manifest.model_config_) != self.model_config:
            return False
        return all(
            e.name in self.tables and self.tables[e.name].shape == (e.rows, e.dim)
            for e in manifest.tables
        )

    def check_manifest(self, m: Manifest) -> None:
        """Raise ApplyError unless `m` is of this copy's model (`fits`) and carries an id-map
        blob for exactly the tables that have one: checked before its blobs are fetched, whose
        decode caps come from those shapes."""
        if not self.fits(m):
            raise ApplyError(
                f"version {m.version} ({m.kind}) has another architecture or table shapes than "
                f"the served model: tables {[(e.name, e.rows, e.dim) for e in m.tables]}, "
                f"served {[(n, *t.shape) for n, t in self.tables.items()]}"
            )
        wrong = sorted(e.name for e in m.tables if e.has_id_map != (e.name in self.mapped))
        if wrong:
            raise ApplyError(
                f"version {m.version}: tables {wrong} disagree with the served model on id "
                f"maps: tables {sorted(self.mapped)} must each carry an id-map blob, the "
                "others none (docs/FORMAT.md section 7)"
            )

    def check(self, fetched: FetchedVersion) -> None:
        """Raise ApplyError unless every blob of `fetched` can be written to this copy."""
        m = fetched.manifest
        if m.kind == "full":
            missing = set(self.tables) - {t.name for t in fetched.tables}
            if missing:
                raise ApplyError(f"full version {m.version} lacks tables {sorted(missing)}")
            if fetched.dense is None and self.dense:
                raise ApplyError(f"full version {m.version} carries no dense parameters")
            absent = set(self.dense) - set(fetched.dense or {})
            if absent:
                raise ApplyError(f"full version {m.version} lacks dense tensors {sorted(absent)}")
        for table in fetched.tables:
            blob = table.blob
            if (
                m.kind == "full"
                and blob.n_rows < blob.table_rows
                and (
                    table.id_entries is None
                    or table.id_map_hashed
                    or not blob.n_rows
                    or blob.row_ids[0] != 0
                )
            ):
                raise ApplyError(
                    f"full version {m.version} carries {blob.n_rows} of the {blob.table_rows} "
                    f"rows of table {table.name!r}: only a table with a dynamic id map may leave "
                    "rows out, and never row 0, the unknown row (docs/FORMAT.md 7.1)"
                )
            held = self.id_maps.get(table.name)
            if (
                table.id_entries is not None
                and held is not None
                and table.id_map_hashed != held.hashed
            ):
                raise ApplyError(
                    f"version {m.version}: the id-map blob of table {table.name!r} is of a "
                    f"{'hashed' if table.id_map_hashed else 'dynamic'} map; the served "
                    f"model's map is {'hashed' if held.hashed else 'dynamic'}"
                )
        for name, value in (fetched.dense or {}).items():
            target = self.dense.get(name)
            new_name = target is None and self.adopts_dense and m.kind == "full"
            if not new_name and (target is None or tuple(target.shape) != value.shape):
                raise ApplyError(
                    f"version {m.version}: dense tensor {name!r} of shape {value.shape} "
                    f"does not match the model "
                    f"({None if target is None else tuple(target.shape)})"
                )
            check_finite(m, f"dense tensor {name!r}", value)

    # --- writes ---------------------------------------------------------------------------------

    def write(self, fetched: FetchedVersion, touched: Touched) -> None:
        """Decode `fetched` into this copy (call `check` first), recording what changed.

        NonFiniteError if a decoded row is NaN or Inf, after recording it in `touched` (the
        caller repairs or drops this copy, which no reader sees while it is written).
        """
        for table in fetched.tables:
            if table.blob.n_rows:
                wider = self._widen_for(table.name, table.blob.codec)
                if wider is not None:
                    self._install(table.name, wider)
                    touched.add_whole(table.name)
            # A blob of every row is written in place: a full table costs no second copy.
            held = self.tables[table.name]
            sparse_full = fetched.manifest.kind == "full" and table.blob.n_rows < held.rows
            if sparse_full:
                # A full of the rows a dynamic map's ids hold: the rest are free and zero, and
                # the map holds the blob's entries only (docs/FORMAT.md 7.1).
                free = np.ones(held.rows, dtype=np.bool_)
                free[table.blob.row_ids] = False
                held.zero_rows(np.flatnonzero(free))
                self.id_maps.pop(table.name, None)
                touched.add_whole(table.name)
            rows = held.write_blob(table.blob)
            if rows is None:
                touched.add_whole(table.name)
            elif not sparse_full:  # a whole table is copied, not replayed row by row
                touched.add_rows(table.name, rows)
            _check_written(fetched.manifest, table.name, held, rows)
            id_rows = table.id_rows()
            if id_rows is not None:
                # IdMapError leaves the map as it was; the rows just written are repaired
                # with the rest of `touched` by the caller.
                id_map = self._id_map(table.name, table.id_map_hashed)
                checked = id_map.check(id_rows.ids, id_rows.entries)
                id_map.write(checked)
                touched.add_id_write(table.name, checked)
        if fetched.dense is not None:
            self._write_dense(fetched.dense)
            touched.dense = True

    def _id_map(self, name: str, hashed: bool) -> IdMap:
        """Table `name`'s map, made empty (of the blob's mode) by the first write to it."""
        id_map = self.id_maps.get(name)
        if id_map is None:
            id_map = self.id_maps[name] = IdMap(self.tables[name].rows, hashed=hashed)
        return id_map

    def _write_dense(self, dense: Mapping[str, np.ndarray]) -> None:
        for name, value in dense.items():
            target = self.dense.get(name)
            if target is None:  # a tensor sink adopting a full version's dense state
                self.dense[name] = torch.from_numpy(np.array(value, copy=True))
            else:
                target.copy_(torch.from_numpy(np.asarray(value)))

    def stage(self, versions: Sequence[FetchedVersion]) -> StagedWrite:
        """Deltas `versions` (in order, each `check`ed) made ready to `commit`, this copy
        untouched: rows in their table's format; a table that must widen is converted and
        written beside the served one. NonFiniteError or CodecError for rows that do not
        decode to finite values."""
        staged = StagedWrite()
        for fetched in versions:
            for table in fetched.tables:
                if not table.blob.n_rows:
                    continue
                name = table.name
                held = staged.replaced.get(name, self.tables[name])
                fmt = held_format(table.blob.codec, held.dim, held.format, held.lookup)
                rows: TableRows | None
                if name not in staged.replaced and fmt == held.format:
                    rows = held.rows_of(table.blob)
                    staged.rows.append((name, rows))
                else:
                    held = staged.replaced[name] = self._staged_copy(staged, name, held, fmt)
                    rows = held.write_blob(table.blob)
                _check_written(fetched.manifest, name, held, rows)
            if fetched.dense is not None:
                staged.dense.append(fetched.dense)
        return staged

    @staticmethod
    def _staged_copy(staged: StagedWrite, name: str, held: HeldTable, fmt: HeldFormat) -> HeldTable:
        """Table `name` in `fmt`, built beside the served one: `held` itself if it already is
        that copy, else a copy with the rows staged for it so far written in (in their format,
        before it converts)."""
        if name in staged.replaced:
            return held if fmt == held.format else held.converted(fmt)
        earlier = [rows for n, rows in staged.rows if n == name]
        if earlier:
            held = held.copy()
            for rows in earlier:
                held.scatter(rows)
            staged.rows = [(n, rows) for n, rows in staged.rows if n != name]
        return held.converted(fmt)

    def commit(self, staged: StagedWrite) -> None:
        """Make the writes `stage` prepared (the reader-writer scheme's critical section)."""
        for name, table in staged.replaced.items():
            self._install(name, table)
        for name, rows in staged.rows:
            self.tables[name].scatter(rows)
        for dense in staged.dense:
            self._write_dense(dense)

    def check_id_rows(self, updates: Mapping[str, IdMapRows]) -> dict[str, IdMapWrite]:
        """The checked writes of `updates` to this copy's maps (IdMapError if one does not
        apply). It reads the maps only: the reader-writer scheme checks before its write lock."""
        return {n: self.id_maps[n].check(rows.ids, rows.entries) for n, rows in updates.items()}

    def write_id_maps(self, writes: Mapping[str, IdMapWrite]) -> None:
        """Make writes `check_id_rows` returned (the reader-writer scheme's critical section:
        nothing else writes the maps in between, so none fails half-way or is checked twice)."""
        for name, checked in writes.items():
            self.id_maps[name].write(checked)

    def copy_from(self, source: ModelCopy, touched: Touched) -> None:
        """Make the `touched` parts of this copy bitwise equal to `source`'s, by gathering
        them from `source` (repairs a copy whose write failed half-way)."""
        for name in touched.whole:
            self._level_table(source, name)
        for name in touched.rows:
            if name in touched.whole:
                continue
            self.tables[name].copy_from(source.tables[name], touched.row_ids(name))
        for name in touched.id_writes:
            ids = touched.id_row_ids(name)
            self._map_like(source, name).apply(ids, source.id_maps[name].entries(ids))
        self._level_maps(source, touched)
        self._level_dense(source, touched)

    def replay(self, source: ModelCopy, touched: Touched) -> None:
        """Repeat on this copy the writes `source` received (`touched`): whole tables are
        copied from `source`, row writes are replayed from their recorded values, in order.
        Afterwards both copies are bitwise equal if they were before the writes."""
        for name in touched.whole:
            self._level_table(source, name)
        for name, writes in touched.rows.items():
            for rows in writes:
                self.tables[name].scatter(rows)
        # The writes were checked on `source`'s maps, equal to these before them.
        for name, id_writes in touched.id_writes.items():
            for checked in id_writes:
                self._map_like(source, name).write(checked)
        self._level_maps(source, touched)
        self._level_dense(source, touched)

    def _map_like(self, source: ModelCopy, name: str) -> IdMap:
        return self._id_map(name, source.id_maps[name].hashed)

    def _level_table(self, source: ModelCopy, name: str) -> None:
        # A table whose format the other copy widened (or, repairing, did not) is replaced.
        theirs = source.tables[name]
        if self.tables[name].format == theirs.format:
            self.tables[name].copy_from(theirs)
        else:
            self._install(name, theirs.copy())

    def _level_maps(self, source: ModelCopy, touched: Touched) -> None:
        # A whole table's map is copied in place (array copies and one dict copy), not
        # re-applied row by row; one the source has and this copy not yet is made first.
        for name in touched.whole:
            if name in source.id_maps:
                self._map_like(source, name).load_from(source.id_maps[name])
            else:
                self.id_maps.pop(name, None)

    def _level_dense(self, source: ModelCopy, touched: Touched) -> None:
        if touched.dense:
            for name, tensor in source.dense.items():
                mine = self.dense.get(name)
                if mine is None:
                    self.dense[name] = tensor.clone()
                else:
                    mine.copy_(tensor)
        self.served = source.served

    def digest(self) -> dict[str, str]:
        """sha256 of every table's float32 values (decoded from a quantized table: servers of
        either format agree), every dense tensor's bytes and every id map (as `<table>.id_map`:
        its rows' ids, counts and last-seen times), for fleet checks."""
        out: dict[str, str] = {}
        tables = {name: table.values() for name, table in self.tables.items()}
        for name, tensor in [*sorted(tables.items()), *sorted(self.dense.items())]:
            # hashlib reads the array's buffer directly (no copy) and releases the GIL.
            out[name] = hashlib.sha256(np.ascontiguousarray(tensor.numpy()).data).hexdigest()
        for name, id_map in sorted(self.id_maps.items()):
            out[f"{name}.id_map"] = id_map_digest(id_map)
        return out


def install_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at `path` (`a.b.c`) of `model`, in place of what is there (a ModuleDict
    keeps its order: the entry is replaced where it stands)."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, module)


def _check_written(manifest: Manifest, name: str, table: HeldTable, rows: TableRows | None) -> None:
    """NonFiniteError if float32 rows just decoded hold NaN or Inf. (Fused rows hold finite
    values by construction: their blob's scale and bias were checked, and bias + code * scale
    stays far inside float32's range.)"""
    what = f"rows of table {name!r}"
    if isinstance(rows, BlobRows):
        check_finite(manifest, what, rows.values)
    elif rows is None and isinstance(table, Float32Table):
        check_finite(manifest, what, table.weights)


def id_map_digest(id_map: IdMap) -> str:
    """sha256 of a map's state: every row's key (UTF-8, length-prefixed: a key may hold any
    character), then the counts and last-seen times."""
    digest = hashlib.sha256()
    entries = id_map.entries(np.arange(id_map.rows, dtype=np.int64))
    for key in entries.keys:
        data = key.encode("utf-8")
        digest.update(len(data).to_bytes(2, "little") + data)
    digest.update(np.ascontiguousarray(entries.counts).data)
    digest.update(np.ascontiguousarray(entries.last_seen).data)
    return digest.hexdigest()
