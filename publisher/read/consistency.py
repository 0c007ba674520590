"""How a new version replaces the served one under running readers: two schemes.

Both guarantee that every reader (a prediction) reads exactly one version (no torn reads: a
prediction never sees rows of version v+1 next to rows or dense parameters of version v), and
both do every slow step (fetch, sha256, decode) before anything a reader can see changes. They
differ in what a reader may wait for and in memory:

``double-buffer`` (default): two full copies of the model. A plan is written into the hidden
  standby copy; publishing it is a pointer swap under a lock held for a few microseconds; the old
  copy is then drained (the swap waits until no prediction still reads it) and brought level by
  copying only the rows the plan touched from the new live copy. Readers never wait for a write.
  Memory: 2 x the model, plus the decoded rows of one delta while it is written.

``rwlock``: one copy behind a writer-preferring reader-writer lock. Rows are decoded (or, for a
  quantized table, put in its fused format), tables that must widen are converted beside the
  served ones, and id-map entries checked against the maps, all outside the lock; the lock is
  then taken for writing and the rows are scattered in (one vectorised assignment per table),
  widened tables swapped in by pointer and the entries applied, so new predictions wait for
  in-flight ones to finish plus the scatter, which grows with the delta.
  A full version (or a new architecture) is built as a new copy beside the old one and swapped in
  by pointer under the lock. Memory: 1 x the model in steady state, 2 x while a full is built.

Measured (bench/serving.py, 1M x 64 int8 table, 2 busy cores; details in docs/SERVER.md):

    delta rows   double-buffer swap pause   rwlock write-lock hold   apply (db / rwlock)
    1,000        6 us                        0.4 ms                   2.4 / 1.9 ms
    100,000      10 us                       13 ms (readers: 47 ms)   47 / 31 ms
    300,000      16 us                       27 ms                    177 / 78 ms

With readers running, the worst wait of a prediction to borrow the model was 0.08 ms with the
double buffer and 47 ms with the rwlock (100k-row deltas). Memory: 493 MiB of tensors vs 247 MiB.
So the double buffer is the default (pauses do not grow with the delta; it costs one more model
copy and ~1.5-2x apply time, spent off the request path); choose `rwlock` to hold one copy
between fulls. Both schemes peak at 2 copies (a full version, or a new architecture, is built
beside the served copy), and that peak is what the memory budget is checked against.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

from publisher.memory_budget import MemoryBudget
from publisher.read.catalog import VersionRef
from publisher.read.copy_builders import CopyBuilder
from publisher.read.errors import ApplyError, NotBootstrappedError
from publisher.read.model_copy import ModelCopy, ServedVersion, Touched
from publisher.read.scheme_names import ConsistencyScheme
from publisher.read.version_fetch import FetchedVersion, FetchFn, merge_id_rows

log = logging.getLogger(__name__)

#: a drain that takes longer than this is logged (a prediction is stuck or very slow).
DRAIN_WARN_S = 10.0


@dataclass(frozen=True)
class UpdateResult:
    """What one `update` did."""

    served: ServedVersion
    versions: tuple[int, ...]
    bytes_fetched: int
    #: longest time predictions could not start because of this update (seconds).
    pause_s: float
    #: the plan was built as a new copy (bootstrap, new architecture, rebuild) vs written in place.
    rebuilt: bool


def _now() -> datetime:
    return datetime.now(UTC)


class ModelSlot(ABC):
    """Holds the served model; readers borrow a copy, one writer at a time updates it.

    A new model is built only once `peak_copies` of it fit the memory budget (checked on its
    manifest, publisher/memory_budget.py): a forged manifest costs a rejection, not the
    allocation it declares.
    """

    scheme: ConsistencyScheme
    #: most model copies the scheme holds at once, the one being built included. (Built beside
    #: a model of another architecture, the old one counts as a copy of the new: old + new is
    #: at most 2 x the larger, and both were checked.)
    peak_copies: int

    def __init__(
        self, builder: CopyBuilder, budget: MemoryBudget, *, quantized: bool = True
    ) -> None:
        self.builder = builder
        self.budget = budget
        #: hold int-coded tables in their fused format (server/held_tables.py).
        self.quantized = quantized
        #: worst time a reader waited to borrow a copy (seconds), for measurements.
        self.max_reader_wait_s = 0.0

    @abstractmethod
    def reader(self) -> AbstractContextManager[ModelCopy]:
        """Borrow the live copy for one reader (a prediction); it holds one version throughout."""

    @abstractmethod
    def current(self) -> ModelCopy | None:
        """The live copy, for metadata only (its weights may change under a later update)."""

    @abstractmethod
    def update(self, plan: Sequence[VersionRef], fetch: FetchFn) -> UpdateResult:
        """Apply `plan` (versions in order) and publish the result as one swap.

        Raises (and leaves the served version untouched) when any version fails to fetch,
        verify, decode or fit. Callers serialise updates.
        """

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of model tensors held, every copy included."""

    def _record_wait(self, started: float) -> None:
        waited = time.perf_counter() - started
        if waited > self.max_reader_wait_s:  # a benign race: it is a statistic
            self.max_reader_wait_s = waited


