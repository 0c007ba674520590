"""Rebuild a model's state at any committed version: its chain's baseline and deltas.

The chain is planned by `publisher.read.planner` and each blob is written into its table by
`publisher.read.blob_rows`: the paths a following server uses too. A table stored in row-range
shards (docs/FORMAT.md 3.3) is read as one blob (`read_blob` joins its shards), at the cost of
one copy of that version's encoded rows of the table while they are joined. A table may be
restored over a range of its rows only (`rows=`, a rank of a row-wise sharded job): its arrays
are that range's, the shard blobs that do not overlap it are not fetched, and a blob that does
gives only its rows inside it. A table's chain is read newest version first, and each row is
decoded once, from the newest version that holds it: the result is bit for bit that of applying
the chain oldest first, and memory stays near one copy of the model plus, per worker, one blob
and one table's codes. What is restored of the target's state (the tables and rows asked for)
is checked against the memory budget before anything is fetched (publisher/memory_budget.py),
and every blob against the sha256 in its manifest before it is decoded. With the fp32 codec the
result is bitwise equal to the trainer's state at that version; with a lossy codec each row is
within its codec's error bound and its optimizer columns are the trainer's rounded to bfloat16
(docs/FORMAT.md section 4).

A table with an id map (an open id space, docs/FORMAT.md section 7) gets its map rebuilt by the
same rule, from the id-map blob beside each table blob (publisher/read/id_map_rows.py), so the
map is the trainer's at that version, exactly. Either every version of a table's chain carries
an id map or none does, and a table with one is restored whole.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from publisher.id_map import IdMap, IdMapError
from publisher.memory_budget import MemoryBudget, MemoryBudgetError
from publisher.read.blob_rows import NewestRows, join_shards, rows_between
from publisher.read.catalog import Catalog, VersionRef
from publisher.read.id_map_rows import NewestIdEntries, read_id_entries
from publisher.read.planner import restore_plan
from publisher.store import ObjectStore
from schemas.delta_blob import DeltaBlob, decode_delta_blob
from schemas.errors import BadDataError, FormatError
from schemas.manifest import Manifest, Position, TableEntry, TableShard
from schemas.tensor_blob import decode_tensors

#: shard blobs of one table fetched at once (network-bound on S3; hashing releases the GIL).
SHARD_FETCH_CONCURRENCY = 8
#: a half-open range [start, end) of a table's global rows.
RowRange = tuple[int, int]


class RestoreError(BadDataError):
    """A version cannot be rebuilt: a blob that disagrees with its manifest or its table."""


@dataclass
class TableState:
    """One embedding table, or a range of its rows: weights and per-row optimizer columns."""

    name: str
    weights: np.ndarray  # float32 (rows, dim)
    aux: np.ndarray  # float32 (rows, aux_dim)
    #: the table's global row that `weights[0]` is: 0 unless a row range was restored.
    row_start: int = 0
    #: rows (of `weights`) no version of the chain carried, restored as zero: the free rows a
    #: full of a table with a dynamic id map leaves out (docs/FORMAT.md 7.1).
    unwritten: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass
class RestoredState:
    """A model at one version, as numpy arrays."""

    manifest: Manifest
    tables: dict[str, TableState]
    #: table -> its id map at this version, for the tables that have one.
    id_maps: dict[str, IdMap] = field(default_factory=dict)
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer_meta: dict[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def position(self) -> Position:
        return self.manifest.position


def read_blob(store: ObjectStore, entry: TableEntry, rows: RowRange | None = None) -> DeltaBlob:
    """Fetch, verify and decode one table's blob, checking it matches its manifest entry: the
    table's rows with global row ids, whether it is stored whole or in row-range shards
    (docs/FORMAT.md section 3.3), whose blobs are fetched in parallel and joined.

    Given `rows` (start, end), within the table: only the blobs that overlap them are fetched,
    and the blob returned is of a table of `end - start` rows, its ids counted from `start`.

    Each blob's decoder caps are its part's (`TableEntry.blob_limits`): a blob declaring a
    bigger table or shard than its entry fails on its header, before a byte is inflated.
    Raises IntegrityError, FormatError or RestoreError on the first blob that fails."""
    start, end = (0, entry.rows) if rows is None else rows
    parts = _overlapping(entry, start, end)
    if len(parts) == 1:
        blobs = [_read_part(store, entry, parts[0])]
    else:
        with ThreadPoolExecutor(max_workers=min(len(parts), SHARD_FETCH_CONCURRENCY)) as pool:
            blobs = list(pool.map(lambda part: _read_part(store, entry, part), parts))
    pieces = []
    for part, blob in zip(parts, blobs, strict=True):
        first, last = max(part.row_start, start), min(part.row_end, end)
        pieces.append(
            (first - start, rows_between(blob, first - part.row_start, last - part.row_start))
        )
    return join_shards(end - start, pieces)


def _overlapping(entry: TableEntry, start: int, end: int) -> list[TableShard]:
    """The parts of `entry` that hold rows of [start, end)."""
    return [p for p in entry.parts if p.row_start < end and start < p.row_end]


def _read_part(store: ObjectStore, entry: TableEntry, part: TableShard) -> DeltaBlob:
    data = store.get_verified(part.blob.key, part.blob.size, part.blob.sha256)
    blob = decode_delta_blob(data, limits=entry.blob_limits(part))
    expected = (
        entry.name,
        entry.codec,
        entry.dim,
        part.rows,
        part.rows_in_checkpoint,
        entry.aux_dim,
    )
    found = (blob.table, blob.codec, blob.dim, blob.table_rows, blob.n_rows, blob.aux_dim)
    if found != expected:
        raise RestoreError(
            f"{part.blob.key}: blob says (table, codec, dim, rows, n_rows, aux_dim)={found}, "
            f"the manifest says {expected}"
        )
    return blob


def _restore_table(
    store: ObjectStore, chain: list[VersionRef], target_entry: TableEntry, rows: RowRange
) -> tuple[TableState, IdMap | None, int]:
    """The `rows` of one table (and its id map, if it has one: then every row) at the chain's
    last version, and the blob bytes read for it.

    The chain is read newest version first and each row is decoded once, from the newest
    version that holds it (`NewestRows`): a row a newer delta gave is neither decoded nor
    written again, so a long chain costs about one table decode plus its blobs' reads. The id
    map's entries follow the same rule (`NewestIdEntries`).
    """
    entries = [_chain_entry(ref, target_entry, chain[-1].manifest) for ref in chain]
    baseline = entries[0]
    if baseline.rows_in_checkpoint != baseline.rows and not baseline.has_id_map:
        raise RestoreError(
            f"table {baseline.name!r} of version {chain[0].version}: the chain must start with "
            "a full table"
        )
    with_map = [entry.has_id_map for entry in entries]
    if any(with_map) and not all(with_map):
        versions = [ref.version for ref, has in zip(chain, with_map, strict=True) if not has]
        raise RestoreError(
            f"table {target_entry.name!r}: versions {versions} of the chain of version "
            f"{chain[-1].version} carry no id map where the others do"
        )
    start, end = rows
    if all(with_map) and rows != (0, target_entry.rows):
        # A sharded job writes no id map (docs/FORMAT.md 3.3): a map is rebuilt for every row.
        raise RestoreError(
            f"table {target_entry.name!r} carries an id map: it restores whole, not rows "
            f"[{start}, {end}) of its {target_entry.rows}"
        )
    newest, *older = reversed(entries)
    first = _read_entry(store, newest, rows)
    # Sized from the target's entry, which the memory budget checked, and only once a verified
    # blob agrees with it.
    table = TableState(
        name=target_entry.name,
        weights=np.empty((end - start, target_entry.dim), dtype=np.float32),
        aux=np.empty((end - start, target_entry.aux_dim), dtype=np.float32),
        row_start=start,
    )
    newest_rows = NewestRows(table.weights, table.aux)
    id_rows = NewestIdEntries(target_entry.rows) if all(with_map) else None
    for entry, blob in _newest_first(store, first, newest, older, rows):
        newest_rows.add(blob)
        if id_rows is not None:
            _add_id_entries(store, id_rows, entry, blob)
    newest_rows.decode()
    table.unwritten = newest_rows.zero_unfilled()
    id_map = None
    if id_rows is not None:
        try:
            id_map = id_rows.build()
        except (FormatError, IdMapError) as exc:
            raise RestoreError(f"table {target_entry.name!r}: id map: {exc}") from exc
    if len(table.unwritten) and (
        id_map is None or id_map.hashed or table.unwritten[0] + start == 0
    ):
        raise RestoreError(
            f"table {target_entry.name!r}: the chain of version {chain[-1].version} gives no "
            f"value for {len(table.unwritten)} rows, which only a full of a table with a "
            "dynamic id map may leave out, and never row 0, the unknown row "
            "(docs/FORMAT.md 7.1)"
        )
    read = sum(part.blob.size for e in entries for part in _overlapping(e, start, end))
    read += sum(e.id_map_bytes for e in entries)
    return table, id_map, read


def _newest_first(
    store: ObjectStore,
    first: DeltaBlob,
    newest: TableEntry,
    older: list[TableEntry],
    rows: RowRange,
) -> Iterator[tuple[TableEntry, DeltaBlob]]:
    """Each entry with its blob of `rows`, newest first; an older blob is fetched only when
    reached."""
    yield newest, first
    for entry in older:
        # Every blob is fetched and verified, even once newer ones gave every row: a chain
        # restores only if all of it is sound, whatever order it is read in.
        yield entry, _read_entry(store, entry, rows)


def _add_id_entries(
    store: ObjectStore, id_rows: NewestIdEntries, entry: TableEntry, blob: DeltaBlob
) -> None:
    """Read `entry`'s id-map blob and add it for `blob`'s rows; RestoreError if it is bad."""
    try:
        entries, hashed = read_id_entries(store, entry)
        id_rows.add(blob.row_ids, entries, hashed=hashed)
    except FormatError as exc:
        raise RestoreError(f"table {entry.name!r}: id map: {exc}") from exc


def _read_entry(store: ObjectStore, entry: TableEntry, rows: RowRange) -> DeltaBlob:
    """`read_blob`, a malformed blob raising RestoreError."""
    try:
        return read_blob(store, entry, rows)  # it matches its entry, hence the target's shape
    except FormatError as exc:
        raise RestoreError(f"table {entry.name!r}: {exc}") from exc


def _chain_entry(ref: VersionRef, target_entry: TableEntry, target: Manifest) -> TableEntry:
    """`ref`'s entry for the target's table, checked to be the same shape."""
    try:
        entry = ref.manifest.table(target_entry.name)
    except KeyError as exc:
        raise RestoreError(f"version {ref.version} lacks table {target_entry.name!r}") from exc
    shape = (entry.rows, entry.dim, entry.aux_dim)
    if shape != (target_entry.rows, target_entry.dim, target_entry.aux_dim):
        # Before any fetch: a blob's decode caps come from its entry, so an entry of another
        # shape (a forged baseline) must not get as far as inflating a blob.
        raise RestoreError(
            f"{ref.key}: table {entry.name!r} is {entry.rows}x{entry.dim} "
            f"(+{entry.aux_dim}), version {target.version} says {target_entry.rows}x"
            f"{target_entry.dim} (+{target_entry.aux_dim})"
        )
    return entry


def restore_chain(
    store: ObjectStore,
    chain: list[VersionRef],
    *,
    progress: bool = False,
    workers: int = 0,
    budget: MemoryBudget | None = None,
    tables: Collection[str] | None = None,
    rows: Mapping[str, RowRange] | None = None,
) -> RestoredState:
    """Apply a chain (baseline first) and return the state at its last version: of `tables`
    only when given (the others' blobs are not fetched; RestoreError for a name the version
    does not have), every table's otherwise.

    `rows` limits tables restored to a range of their rows: table -> (start, end), half-open,
    `TableState.row_start` is start (a table not named is restored whole). RestoreError for
    a range that is empty or not within the table, a table not restored, or one with an id map
    (unless the range is every row).

    Tables are independent, so they are restored on `workers` threads (default: one per core):
    sha256, zstd and the numpy scatter release the GIL. Each table reads its chain newest first
    and decodes each row once, and memory stays near one model copy plus one blob and one
    table's codes per worker. Before anything is fetched what it restores of the target's state
    (those tables and rows) must fit `budget` (default: the machine's), else RestoreError (from
    a MemoryBudgetError).
    """
    started = time.perf_counter()
    target = chain[-1].manifest
    entries = list(target.tables)
    if tables is not None:
        unknown = set(tables) - {e.name for e in entries}
        if unknown:
            raise RestoreError(
                f"version {target.version} has no table {', '.join(map(repr, sorted(unknown)))}"
            )
        entries = [e for e in entries if e.name in tables]
    ranges = _row_ranges(target, entries, rows or {})
    mapped = {t.name for t in entries if t.has_id_map}
    id_map_bytes = sum(
        t.id_map_bytes for ref in chain for t in ref.manifest.tables if t.name in mapped
    )
    try:
        restored = {name: end - start for name, (start, end) in ranges.items()}
        (budget or MemoryBudget.of_machine()).check_restore(target, id_map_bytes, restored)
    except MemoryBudgetError as exc:
        raise RestoreError(str(exc)) from exc
    state = RestoredState(manifest=target, tables={})
    workers = workers or min(len(entries), os.cpu_count() or 1) or 1
    bar = tqdm(
        total=len(entries),
        desc=f"restore v{target.version} ({len(chain)} versions)",
        unit="table",
        file=sys.stderr,
        disable=True if not progress else None,
    )
    with bar, ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_restore_table, store, chain, e, ranges[e.name]) for e in entries]
        for future in futures:
            table, id_map, bytes_read = future.result()
            state.tables[table.name] = table
            if id_map is not None:
                state.id_maps[table.name] = id_map
            state.bytes_read += bytes_read
            bar.update(1)
    if target.dense is not None:
        data = store.get_verified(target.dense.key, target.dense.size, target.dense.sha256)
        state.dense, _ = decode_tensors(data)
        state.bytes_read += len(data)
    if target.optimizer is not None:
        ref = target.optimizer
        data = store.get_verified(ref.key, ref.size, ref.sha256)
        state.optimizer, state.optimizer_meta = decode_tensors(data)
        state.bytes_read += len(data)
    state.seconds = time.perf_counter() - started
    return state


def _row_ranges(
    target: Manifest, entries: list[TableEntry], rows: Mapping[str, RowRange]
) -> dict[str, RowRange]:
    """Each table to restore -> the range of its rows to restore: `rows`' (checked), else
    every row."""
    names = {e.name for e in entries}
    unknown = set(rows) - names
    if unknown:
        raise RestoreError(
            f"rows asked of tables {sorted(unknown)} that version {target.version} does not "
            f"restore (restored: {sorted(names)})"
        )
    ranges = {}
    for entry in entries:
        start, end = rows.get(entry.name, (0, entry.rows))
        if not 0 <= start < end <= entry.rows:
            raise RestoreError(
                f"table {entry.name!r}: rows [{start}, {end}) are not a non-empty range of its "
                f"rows [0, {entry.rows})"
            )
        ranges[entry.name] = (start, end)
    return ranges


def restore(
    store: ObjectStore,
    model: str,
    version: int | None = None,
    *,
    progress: bool = False,
    budget: MemoryBudget | None = None,
    tables: Collection[str] | None = None,
    rows: Mapping[str, RowRange] | None = None,
) -> RestoredState:
    """The state of `model` at `version` (the latest when None), if it fits `budget`; of
    `tables` only when given, and of the named tables' `rows` ranges only (`restore_chain`)."""
    chain = restore_plan(Catalog(store, model), version)
    return restore_chain(store, chain, progress=progress, budget=budget, tables=tables, rows=rows)
