"""A rank's publishing rounds on a background thread: the trainer hands a snapshot over and goes on.

    worker = JobBackgroundPublisher(JobPublisher(store, "ranker", collective))
    worker.submit(snapshot)          # returns at once
    worker.wait()                    # every snapshot submitted is in a committed version

The rounds are `JobPublisher.publish` calls (publisher/write/job_publishing.py), collective:
every rank of the job runs this worker, and rank 0 says which snapshot each round publishes.
One process's snapshots go to `BackgroundPublisher` (publisher/write/publishing.py) instead,
which also folds a backlog on a merger thread and retries a store that is down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from publisher.write.job_publishing import JobMismatchError, JobPublisher
from publisher.write.priority import lower_this_thread
from publisher.write.publishing import NonFinitePolicy, PublisherWorker, PublishResult
from publisher.write.snapshot import NonFiniteSnapshotError, Snapshot

log = logging.getLogger(__name__)


class JobBackgroundPublisher(PublisherWorker):
    """Runs a rank's `JobPublisher` rounds on a background thread: `submit` returns at once.

    Every version holds the same snapshot sequence (`Snapshot.sequence`, the trainer's record
    number) on every rank: rank 0 folds what it has and sends its sequence S; another rank folds
    its snapshots up to S (waiting up to `job_publisher.timeout_s` for its trainer to submit S)
    and keeps the newer ones for the next round. A rank enters a round only once it has a
    snapshot (or is closing), so a long interval between checkpoints costs no collective wait.

    A failure stops the worker and is re-raised by the next `submit`, `wait`, `close` or
    `raise_if_failed` (docs/FORMAT.md section 2.1: rank 0 stops the job): a store that is down
    fails a round on every rank alike, which the job restarts from its last version. A version
    some rank's part of holds NaN or inf is refused by every rank before anything is written:
    the job stops (`on_non_finite="stop"`), or every rank holds its part back and folds it into
    the next round's ("skip"), published once the values are finite again.
    """

    def __init__(
        self,
        job_publisher: JobPublisher,
        on_published: Callable[[PublishResult], None] | None = None,
        on_non_finite: NonFinitePolicy = "stop",
    ) -> None:
        if on_non_finite not in ("stop", "skip"):
            raise ValueError(f"on_non_finite must be 'stop' or 'skip', got {on_non_finite!r}")
        self.job = job_publisher
        self.on_published = on_published
        self.on_non_finite = on_non_finite
        #: snapshots not published because the job's version held NaN or inf somewhere.
        self.non_finite_skipped = 0
        self.results: list[PublishResult] = []
        self._queue: list[Snapshot] = []  # oldest first
        #: a version every rank refused as non-finite, folded into the next one ("skip").
        self._held: Snapshot | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"job-publisher-{job_publisher.rank}", daemon=True
        )
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        """Queue a snapshot; returns at once."""
        with self._cond:
            self.raise_if_failed()
            self._queue.append(snapshot)
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every snapshot submitted here is in a committed version; re-raise a
        background failure. (A rank's snapshot newer than rank 0's waits for rank 0's.)"""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._busy) and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("publishing did not finish in time")
                self._cond.wait(remaining)
            self.raise_if_failed()

    def close(self, flush: bool = True) -> None:
        """Optionally flush, then end the rounds (rank 0 tells the others) and release the
        job's lease. Every rank closes; rank 0's close is what ends the others' workers."""
        try:
            if flush:
                self.wait()
        finally:
            self._mark_closed()
            # No timeout needed: every wait of a round is bounded by the collective's timeout or
            # `timeout_s`, so the worker ends once rank 0 has said the rounds are over.
            self._thread.join()
            self.job.close()

    def _run(self) -> None:
        lower_this_thread(self.job.tunables.publisher_nice)
        try:
            while self._round():
                pass
            with self._cond:
                left = [s.sequence for s in self._queue]
            if left:
                raise JobMismatchError(
                    f"rank 0 ended the job's rounds; snapshots {left} of rank {self.job.rank} "
                    "were never published"
                )
        except BaseException as exc:
            with self._cond:
                self._error = exc
                self._busy = False
                self._cond.notify_all()

    def _round(self) -> bool:
        """One round of the job; False once rank 0 said the rounds are over."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self.job.rank == 0:
                taken, self._queue = self._queue, []
                self._busy = bool(taken)
        if self.job.rank == 0:
            self.job.next_sequence(taken[-1].sequence if taken else None)
            if not taken:
                return False
            self._publish(_fold(taken))
            return True
        told = self.job.next_sequence(None)
        if told is None:
            return False
        snapshot = self._take_up_to(told)
        if snapshot is None:
            self.job.fail(
                JobMismatchError(f"rank {self.job.rank} has no snapshot of sequence {told}")
            )
        else:
            self._publish(snapshot)
        return True

    def _take_up_to(self, sequence: int) -> Snapshot | None:
        """This rank's snapshots up to `sequence` folded, once its trainer submitted it; None
        if it does not in time, or never will (closed, or it skipped that sequence)."""
        deadline = time.monotonic() + self.job.timeout_s
        with self._cond:
            while not any(s.sequence >= sequence for s in self._queue) and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            taken = [s for s in self._queue if s.sequence <= sequence]
            if not taken or taken[-1].sequence != sequence:
                return None
            self._queue = [s for s in self._queue if s.sequence > sequence]
            self._busy = True
        return _fold(taken)

    def _publish(self, snapshot: Snapshot) -> None:
        held, self._held = self._held, None
        if held is not None:
            snapshot = _fold([held, snapshot])
        try:
            result = self.job.publish(snapshot)
        except NonFiniteSnapshotError as exc:
            if self.on_non_finite == "stop":
                raise
            # Every rank refused the same round: each holds its part and folds it into the
            # next, so the rows it carried stay in the chain (as BackgroundPublisher does).
            log.warning("%s; held back until a later version is finite", exc)
            with self._cond:
                self._held = snapshot
                self.non_finite_skipped += snapshot.merged - (0 if held is None else held.merged)
                self._busy = False
                self._cond.notify_all()
            return
        self._deliver(result)


def _fold(snapshots: list[Snapshot]) -> Snapshot:
    merged = snapshots[0]
    for newer in snapshots[1:]:
        merged = merged.merge(newer)
    return merged
