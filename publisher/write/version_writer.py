"""The write side of the commit protocol (docs/FORMAT.md section 2): lease, blobs, manifest, HEAD.

    writer = VersionWriter(store, "movielens")      # probes the store, takes the lease
    ref = writer.commit(draft)                       # blobs -> manifest -> HEAD (compare-and-swap)

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
from schemas.errors import CheckNRunError, ConflictError
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
    check_model_name,
    utc_now,
)
from schemas.store_keys import blob_prefix, head_key, lease_key, manifest_key, probe_key


class WriterError(CheckNRunError):
    """The commit protocol refused to go on (raised itself for a draft it cannot commit)."""


class LeaseHeldError(WriterError, ConflictError):
    """Another live writer holds the model's lease."""


class HeadConflictError(WriterError, ConflictError):
    """HEAD moved under this writer: another writer committed, so this one must stop."""


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


@dataclass(frozen=True)
class VersionDraft:
    """A version before it has a number: what the publisher hands to `commit`."""

    kind: Literal["full", "delta"]
    #: what a delta's rows are relative to: the previous version or the baseline (one-shot).
    relative_to: Literal["parent", "baseline"] | None
    policy: str
    position: Position
    tables: Sequence[TableBlob]
    dense: bytes | None = None
    optimizer: bytes | None = None
    #: the tensors' share of `dense` / `optimizer` (docs/FORMAT.md 3.1); None: not known.
    dense_tensor_bytes: int | None = None
    optimizer_tensor_bytes: int | None = None
    model_config: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    #: the version as a server holds it next to the fp32 state (docs/FORMAT.md 3.2).
    served_loss: ServedLoss | None = None


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

    def _put_blob(self, key: str, data: bytes) -> BlobRef:
        self.store.put(key, data)
        self._hook("blob_written")
        return BlobRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())

    def commit(self, draft: VersionDraft) -> VersionRef:
        """Write a draft as the next version and move HEAD to it."""
        try:
            head_data, head_etag = self.store.get_with_etag(head_key(self.model), MAX_HEAD_BYTES)
        except NotFoundError:
            parent: VersionRef | None = None
            head_etag_or_none: str | None = None
        else:
            head = Head.from_json(head_data)
            parent = VersionRef(self.catalog.manifest(head.manifest), head.manifest)
            head_etag_or_none = head_etag
        version = 1 if parent is None else parent.version + 1
        if draft.kind == "delta" and parent is None:
            raise WriterError(f"model {self.model!r} has no version yet: the first must be full")

        prefix = blob_prefix(self.model, version, self.token)
        uploads: list[tuple[str, bytes]] = [
            (f"{prefix}{i:04d}-{_safe_name(t.name)}.cnrd", t.data)
            for i, t in enumerate(draft.tables)
        ]
        id_maps = [(i, t.id_map) for i, t in enumerate(draft.tables) if t.id_map is not None]
        uploads += [
            (f"{prefix}{i:04d}-{_safe_name(draft.tables[i].name)}.idmap", data)
            for i, data in id_maps
        ]
        if draft.dense is not None:
            uploads.append((f"{prefix}dense.safetensors", draft.dense))
        if draft.optimizer is not None:
            uploads.append((f"{prefix}optimizer.safetensors", draft.optimizer))
        with ThreadPoolExecutor(max_workers=self.tunables.upload_concurrency) as pool:
            refs = list(pool.map(lambda kv: self._put_blob(*kv), uploads))
        self._hook("blobs_done")

        if draft.kind == "full":
            baseline, applies_to = version, None
        else:
            assert parent is not None
            baseline = parent.manifest.baseline
            applies_to = parent.version if draft.relative_to == "parent" else baseline
        n_tables = len(draft.tables)
        id_map_refs = dict(
            zip((i for i, _ in id_maps), refs[n_tables : n_tables + len(id_maps)], strict=True)
        )
        tables = tuple(
            TableEntry(
                name=t.name,
                rows=t.rows,
                dim=t.dim,
                codec=t.codec,
                rows_in_checkpoint=t.rows_in_checkpoint,
                aux_dim=t.aux_dim,
                blob=ref,
                id_map=id_map_refs.get(i),
            )
            for i, (t, ref) in enumerate(zip(draft.tables, refs, strict=False))
        )
        extra = iter(refs[n_tables + len(id_maps) :])
        manifest = Manifest(
            model=self.model,
            version=version,
            parent=None if parent is None else parent.version,
            parent_manifest=None if parent is None else parent.key,
            kind=draft.kind,
            baseline=baseline,
            applies_to=applies_to,
            policy=draft.policy,
            created_at=utc_now(),
            position=draft.position,
            tables=tables,
            dense=next(extra) if draft.dense is not None else None,
            optimizer=next(extra) if draft.optimizer is not None else None,
            dense_tensor_bytes=draft.dense_tensor_bytes,
            optimizer_tensor_bytes=draft.optimizer_tensor_bytes,
            model_config=dict(draft.model_config),
            metrics={k: float(v) for k, v in draft.metrics.items()},
            served_loss=draft.served_loss,
        )
        key = manifest_key(self.model, version, self.token)
        self.store.put(key, manifest.to_json())
        self._hook("manifest_written")

        self.renew_lease()  # refuses if another writer took over while we uploaded
        head = Head(model=self.model, version=version, manifest=key)
        try:
            self.store.put_if(head_key(self.model), head.to_json(), etag=head_etag_or_none)
        except PreconditionFailedError as exc:
            raise HeadConflictError(
                f"HEAD of {self.model!r} moved while committing version {version}: another "
                "writer is publishing this model"
            ) from exc
        self.catalog.remember(key, manifest)
        self._hook("head_moved")
        return VersionRef(manifest, key)


def _safe_name(name: str) -> str:
    """A table name as one path segment (module names contain dots, never slashes)."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return cleaned.strip(".") or "table"
