"""One servable copy of a model, and the verified contents of a version about to be written to it.

`fetch_version` reads every blob of a version through `publisher.read.restore.read_blob` (the
restore path's own fetch, size + sha256 check, hostile-input decode and manifest cross-check)
and the dense tensor blob through `get_verified` + `decode_tensors`, so a follower verifies
exactly what a restore verifies. Nothing is written to a model before every blob of the version
has passed.

A `ModelBuffer` is a `DLRM` with its weights reachable by table name and dense state name, plus
the version it holds. Writing a version decodes rows straight into the buffer's tensors through
`publisher.read.blob_rows`, the restore path's own blob-to-rows code (a full table decodes in
place, a delta's rows are scattered in by one vectorised assignment per table), and records what
it touched, so a second buffer can be brought level by repeating only those writes
(server/consistency.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import torch

from publisher.dlrm import DLRM, DLRMConfig, table_weight_names
from publisher.memory_budget import MemoryBudget
from publisher.read.blob_rows import BlobRows, decode_blob, write_blob
from publisher.read.catalog import VersionRef
from publisher.read.restore import read_blob
from publisher.store import ObjectStore
from schemas.delta_blob import DeltaBlob
from schemas.manifest import Manifest, TableEntry
from schemas.tensor_blob import decode_tensors
from server.errors import ApplyError, NonFiniteError

#: blobs of one version fetched at once (network-bound on S3; hashing releases the GIL).
FETCH_CONCURRENCY = 4


@dataclass(frozen=True)
class FetchedTable:
    """One table's verified, parsed blob (codes still encoded)."""

    entry: TableEntry
    blob: DeltaBlob

    @property
    def name(self) -> str:
        return self.entry.name


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

    def decode_rows(self) -> dict[str, BlobRows]:
        """Every table's rows decoded to float32, for `ModelBuffer.assign_rows` (tables without
        rows are left out). NonFiniteError if any decoded value is NaN or Inf."""
        decoded = {t.name: decode_blob(t.blob) for t in self.tables if t.blob.n_rows}
        for name, rows in decoded.items():
            check_finite(self.manifest, f"rows of table {name!r}", rows.values)
        return decoded


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
    needs no optimizer state.
    """
    manifest = ref.manifest
    entries = list(manifest.tables)
    if pool is not None and len(entries) > 1:
        blobs = list(pool.map(lambda e: read_blob(store, e), entries))
    else:
        blobs = [read_blob(store, e) for e in entries]
    fetched = sum(e.blob.size for e in entries)
    dense: dict[str, np.ndarray] | None = None
    if manifest.dense is not None:
        d = manifest.dense
        dense, _ = decode_tensors(store.get_verified(d.key, d.size, d.sha256))
        fetched += d.size
    tables = tuple(FetchedTable(e, b) for e, b in zip(entries, blobs, strict=True))
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
    """What writing a plan changed in a buffer: whole tables, and per table the row writes
    (ids and the decoded values, in order) after the last whole-table write; dense or not.

    Keeping the decoded values lets the second copy of a double buffer replay the same writes
    (no gather from the live copy, no second allocation of the rows).
    """

    whole: set[str] = field(default_factory=set)
    rows: dict[str, list[BlobRows]] = field(default_factory=dict)
    dense: bool = False

    def add_whole(self, name: str) -> None:
        self.whole.add(name)
        self.rows.pop(name, None)  # the whole table is copied; earlier row writes are moot

    def add_rows(self, name: str, rows: BlobRows) -> None:
        if rows.ids.size:
            self.rows.setdefault(name, []).append(rows)

    def row_ids(self, name: str) -> np.ndarray:
        parts = [rows.ids for rows in self.rows[name]]
        return parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))


def model_state_names(model: DLRM) -> tuple[dict[str, str], list[str]]:
    """(table name -> weight state name, dense state names) of a model."""
    weights = table_weight_names(model)
    table_keys = set(weights.values())
    dense = [k for k in model.state_dict() if k not in table_keys]
    return weights, dense


class ModelBuffer:
    """A DLRM for inference, its tensors by name, and the version it holds.

    Readers only call `forward` (under `torch.inference_mode`); writers go through `write`,
    `copy_from` and `assign_rows`, which the consistency schemes call only while no reader can
    see this buffer (double buffer) or under the write lock (reader-writer).
    """

    def __init__(self, config: DLRMConfig, model: DLRM | None = None) -> None:
        self.config = config
        self.model = model if model is not None else DLRM(config)
        self.model.eval()
        self.model.requires_grad_(False)  # in-place writes on leaves need no autograd
        state = self.model.state_dict(keep_vars=True)
        weights, dense = model_state_names(self.model)
        self.tables: dict[str, torch.Tensor] = {t: state[k].data for t, k in weights.items()}
        self.dense: dict[str, torch.Tensor] = {k: state[k].data for k in dense}
        self.served: ServedVersion | None = None
        #: predictions reading this buffer now (double buffer only; guarded by the slot's lock).
        self.readers = 0

    @classmethod
    def for_manifest(cls, manifest: Manifest, budget: MemoryBudget, copies: int) -> ModelBuffer:
        """An empty buffer with the architecture `manifest.model_config` describes, once
        `copies` models of it fit `budget` (MemoryBudgetError before anything is allocated)."""
        try:
            config = DLRMConfig.from_json(manifest.model_config_)
        except ValueError as exc:
            raise ApplyError(f"version {manifest.version}: {exc}") from exc
        budget.check_model(manifest, config, copies)
        return cls(config)

    @property
    def nbytes(self) -> int:
        tensors = [*self.tables.values(), *self.dense.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

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
            e.name in self.tables and tuple(self.tables[e.name].shape) == (e.rows, e.dim)
            for e in manifest.tables
        )

    def check_manifest(self, m: Manifest) -> None:
        """Raise ApplyError unless `m` describes this buffer's architecture and table shapes:
        checked before its blobs are fetched, whose decode caps come from those shapes."""
        if not self.fits(m):
            raise ApplyError(
                f"version {m.version} ({m.kind}) has another architecture or table shapes than "
                f"the served model: tables {[(e.name, e.rows, e.dim) for e in m.tables]}, "
                f"served {[(n, *t.shape) for n, t in self.tables.items()]}"
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
            # A blob of every row decodes in place: a full table costs no second copy of itself.
            weights = self.tables[table.name].numpy()
            rows = write_blob(table.blob, weights)
            if rows is None:
                touched.add_whole(table.name)
            else:
                touched.add_rows(table.name, rows)
            what = f"rows of table {table.name!r}"
            check_finite(fetched.manifest, what, weights if rows is None else rows.values)
        if fetched.dense is not None:
            for name, value in fetched.dense.items():
                self.dense[name].copy_(torch.from_numpy(np.asarray(value)))
            touched.dense = True

    def assign_rows(self, updates: Mapping[str, BlobRows], dense: Mapping[str, np.ndarray]) -> None:
        """Write decoded rows and dense tensors (the reader-writer scheme's critical section)."""
        for name, rows in updates.items():
            rows.scatter(self.tables[name].numpy())
        for name, value in dense.items():
            self.dense[name].copy_(torch.from_numpy(np.asarray(value)))

    def copy_from(self, source: ModelBuffer, touched: Touched) -> None:
        """Make the `touched` parts of this buffer bitwise equal to `source`'s, by gathering
        them from `source` (repairs a buffer whose write failed half-way)."""
        for name in touched.whole:
            self.tables[name].copy_(source.tables[name])
        for name in touched.rows:
            if name in touched.whole:
                continue
            ids = touched.row_ids(name)
            self.tables[name].numpy()[ids] = source.tables[name].numpy()[ids]
        self._level_dense(source, touched)

    def replay(self, source: ModelBuffer, touched: Touched) -> None:
        """Repeat on this buffer the writes `source` received (`touched`): whole tables are
        copied from `source`, row writes are replayed from their recorded values, in order.
        Afterwards both buffers are bitwise equal if they were before the writes."""
        for name in touched.whole:
            self.tables[name].copy_(source.tables[name])
        for name, writes in touched.rows.items():
            for rows in writes:
                rows.scatter(self.tables[name].numpy())
        self._level_dense(source, touched)

    def _level_dense(self, source: ModelBuffer, touched: Touched) -> None:
        if touched.dense:
            for name, tensor in self.dense.items():
                tensor.copy_(source.dense[name])
        self.served = source.served

    def clone(self) -> ModelBuffer:
        """A second buffer with the same architecture, bitwise equal weights and version."""
        other = ModelBuffer(self.config)
        touched = Touched(whole=set(self.tables), dense=True)
        other.copy_from(self, touched)
        return other

    def digest(self) -> dict[str, str]:
        """sha256 of every table's and dense tensor's bytes (fleet consistency checks)."""
        out: dict[str, str] = {}
        for name, tensor in [*sorted(self.tables.items()), *sorted(self.dense.items())]:
            # hashlib reads the array's buffer directly (no copy) and releases the GIL.
            out[name] = hashlib.sha256(np.ascontiguousarray(tensor.numpy()).data).hexdigest()
        return out


FetchFn = Callable[[VersionRef], FetchedVersion]