def _build_fresh(
    slot: ModelSlot, plan: Sequence[VersionRef], fetch: FetchFn
) -> tuple[ModelCopy, int]:
    """A new copy holding the plan's last version; the plan must start with a full."""
    first = plan[0].manifest
    if first.kind != "full":
        raise ApplyError(
            f"cannot build a model from version {first.version}: it is a delta "
            f"(applies to {first.applies_to}); a rebuild starts from a full version"
        )
    buffer = slot.builder.new_copy(first, slot.budget, slot.peak_copies, quantized=slot.quantized)
    fetched_bytes = _write_plan(buffer, plan, fetch, Touched())
    return buffer, fetched_bytes


def _write_plan(
    buffer: ModelCopy, plan: Sequence[VersionRef], fetch: FetchFn, touched: Touched
) -> int:
    total = len(plan)
    fetched_bytes = 0
    for i, ref in enumerate(plan, 1):
        started = time.perf_counter()
        buffer.check_manifest(ref.manifest)
        fetched = fetch(ref)
        buffer.check(fetched)
        buffer.write(fetched, touched)
        fetched_bytes += fetched.bytes_fetched
        if total > 1:  # progress of a bootstrap or rebuild, one line per version
            log.info(
                "model %s: wrote v%d (%d/%d, %s, %d bytes) in %.3f s",
                ref.manifest.model,
                ref.version,
                i,
                total,
                ref.manifest.kind,
                fetched.bytes_fetched,
                time.perf_counter() - started,
            )
    buffer.served = ServedVersion(plan[-1], _now())
    return fetched_bytes


class DoubleBufferSlot(ModelSlot):
    """Live + standby copies; publish by pointer swap, then bring the old copy level."""

    scheme: ConsistencyScheme = "double-buffer"
    peak_copies = 2

    def __init__(
        self, builder: CopyBuilder, budget: MemoryBudget, *, quantized: bool = True
    ) -> None:
        super().__init__(builder, budget, quantized=quantized)
        self._cond = threading.Condition(threading.Lock())
        self._live: ModelCopy | None = None
        self._standby: ModelCopy | None = None

    @contextmanager
    def reader(self) -> Iterator[ModelCopy]:
        started = time.perf_counter()
        with self._cond:
            buffer = self._live
            if buffer is None:
                raise NotBootstrappedError("no version is served yet")
            buffer.readers += 1
        self._record_wait(started)
        try:
            yield buffer
        finally:
            with self._cond:
                buffer.readers -= 1
                if buffer.readers == 0:
                    self._cond.notify_all()

    def current(self) -> ModelCopy | None:
        return self._live

    def nbytes(self) -> int:
        return sum(b.nbytes for b in (self._live, self._standby) if b is not None)

    def _swap_in(self, buffer: ModelCopy) -> tuple[ModelCopy | None, float]:
        started = time.perf_counter()
        with self._cond:
            old, self._live = self._live, buffer
        return old, time.perf_counter() - started

    def _written(self, buffer: ModelCopy, touched: Touched | None) -> None:
        """`buffer`, which no reader sees, has been written: with `touched` (a plan or its
        replay), or whole (None: built, cloned). A hook for readers in other processes
        (server/workers/); nothing to do here."""

    def _drain(self, buffer: ModelCopy) -> None:
        """Wait until no prediction reads `buffer` (no new one can: it is not live)."""
        started = time.monotonic()
        warned = False
        with self._cond:
            while buffer.readers:
                self._cond.wait(timeout=1.0)
                if not warned and time.monotonic() - started > DRAIN_WARN_S:
                    log.warning(
                        "a prediction has held the previous model for %.0f s",
                        time.monotonic() - started,
                    )
                    warned = True

    def update(self, plan: Sequence[VersionRef], fetch: FetchFn) -> UpdateResult:
        if not plan:
            raise ValueError("empty plan")
        first = plan[0].manifest
        if self._standby is None and self._live is not None and self._live.fits(first):
            # A failed rebuild dropped the standby (see _rebuild); a plan on top of the live
            # model needs it back, not a rebuild from a full.
            self._standby = self.builder.clone(self._live)
            self._written(self._standby, None)
        if self._live is None or self._standby is None or not self._standby.fits(first):
            # No reference to either copy may be held here: the rebuild frees the standby.
            return self._rebuild(plan, fetch)
        return self._write_standby(plan, fetch)

    def _write_standby(self, plan: Sequence[VersionRef], fetch: FetchFn) -> UpdateResult:
        live, standby = self._live, self._standby
        assert live is not None and standby is not None
        touched = Touched()
        try:
            fetched_bytes = _write_plan(standby, plan, fetch, touched)
        except BaseException:
            # The standby is hidden, so a failed write tore nothing anyone sees; put it back.
            standby.copy_from(live, touched)
            raise
        self._written(standby, touched)
        old, pause = self._swap_in(standby)
        assert old is live
        self._drain(live)
        live.replay(standby, touched)
        self._standby = live
        self._written(live, touched)
        assert standby.served is not None
        return UpdateResult(
            standby.served, tuple(r.version for r in plan), fetched_bytes, pause, rebuilt=False
        )

    def _rebuild(self, plan: Sequence[VersionRef], fetch: FetchFn) -> UpdateResult:
        # Free the standby before building, so that memory peaks at 2 copies (the live one and
        # the new one), not 3: nothing else holds it (readers only borrow the live copy). Not
        # kept for a failed build either: `update` clones the live copy when a plan needs it.
        self._standby = None
        fresh, fetched_bytes = _build_fresh(self, plan, fetch)
        self._written(fresh, None)
        old, pause = self._swap_in(fresh)
        if old is not None:
            self._drain(old)
            del old  # freed before the standby is cloned: 2 copies again, not 3
        self._standby = self.builder.clone(fresh)
        self._written(self._standby, None)
        assert fresh.served is not None
        return UpdateResult(
            fresh.served, tuple(r.version for r in plan), fetched_bytes, pause, rebuilt=True
        )


