"""Snapshots published in the background, and what a published version is and cost.

    publisher = CheckpointPublisher(store, "movielens", announce=bus.announce)
    background = BackgroundPublisher(publisher)
    background.submit(snapshot)      # returns at once; folded into a waiting one if busy
    background.wait()                # re-raises a background failure

The publisher (publisher/write/job_publishing.py: `JobPublisher`, and `CheckpointPublisher`,
one process as a one-part job) runs the paper's stages two and three: quantize + encode every
table (`encode_table`, schemas/delta_blob.py), then commit (version_writer.py), then announce.
A snapshot that holds NaN or inf anywhere is refused before any of that
(`Snapshot.check_finite`): a version is what servers serve and trainers resume from.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Protocol

import numpy as np

from publisher.codecs import QuantizedRows, codec_of, encode_rows
from publisher.read.catalog import VersionRef
from publisher.store import StoreError
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.priority import lower_this_thread
from publisher.write.snapshot import NonFiniteSnapshotError, Snapshot, TableRows
from publisher.write.version_writer import TableBlob
from schemas.delta_blob import AuxEncoding, DeltaBlob, encode_delta_blob, round_to_bfloat16
from schemas.errors import BadDataError, UnavailableError
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
    a table of `end - start` rows with shard-local ids; ShardRowsError for a row outside the
    range or a shard with an id map (a sharded table has none)."""
    q = quantized if quantized is not None else encode_rows(rows.codec, rows.values)
    aux_encoding = aux_encoding_for(rows.codec)
    id_entries = rows.id_map_entries()
    table_rows, row_ids = rows.table_rows, rows.row_ids
    if rows.row_range is not None:
        table_rows, row_ids = _shard_rows(rows, id_entries is not None)
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
    """The rows of a shard do not fit it: a row outside its range, a range outside the table,
    or an id map on a sharded table."""


def _shard_rows(rows: TableRows, has_id_map: bool) -> tuple[int, np.ndarray]:
    """(rows of the shard, its shard-local row ids) of `rows.row_range`, checked."""
    assert rows.row_range is not None
    start, end = rows.row_range
    if not 0 <= start < end <= rows.table_rows:
        raise ShardRowsError(
            f"table {rows.name!r}: shard rows [{start}, {end}) are not within its "
            f"{rows.table_rows} rows"
        )
    if has_id_map:
        raise ShardRowsError(f"table {rows.name!r}: a sharded table carries no id map")
    ids = rows.row_ids
    if ids.size and (int(ids[0]) < start or int(ids[-1]) >= end):
        raise ShardRowsError(
            f"table {rows.name!r}: rows {int(ids[0])}..{int(ids[-1])} are outside its shard "
            f"[{start}, {end})"
        )
    return end - start, ids - start


class SnapshotPublisher(Protocol):
    """What `BackgroundPublisher` drives: `CheckpointPublisher` in this process, or
    `process_publisher.ProcessPublisher` in a child one."""

    def publish(self, snapshot: Snapshot) -> PublishResult:
        """Encode, commit and announce one snapshot; return the committed version."""
        ...

    def close(self) -> None:
        """Release the writer's lease and whatever else the publisher holds."""
        ...


