"""The manifest of one version, the HEAD pointer and the writer lease (docs/FORMAT.md sections 1-3).

A manifest is UTF-8 JSON, at most `MAX_MANIFEST_BYTES`, parsed by the JSON rule of every document
(schemas/strict_json.py: no duplicate keys, NaN or lone surrogates) and validated by frozen
pydantic models that forbid extra fields. Rules (MUST):

- `schema_version` is 1; `model` matches `[A-Za-z0-9._-]{1,128}`.
- `version` >= 1 and > `parent`; `parent` and `parent_manifest` are both null or both set.
- `kind` is `full` or `delta`; a full has `baseline == version` and `applies_to` null and every
  table's `rows_in_checkpoint == rows` but a table with an id map's (which may hold the rows its
  ids hold, section 7.1); a delta has `baseline <= applies_to < version`.
- Table names are unique; every blob key starts with `model + "/"`, has no `..`, backslash or
  leading slash; sha256 is 64 lowercase hex digits.
- Every blob key lies under `model + "/blobs/"`; `parent_manifest` (and HEAD's `manifest`) under
  `model + "/manifests/"`, ending in `.json`.
- `dense_tensor_bytes` / `optimizer_tensor_bytes`, when set, are at most their blob's size.
- `served_loss`, when set, holds finite figures whose relative ones match the absolute ones.
- A table has exactly one of `blob` and `shards` (section 3.3): shards sorted by `row_start`,
  covering `[0, rows)` with no gap or overlap, their `rows_in_checkpoint` summing to the
  table's, and no id map. Readers walk a table's blobs through `TableEntry.parts`.
- `position.ranks`, when set, lists ranks 0..N-1 in order.

"x smaller than fp32", wherever a tool prints it, is `Manifest.ratio_to_full_fp32`: the bytes a
full fp32 checkpoint of the same state holds (`Manifest.full_fp32_bytes`) over the bytes the
version wrote (`Manifest.written_bytes`), docs/FORMAT.md section 3.1.

HEAD is the commit point: `{"schema_version": 1, "model", "version", "manifest"}`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from schemas import strict_json
from schemas.codec_names import CODECS
from schemas.delta_blob import BlobLimits
from schemas.errors import ManifestError
from schemas.store_keys import blobs_prefix, check_key, is_blob_key, is_manifest_key

SCHEMA_VERSION = 1
#: the most bytes a reader takes for each record; the store read itself stops there.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_LEASE_BYTES = 64 * 1024
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
#: a version's `metrics` entry `ids_held_<table>`: the ids its dynamic map of that table holds
#: (docs/FORMAT.md section 7; what `checknrun inspect` shows, and what section 3.1 counts).
IDS_HELD_METRIC = "ids_held_"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_M = TypeVar("_M", bound="BaseModel")
#: bytes of one value in the full fp32 checkpoint every ratio is measured against.
FP32_BYTES = 4


def full_fp32_bytes(tables: Iterable[tuple[int, int, int]], dense_state_bytes: int = 0) -> int:
    """What a full fp32 checkpoint of a state holds (docs/FORMAT.md section 3.1).

    `tables` gives each table's (rows, dim, aux_dim): every row and its per-row optimizer
    columns count at 4 bytes a value, whatever a version holds of them. `dense_state_bytes` is
    the tensor bytes of the dense parameters and the dense optimizer state.
    """
    rows_bytes = sum(rows * (dim + aux_dim) * FP32_BYTES for rows, dim, aux_dim in tables)
    return rows_bytes + dense_state_bytes


def ratio_to_full_fp32(full_fp32: int, written: int) -> float:
    """How many times fewer bytes than the full fp32 checkpoint were written."""
    return full_fp32 / max(written, 1)


def check_model_name(name: str) -> str:
    """Return `name` if it is a valid model name, else raise ManifestError."""
    if not MODEL_NAME_RE.match(name) or name in (".", ".."):
        raise ManifestError(f"model name {name!r} must match {MODEL_NAME_RE.pattern}")
    return name


def parse_created_at(value: object) -> object:
    """A `created_at` value (manifest or announcement) as a timezone-aware datetime.

    JSON carries an ISO 8601 string, which strict mode would refuse without this. A value with
    no UTC offset is refused (ValueError): readers subtract it from the aware clock
    (staleness, apply lag), and a naive one made that raise TypeError after the swap.
    """
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime) and value.utcoffset() is None:
        raise ValueError(f"created_at {value.isoformat()!r} has no UTC offset (ISO 8601 UTC)")
    return value


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class BlobRef(_Frozen):
    """Where a blob lives and how to verify it."""

    key: str
    size: int = Field(ge=0)
    sha256: str

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not _SHA256_RE.match(value):
            raise ValueError("sha256 must be 64 lowercase hex digits")
        return value


class TableShard(_Frozen):
    """The rows `[row_start, row_end)` of a table, stored as a delta blob of their own with
    shard-local row ids (docs/FORMAT.md section 3.3). An unsharded table reads as one shard of
    every row (`TableEntry.parts`), so readers walk every table the same way."""

    #: the rank that wrote the shard (informational: readers do not need it).
    rank: int = Field(ge=0)
    row_start: int = Field(ge=0)
    row_end: int = Field(ge=1, le=2**31)
    rows_in_checkpoint: int = Field(ge=0)
    blob: BlobRef
    #: the id-map blob of the shard's rows (docs/FORMAT.md 3.3, 7.2); null: none.
    id_map: BlobRef | None = None

    @model_validator(mode="after")
    def _range(self) -> TableShard:
        if self.row_start >= self.row_end:
            raise ValueError(f"shard rows [{self.row_start}, {self.row_end}) are empty")
        if self.rows_in_checkpoint > self.rows:
            raise ValueError(
                f"shard [{self.row_start}, {self.row_end}) holds {self.rows_in_checkpoint} rows, "
                f"more than its {self.rows}"
            )
        return self

    @property
    def rows(self) -> int:
        """Rows of the shard: the `table_rows` its blob declares."""
        return self.row_end - self.row_start

    @model_serializer(mode="wrap")
    def _omit_no_map(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A shard without an id map is written as before `id_map` existed on shards.
        return _without_null(handler(self), "id_map")


class TableEntry(_Frozen):
    """One embedding table in a version: one blob, or row-range shards (section 3.3)."""

    name: str = Field(min_length=1, max_length=256)
    rows: int = Field(ge=1, le=2**31)
    dim: int = Field(ge=1, le=65536)
    codec: str
    rows_in_checkpoint: int = Field(ge=0)
    aux_dim: int = Field(ge=0, le=65536)
    #: the table's delta blob; null iff `shards` is given.
    blob: BlobRef | None
    #: the id-map blob of the same rows (docs/FORMAT.md section 7); null for a table whose ids
    #: are encoded by the client (no live id space) and in manifests written before it existed.
    id_map: BlobRef | None = None
    #: the table stored as row-range shards (docs/FORMAT.md section 3.3); null: one blob.
    shards: tuple[TableShard, ...] | None = None

    @field_validator("codec")
    @classmethod
    def _codec(cls, value: str) -> str:
        if value not in CODECS:
            raise ValueError(f"unknown codec {value!r}; expected one of {', '.join(CODECS)}")
        return value

    @model_validator(mode="after")
    def _counts(self) -> TableEntry:
        if self.rows_in_checkpoint > self.rows:
            raise ValueError(f"rows_in_checkpoint {self.rows_in_checkpoint} > rows {self.rows}")
        if (self.blob is None) == (self.shards is None):
            raise ValueError(f"table {self.name!r} needs exactly one of blob and shards")
        if self.shards is not None:
            self._check_shards(self.shards)
        return self

    def _check_shards(self, shards: tuple[TableShard, ...]) -> None:
        if self.id_map is not None:
            raise ValueError(
                f"sharded table {self.name!r} carries its id map in its shards, not the entry"
            )
        if len({s.id_map is None for s in shards}) > 1:
            raise ValueError(f"either every shard of table {self.name!r} has an id map or none")
        # Sorted, back to back, from 0 to rows: no row is missing or held twice.
        ends = [0, *(s.row_end for s in shards)]
        starts = [s.row_start for s in shards]
        if not shards or starts != ends[:-1] or ends[-1] != self.rows:
            ranges = [(s.row_start, s.row_end) for s in shards]
            raise ValueError(
                f"shards of table {self.name!r} must cover [0, {self.rows}) in order with no gap "
                f"or overlap, got {ranges}"
            )
        held = sum(s.rows_in_checkpoint for s in shards)
        if held != self.rows_in_checkpoint:
            raise ValueError(
                f"shards of table {self.name!r} hold {held} rows, the table says "
                f"rows_in_checkpoint {self.rows_in_checkpoint}"
            )

    @model_serializer(mode="wrap")
    def _omit_unsharded(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # An unsharded entry is written as before `shards` existed, so readers older than it
        # still read every manifest of a single process.
        return _without_null(handler(self), "shards")

    @property
    def parts(self) -> tuple[TableShard, ...]:
        """The table's delta blobs as row ranges: its shards, or one range of every row.

        The one walk over a table's row blobs: readers (restore, servers, gc, ls/inspect) go
        through it, so a sharded table is counted, kept and read like any other."""
        if self.shards is not None:
            return self.shards
        assert self.blob is not None  # the validator: one of blob and shards
        whole = TableShard(
            rank=0,
            row_start=0,
            row_end=self.rows,
            rows_in_checkpoint=self.rows_in_checkpoint,
            blob=self.blob,
            id_map=self.id_map,
        )
        return (whole,)

    @property
    def has_id_map(self) -> bool:
        """Whether the table carries an id map: in its entry, or in its shards (3.3)."""
        return self.id_map is not None or (
            self.shards is not None and self.shards[0].id_map is not None
        )

    @property
    def id_map_refs(self) -> tuple[BlobRef, ...]:
        """The table's id-map blobs, one per part (`parts`) in order; empty: no id map."""
        return tuple(p.id_map for p in self.parts if p.id_map is not None)

    @property
    def id_map_bytes(self) -> int:
        """Bytes of the table's id-map blobs in the store."""
        return sum(ref.size for ref in self.id_map_refs)

    @property
    def blobs(self) -> tuple[BlobRef, ...]:
        """Every blob of this table: its row blobs (one, or one per shard), then its id maps."""
        return (*(part.blob for part in self.parts), *self.id_map_refs)

    @property
    def stored_bytes(self) -> int:
        """Bytes of this table's blobs in the store."""
        return sum(b.size for b in self.blobs)

    def full_fp32_bytes(self, metrics: Mapping[str, float]) -> int:
        """This table's share of a full fp32 checkpoint of a version with `metrics`: its rows
        (`fp32_rows`) and their optimizer columns."""
        return full_fp32_bytes([(self.fp32_rows(metrics), self.dim, self.aux_dim)])

    def fp32_rows(self, metrics: Mapping[str, float]) -> int:
        """The rows a full fp32 checkpoint of this table counts (docs/FORMAT.md 3.1): every
        row, or for a table with an id map whose version's `metrics` say how many ids it holds,
        those and the unknown row."""
        held = metrics.get(IDS_HELD_METRIC + self.name) if self.has_id_map else None
        if held is None or not 0 <= held < self.rows:
            return self.rows
        return int(held) + 1

    def blob_limits(self, part: TableShard) -> BlobLimits:
        """The decoder's caps for the blob of `part` (one of `parts`): its shape and size,
        nothing larger, so a blob that declares more than its entry is refused before it is
        inflated."""
        return BlobLimits.for_table(
            codec=self.codec,
            dim=self.dim,
            table_rows=part.rows,
            n_rows=part.rows_in_checkpoint,
            aux_dim=self.aux_dim,
            size=part.blob.size,
        )


