"""Snapshots published on a background thread, by one process or by every rank of a job.

    background = BackgroundPublisher(CheckpointPublisher(store, "movielens"))   # one process
    background = BackgroundPublisher(JobPublisher(store, "ranker", collective))  # each rank
    background.submit(snapshot)      # returns at once; folded into a waiting one if busy
    background.wait()                # every snapshot submitted is committed, or the failure

One worker for any world size. Each round publishes one snapshot sequence (`Snapshot.sequence`,
the trainer's record number) on every rank: the leader (rank 0, or the one process) folds what
it has queued and names its sequence S; every other rank folds its snapshots up to S (waiting up
to `JobPublisher.timeout_s` for its trainer to submit S) and keeps the newer ones for the next
round. A rank enters a round only once it has a snapshot (or is closing), so a long interval
between checkpoints costs no collective wait. One process's rounds exchange nothing
(`CheckpointPublisher`, a `SoloCollective`; or `ProcessPublisher` in a child process).

What a round's outcome does, the same at any world size:

- committed: kept in `results`, waiters woken, `on_published` told (its failure is logged);
- the store is unreachable (`UnavailableError`, `ConnectionError`, `TimeoutError`; a job's
  `RankFailedError` with `retryable`): every rank puts its snapshot back, waits with backoff and
  tries again, folding whatever arrived meanwhile;
- NaN or inf somewhere in the version (every rank refuses it together): the worker stops
  (`on_non_finite="stop"`), or every rank holds its part back, counted in `non_finite_skipped`,
  and folds it into the next round's, published once the values are finite again, so the rows
  it carried stay in the chain ("skip");
- anything else (a lost lease, a rank that did not answer, a bug) stops the worker: the next
  `submit`, `wait`, `close` or `raise_if_failed` re-raises it (docs/FORMAT.md section 2.1: rank
  0 stops the job, which restarts from its last version).

While the leader publishes, a merger thread folds the snapshots waiting behind it into one
(union of rows, newest values), so memory stays bounded by about one model copy plus the
snapshot being folded, and the training thread never pays for a merge. (Another rank folds at
the round, up to the leader's S: its queue is short, the ranks train in step.)

Threads (not processes) do the work: quantization, zstd, hashing, socket I/O and the numpy
copies of a merge all release the GIL for their heavy part, and the snapshot arrays need no copy
across a process boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from publisher.tunables import DEFAULT_TUNABLES
from publisher.write.job_publishing import JobMismatchError, JobPublisher, retryable
from publisher.write.priority import lower_this_thread
from publisher.write.publishing import NonFinitePolicy, PublishResult, SnapshotPublisher
from publisher.write.snapshot import NonFiniteSnapshotError, Snapshot

log = logging.getLogger(__name__)


class BackgroundPublisher:
    """Runs a publisher's rounds on a background thread so the trainer never waits for storage."""

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
        #: the job's publisher when the rounds are exchanged with other ranks (None: one process).
        self.job = publisher if isinstance(publisher, JobPublisher) and not publisher.solo else None
        self.rank = 0 if self.job is None else self.job.rank
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
        name = "publisher" if self.job is None else f"publisher-{self.rank}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._merger: threading.Thread | None = None
        if self.rank == 0:
            self._merger = threading.Thread(target=self._merge_loop, name="merger", daemon=True)
            self._merger.start()
        self._thread.start()

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

    def raise_if_failed(self) -> None:
        """Re-raise the failure that stopped the worker, if any (cheap: call it every batch)."""
        error = self._error  # one read: the worker sets it once and never clears it
        if error is not None:
            # The error itself, as `Future.result()` does: its class says what it means (a
            # lost lease is a ConflictError, a bug stays a bug) and its traceback shows where.
            raise error

    def wait(self, timeout: float | None = None) -> None:
        """Block until everything submitted is committed (or held back as non-finite, with
        `on_non_finite="skip"`); re-raise a background failure. (At a rank other than 0, a
        snapshot newer than rank 0's waits for rank 0's.)"""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._merging or self._busy) and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("publishing did not finish in time")
                self._cond.wait(remaining)
            self.raise_if_failed()

    def close(self, flush: bool = True) -> None:
        """Optionally flush, then stop the threads (rank 0 tells the other ranks the rounds are
        over) and release the writer's lease. Every rank of a job closes."""
        try:
            if flush:
                self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._merger is not None:
                self._merger.join(timeout=30)
            # A job's rounds need no timeout here: each wait in one is bounded by the
            # collective's timeout or `timeout_s`, so the worker ends once rank 0 said so.
            self._thread.join(timeout=30 if self.job is None else None)
            self.publisher.close()

    def _fail(self, exc: BaseException) -> None:
        """Stop the worker with `exc` (re-raised on the submitting side)."""
        with self._cond:
            self._error = exc
            self._busy = False
            self._merging = False
            self._cond.notify_all()

    def _put_front(self, snapshot: Snapshot, folded: int) -> None:
        """Return a folded snapshot to the head of the queue (lock held)."""
        self._queue.insert(0, snapshot)
        self._queued_bytes += snapshot.nbytes
        self.merges += folded - 1
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._queued_bytes)
        self._cond.notify_all()

    def _merge_loop(self) -> None:
        """Fold the snapshots queued behind a busy leader, off the training thread."""
        lower_this_thread(self.nice)
        while True:
            with self._cond:
                while len(self._queue) < 2 and not self._closed:
                    self._cond.wait()
                if len(self._queue) < 2:
                    return
                batch, self._queue, self._queued_bytes = self._queue, [], 0
                self._merging = True
            try:
                merged = _fold(batch)
            except BaseException as exc:
                self._fail(exc)
                return
            with self._cond:
                self._put_front(merged, len(batch))
                self._merging = False

    def _run(self) -> None:
        lower_this_thread(self.nice)  # and the upload pools it starts, which inherit it
        delay = self.retry_initial_s
        try:
            while True:
                taken = self._lead() if self.rank == 0 else self._follow()
                if taken is None:
                    return
                if self._publish(*taken, delay):
                    delay = self.retry_initial_s
                else:
                    delay = min(delay * 2, self.retry_max_s)
        except BaseException as exc:
            self._fail(exc)

    def _lead(self) -> tuple[Snapshot, int] | None:
        """The leader's next snapshot: all it has queued (and what it held back), folded, with
        the count of snapshots in it already refused; the other ranks are told its sequence.
        None once closed with nothing left (and the other ranks told so)."""
        with self._cond:
            while (not self._queue or self._merging) and not self._closed:
                self._cond.wait()
            held, self._held = self._held, None
            taken = self._queue
            self._queue, self._queued_bytes = [], 0
            self._busy = bool(taken)
            batch = ([] if held is None else [held]) + taken
            self.merges += max(len(batch) - 1, 0)
        if not taken:
            if self.job is not None:
                self.job.next_sequence(None)
            return None
        snapshot = _fold(batch)
        if self.job is not None:
            self.job.next_sequence(snapshot.sequence)
        return snapshot, 0 if held is None else held.merged

    def _follow(self) -> tuple[Snapshot, int] | None:
        """Another rank's snapshot for the round rank 0 names: its own up to that sequence
        (and what it held back), folded, as `_lead` gives it; None once rank 0 said the rounds
        are over."""
        assert self.job is not None
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
        told = self.job.next_sequence(None)
        if told is None:
            with self._cond:
                left = [s.sequence for s in self._queue]
            if left:
                raise JobMismatchError(
                    f"rank 0 ended the job's rounds; snapshots {left} of rank {self.rank} "
                    "were never published"
                )
            return None
        deadline = time.monotonic() + self.job.timeout_s
        with self._cond:
            while not any(s.sequence >= told for s in self._queue) and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            taken = [s for s in self._queue if s.sequence <= told]
            found = bool(taken) and taken[-1].sequence == told
            if found:
                self._queue = [s for s in self._queue if s.sequence > told]
                self._queued_bytes = sum(s.nbytes for s in self._queue)
                self._busy = True
                held, self._held = self._held, None
                batch = ([] if held is None else [held]) + taken
                self.merges += len(batch) - 1
        if not found:
            self.job.fail(JobMismatchError(f"rank {self.rank} has no snapshot of sequence {told}"))
            raise AssertionError("unreachable: a failed round raises on every rank")
        return _fold(batch), 0 if held is None else held.merged

    def _publish(self, snapshot: Snapshot, refused: int, delay: float) -> bool:
        """One round with `snapshot` (`refused` of its snapshots were refused before); False
        when it is to be tried again after `delay`."""
        try:
            result = self.publisher.publish(snapshot)
        except NonFiniteSnapshotError as exc:
            if self.on_non_finite == "stop":
                raise
            log.warning("%s; held back until a later snapshot is finite", exc)
            with self._cond:
                self._held = snapshot
                # Count each snapshot once, not again each time it is refused folded.
                self.non_finite_skipped += snapshot.merged - refused
                self._busy = False
                self._cond.notify_all()
            return True
        except Exception as exc:
            if not retryable(exc):
                raise
            log.warning("store unavailable (%s); retrying in %.1f s", exc, delay)
            with self._cond:
                self._put_front(snapshot, 1)
                self._busy = False
            time.sleep(delay)
            return False
        with self._cond:
            self.results.append(result)
            self._busy = False
            self._cond.notify_all()
        if self.on_published is not None:
            try:
                self.on_published(result)
            except Exception:
                log.exception("on_published callback failed")
        return True


def _fold(snapshots: list[Snapshot]) -> Snapshot:
    """One snapshot carrying all of `snapshots` (oldest first); called without the lock."""
    merged = snapshots[0]
    for newer in snapshots[1:]:
        merged = merged.merge(newer)
    return merged


__all__ = ["BackgroundPublisher"]