class ReaderWriterLock:
    """Many readers or one writer; a waiting writer stops new readers (no writer starvation)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def acquire_read(self) -> None:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class ReaderWriterSlot(ModelSlot):
    """One copy; deltas are scattered in under a write lock, fulls are built beside and swapped."""

    scheme: ConsistencyScheme = "rwlock"
    #: one copy between fulls, but a full is built beside the served copy before the swap.
    peak_copies = 2

    def __init__(
        self, builder: CopyBuilder, budget: MemoryBudget, *, quantized: bool = True
    ) -> None:
        super().__init__(builder, budget, quantized=quantized)
        self._lock = ReaderWriterLock()
        self._buffer: ModelCopy | None = None

    @contextmanager
    def reader(self) -> Iterator[ModelCopy]:
        started = time.perf_counter()
        self._lock.acquire_read()
        self._record_wait(started)
        try:
            buffer = self._buffer
            if buffer is None:
                raise NotBootstrappedError("no version is served yet")
            yield buffer
        finally:
            self._lock.release_read()

    def current(self) -> ModelCopy | None:
        return self._buffer

    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.nbytes

    def _locked(self, action: Callable[[], None]) -> float:
        started = time.perf_counter()
        with self._lock.write():
            action()
        return time.perf_counter() - started

    def update(self, plan: Sequence[VersionRef], fetch: FetchFn) -> UpdateResult:
        if not plan:
            raise ValueError("empty plan")
        buffer = self._buffer
        if (
            buffer is None
            or any(r.manifest.kind == "full" for r in plan)
            or not buffer.fits(plan[0].manifest)
        ):
            # A full rewrites every row: build it beside the live copy and swap the pointer.
            fresh, fetched_bytes = _build_fresh(self, plan, fetch)

            def swap() -> None:
                self._buffer = fresh

            pause = self._locked(swap)
            assert fresh.served is not None
            return UpdateResult(
                fresh.served, tuple(r.version for r in plan), fetched_bytes, pause, rebuilt=True
            )
        # Deltas only: fetch, verify and stage everything before taking the lock.
        fetched_all: list[FetchedVersion] = []
        for ref in plan:
            buffer.check_manifest(ref.manifest)
            fetched = fetch(ref)
            buffer.check(fetched)
            fetched_all.append(fetched)
        staged = buffer.stage(fetched_all)
        # The plan's id-map writes as one per table, checked while readers still run: under
        # the lock they are only made, and cannot fail half-way.
        id_writes = buffer.check_id_rows(merge_id_rows(fetched_all))
        served = ServedVersion(plan[-1], _now())

        def scatter() -> None:
            buffer.commit(staged)
            buffer.write_id_maps(id_writes)
            buffer.served = served

        pause = self._locked(scatter)
        return UpdateResult(
            served,
            tuple(r.version for r in plan),
            sum(f.bytes_fetched for f in fetched_all),
            pause,
            rebuilt=False,
        )


def make_slot(
    scheme: ConsistencyScheme, builder: CopyBuilder, budget: MemoryBudget, *, quantized: bool = True
) -> ModelSlot:
    """The slot implementing `scheme`, building copies with `builder` once they fit `budget`,
    with int-coded tables held quantized if `quantized`."""
    if scheme == "double-buffer":
        return DoubleBufferSlot(builder, budget, quantized=quantized)
    if scheme == "rwlock":
        return ReaderWriterSlot(builder, budget, quantized=quantized)
    raise ValueError(f"unknown consistency scheme {scheme!r}")
