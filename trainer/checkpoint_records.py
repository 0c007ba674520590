"""What each checkpoint cost the trainer and what it wrote, by sequence number.

A record is made during the stall with its index (1, 2, ... per checkpointer), which is also
its snapshot's `sequence`. Publishing results come back carrying the sequence of the newest
snapshot a version holds (snapshots that waited behind a busy publisher are folded into a
later one), so `CheckpointRecords.settle` fills the record with that index and marks every
earlier unpublished one as merged into the same version.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from publisher.release.gate import GateWord
from publisher.write.publishing import PublishResult, reencoded_json
from publisher.write.snapshot import Snapshot
from schemas.manifest import ServedLoss, ratio_to_full_fp32


@dataclass
class CheckpointRecord:
    """What one snapshot cost the trainer and, once published, what it wrote."""

    index: int
    kind: str
    step: int
    samples_seen: int
    #: how long the training thread was stopped (bitmaps, plan, copies, hand-off).
    stall_ms: float
    #: rows modified in the interval / table rows, per table.
    dirty_fraction: dict[str, float]
    #: rows modified in the interval / rows of all tables.
    dirty_fraction_total: float
    rows_copied: int
    snapshot_bytes: int
    taken_at: float
    metrics: dict[str, float] = field(default_factory=dict)
    #: where the stall went: dirty bitmaps + policy, copies, hand-off to the publisher.
    stall_breakdown_ms: dict[str, float] = field(default_factory=dict)
    #: milliseconds of each stop before the last of a full copied in chunks (its first stop
    #: and each chunk's); empty for a checkpoint taken in one stop.
    pauses_ms: list[float] = field(default_factory=list)
    #: CPU time of the training thread in the stall's last stop (not inflated by other
    #: processes taking the cores, unlike `stall_ms`).
    stall_cpu_ms: float = 0.0
    #: set when published; None until then or when merged into a later snapshot.
    version: int | None = None
    published_kind: str | None = None
    bytes: int | None = None
    full_fp32_bytes: int | None = None
    #: the version that carried this snapshot's rows after it merged into a later one.
    merged_into: int | None = None
    publish_s: float | None = None
    #: the codecs of the version's tables (one name when they share one).
    codec: str | None = None
    #: the version as a server holds it next to fp32 (docs/FORMAT.md 3.2); None: not measured.
    served_loss: ServedLoss | None = None
    #: of publish_s: updating the served-loss copy and scoring it.
    measure_s: float | None = None
    #: `--codec auto`: the codecs this version was measured over the budget at, and their
    #: losses, before it was encoded again with more bits and committed.
    reencoded: list[tuple[str, float]] = field(default_factory=list)
    #: the release gate's word on the version before this one (judged on this interval's
    #: events), when it judged it.
    gate: GateWord | None = None

    @classmethod
    def of(
        cls,
        snapshot: Snapshot,
        dirty: Mapping[str, np.ndarray],
        table_rows: Mapping[str, int],
    ) -> CheckpointRecord:
        """The record of a snapshot just taken (its stall is filled in after the hand-off)."""
        return cls(
            index=snapshot.sequence,
            kind=snapshot.kind,
            step=snapshot.position.step,
            samples_seen=snapshot.position.samples_seen,
            stall_ms=0.0,
            dirty_fraction={
                name: len(dirty[name]) / max(rows, 1) for name, rows in table_rows.items()
            },
            dirty_fraction_total=sum(len(ids) for ids in dirty.values())
            / max(sum(table_rows.values()), 1),
            rows_copied=sum(t.n_rows for t in snapshot.tables),
            snapshot_bytes=snapshot.nbytes,
            taken_at=snapshot.taken_at,
            metrics=snapshot.metrics,
        )

    def stopped(
        self,
        started: float,
        started_cpu: float,
        breakdown_ms: Mapping[str, float],
        pauses_ms: Sequence[float] = (),
    ) -> None:
        """Fill in the stall of the stop that began at `started` (`time.perf_counter()`) and
        `started_cpu` (`time.thread_time()`) and ends now: where it went (`breakdown_ms`), and
        the stops before it (`pauses_ms`, a full copied in chunks: each is a stop of its own,
        so `stall_ms` is the longest)."""
        self.stall_cpu_ms = (time.thread_time() - started_cpu) * 1e3
        self.stall_ms = max([(time.perf_counter() - started) * 1e3, *pauses_ms])
        self.pauses_ms = list(pauses_ms)
        self.stall_breakdown_ms = dict(breakdown_ms)
        if pauses_ms:
            self.stall_breakdown_ms.setdefault("chunk_pauses", sum(pauses_ms))
            self.stall_breakdown_ms.setdefault("longest_chunk_pause", max(pauses_ms))

    @property
    def published(self) -> bool:
        return self.version is not None or self.merged_into is not None

    @property
    def ratio(self) -> float | None:
        """Full fp32 checkpoint bytes / bytes written (None until published)."""
        if self.bytes is None or self.full_fp32_bytes is None:
            return None
        return ratio_to_full_fp32(self.full_fp32_bytes, self.bytes)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the `train --json` per-checkpoint record)."""
        return {
            "index": self.index,
            "version": self.version,
            "kind": self.published_kind or self.kind,
            "merged_into": self.merged_into,
            "step": self.step,
            "samples_seen": self.samples_seen,
            "stall_ms": round(self.stall_ms, 3),
            "stall_cpu_ms": round(self.stall_cpu_ms, 3),
            "stall_breakdown_ms": {k: round(v, 3) for k, v in self.stall_breakdown_ms.items()},
            "dirty_fraction": {k: round(v, 6) for k, v in self.dirty_fraction.items()},
            "dirty_fraction_total": round(self.dirty_fraction_total, 6),
            "rows_copied": self.rows_copied,
            "bytes": self.bytes,
            "full_fp32_bytes": self.full_fp32_bytes,
            "ratio": None if self.ratio is None else round(self.ratio, 3),
            "publish_s": None if self.publish_s is None else round(self.publish_s, 4),
            "codec": self.codec,
            "served_loss": None if self.served_loss is None else self.served_loss.model_dump(),
            "measure_s": None if self.measure_s is None else round(self.measure_s, 4),
            "reencoded": reencoded_json(self.reencoded),
            "gate": None if self.gate is None else self.gate.to_json(),
            "metrics": {k: round(v, 6) for k, v in self.metrics.items()},
        }


