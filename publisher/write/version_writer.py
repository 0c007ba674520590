"""The write side of the commit protocol (docs/FORMAT.md section 2): lease, blobs, manifest, HEAD.

    writer = VersionWriter(store, "movielens")      # probes the store, takes the lease
    ref = writer.commit(draft)                       # blobs -> manifest -> HEAD (compare-and-swap)

`commit` is three steps a job of several ranks (section 2.1) takes apart: `reserve` (read HEAD,
pick V and its parent: the writer's, rank 0's), `upload_part` (each rank puts its blobs under
its own prefix and reports their references, JSON-able `WrittenPart`s) and `commit_parts` (the
writer's: one manifest of every part, the lease renewed, HEAD by compare-and-swap).

Order is the whole point: blobs first, the manifest next, and HEAD last by compare-and-swap, so
a crash anywhere leaves the previous version as HEAD and nothing committed refers to a missing
object. Leftovers of a crash are orphans that `gc` removes. `crash_hook` lets tests stop the
protocol at each step.

The lease and HEAD are compare-and-swaps, so a writer first checks that the store enforces
conditional writes (`check_conditional_writes`) and refuses to publish to one that ignores them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from publisher.faults import fault_point
from publisher.read.catalog import Catalog, VersionRef
from publisher.store import (
    NotFoundError,
    ObjectStore,
    PreconditionFailedError,
    StoreError,
    check_conditional_writes,
)
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from schemas.errors import BadDataError, CheckNRunError, ConflictError
from schemas.manifest import (
    MAX_HEAD_BYTES,
    MAX_LEASE_BYTES,
    BlobRef,
    Head,
    Lease,
    Manifest,
    Position,
    ServedLoss,
    TableEntry,
    TableShard,
    check_model_name,
    utc_now,
)
from schemas.store_keys import (
    head_key,
    lease_key,
    manifest_key,
    probe_key,
    rank_blob_prefix,
    table_blob_name,
)


class WriterError(CheckNRunError):
    """The commit protocol refused to go on (raised itself for a draft it cannot commit)."""


class LeaseHeldError(WriterError, ConflictError):
    """Another live writer holds the model's lease."""


class HeadConflictError(WriterError, ConflictError):
    """HEAD moved under this writer: another writer committed, so this one must stop."""


class PartsError(WriterError, BadDataError):
    """The parts the writers of a version uploaded do not make one version (a table missing or
    written twice, shards with a gap or an overlap, dense state from two ranks): nothing is
    committed."""


#: stages of a commit, in order; `crash_hook(stage)` runs at each.
CommitStage = Literal["blob_written", "blobs_done", "manifest_written", "head_moved"]


@dataclass(frozen=True)
class TableBlob:
    """One encoded table of a version about to be committed."""

    name: str
    rows: int
    dim: int
    codec: str
    rows_in_checkpoint: int
    aux_dim: int
    data: bytes
    #: the id-map blob of the same rows (docs/FORMAT.md section 7), for a table with an id map.
    id_map: bytes | None = None
    #: the global rows [start, end) of a shard blob (docs/FORMAT.md 3.3: its `table_rows` is
    #: end - start, its row ids shard-local); None: the blob holds the whole table.
    row_range: tuple[int, int] | None = None


@dataclass(frozen=True, kw_only=True)
class VersionHeader:
    """What a version says besides its blobs: kind, policy, position, model and metrics."""

    kind: Literal["full", "delta"]
    #: what a delta's rows are relative to: the previous version or the baseline (one-shot).
    relative_to: Literal["parent", "baseline"] | None
    policy: str
    position: Position
    model_config: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    #: the version as a server holds it next to the fp32 state (docs/FORMAT.md 3.2).
    served_loss: ServedLoss | None = None


@dataclass(frozen=True, kw_only=True)
class BlobsDraft:
    """The encoded blobs one writer puts for a version: all of them for a single process, its
    own tables or shards (and on rank 0 the dense state) for a rank of a job."""

    tables: Sequence[TableBlob]
    dense: bytes | None = None
    optimizer: bytes | None = None
    #: the tensors' share of `dense` / `optimizer` (docs/FORMAT.md 3.1); None: not known.
    dense_tensor_bytes: int | None = None
    optimizer_tensor_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class VersionDraft(VersionHeader, BlobsDraft):
    """A version before it has a number: what a single-process publisher hands to `commit`,
    its header and all of its blobs in one."""