class PublisherWorker:
    """What both background publishers (this module's and job_publishing.py's) share: each
    committed version is kept in `results`, the worker marked idle, the waiters woken, then
    `on_published` told (its failure is logged, never the publisher's); the failure that
    stopped the worker is re-raised on the submitting side; closing wakes every waiter."""

    results: list[PublishResult]
    on_published: Callable[[PublishResult], None] | None
    _busy: bool
    _closed: bool
    _error: BaseException | None
    _cond: threading.Condition

    def raise_if_failed(self) -> None:
        """Re-raise the failure that stopped the worker, if any (cheap: call it every batch)."""
        error = self._error  # one read: the worker sets it once and never clears it
        if error is not None:
            # The error itself, as `Future.result()` does: its class says what it means (a
            # lost lease is a ConflictError, a bug stays a bug) and its traceback shows where.
            raise error

    def _mark_closed(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _deliver(self, result: PublishResult) -> None:
        with self._cond:
            self.results.append(result)
            self._busy = False
            self._cond.notify_all()
        if self.on_published is not None:
            try:
                self.on_published(result)
            except Exception:
                log.exception("on_published callback failed")


class BackgroundPublisher(PublisherWorker):
    """Publishes snapshots on a worker thread so the trainer never waits for storage.

    `submit` only appends to a queue. While the worker publishes, a merger thread folds the
    snapshots waiting behind it into one (union of rows, newest values), so memory stays bounded
    by about one model copy plus the snapshot being folded, and the training thread never pays
    for a merge. A store that is unreachable is retried with backoff, folding whatever arrives
    meanwhile. A snapshot holding NaN or inf stops the worker like any other failure, or, with
    `on_non_finite="skip"`, is held back (counted in `non_finite_skipped`) and folded into the
    next one, which is published once its values are finite again: the rows the held snapshot
    carried are not lost from the chain. Any other failure stops the worker and is re-raised by
    the next `submit`, `wait` or `close` (or `raise_if_failed`).

    Threads (not processes) do the work: quantization, zstd, hashing, socket I/O and the numpy
    copies of a merge all release the GIL for their heavy part, and the snapshot arrays need no
    copy across a process boundary.
    """

    def __init__(
        self,
        publisher: SnapshotPublisher,
        *,
        on_published: Callable[[PublishResult], None] | None = None,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 10.0,
        on_non_finite: NonFinitePolicy = "stop",
        nice: int = DEFAULT_TUNABLES.publisher_nice,
    ) -> None:
        if on_non_finite not in ("stop", "skip"):
            raise ValueError(f"on_non_finite must be 'stop' or 'skip', got {on_non_finite!r}")
        self.publisher = publisher
        #: added to the worker threads' nice value (publisher/write/priority.py).
        self.nice = nice
        self.on_non_finite = on_non_finite
        self.on_published = on_published
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.results: list[PublishResult] = []
        #: snapshots folded into a later one (submitted - published, once everything is out).
        self.merges = 0
        #: snapshots not published because they (or one folded into them) held NaN or inf.
        self.non_finite_skipped = 0
        self.peak_pending_bytes = 0
        self._queue: list[Snapshot] = []  # oldest first
        #: a refused (non-finite) snapshot waiting to be folded into the next one.
        self._held: Snapshot | None = None
        self._queued_bytes = 0
        self._merging = False
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._merger = threading.Thread(target=self._merge_loop, name="merger", daemon=True)
        self._thread.start()
        self._merger.start()

    def submit(self, snapshot: Snapshot) -> None:
        """Queue a snapshot; returns at once (no merge, no storage on the caller's thread)."""
        with self._cond:
            self.raise_if_failed()
            self._queue.append(snapshot)
            self._queued_bytes += snapshot.nbytes
            self.peak_pending_bytes = max(self.peak_pending_bytes, self._queued_bytes)
            self._cond.notify_all()

    @property
    def backlog(self) -> bool:
        """True while a snapshot waits behind a publish in progress."""
        with self._cond:
            return bool(self._queue) or self._merging

    def wait(self, timeout: float | None = None) -> None:
        """Block until everything submitted is committed (or held back as non-finite, with
        `on_non_finite="skip"`); re-raise a background failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._merging or self._busy) and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("publishing did not finish in time")
                self._cond.wait(remaining)
            self.raise_if_failed()

    def close(self, flush: bool = True) -> None:
        """Optionally flush, then stop the threads and release the writer's lease."""
        try:
            if flush:
                self.wait()
        finally:
            self._mark_closed()
            self._merger.join(timeout=30)
            self._thread.join(timeout=30)
            self.publisher.close()

    def _fail(self, exc: BaseException) -> None:
        """Stop the worker with `exc` (re-raised on the submitting side)."""
        with self._cond:
            self._error = exc
            self._busy = False
            self._cond.notify_all()

    def _fold(self, snapshots: list[Snapshot]) -> Snapshot:
        """One snapshot carrying all of `snapshots` (oldest first); called without the lock."""
        merged = snapshots[0]
        for newer in snapshots[1:]:
            merged = merged.merge(newer)
        return merged

    def _take_all(self) -> list[Snapshot]:
        """Empty the queue (lock held)."""
        taken, self._queue, self._queued_bytes = self._queue, [], 0
        return taken

    def _put_front(self, snapshot: Snapshot, folded: int) -> None:
        """Return a folded snapshot to the head of the queue (lock held)."""
        self._queue.insert(0, snapshot)
        self._queued_bytes += snapshot.nbytes
        self.merges += folded - 1
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._queued_bytes)
        self._cond.notify_all()

    def _merge_loop(self) -> None:
        """Fold the snapshots queued behind a busy worker, off the training thread."""
        lower_this_thread(self.nice)
        while True:
            with self._cond:
                while len(self._queue) < 2 and not self._closed:
                    self._cond.wait()
                if len(self._queue) < 2:
                    return
                batch = self._take_all()
                self._merging = True
            try:
                merged = self._fold(batch)
            except BaseException as exc:
                with self._cond:
                    self._error = exc
                    self._merging = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._put_front(merged, len(batch))
                self._merging = False

    def _run(self) -> None:
        lower_this_thread(self.nice)  # and the upload pools it starts, which inherit it
        delay = self.retry_initial_s
        while True:
            with self._cond:
                while (not self._queue or self._merging) and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                held, self._held = self._held, None
                batch = ([] if held is None else [held]) + self._take_all()
                self._busy = True
                self.merges += len(batch) - 1
            snapshot = batch[0]
            try:
                snapshot = self._fold(batch)
                result = self.publisher.publish(snapshot)
            except (UnavailableError, ConnectionError, TimeoutError) as exc:
                log.warning("store unavailable (%s); retrying in %.1f s", exc, delay)
                with self._cond:
                    self._put_front(snapshot, 1)
                    self._busy = False
                time.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            except NonFiniteSnapshotError as exc:
                if self.on_non_finite == "stop":
                    self._fail(exc)
                    return
                log.warning("%s; held back until a later snapshot is finite", exc)
                with self._cond:
                    self._held = snapshot
                    # Count each snapshot once, not again each time it is refused folded.
                    already = 0 if held is None else held.merged
                    self.non_finite_skipped += snapshot.merged - already
                    self._busy = False
                    self._cond.notify_all()
                continue
            except BaseException as exc:
                self._fail(exc)
                return
            delay = self.retry_initial_s
            self._deliver(result)


__all__ = [
    "BackgroundPublisher",
    "NonFinitePolicy",
    "NonFiniteSnapshotError",
    "PublishResult",
    "SnapshotPublisher",
    "StoreError",
    "encode_table",
]
