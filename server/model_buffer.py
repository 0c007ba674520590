"""One servable copy of a model, and the verified contents of a version about to be written to it.

`fetch_version` reads every blob of a version through `publisher.read.restore.read_blob` (the
restore path's own fetch, size + sha256 check, hostile-input decode and manifest cross-check)
and the dense tensor blob through `get_verified` + `decode_tensors`, so a follower verifies
exactly what a restore verifies. A table a job stored in row-range shards (docs/FORMAT.md 3.3)
comes back from `read_blob` as one blob of global rows (its shards fetched in parallel and
joined), so everything below reads it like any table. Nothing is written to a model before
every blob of the version has passed.

A model trained from raw events (`extra["live"]`) also carries an id-map blob beside each table
blob (docs/FORMAT.md section 7); it is fetched, verified and decoded with the table's, by the
restore path's own `publisher.read.id_map_rows.read_id_entries`, and a bad one rejects the
version like a bad table blob.

A `ModelBuffer` is a `DLRM` with its weights reachable by table name and dense state name, plus
the version it holds, and for a model trained from raw events one `IdMap` per table: each copy
of the model holds its own maps, written with its rows, so that swapping a copy in swaps rows
and maps together and a prediction maps its ids with the version whose rows it reads.

Each table is a `server.held_tables.HeldTable`: float32, written by decoding rows through
`publisher.read.blob_rows`, the restore path's own blob-to-rows code (a full table decodes in
place, a delta's rows are scattered in by one vectorised assignment per table); or, with
quantized serving on, FBGEMM's fused int8/int4/int2 rows, written by copying the blob's codes,
scale and bias into place and looked up by torch's quantized embedding-bag kernels. A table
starts in the format of the codec the model's first full version brings and widens exactly when
a version brings a finer one (server/held_tables.py says why and how). Writing a version also
applies the id-map entries of those rows (`IdMap.apply`, checked and atomic), and records what
it touched, so a second buffer can be brought level by repeating only those writes
(server/consistency.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import numpy.typing as npt
import torch

from publisher.dlrm import DLRM, TABLE_PREFIX, DLRMConfig, table_weight_names
from publisher.id_map import IdMap, IdMapWrite
from publisher.live_features import LiveSpec
from publisher.memory_budget import MemoryBudget
from publisher.read.blob_rows import BlobRows
from publisher.read.catalog import VersionRef
from publisher.read.id_map_rows import read_id_entries
from publisher.read.restore import read_blob
from publisher.store import ObjectStore
from schemas.delta_blob import DeltaBlob
from schemas.id_map_blob import IdEntries
from schemas.manifest import Manifest, TableEntry
from schemas.tensor_blob import decode_tensors
from server.errors import ApplyError, NonFiniteError
from server.held_tables import (
    Float32Table,
    HeldFormat,
    HeldTable,
    TableRows,
    held_format,
    new_table,
)
from server.raw_ids import live_spec_of, new_id_maps

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
    #: whether the id-map blob says its map is hashed (checked against the served model).
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
    buffer's `check_manifest` has checked that the model expects it; its `check` that the
    blob's mode is the model's).
    """
    manifest = ref.manifest
    entries = list(manifest.tables)

    def read(entry: TableEntry) -> FetchedTable:
        blob = read_blob(store, entry)
        if entry.id_map is None:
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