class RankPosition(_Frozen):
    """Where one rank of a job stops: the samples it took and its part of the stream's reader."""

    rank: int = Field(ge=0)
    samples_seen: int = Field(ge=0)
    reader: dict[str, int | str | dict[str, int]] = Field(default_factory=dict)


class Position(_Frozen):
    """Where training resumes: optimizer step, samples consumed and the data reader's state."""

    step: int = Field(ge=0)
    samples_seen: int = Field(ge=0)
    #: a file stream: {"source", "offset", "fingerprint"}; a Kafka stream also "topic" and
    #: "offsets": {partition: next offset} (docs/FORMAT.md section 8.3).
    reader: dict[str, int | str | dict[str, int]] = Field(default_factory=dict)
    #: where each rank of a job of several ranks stops (docs/FORMAT.md section 3.3), rank 0
    #: first; null for a single process.
    ranks: tuple[RankPosition, ...] | None = None

    @model_serializer(mode="wrap")
    def _omit_single(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A single process's position is written as before `ranks` existed (see TableEntry).
        return _without_null(handler(self), "ranks")

    @model_validator(mode="after")
    def _ranks(self) -> Position:
        if self.ranks is not None:
            found = [r.rank for r in self.ranks]
            if found != list(range(len(found))) or not found:
                raise ValueError(f"position.ranks must be ranks 0..N-1 in order, got {found}")
        return self


#: how far a stored relative figure may be from what its absolute ones give (float rounding).
_RELATIVE_SLACK = 1e-9


class ServedLoss(_Frozen):
    """What quantization costs a version as a server holds it (docs/FORMAT.md section 3.2):
    the served model (decoded rows of the chain) next to the writer's fp32 state, scored on
    the same recent samples."""

    samples: int = Field(ge=1)
    auc_fp32: float = Field(ge=0.0, le=1.0)
    auc_served: float = Field(ge=0.0, le=1.0)
    logloss_fp32: float = Field(ge=0.0, allow_inf_nan=False)
    logloss_served: float = Field(ge=0.0, allow_inf_nan=False)
    #: (auc_fp32 - auc_served) / auc_fp32: positive when the served model ranks worse.
    auc_rel_loss: float = Field(allow_inf_nan=False)
    #: (logloss_served - logloss_fp32) / logloss_fp32.
    logloss_rel_increase: float = Field(allow_inf_nan=False)
    #: positive labels among the samples (None in records written before it existed).
    positives: int | None = Field(default=None, ge=0)
    #: the 95% paired DeLong interval of auc_fp32 - auc_served (both or neither).
    auc_loss_low: float | None = Field(default=None, allow_inf_nan=False)
    auc_loss_high: float | None = Field(default=None, allow_inf_nan=False)

    @property
    def sure_auc_rel_loss(self) -> float:
        """The relative AUC the served model loses beyond the samples' noise: the low end of the
        loss's 95% interval over `auc_fp32` (the point estimate for a record without one).
        `--codec auto` judges its budget against this (docs/SERVED_LOSS.md), so a loss the
        window cannot tell from noise adds no bits."""
        if self.auc_loss_low is None:
            return self.auc_rel_loss
        return _relative(self.auc_loss_low, self.auc_fp32)

    @classmethod
    def of(
        cls,
        samples: int,
        *,
        auc_fp32: float,
        auc_served: float,
        logloss_fp32: float,
        logloss_served: float,
        positives: int | None = None,
        auc_loss: tuple[float, float] | None = None,
    ) -> ServedLoss:
        """The record of one paired measurement, its relative figures computed here;
        `auc_loss`: the (low, high) interval of auc_fp32 - auc_served."""
        return cls(
            samples=samples,
            auc_fp32=auc_fp32,
            auc_served=auc_served,
            logloss_fp32=logloss_fp32,
            logloss_served=logloss_served,
            auc_rel_loss=_relative(auc_fp32 - auc_served, auc_fp32),
            logloss_rel_increase=_relative(logloss_served - logloss_fp32, logloss_fp32),
            positives=positives,
            auc_loss_low=None if auc_loss is None else auc_loss[0],
            auc_loss_high=None if auc_loss is None else auc_loss[1],
        )

    @property
    def auc_rel_loss_low(self) -> float | None:
        """The interval's low end as a relative loss (`auc_loss_low / auc_fp32`): above 0 the
        loss is significant (docs/FORMAT.md 3.2); None without an interval."""
        if self.auc_loss_low is None:
            return None
        return _relative(self.auc_loss_low, self.auc_fp32)

    @model_validator(mode="after")
    def _interval(self) -> ServedLoss:
        if self.positives is not None and self.positives > self.samples:
            raise ValueError(f"{self.positives} positives among {self.samples} samples")
        low, high = self.auc_loss_low, self.auc_loss_high
        if (low is None) != (high is None):
            raise ValueError("auc_loss_low and auc_loss_high come together or not at all")
        if low is not None and high is not None:
            loss = self.auc_fp32 - self.auc_served
            if not low - _RELATIVE_SLACK <= loss <= high + _RELATIVE_SLACK:
                raise ValueError(
                    f"the AUC loss interval [{low}, {high}] does not hold the loss {loss}"
                )
        return self

    @model_validator(mode="after")
    def _relatives(self) -> ServedLoss:
        for name, stored, expected in (
            (
                "auc_rel_loss",
                self.auc_rel_loss,
                _relative(self.auc_fp32 - self.auc_served, self.auc_fp32),
            ),
            (
                "logloss_rel_increase",
                self.logloss_rel_increase,
                _relative(self.logloss_served - self.logloss_fp32, self.logloss_fp32),
            ),
        ):
            if abs(stored - expected) > _RELATIVE_SLACK:
                raise ValueError(
                    f"{name} {stored} disagrees with its absolute figures ({expected})"
                )
        return self


def _relative(difference: float, reference: float) -> float:
    # A reference of 0 (AUC 0, a perfect log loss) has no relative scale: the difference itself.
    return difference / reference if reference > 0 else difference


class Manifest(_Frozen):
    """Everything needed to read and verify one version."""

    schema_version: Literal[1] = 1
    model: str
    version: int = Field(ge=1)
    parent: int | None
    parent_manifest: str | None
    kind: Literal["full", "delta"]
    baseline: int = Field(ge=1)
    applies_to: int | None
    policy: str
    created_at: datetime
    position: Position
    tables: tuple[TableEntry, ...]
    dense: BlobRef | None = None
    optimizer: BlobRef | None = None
    #: tensor bytes of the dense / optimizer blob (its size less the safetensors header); null
    #: in manifests written before these fields existed.
    dense_tensor_bytes: int | None = Field(default=None, ge=0)
    optimizer_tensor_bytes: int | None = Field(default=None, ge=0)
    model_config_: dict[str, Any] = Field(alias="model_config", default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)
    #: null where nothing was measured and in manifests written before the field existed.
    served_loss: ServedLoss | None = None

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, populate_by_name=True, protected_namespaces=()
    )

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        try:
            return check_model_name(value)
        except ManifestError as exc:
            raise ValueError(str(exc)) from exc

    @field_validator("created_at", mode="before")
    @classmethod
    def _created(cls, value: object) -> object:
        return parse_created_at(value)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if (self.parent is None) != (self.parent_manifest is None):
            raise ValueError("parent and parent_manifest must both be set or both be null")
        if self.parent is not None and self.parent >= self.version:
            raise ValueError(f"parent {self.parent} must be < version {self.version}")
        if self.kind == "full":
            if self.baseline != self.version or self.applies_to is not None:
                raise ValueError("a full version has baseline == version and applies_to null")
            for table in self.tables:
                # a table with an id map may hold the rows its ids hold (docs/FORMAT.md 7.1)
                if table.rows_in_checkpoint != table.rows and not table.has_id_map:
                    raise ValueError(f"full version holds every row of table {table.name!r}")
        else:
            if self.applies_to is None or not self.baseline <= self.applies_to < self.version:
                raise ValueError(
                    f"delta needs baseline <= applies_to < version, got baseline={self.baseline} "
                    f"applies_to={self.applies_to} version={self.version}"
                )
        for blob, tensors, what in (
            (self.dense, self.dense_tensor_bytes, "dense"),
            (self.optimizer, self.optimizer_tensor_bytes, "optimizer"),
        ):
            if tensors is not None and tensors > (0 if blob is None else blob.size):
                raise ValueError(
                    f"{what}_tensor_bytes {tensors} exceeds the {what} blob's size "
                    f"{None if blob is None else blob.size}"
                )
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        keys = [b.key for b in self.blobs]
        if self.parent_manifest is not None:
            keys.append(self.parent_manifest)
        for key in keys:
            try:
                check_key(self.model, key)
            except ManifestError as exc:
                raise ValueError(str(exc)) from exc
        # gc deletes a dropped version's blobs: a "blob" at HEAD or LEASE must never parse.
        for blob in self.blobs:
            if not is_blob_key(self.model, blob.key):
                raise ValueError(f"blob key {blob.key!r} is not under {blobs_prefix(self.model)!r}")
        if self.parent_manifest is not None and not is_manifest_key(
            self.model, self.parent_manifest
        ):
            raise ValueError(f"parent_manifest {self.parent_manifest!r} is not a manifest key")
        return self

    @property
    def blobs(self) -> tuple[BlobRef, ...]:
        """Every blob this version references, tables (their shards, their id maps) first."""
        refs = [b for t in self.tables for b in t.blobs]
        refs += [b for b in (self.dense, self.optimizer) if b is not None]
        return tuple(refs)

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of this version's blobs."""
        return sum(b.size for b in self.blobs)

    @property
    def written_bytes(self) -> int:
        """Bytes this version put in the store: its blobs and its manifest."""
        return self.total_bytes + len(self.to_json())

    @property
    def full_fp32_bytes(self) -> int:
        """What a full fp32 checkpoint of this version's state holds (docs/FORMAT.md 3.1)."""
        tables = sum(t.full_fp32_bytes(self.metrics) for t in self.tables)
        return tables + self._dense_state_bytes

    @property
    def restored_fp32_bytes(self) -> int:
        """What a restore of this version allocates: every row of every table (held or not)
        with its optimizer columns in fp32, and the dense and optimizer tensors."""
        tables = ((t.rows, t.dim, t.aux_dim) for t in self.tables)
        return full_fp32_bytes(tables, self._dense_state_bytes)

    @property
    def _dense_state_bytes(self) -> int:
        """The tensors of the dense and optimizer blobs (section 3.1)."""
        dense = _tensor_bytes(self.dense, self.dense_tensor_bytes)
        return dense + _tensor_bytes(self.optimizer, self.optimizer_tensor_bytes)

    @property
    def served_fp32_bytes(self) -> int:
        """What serving this version's state holds in fp32: its tables and dense parameters,
        none of the optimizer's (per-row columns or dense state)."""
        dense = _tensor_bytes(self.dense, self.dense_tensor_bytes)
        return full_fp32_bytes(((t.rows, t.dim, 0) for t in self.tables), dense)

    @property
    def ratio_to_full_fp32(self) -> float:
        """How many times fewer bytes than a full fp32 checkpoint this version wrote."""
        return ratio_to_full_fp32(self.full_fp32_bytes, self.written_bytes)

    def table(self, name: str) -> TableEntry:
        """The entry of table `name` (KeyError if absent)."""
        for entry in self.tables:
            if entry.name == name:
                return entry
        raise KeyError(name)

    def to_json(self) -> bytes:
        """Canonical UTF-8 JSON bytes of this manifest."""
        return self.model_dump_json(by_alias=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate manifest bytes; raise ManifestError on anything wrong."""
        return parse_document(cls, data, MAX_MANIFEST_BYTES, "manifest")


class Head(_Frozen):
    """The HEAD pointer: the newest committed version of a model."""

    schema_version: Literal[1] = 1
    model: str
    version: int = Field(ge=1)
    manifest: str

    @model_validator(mode="after")
    def _key(self) -> Head:
        try:
            check_model_name(self.model)
            check_key(self.model, self.manifest)
        except ManifestError as exc:
            raise ValueError(str(exc)) from exc
        if not is_manifest_key(self.model, self.manifest):
            raise ValueError(f"HEAD names {self.manifest!r}, which is not a manifest key")
        return self

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes) -> Head:
        return parse_document(cls, data, MAX_HEAD_BYTES, "HEAD")


class Lease(_Frozen):
    """The single-writer lease of a model."""

    schema_version: Literal[1] = 1
    model: str
    owner: str = Field(min_length=1, max_length=512)
    token: str = Field(min_length=1, max_length=128)
    expires_at: float

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes) -> Lease:
        return parse_document(cls, data, MAX_LEASE_BYTES, "lease")


def _without_null(data: dict[str, Any], field: str) -> dict[str, Any]:
    if data.get(field, ...) is None:
        del data[field]
    return data


def _tensor_bytes(blob: BlobRef | None, tensors: int | None) -> int:
    # An older manifest does not say: its whole blob counts, header included (a few hundred
    # bytes of JSON next to the tensors).
    if blob is None:
        return 0
    return blob.size if tensors is None else tensors


def parse_document(
    cls: type[_M], data: bytes, cap: int, what: str, error: type[ManifestError] = ManifestError
) -> _M:
    """A stored JSON document (`what`, at most `cap` bytes) as `cls`: the JSON rule of every
    document, then `cls`'s validation; `error` for anything wrong (the manifest's, HEAD's and
    the lease's; the release gate's documents, schemas/release.py)."""
    if len(data) > cap:
        raise error(f"{what} is {len(data)} bytes; the cap is {cap}")
    strict_json.loads(data, error, what)  # the rules pydantic's own parser lacks
    try:
        return cls.model_validate_json(data)
    except ValidationError as exc:
        raise error(f"invalid {what}: {exc}") from exc


def utc_now() -> datetime:
    """The current time, timezone-aware UTC (what `created_at` holds)."""
    return datetime.now(UTC)
