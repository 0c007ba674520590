"""The live model: bootstrapped from its track's version (RELEASED, or HEAD), advanced version by
version, pinnable.

    live = LiveModel(store, "ranker", ModuleSink(build))
    live.bootstrap()                      # HEAD's chain: baseline, then each delta
    live.advance(ref)                     # a newer committed version (idempotent by version)
    with live.reader() as copy:           # one version for the whole prediction
        logits = copy.module(*inputs)

`publisher.read.subscriber.Subscriber` drives it (the follow loop); this module moves the
version and keeps what a server reports about it.

Rules it keeps:

- Idempotent by version: a version at or below the served one is ignored, so redelivered or old
  announcements do no harm.
- What to apply is planned by `publisher.read.planner.plan_versions`, the planner restore and
  the follower use: the part of the target's restore chain newer than the served version (just
  the target when its parent is served), or the whole chain when the served version is not in
  its lineage. So a gap is filled from the store, never guessed.
- A plan is applied as one swap by the sink's consistency scheme (publisher/read/consistency.py);
  until it has fully passed verification the served version does not move. A new model is built
  only if its copies fit the memory budget (publisher/memory_budget.py), checked on the manifest.
- While pinned, nothing but `unpin` moves the version.

All mutations are serialised by one lock; predictions never take it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime

from publisher.read.catalog import Catalog, VersionRef
from publisher.read.consistency import UpdateResult
from publisher.read.errors import PinnedError, ShuttingDownError
from publisher.read.model_copy import ModelCopy, ServedVersion
from publisher.read.observer import SubscriberObserver
from publisher.read.planner import plan_versions
from publisher.read.sinks import VersionSink
from publisher.read.tracks import Track, TrackTarget
from publisher.read.version_fetch import FETCH_CONCURRENCY, FetchedVersion, fetch_version
from publisher.store import ObjectStore
from publisher.tunables import DEFAULT_TUNABLES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApplyTimes:
    """When each stage of one apply ended (unix seconds): where freshness goes on this server."""

    versions: tuple[int, ...]
    #: the announcement came off the bus, or the HEAD poll that found the plan began (None for
    #: a bootstrap, pin or catch-up, which no announcement started).
    heard_at: float | None
    #: the follower had read HEAD and the manifest: the plan was known.
    planned_at: float | None
    #: the apply began (the mutation lock taken).
    started_at: float
    #: seconds spent fetching, verifying (size, sha256) and parsing the plan's blobs.
    fetch_s: float
    #: the new version serves (written into a copy and swapped in).
    served_at: float
    #: the apply returned (the previous copy drained and brought level).
    finished_at: float


class SinkView:
    """What a holder of a sink reads of it: the served version, its number and age (a
    `LiveModel`, and a `checknrun serve --workers` worker's view of one)."""

    sink: VersionSink

    def reader(self) -> AbstractContextManager[ModelCopy]:
        """Borrow the served model for one prediction (NotBootstrappedError before bootstrap)."""
        return self.sink.reader()

    @property
    def served(self) -> ServedVersion | None:
        buffer = self.sink.current()
        return None if buffer is None else buffer.served

    @property
    def version(self) -> int | None:
        served = self.served
        return None if served is None else served.version

    def age_s(self, now: float | None = None) -> float | None:
        """Seconds since the served version was created by the trainer."""
        served = self.served
        if served is None:
            return None
        now = time.time() if now is None else now
        return max(0.0, now - served.manifest.created_at.timestamp())


class LiveModel(SinkView):
    """The served model of one store model name, and everything that moves its version."""

    def __init__(
        self,
        store: ObjectStore,
        model: str,
        sink: VersionSink,
        *,
        observer: SubscriberObserver | None = None,
        manifest_cache_size: int = DEFAULT_TUNABLES.manifest_cache_size,
        track: Track = "released",
    ) -> None:
        """`track`: which version to serve, RELEASED's (HEAD's while the model has none) or
        HEAD's (`candidate`); publisher/read/tracks.py."""
        self.store = store
        self.catalog = Catalog(store, model, cache_size=manifest_cache_size)
        self.target = TrackTarget(self.catalog, track)
        self.track: Track = track
        self.model_name = self.catalog.model
        self.sink = sink
        self.observer = observer or SubscriberObserver()
        self._mutate = threading.Lock()
        self._pinned: int | None = None
        #: committed versions newer than the served one that we know of -> their created_at.
        self._pending: dict[int, datetime] = {}
        self.versions_applied = 0
        self.bytes_fetched = 0
        self.last_apply: UpdateResult | None = None
        self.last_times: ApplyTimes | None = None
        self._fetch_s = 0.0
        # One pool for the life of the model: a version's blobs download in parallel without
        # paying thread start-up per version (S3 round trips dominate; hashing frees the GIL).
        self._pool = ThreadPoolExecutor(FETCH_CONCURRENCY, thread_name_prefix="fetch")
        self._interrupted = threading.Event()

    # --- reading ---------------------------------------------------------------------------------

    @property
    def pinned(self) -> int | None:
        """The version pinned, or None while following."""
        return self._pinned

    def staleness_s(self, now: float | None = None) -> float:
        """Seconds the oldest known unapplied committed version has waited; 0 when current."""
        current = self.version or 0
        created = [c for v, c in list(self._pending.items()) if v > current]
        if not created:
            return 0.0
        now = time.time() if now is None else now
        return max(0.0, now - min(created).timestamp())

    def latest_known(self) -> int | None:
        """The newest committed version this server has heard of (served or pending)."""
        known = [v for v in self._pending if v > (self.version or 0)]
        return max(known, default=self.version)

    def note_known(self, refs: Iterable[VersionRef]) -> None:
        """Remember committed versions we heard of (for staleness), applied or not."""
        current = self.version or 0
        for ref in refs:
            if ref.version > current:
                self._pending[ref.version] = ref.manifest.created_at

    # --- moving the version ---------------------------------------------------------------------

    def bootstrap(self) -> ServedVersion | None:
        """Serve the track's version (HEAD, or RELEASED): rebuild its architecture and apply its
        chain. None if nothing committed."""
        with self._mutate:
            if self._pinned is not None:
                return self.served  # an admin pinned while we waited for the lock
            target = self.target.read()
            if target is None:
                return None
            if not self.target.wants(target.version, self.version):
                return self.served
            chain = plan_versions(self.catalog, self.version, target)
            log.info(
                "model %s: bootstrapping v%d from v%d (%d versions, %d bytes)",
                self.model_name,
                target.version,
                chain[0].version,
                len(chain),
                sum(r.manifest.total_bytes for r in chain),
            )
            self.note_known([target])
            result = self._apply(chain, kind="bootstrap")
            return result.served

    def advance(
        self, ref: VersionRef, *, heard_at: float | None = None, planned_at: float | None = None
    ) -> list[int]:
        """Serve committed version `ref` if it is newer (on the released track: if it is not
        the one served, a rollback moving back); return the versions applied.

        `heard_at` and `planned_at` (unix seconds) say when the follower heard of `ref` and had
        planned it; they go into `last_times`. Raises PinnedError while pinned, and whatever
        fetching, verifying or fitting raised (the served version is then unchanged).
        """
        with self._mutate:
            if self._pinned is not None:
                raise PinnedError(f"pinned to v{self._pinned}; v{ref.version} is not applied")
            current = self.version
            if not self.target.wants(ref.version, current):
                return []  # idempotent: already served (or older)
            self.note_known([ref])
            plan = plan_versions(self.catalog, current, ref)
            if not plan:
                return []
            applied = self._apply(
                plan, kind=plan[0].manifest.kind, heard_at=heard_at, planned_at=planned_at
            )
            return list(applied.versions)

    def catch_up(self) -> list[int]:
        """Reconcile with the track's version from the store (after a rejection, an unpin, or
        silence)."""
        with self._mutate:
            if self._pinned is not None:
                return []
            target = self.target.read()
            if target is None:
                return []
            self.note_known([target])
            current = self.version
            if not self.target.wants(target.version, current):
                return []
            plan = plan_versions(self.catalog, current, target)
            if not plan:
                return []
            return list(self._apply(plan, kind="catch_up").versions)

    def pin(self, version: int) -> ServedVersion:
        """Serve committed `version` (rebuilt from the store if needed) and stop following.

        NoVersionError if it is not committed; fetch/verify errors leave the model as it was
        (and unpinned if it was).
        """
        with self._mutate:
            target = self.catalog.find(version)
            served = self.served
            if served is not None and served.version > version:
                # Remember what we leave, so staleness keeps telling how far behind we are.
                self._pending[served.version] = served.manifest.created_at
            if served is None or served.version != version:
                self._apply(plan_versions(self.catalog, self.version, target), kind="pin")
            self._pinned = version
            log.info("model %s: pinned to v%d", self.model_name, version)
            result = self.served
            assert result is not None
            return result

    def unpin(self) -> bool:
        """Follow again (the follow loop catches up); False if it was not pinned."""
        with self._mutate:
            was, self._pinned = self._pinned, None
        if was is not None:
            log.info("model %s: unpinned from v%d; following again", self.model_name, was)
        return was is not None

    # --- internals -------------------------------------------------------------------------------

    def _fetch(self, ref: VersionRef) -> FetchedVersion:
        if self._interrupted.is_set():
            # Checked before every version of a plan: a shutdown does not wait for a long
            # rebuild; the slot discards the half-written copy (nothing torn is published).
            raise ShuttingDownError(f"shutting down; v{ref.version} not applied")
        started = time.perf_counter()
        fetched = fetch_version(self.store, ref, self._pool)
        self._fetch_s += time.perf_counter() - started
        self.bytes_fetched += fetched.bytes_fetched
        self.observer.fetched(fetched.bytes_fetched)
        return fetched

    def _apply(
        self,
        plan: list[VersionRef],
        *,
        kind: str,
        heard_at: float | None = None,
        planned_at: float | None = None,
    ) -> UpdateResult:
        started_at = time.time()
        started = time.perf_counter()
        self._fetch_s = 0.0
        result = self.sink.update(plan, self._fetch)
        seconds = time.perf_counter() - started
        self.last_apply = result
        self.last_times = ApplyTimes(
            versions=result.versions,
            heard_at=heard_at,
            planned_at=planned_at,
            started_at=started_at,
            fetch_s=self._fetch_s,
            served_at=result.served.applied_at.timestamp(),
            finished_at=started_at + seconds,
        )
        self.versions_applied += len(plan)
        self.observer.applied(plan, result, seconds, kind)
        current = result.served.version
        for v in [v for v in self._pending if v <= current]:
            del self._pending[v]
        lag = (datetime.now(UTC) - result.served.manifest.created_at).total_seconds()
        log.info(
            "model %s: serving v%d (%s; applied %s, %d bytes, %.3f s, swap pause %.6f s, "
            "%.3f s after it was created)",
            self.model_name,
            current,
            kind,
            list(result.versions),
            result.bytes_fetched,
            seconds,
            result.pause_s,
            lag,
        )
        return result

    def interrupt(self) -> None:
        """Make an apply in progress stop before its next version (at shutdown)."""
        self._interrupted.set()

    def close(self) -> None:
        """Stop the fetch threads (the store is closed by whoever opened it)."""
        self._interrupted.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def nbytes(self) -> int:
        """Bytes of model tensors held by every copy."""
        return self.sink.nbytes()

    def digest(self) -> tuple[int, dict[str, str]]:
        """(version, sha256 of every tensor) read under one reader, so both agree."""
        with self.reader() as buffer:
            assert buffer.served is not None
            return buffer.served.version, buffer.digest()