@dataclass(frozen=True)
class Reservation:
    """The number and parent `VersionWriter.reserve` picked for the next version, and HEAD's
    ETag then: the compare-and-swap that commits it fails if HEAD has moved since."""

    model: str
    version: int
    #: the writer's (the job's) token, in every blob and manifest key of the version.
    token: str
    parent: VersionRef | None
    head_etag: str | None

    def check_kind(self, kind: Literal["full", "delta"]) -> None:
        """WriterError for a delta with nothing to apply to."""
        if kind == "delta" and self.parent is None:
            raise WriterError(f"model {self.model!r} has no version yet: the first must be full")


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WrittenTable(_Wire):
    """One durable table blob (or shard) of a version and its id map: what a rank reports."""

    name: str
    rows: int
    dim: int
    codec: str
    rows_in_checkpoint: int
    aux_dim: int
    blob: BlobRef
    id_map: BlobRef | None = None
    row_range: tuple[int, int] | None = None
    rank: int = 0


class WrittenPart(_Wire):
    """Every blob one writer put for a version, durable: sent to rank 0 as JSON
    (`model_dump(mode="json")`) and checked again there (`model_validate`)."""

    #: the job's rank that wrote it; None for a single process.
    rank: int | None
    tables: tuple[WrittenTable, ...]
    dense: BlobRef | None = None
    optimizer: BlobRef | None = None
    dense_tensor_bytes: int | None = None
    optimizer_tensor_bytes: int | None = None


