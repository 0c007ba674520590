"""What a published version is and cost, and how one table of a snapshot is encoded.

The publisher (publisher/write/job_publishing.py: `JobPublisher`, and `CheckpointPublisher`,
one process as a one-part job) runs the paper's stages two and three: quantize + encode every
table (`encode_table`, schemas/delta_blob.py), then commit (version_writer.py), then announce.
A snapshot that holds NaN or inf anywhere is refused before any of that
(`Snapshot.check_finite`): a version is what servers serve and trainers resume from.
`BackgroundPublisher` (background.py) runs a publisher off the training thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Protocol

import numpy as np

from publisher.codecs import QuantizedRows, codec_of, encode_rows
from publisher.read.catalog import VersionRef
from publisher.release.gate import GateWord
from publisher.store import StoreError
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.snapshot import NonFiniteSnapshotError, Snapshot, TableRows
from publisher.write.version_writer import TableBlob
from schemas.delta_blob import AuxEncoding, DeltaBlob, encode_delta_blob, round_to_bfloat16
from schemas.errors import BadDataError
from schemas.id_map_blob import encode_id_entries
from schemas.manifest import Manifest, ratio_to_full_fp32

log = logging.getLogger(__name__)

#: what `BackgroundPublisher` does with a snapshot holding NaN or inf: fail, or hold it back.
NonFinitePolicy = Literal["stop", "skip"]


@dataclass(frozen=True)
class PublishResult:
    """One committed version and what it cost."""

    ref: VersionRef
    encode_s: float
    commit_s: float
    merged: int
    taken_at: float
    #: the `Snapshot.sequence` of the newest snapshot this version holds.
    sequence: int
    #: of `encode_s`: updating the served-loss copy and scoring it.
    measure_s: float = 0.0
    #: `--codec auto`: each (codec, measured `auc_rel_loss`) this version was encoded with and
    #: measured over the budget at before the commit, in order; empty when the first was kept.
    reencoded: tuple[tuple[str, float], ...] = ()
    #: the release gate's word on the version committed before this one, judged on this
    #: version's snapshot's fresh samples (None: nothing judged).
    gate: GateWord | None = None

    @property
    def manifest(self) -> Manifest:
        return self.ref.manifest

    # Cached: a trainer sums these over every version it published at each progress update.
    @cached_property
    def bytes_written(self) -> int:
        """The version's blobs and manifest."""
        return self.manifest.written_bytes

    @cached_property
    def full_fp32_bytes(self) -> int:
        """What a full fp32 checkpoint of the same state holds (docs/FORMAT.md 3.1)."""
        return self.manifest.full_fp32_bytes

    @property
    def ratio(self) -> float:
        """How many times smaller than a full fp32 checkpoint."""
        return ratio_to_full_fp32(self.full_fp32_bytes, self.bytes_written)


def reencoded_json(reencoded: Sequence[tuple[str, float]]) -> list[dict[str, Any]]:
    """`PublishResult.reencoded` as JSON records (`train --json`, the benches)."""
    return [{"codec": codec, "auc_rel_loss": loss} for codec, loss in reencoded]


def aux_encoding_for(codec: str) -> AuxEncoding:
    """How a table of `codec` stores its optimizer columns (docs/FORMAT.md section 4).

    bfloat16 for a lossy codec: its relative error (at most 2^-9 on a row-wise Adagrad
    accumulator, 2^-10 on the step it scales) is far below the codec's on the weights. Resuming
    from a bfloat16 accumulator at every one of MovieLens-1M's 20 checkpoints moved AUC by
    -0.005% (synthetic, 8 checkpoints: +0.001%), the size of the divergence a one-ulp float32
    nudge at the same points gives (-0.003%). It halves the aux section, a third of an int2
    MovieLens delta's table bytes. float32 for a lossless codec (`fp32`), whose checkpoints
    restore the trainer's state bit for bit.
    """
    return "float32" if codec_of(codec).lossless else "bfloat16"


def encode_table(
    rows: TableRows,
    tunables: Tunables = DEFAULT_TUNABLES,
    quantized: QuantizedRows | None = None,
) -> TableBlob:
    """Quantize (unless `quantized` holds the rows already quantized with `rows.codec`) and
    encode one table's copied rows as a delta blob, and their id-map entries (if the table has
    an id map) as an id-map blob.

    The rows of a shard (`rows.row_range`) become a shard blob (docs/FORMAT.md section 3.3):
    a table of `end - start` rows with shard-local ids, and its id-map entries the shard's id
    map; ShardRowsError for a row outside the range."""
    q = quantized if quantized is not None else encode_rows(rows.codec, rows.values)
    aux_encoding = aux_encoding_for(rows.codec)
    id_entries = rows.id_map_entries()
    table_rows, row_ids = rows.table_rows, rows.row_ids
    if rows.row_range is not None:
        table_rows, row_ids = _shard_rows(rows)
    blob = DeltaBlob(
        table=rows.name,
        codec=rows.codec,
        dim=rows.dim,
        table_rows=table_rows,
        row_ids=row_ids,
        codes=q.codes,
        scale=q.scale,
        bias=q.bias,
        aux=rows.aux if aux_encoding == "float32" else round_to_bfloat16(rows.aux),
        aux_encoding=aux_encoding,
    )
    return TableBlob(
        name=rows.name,
        rows=rows.table_rows,
        dim=rows.dim,
        codec=rows.codec,
        rows_in_checkpoint=rows.n_rows,
        aux_dim=int(rows.aux.shape[1]),
        data=encode_delta_blob(blob, zstd_level=tunables.zstd_level),
        id_map=None
        if id_entries is None
        else encode_id_entries(id_entries, hashed=rows.id_map_hashed),
        row_range=rows.row_range,
    )


class ShardRowsError(BadDataError):
    """The rows of a shard do not fit it: a row outside its range, or a range outside the
    table."""


def _shard_rows(rows: TableRows) -> tuple[int, np.ndarray]:
    """(rows of the shard, its shard-local row ids) of `rows.row_range`, checked."""
    assert rows.row_range is not None
    start, end = rows.row_range
    if not 0 <= start < end <= rows.table_rows:
        raise ShardRowsError(
            f"table {rows.name!r}: shard rows [{start}, {end}) are not within its "
            f"{rows.table_rows} rows"
        )
    ids = rows.row_ids
    if ids.size and (int(ids[0]) < start or int(ids[-1]) >= end):
        raise ShardRowsError(
            f"table {rows.name!r}: rows {int(ids[0])}..{int(ids[-1])} are outside its shard "
            f"[{start}, {end})"
        )
    return end - start, ids - start


class SnapshotPublisher(Protocol):
    """What `BackgroundPublisher` drives: `JobPublisher` (a rank of a job, or one process as
    `CheckpointPublisher`), or `process_publisher.ProcessPublisher` in a child process."""

    def publish(self, snapshot: Snapshot) -> PublishResult:
        """Encode, commit and announce one snapshot; return the committed version."""
        ...

    def close(self) -> None:
        """Release the writer's lease and whatever else the publisher holds."""
        ...


__all__ = [
    "NonFinitePolicy",
    "NonFiniteSnapshotError",
    "PublishResult",
    "SnapshotPublisher",
    "StoreError",
    "encode_table",
]