@dataclass(frozen=True)
class ServedVersion:
    """The version a buffer holds and when it became servable."""

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
    """What writing a plan changed in a buffer: whole tables (with their id maps; a table whose
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
    """Deltas made ready to write to a buffer (`ModelBuffer.stage`), so that writing them
    (`ModelBuffer.commit`, the reader-writer scheme's critical section) only copies: per table
    the rows in its format, in order; tables that widen, built whole beside the served ones; and
    the dense tensors."""

    rows: list[tuple[str, TableRows]] = field(default_factory=list)
    replaced: dict[str, HeldTable] = field(default_factory=dict)
    dense: list[Mapping[str, np.ndarray]] = field(default_factory=list)


def model_state_names(model: DLRM) -> tuple[dict[str, str], list[str]]:
    """(table name -> weight state name, dense state names) of a model."""
    weights = table_weight_names(model)
    table_keys = set(weights.values())
    dense = [k for k in model.state_dict() if k not in table_keys]
    return weights, dense


class ModelBuffer:
    """A DLRM for inference, its tensors by name, and the version it holds.

    Readers only call `forward` (under `torch.inference_mode`); writers go through `write`,
    `copy_from`, `replay` and `commit`, which the consistency schemes call only while no reader
    can see this buffer (double buffer) or under the write lock (reader-writer).

    `formats` gives the format each table starts in (server/held_tables.py; default fp32).
    """

    def __init__(
        self,
        config: DLRMConfig,
        model: DLRM | None = None,
        formats: Mapping[str, HeldFormat] | None = None,
    ) -> None:
        self.config = config
        #: the inputs of a model trained from raw events (None: the client sends encoded ids),
        #: and then its id maps by table name, written with the rows of each version.
        self.live: LiveSpec | None = live_spec_of(config)
        self.id_maps: dict[str, IdMap] = {} if self.live is None else new_id_maps(config, self.live)
        # Every row is written (by a full version, or `clone`'s copy) before a reader sees it.
        self.model = model if model is not None else DLRM(config, draw_tables=False)
        self.model.eval()
        self.model.requires_grad_(False)  # in-place writes on leaves need no autograd
        state = self.model.state_dict(keep_vars=True)
        weights, dense = model_state_names(self.model)
        self.tables: dict[str, HeldTable] = {}
        for name in weights:
            bag = self.model.embeddings[name.removeprefix(TABLE_PREFIX)]
            assert isinstance(bag, torch.nn.EmbeddingBag)
            fmt = (formats or {}).get(name, "fp32")
            if fmt == "fp32":
                self.tables[name] = Float32Table(bag)
            else:  # the model's float32 table is dropped: the held one replaces it
                self._install(name, new_table(bag.num_embeddings, bag.embedding_dim, fmt))
        self.dense: dict[str, torch.Tensor] = {k: state[k].data for k in dense}
        self.served: ServedVersion | None = None
        #: predictions reading this buffer now (double buffer only; guarded by the slot's lock).
        self.readers = 0

    @classmethod
    def for_manifest(
        cls, manifest: Manifest, budget: MemoryBudget, copies: int, *, quantized: bool = True
    ) -> ModelBuffer:
        """An empty buffer with the architecture `manifest.model_config` describes, once
        `copies` models of it fit `budget` (MemoryBudgetError before anything is allocated).
        With `quantized`, each table starts in the format of its codec in `manifest` (a full
        version; server/held_tables.py), else every table is float32.

        The budget counts float32 tables: a bound for every format, since tables may widen."""
        try:
            config = DLRMConfig.from_json(manifest.model_config_)
            live_spec_of(config)
        except ValueError as exc:  # ArchitectureError, LiveSpecError
            raise ApplyError(f"version {manifest.version}: {exc}") from exc
        budget.check_model(manifest, config, copies)
        formats = {e.name: held_format(e.codec, e.dim) for e in manifest.tables if quantized}
        return cls(config, formats=formats)

    @property
    def formats(self) -> dict[str, HeldFormat]:
        """The format each table is held in."""
        return {name: table.format for name, table in self.tables.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of the model's tensors and (approximately) its id maps."""
        dense = sum(t.numel() * t.element_size() for t in self.dense.values())
        maps = sum(m.nbytes for m in self.id_maps.values())
        return sum(t.nbytes for t in self.tables.values()) + dense + maps

    def values(self, name: str) -> torch.Tensor:
        """Table `name` as float32 (rows, dim): what a lookup of one row returns."""
        return self.tables[name].values()

    def _install(self, name: str, table: HeldTable) -> None:
        """Hold `table` as table `name` and look it up in the model's forward pass."""
        self.tables[name] = table
        self.model.embeddings[name.removeprefix(TABLE_PREFIX)] = table.module

    def _widen_for(self, name: str, codec: str) -> HeldTable | None:
        """Table `name` converted to the format rows of `codec` need, or None if it holds them."""
        table = self.tables[name]
        fmt = held_format(codec, table.dim, table.format)
        return None if fmt == table.format else table.converted(fmt)

    def forward(self, dense: torch.Tensor, sparse: Mapping[str, object]) -> torch.Tensor:
        """Logits of a batch (callers hold a reader on this buffer)."""
        with torch.inference_mode():
            logits: torch.Tensor = self.model(dense, sparse)
        return logits

    # --- checks ---------------------------------------------------------------------------------

    def fits(self, manifest: Manifest) -> bool:
        """True if `manifest` describes this buffer's architecture and table shapes."""
        try:
            config = DLRMConfig.from_json(manifest.model_config_)
        except ValueError:
            return False
        if config != self.config:
            return False
        return all(
            e.name in self.tables and self.tables[e.name].shape == (e.rows, e.dim)
            for e in manifest.tables
        )

    def check_manifest(self, m: Manifest) -> None:
        """Raise ApplyError unless `m` describes this buffer's architecture and table shapes,
        and carries an id-map blob for every table exactly when the model was trained from raw
        events: checked before its blobs are fetched, whose decode caps come from those shapes."""
        if not self.fits(m):
            raise ApplyError(
                f"version {m.version} ({m.kind}) has another architecture or table shapes than "
                f"the served model: tables {[(e.name, e.rows, e.dim) for e in m.tables]}, "
                f"served {[(n, *t.shape) for n, t in self.tables.items()]}"
            )
        wrong = [e.name for e in m.tables if (e.id_map is None) == (self.live is not None)]
        if wrong:
            expected = "an id-map blob" if self.live is not None else "no id-map blob"
            raise ApplyError(
                f"version {m.version}: tables {wrong} of a model "
                f"{'trained from raw events' if self.live is not None else 'of encoded ids'} "
                f"must each carry {expected} (docs/FORMAT.md section 7)"
            )

    def check(self, fetched: FetchedVersion) -> None:
        """Raise ApplyError unless every blob of `fetched` can be written to this buffer."""
        m = fetched.manifest
        self.check_manifest(m)
        if m.kind == "full":
            missing = set(self.tables) - {t.name for t in fetched.tables}
            if missing:
                raise ApplyError(f"full version {m.version} lacks tables {sorted(missing)}")
            if fetched.dense is None:
                raise ApplyError(f"full version {m.version} carries no dense parameters")
            absent = set(self.dense) - set(fetched.dense)
            if absent:
                raise ApplyError(f"full version {m.version} lacks dense tensors {sorted(absent)}")
        hashed = self.live is not None and self.live.id_space == "hash"
        for table in fetched.tables:
            if table.id_entries is not None and table.id_map_hashed != hashed:
                raise ApplyError(
                    f"version {m.version}: the id-map blob of table {table.name!r} is of a "
                    f"{'hashed' if table.id_map_hashed else 'dynamic'} map; the model's id "
                    f"space is {'hash' if hashed else 'dynamic'}"
                )
        if fetched.dense is not None:
            for name, value in fetched.dense.items():
                target = self.dense.get(name)
                if target is None or tuple(target.shape) != value.shape:
                    raise ApplyError(
                        f"version {m.version}: dense tensor {name!r} of shape {value.shape} "
                        f"does not match the model "
                        f"({None if target is None else tuple(target.shape)})"
                    )
                check_finite(m, f"dense tensor {name!r}", value)

    # --- writes ---------------------------------------------------------------------------------

    def write(self, fetched: FetchedVersion, touched: Touched) -> None:
        """Decode `fetched` into this buffer (call `check` first), recording what changed.

        NonFiniteError if a decoded row is NaN or Inf, after recording it in `touched` (the
        caller repairs or drops this buffer, which no reader sees while it is written).
        """
        for table in fetched.tables:
            if table.blob.n_rows:
                wider = self._widen_for(table.name, table.blob.codec)
                if wider is not None:
                    self._install(table.name, wider)
                    touched.add_whole(table.name)
            # A blob of every row is written in place: a full table costs no second copy.
            held = self.tables[table.name]
            rows = held.write_blob(table.blob)
            if rows is None:
                touched.add_whole(table.name)
            else:
                touched.add_rows(table.name, rows)
            _check_written(fetched.manifest, table.name, held, rows)
            id_rows = table.id_rows()
            if id_rows is not None:
                # IdMapError leaves the map as it was; the rows just written are repaired
                # with the rest of `touched` by the caller.
                id_map = self.id_maps[table.name]
                checked = id_map.check(id_rows.ids, id_rows.entries)
                id_map.write(checked)
                touched.add_id_write(table.name, checked)
        if fetched.dense is not None:
            for name, value in fetched.dense.items():
                self.dense[name].copy_(torch.from_numpy(np.asarray(value)))
            touched.dense = True

    def stage(self, versions: Sequence[FetchedVersion]) -> StagedWrite:
        """Deltas `versions` (in order, each `check`ed) made ready to `commit`, this buffer
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
                fmt = held_format(table.blob.codec, held.dim, held.format)
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
            for name, value in dense.items():
                self.dense[name].copy_(torch.from_numpy(np.asarray(value)))

    def check_id_rows(self, updates: Mapping[str, IdMapRows]) -> dict[str, IdMapWrite]:
        """The checked writes of `updates` to this buffer's maps (IdMapError if one does not
        apply). It reads the maps only: the reader-writer scheme checks before its write lock."""
        return {n: self.id_maps[n].check(rows.ids, rows.entries) for n, rows in updates.items()}

    def write_id_maps(self, writes: Mapping[str, IdMapWrite]) -> None:
        """Make writes `check_id_rows` returned (the reader-writer scheme's critical section:
        nothing else writes the maps in between, so none fails half-way or is checked twice)."""
        for name, checked in writes.items():
            self.id_maps[name].write(checked)

    def copy_from(self, source: ModelBuffer, touched: Touched) -> None:
        """Make the `touched` parts of this buffer bitwise equal to `source`'s, by gathering
        them from `source` (repairs a buffer whose write failed half-way)."""
        for name in touched.whole:
            self._level_table(source, name)
        for name in touched.rows:
            if name in touched.whole:
                continue
            self.tables[name].copy_from(source.tables[name], touched.row_ids(name))
        for name in touched.id_writes:
            ids = touched.id_row_ids(name)
            self.id_maps[name].apply(ids, source.id_maps[name].entries(ids))
        self._level_maps(source, touched)
        self._level_dense(source, touched)

    def replay(self, source: ModelBuffer, touched: Touched) -> None:
        """Repeat on this buffer the writes `source` received (`touched`): whole tables are
        copied from `source`, row writes are replayed from their recorded values, in order.
        Afterwards both buffers are bitwise equal if they were before the writes."""
        for name in touched.whole:
            self._level_table(source, name)
        for name, writes in touched.rows.items():
            for rows in writes:
                self.tables[name].scatter(rows)
        # The writes were checked on `source`'s maps, equal to these before them.
        for name, id_writes in touched.id_writes.items():
            for checked in id_writes:
                self.id_maps[name].write(checked)
        self._level_maps(source, touched)
        self._level_dense(source, touched)

    def _level_table(self, source: ModelBuffer, name: str) -> None:
        # A table whose format the other copy widened (or, repairing, did not) is replaced.
        theirs = source.tables[name]
        if self.tables[name].format == theirs.format:
            self.tables[name].copy_from(theirs)
        else:
            self._install(name, theirs.copy())

    def _level_maps(self, source: ModelBuffer, touched: Touched) -> None:
        # A whole table's map is copied in place (array copies and one dict copy), not
        # re-applied row by row.
        for name in touched.whole:
            if name in self.id_maps:
                self.id_maps[name].load_from(source.id_maps[name])

    def _level_dense(self, source: ModelBuffer, touched: Touched) -> None:
        if touched.dense:
            for name, tensor in self.dense.items():
                tensor.copy_(source.dense[name])
        self.served = source.served

    def clone(self) -> ModelBuffer:
        """A second buffer with the same architecture, bitwise equal weights and version."""
        other = ModelBuffer(self.config, formats=self.formats)
        touched = Touched(whole=set(self.tables), dense=True)
        other.copy_from(self, touched)
        return other

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


FetchFn = Callable[[VersionRef], FetchedVersion]