def default_owner() -> str:
    """host:pid, so a restarted trainer on the same host can take over a dead one's lease."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class VersionWriter:
    """Commits versions of one model; holds its lease while open."""

    def __init__(
        self,
        store: ObjectStore,
        model: str,
        *,
        owner: str | None = None,
        tunables: Tunables = DEFAULT_TUNABLES,
        crash_hook: Callable[[CommitStage], None] | None = None,
    ) -> None:
        self.store = store
        self.model = check_model_name(model)
        self.owner = owner or default_owner()
        self.token = uuid.uuid4().hex[:16]
        self.tunables = tunables
        self.crash_hook = crash_hook
        self.catalog = Catalog(store, model, cache_size=tunables.manifest_cache_size)
        self._lease_etag: str | None = None
        self._lease_lock = threading.Lock()
        self._stop = threading.Event()
        # Once per writer, before the lease: taking it is itself a conditional write.
        check_conditional_writes(store, probe_key(self.model, self.token))
        self._acquire_lease()
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True, name="lease")
        self._renewer.start()

    # --- lease --------------------------------------------------------------------------------

    def _lease(self) -> Lease:
        return Lease(
            model=self.model,
            owner=self.owner,
            token=self.token,
            expires_at=time.time() + self.tunables.lease_ttl_s,
        )

    def _acquire_lease(self) -> None:
        key = lease_key(self.model)
        try:
            data, etag = self.store.get_with_etag(key, MAX_LEASE_BYTES)
        except NotFoundError:
            etag = None
        else:
            held = Lease.from_json(data)
            if not self._may_take(held):
                raise LeaseHeldError(
                    f"model {self.model!r} is being published by {held.owner} (lease expires in "
                    f"{held.expires_at - time.time():.0f} s); stop that trainer or wait"
                )
        try:
            self._lease_etag = self.store.put_if(key, self._lease().to_json(), etag=etag)
        except PreconditionFailedError as exc:
            raise LeaseHeldError(f"model {self.model!r}: another writer took the lease") from exc

    def _may_take(self, held: Lease) -> bool:
        if held.expires_at <= time.time():
            return True
        host, _, pid = held.owner.rpartition(":")
        # A crashed writer on this very host: its pid is gone, so the lease is stale.
        return host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid))

    def renew_lease(self) -> None:
        """Extend the lease; LeaseHeldError if another writer has taken it."""
        with self._lease_lock:
            try:
                self._lease_etag = self.store.put_if(
                    lease_key(self.model), self._lease().to_json(), etag=self._lease_etag
                )
            except PreconditionFailedError as exc:
                raise LeaseHeldError(f"model {self.model!r}: lease lost to another writer") from exc

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.tunables.lease_ttl_s / 3):
            try:
                self.renew_lease()
            except (StoreError, LeaseHeldError):
                # The store may be down for a while, or the lease taken; commit() re-checks
                # before moving HEAD.
                continue

    def close(self) -> None:
        """Stop renewing and release the lease (it expires anyway if this fails)."""
        self._stop.set()
        self._renewer.join(timeout=5)
        released = Lease(model=self.model, owner=self.owner, token=self.token, expires_at=0.0)
        with self._lease_lock, contextlib.suppress(StoreError):
            self.store.put_if(lease_key(self.model), released.to_json(), etag=self._lease_etag)

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- commit -------------------------------------------------------------------------------

    def _hook(self, stage: CommitStage) -> None:
        fault_point(stage)
        if self.crash_hook is not None:
            self.crash_hook(stage)

    def reserve(self) -> Reservation:
        """Read HEAD and pick the next version's number and parent (step 2 of FORMAT 2.1).

        Nothing is written: the blobs of the reservation go under `rank_blob_prefix(model,
        version, token, rank)`, and `commit_parts` commits them if HEAD has not moved since."""
        try:
            head_data, head_etag = self.store.get_with_etag(head_key(self.model), MAX_HEAD_BYTES)
        except NotFoundError:
            return Reservation(self.model, 1, self.token, None, None)
        head = Head.from_json(head_data)
        parent = VersionRef(self.catalog.manifest(head.manifest), head.manifest)
        return Reservation(self.model, parent.version + 1, self.token, parent, head_etag)

    def commit(self, draft: VersionDraft) -> VersionRef:
        """Write a draft as the next version and move HEAD to it."""
        reservation = self.reserve()
        reservation.check_kind(draft.kind)
        return self.commit_parts(reservation, draft, [self.upload(reservation, draft)])

    def upload(self, reservation: Reservation, blobs: BlobsDraft) -> WrittenPart:
        """Put a single writer's blobs of `reservation` (`upload_part` with this writer's
        crash hook)."""
        return upload_part(
            self.store, reservation, None, blobs, tunables=self.tunables, hook=self._hook
        )

    def commit_parts(
        self,
        reservation: Reservation,
        header: VersionHeader,
        parts: Sequence[WrittenPart],
        table_order: Sequence[str] | None = None,
    ) -> VersionRef:
        """Commit the parts every writer of `reservation` uploaded as one version: the
        manifest, then HEAD by compare-and-swap against what `reserve` read.

        Tables appear once, in `table_order` (every table named there must be present), else in
        the parts' order; a table written in row-range shards gets them sorted, and shards that
        leave a gap or overlap are refused (WriterError) before anything is written."""
        self._hook("blobs_done")
        reservation.check_kind(header.kind)
        version, parent = reservation.version, reservation.parent
        if header.kind == "full":
            baseline, applies_to = version, None
        else:
            assert parent is not None  # check_kind
            baseline = parent.manifest.baseline
            applies_to = parent.version if header.relative_to == "parent" else baseline
        dense = [p for p in parts if p.dense is not None or p.optimizer is not None]
        if len(dense) > 1:
            raise PartsError(
                f"version {version}: ranks {[p.rank for p in dense]} each sent dense state; "
                "one writer (rank 0) holds it"
            )
        state = dense[0] if dense else None
        try:
            manifest = Manifest(
                model=self.model,
                version=version,
                parent=None if parent is None else parent.version,
                parent_manifest=None if parent is None else parent.key,
                kind=header.kind,
                baseline=baseline,
                applies_to=applies_to,
                policy=header.policy,
                created_at=utc_now(),
                position=header.position,
                tables=_table_entries(parts, table_order),
                dense=None if state is None else state.dense,
                optimizer=None if state is None else state.optimizer,
                dense_tensor_bytes=None if state is None else state.dense_tensor_bytes,
                optimizer_tensor_bytes=None if state is None else state.optimizer_tensor_bytes,
                model_config=dict(header.model_config),
                metrics={k: float(v) for k, v in header.metrics.items()},
                served_loss=header.served_loss,
            )
        except ValidationError as exc:
            raise PartsError(f"version {version} cannot be committed: {exc}") from exc
        key = manifest_key(self.model, version, self.token)
        self.store.put(key, manifest.to_json())
        self._hook("manifest_written")

        self.renew_lease()  # refuses if another writer took over while we uploaded
        head = Head(model=self.model, version=version, manifest=key)
        try:
            self.store.put_if(head_key(self.model), head.to_json(), etag=reservation.head_etag)
        except PreconditionFailedError as exc:
            raise HeadConflictError(
                f"HEAD of {self.model!r} moved while committing version {version}: another "
                "writer is publishing this model"
            ) from exc
        self.catalog.remember(key, manifest)
        self._hook("head_moved")
        return VersionRef(manifest, key)


def upload_part(
    store: ObjectStore,
    reservation: Reservation,
    rank: int | None,
    blobs: BlobsDraft,
    *,
    tunables: Tunables = DEFAULT_TUNABLES,
    hook: Callable[[CommitStage], None] = fault_point,
    table_index: Mapping[str, int] | None = None,
) -> WrittenPart:
    """Put one writer's blobs of a reserved version (in parallel) and return their references,
    once every put has returned: the whole version for a single process (`rank` None), or one
    rank's tables, shards and (rank 0) dense state under its `rRRRR/` prefix.

    A table blob is named by the table's index in `table_index` (the model's table order, which
    every rank knows), else by its position in `blobs.tables`."""
    prefix = rank_blob_prefix(reservation.model, reservation.version, reservation.token, rank)

    def name(i: int, t: TableBlob, suffix: str) -> str:
        index = i if table_index is None else table_index[t.name]
        start = None if t.row_range is None else t.row_range[0]
        return prefix + table_blob_name(index, t.name, suffix, start)

    uploads = [(name(i, t, "cnrd"), t.data) for i, t in enumerate(blobs.tables)]
    uploads += [
        (name(i, t, "idmap"), t.id_map) for i, t in enumerate(blobs.tables) if t.id_map is not None
    ]
    if blobs.dense is not None:
        uploads.append((f"{prefix}dense.safetensors", blobs.dense))
    if blobs.optimizer is not None:
        uploads.append((f"{prefix}optimizer.safetensors", blobs.optimizer))

    def put(key: str, data: bytes) -> BlobRef:
        store.put(key, data)
        hook("blob_written")
        return BlobRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())

    with ThreadPoolExecutor(max_workers=tunables.upload_concurrency) as pool:
        refs = iter(list(pool.map(lambda kv: put(*kv), uploads)))
    row_refs = [next(refs) for _ in blobs.tables]
    tables = tuple(
        WrittenTable(
            name=t.name,
            rows=t.rows,
            dim=t.dim,
            codec=t.codec,
            rows_in_checkpoint=t.rows_in_checkpoint,
            aux_dim=t.aux_dim,
            blob=ref,
            id_map=next(refs) if t.id_map is not None else None,
            row_range=t.row_range,
            rank=rank or 0,
        )
        for t, ref in zip(blobs.tables, row_refs, strict=True)
    )
    return WrittenPart(
        rank=rank,
        tables=tables,
        dense=next(refs) if blobs.dense is not None else None,
        optimizer=next(refs) if blobs.optimizer is not None else None,
        dense_tensor_bytes=blobs.dense_tensor_bytes,
        optimizer_tensor_bytes=blobs.optimizer_tensor_bytes,
    )


def _table_entries(
    parts: Sequence[WrittenPart], table_order: Sequence[str] | None
) -> tuple[TableEntry, ...]:
    """One manifest entry per table of `parts`: whole, or its shards sorted by row_start."""
    written: dict[str, list[WrittenTable]] = {}
    for part in parts:
        for table in part.tables:
            written.setdefault(table.name, []).append(table)
    if table_order is not None:
        missing = [n for n in table_order if n not in written]
        unknown = [n for n in written if n not in table_order]
        if missing or unknown:
            raise PartsError(
                f"the version must hold the model's tables {list(table_order)}: "
                f"{missing} were not written, {unknown} are not the model's"
            )
    names = list(written) if table_order is None else list(table_order)
    return tuple(_table_entry(written[name]) for name in names)


def _table_entry(pieces: list[WrittenTable]) -> TableEntry:
    first = pieces[0]
    shapes = {(p.rows, p.dim, p.codec, p.aux_dim) for p in pieces}
    if len(shapes) > 1:
        raise PartsError(f"table {first.name!r} was written in several shapes: {sorted(shapes)}")
    ranged = [p for p in pieces if p.row_range is not None]
    if not ranged:
        if len(pieces) > 1:
            ranks = [p.rank for p in pieces]
            raise PartsError(f"table {first.name!r} was written whole by ranks {ranks}")
        return TableEntry(
            name=first.name,
            rows=first.rows,
            dim=first.dim,
            codec=first.codec,
            rows_in_checkpoint=first.rows_in_checkpoint,
            aux_dim=first.aux_dim,
            blob=first.blob,
            id_map=first.id_map,
        )
    if len(ranged) != len(pieces):
        raise PartsError(f"table {first.name!r} was written both whole and in row ranges")
    shards = []
    for p in sorted(ranged, key=lambda p: p.row_range or (0, 0)):
        assert p.row_range is not None
        shards.append(
            TableShard(
                rank=p.rank,
                row_start=p.row_range[0],
                row_end=p.row_range[1],
                rows_in_checkpoint=p.rows_in_checkpoint,
                blob=p.blob,
                id_map=p.id_map,
            )
        )
    return TableEntry(
        name=first.name,
        rows=first.rows,
        dim=first.dim,
        codec=first.codec,
        rows_in_checkpoint=sum(s.rows_in_checkpoint for s in shards),
        aux_dim=first.aux_dim,
        blob=None,
        shards=tuple(shards),
    )