class CheckpointRecords:
    """One checkpointer's records, in order: `records[i]` has index i + 1.

    `add` runs on the training thread, `settle` on any thread (the publisher's callback or a
    reader of the records); a lock keeps them apart.
    """

    def __init__(self) -> None:
        self.records: list[CheckpointRecord] = []
        self._lock = threading.Lock()
        self._settled = 0

    @property
    def next_index(self) -> int:
        """The index (and snapshot sequence) the next record gets."""
        return len(self.records) + 1

    def add(self, record: CheckpointRecord) -> None:
        """Append the record of the snapshot just taken."""
        with self._lock:
            self.records.append(record)

    def get(self, index: int) -> CheckpointRecord | None:
        """The record with this index (a result's `sequence`), None when there is none."""
        return self.records[index - 1] if 1 <= index <= len(self.records) else None

    def settle(self, results: Sequence[PublishResult]) -> None:
        """Fill records from the publisher's results so far (all of them, in order; idempotent)."""
        with self._lock:
            new = list(results[self._settled :])
            for result in new:
                record = self.get(result.sequence)
                if record is None:
                    continue
                record.version = result.ref.version
                record.published_kind = result.manifest.kind
                record.bytes = result.bytes_written
                record.full_fp32_bytes = result.full_fp32_bytes
                record.publish_s = result.encode_s + result.commit_s
                record.codec = ",".join(sorted({t.codec for t in result.manifest.tables}))
                record.served_loss = result.manifest.served_loss
                record.measure_s = result.measure_s
                record.reencoded = list(result.reencoded)
                record.gate = result.gate
                # Every earlier unpublished snapshot was merged into this one.
                for earlier in self.records[: record.index - 1]:
                    if not earlier.published:
                        earlier.merged_into = record.version
            self._settled += len(new)
