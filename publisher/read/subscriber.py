"""Keep a model at the newest verified version: the read side's public loop.

    sink = ModuleSink(build)                               # or ModuleSink(model), TensorSink()
    with Subscriber("s3://models/prod", "ranker", sink, bus="kafka://broker:9092/models") as sub:
        sub.start()                                        # follows on a background thread
        sub.wait_for_version()                             # the bootstrap
        with sink.reader() as copy:                        # one version per read
            scores = copy.module(*inputs)

    sub.run(max_versions=3, timeout=10.0)                  # or in the foreground, bounded

A subscriber reads, never writes: it takes no lease, so it runs beside a trainer that is
publishing. It serves a track (`SubscriberOptions.track`): the version RELEASED names (the
default; HEAD's while the model has no release gate) or HEAD's (`candidate`). It bootstraps
from that version (the full baseline and the deltas its chain leads through), then follows:
announcements on the bus are hints and the store is the truth
(publisher/read/follower.py: gaps reconciled from HEAD, silence covered by HEAD polls, forged
messages bounded), every blob is verified against its manifest's sha256 before anything is
written (publisher/read/version_fetch.py), a new model is built only once its copies fit the
memory budget, and each plan is swapped in by the sink's consistency scheme
(publisher/read/sinks.py). `checknrun serve` is one of these with a `ModuleSink`.

Rules (quix-streams / aiokafka style):

- `stop()` only sets an event; `run` notices it within one poll timeout and returns.
- The served version moves only after a version's work is done (fetched, verified, decoded,
  swapped in); `LiveModel.advance` is idempotent by version, so a redelivered or old
  announcement does nothing.
- A version that is bad data (a `BadDataError`: it fails verification, decoding or layout
  checks, or names a blob that is missing) is rejected and counted; the model keeps serving the
  version it had (the schemes never publish a half-written model). The loop then backs off
  (`retry_initial_s`, doubling up to `retry_max_s`) and reconciles from the store's HEAD, which
  retries the version (the store may have healed), or skips it once a newer full version exists.
- Store failures (unreachable, refused) and unexpected errors are logged, counted and retried
  the same way; nothing escapes `run` except KeyboardInterrupt/SystemExit. A background
  thread's failure (`start`) is re-raised by `close`, never lost.
- `pin(v)` serves committed version `v` and stops following until `unpin()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

from publisher.bus import StartAt, open_source
from publisher.bus.base import AnnouncementSource
from publisher.codecs import CodecError
from publisher.id_map import IdMapError
from publisher.memory_budget import MemoryBudgetError
from publisher.read.errors import ApplyError, NonFiniteError, PinnedError, ShuttingDownError
from publisher.read.follower import VersionFollower
from publisher.read.live_model import LiveModel
from publisher.read.model_copy import ModelCopy, ServedVersion
from publisher.read.observer import SubscriberObserver
from publisher.read.sinks import VersionSink
from publisher.read.tracks import Track
from publisher.store import IntegrityError, ObjectStore, StoreError, open_store
from publisher.tunables import DEFAULT_TUNABLES
from schemas.errors import BadDataError, FormatError

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def rejection_reason(exc: BadDataError) -> str:
    """The `reason` label of a rejected version ("restore": anything else keeping it from being
    rebuilt, such as a RestoreError or a missing blob)."""
    if isinstance(exc, MemoryBudgetError):
        return "budget"
    if isinstance(exc, IntegrityError):
        return "integrity"
    if isinstance(exc, FormatError):
        return "format"
    if isinstance(exc, CodecError):
        return "codec"
    if isinstance(exc, NonFiniteError):
        return "non_finite"
    if isinstance(exc, ApplyError):
        return "layout"
    if isinstance(exc, IdMapError):  # id-map entries that break the served map's rules
        return "id_map"
    return "restore"


@dataclass(frozen=True)
class SubscriberOptions:
    """How a subscriber follows (the server's settings of the same names, docs/SERVER.md)."""

    #: longest wait of one bus poll; `run` notices `stop` within it.
    poll_timeout_s: float = 1.0
    #: read HEAD after this long without an announcement of the model.
    poll_head_after_s: float = 5.0
    #: announcements with a gap reconcile from the store at most once per this long.
    min_reconcile_interval_s: float = 1.0
    #: first retry after a failure, doubling up to `retry_max_s`.
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0
    #: where a new bus subscription starts (the bootstrap reads HEAD anyway).
    bus_start: StartAt = "latest"
    #: manifests kept in memory (least recently used evicted first).
    manifest_cache_size: int = DEFAULT_TUNABLES.manifest_cache_size
    #: which version to serve: RELEASED's (HEAD's while the model has none), or HEAD's
    #: (`candidate`, every committed version); publisher/read/tracks.py.
    track: Track = "released"

    def __post_init__(self) -> None:
        for name in ("poll_timeout_s", "poll_head_after_s", "retry_initial_s", "retry_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.min_reconcile_interval_s < 0:
            raise ValueError("min_reconcile_interval_s must be >= 0")
        if self.retry_max_s < self.retry_initial_s:
            raise ValueError("retry_max_s must be >= retry_initial_s")


class Subscriber:
    """Follows one model's committed versions into a sink (see the module docstring).

    `store` and `bus` are URLs (opened here, closed by `close`) or objects the caller opened
    and closes. A store URL is opened read-only: a missing directory or bucket raises
    StoreMissingError at once; a store with no version yet is waited on.
    """

    def __init__(
        self,
        store: ObjectStore | str,
        model: str,
        sink: VersionSink,
        *,
        bus: AnnouncementSource | str | None = None,
        options: SubscriberOptions | None = None,
        observer: SubscriberObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options or SubscriberOptions()
        self.observer = observer or SubscriberObserver()
        self.sink = sink
        self._owned: list[Callable[[], None]] = []  # closed in reverse by `close`
        try:
            if isinstance(store, str):
                store = open_store(store, create=False)
                self._owned.append(store.close)
            self.store = store
            if isinstance(bus, str):
                bus = open_source(bus, start=self.options.bus_start)
                self._owned.append(bus.close)
            self.live = LiveModel(
                store,
                model,
                sink,
                observer=self.observer,
                manifest_cache_size=self.options.manifest_cache_size,
                track=self.options.track,
            )
            self._owned.append(self.live.close)
            self.follower = VersionFollower(
                self.live.catalog,
                bus,
                poll_head_after_s=self.options.poll_head_after_s,
                retry_after_error_s=self.options.retry_initial_s,
                min_reconcile_interval_s=self.options.min_reconcile_interval_s,
                target=self.live.target,
            )
        except BaseException:
            self._close_owned()
            raise
        self.model_name = self.live.model_name
        self.poll_timeout_s = self.options.poll_timeout_s
        self.retry_initial_s = self.options.retry_initial_s
        self.retry_max_s = self.options.retry_max_s
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._applied = threading.Condition()
        self._backoff = 0.0
        self._retry_at: float | None = None
        self.rejected = 0
        self.errors = 0
        self.last_error: str | None = None
        self._waiting_logged = False
        self._reading_started = False
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._closed = False

    # --- what is served --------------------------------------------------------------------------

    def reader(self) -> AbstractContextManager[ModelCopy]:
        """Borrow the served copy for one read (the sink's `reader`)."""
        return self.sink.reader()

    @property
    def version(self) -> int | None:
        """The version served now, if any."""
        return self.live.version

    @property
    def served(self) -> ServedVersion | None:
        return self.live.served

    @property
    def pinned(self) -> int | None:
        """The version pinned, or None while following."""
        return self.live.pinned

    def pin(self, version: int) -> ServedVersion:
        """Serve committed `version` (rebuilt from the store if needed) and stop following
        (NoVersionError if it is not committed; a bad version leaves the model as it was)."""
        return self.live.pin(version)

    def unpin(self) -> bool:
        """Follow again, catching up with HEAD at once; False if it was not pinned."""
        was = self.live.unpin()
        self.request_catch_up()
        return was

    def wait_for_version(self, version: int | None = None, timeout: float = 60.0) -> int:
        """Block until the served version is at least `version` (any version when None) and
        return it; TimeoutError after `timeout` seconds (the last error in its message)."""
        deadline = time.monotonic() + timeout
        with self._applied:
            while True:
                current = self.live.version
                if current is not None and (version is None or current >= version):
                    return current
                left = deadline - time.monotonic()
                if left <= 0 or self._thread_error is not None:
                    raise TimeoutError(
                        f"model {self.model_name}: serving v{current} after {timeout} s, waiting "
                        f"for {'a version' if version is None else f'v{version}'}"
                        + (f" (last error: {self.last_error})" if self.last_error else "")
                    )
                self._applied.wait(min(left, 0.5))

    # --- the loop ----------------------------------------------------------------------------

    def start(self) -> Subscriber:
        """Run `run()` on a background thread until `stop` or `close`; returns self."""
        if self._thread is not None:
            raise RuntimeError("this subscriber is already started")

        def target() -> None:
            try:
                self.run()
            except BaseException as exc:  # handed to `close`, never lost in the thread
                self._thread_error = exc
                log.exception("model %s: the subscriber thread failed", self.model_name)

        self._thread = threading.Thread(
            target=target, name=f"subscriber-{self.model_name}", daemon=True
        )
        self._thread.start()
        return self

    @property
    def following(self) -> bool:
        """True while `start`'s thread runs and has not been asked to stop (a health check:
        the loop survives every Exception, so it ends only when stopped or on a BaseException,
        which `close` re-raises)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self.stopped

    def close(self, timeout: float = 30.0) -> None:
        """Stop following, wait for the background thread (re-raising what it failed with),
        and close what this subscriber opened. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        self.live.interrupt()
        try:
            if self._thread is not None:
                self._thread.join(timeout)
                if self._thread.is_alive():
                    log.warning("model %s: the subscriber thread did not stop", self.model_name)
        finally:
            self._close_owned()
        if self._thread_error is not None:
            raise self._thread_error

    def _close_owned(self) -> None:
        while self._owned:
            close = self._owned.pop()
            try:
                close()
            except Exception:
                log.exception("closing %r failed", close)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stop(self) -> None:
        """Ask `run` to return (safe from any thread or a signal handler)."""
        self._stop.set()
        self._wake.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def request_catch_up(self) -> None:
        """Reconcile with HEAD at the next iteration (after an unpin)."""
        self._retry_at = self._clock()
        self._wake.set()

    def run(self, max_versions: int | None = None, timeout: float | None = None) -> list[int]:
        """Follow until stopped, `max_versions` versions applied, or `timeout` seconds passed.

        Returns the versions applied, in order (a bootstrap counts its whole chain).
        """
        deadline = None if timeout is None else self._clock() + timeout
        applied: list[int] = []
        while not self._stop.is_set():
            if max_versions is not None and len(applied) >= max_versions:
                break
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                break
            wait = self.poll_timeout_s if remaining is None else min(self.poll_timeout_s, remaining)
            step = self._step(wait)
            if step:
                applied += step
                with self._applied:
                    self._applied.notify_all()
        return applied

    # --- one iteration -------------------------------------------------------------------------

    def _step(self, wait: float) -> list[int]:
        try:
            if self.live.version is None:
                return self._bootstrap(wait)
            if self.live.pinned is not None:
                self._note_while_pinned(wait)
                return []
            if self._retry_at is not None and self._clock() >= self._retry_at:
                return self._guard_value(self.live.catch_up) or []
            return self._follow(wait)
        except ShuttingDownError:
            return []
        except Exception as exc:  # the loop must survive anything; _guard covers the usual
            self._failed("error", exc)
            self._sleep(wait)
            return []

    def _bootstrap(self, wait: float) -> list[int]:
        if self._retry_at is not None and self._clock() < self._retry_at:
            self._sleep(min(wait, self._retry_at - self._clock()))
            return []
        if not self._reading_started:
            # Before HEAD is read: announcements of versions committed after it then reach us.
            self._reading_started = True
            self.follower.start_reading()
        served = self._guard_value(self.live.bootstrap)
        if served is None:
            if self.live.version is None and self._retry_at is None:
                # Nothing committed yet (not a failure): look at HEAD again after a poll timeout.
                if not self._waiting_logged:
                    log.info("model %s: no committed version yet; waiting for one", self.model_name)
                    self._waiting_logged = True
                self._retry_at = self._clock() + self.poll_timeout_s
            self._sleep(wait)
            return []
        assert self.live.last_apply is not None
        return list(self.live.last_apply.versions)

    def _follow(self, wait: float) -> list[int]:
        refs = self.follower.poll(current=self.live.version, timeout_s=wait)
        planned_at = time.time()
        self._sync_follower_stats()
        self.live.note_known(refs)
        if not refs:
            return []
        if self._retry_at is not None:
            # Backing off after a rejection: these are reconciled from HEAD when it expires.
            return []
        applied: list[int] = []
        for ref in refs:
            try:
                applied += self.live.advance(
                    ref, heard_at=self.follower.heard_at, planned_at=planned_at
                )
            except PinnedError:
                break
            except BadDataError as exc:
                self._rejected(ref.version, exc)
                break
            except StoreError as exc:
                self._failed("store", exc)
                break
        else:
            self._succeeded()
        return applied

    def _note_while_pinned(self, wait: float) -> None:
        # Keep draining announcements so staleness (and HEAD) stay known; apply nothing.
        current = self.live.latest_known()
        refs = self.follower.poll(current=current, timeout_s=wait)
        self._sync_follower_stats()
        self.live.note_known(refs)

    # --- outcomes ----------------------------------------------------------------------------

    def _guard_value(self, action: Callable[[], _T]) -> _T | None:
        """`action()`, or None after recording a rejection or a store failure."""
        try:
            result = action()
        except PinnedError:
            return None
        except BadDataError as exc:
            self._rejected(None, exc)
            return None
        except StoreError as exc:
            self._failed("store", exc)
            return None
        self._succeeded()
        return result

    def _rejected(self, version: int | None, exc: BadDataError) -> None:
        reason = rejection_reason(exc)
        self.rejected += 1
        self.observer.rejected(reason)
        self.last_error = f"{type(exc).__name__}: {exc}"
        delay = self._next_delay()
        log.warning(
            "model %s: rejected %s (%s: %s); still serving v%s, retrying from HEAD in %.1f s",
            self.model_name,
            "a version" if version is None else f"v{version}",
            type(exc).__name__,
            exc,
            self.live.version,
            delay,
        )

    def _failed(self, kind: str, exc: BaseException) -> None:
        self.errors += 1
        self.observer.failed(kind)
        self.last_error = f"{type(exc).__name__}: {exc}"
        delay = self._next_delay()
        if kind == "store":
            log.warning(
                "model %s: store unavailable (%s); retrying in %.1f s",
                self.model_name,
                exc,
                delay,
            )
        else:
            log.exception(
                "model %s: follow loop error; retrying in %.1f s",
                self.model_name,
                delay,
                exc_info=exc,
            )

    def _next_delay(self) -> float:
        self._backoff = (
            self.retry_initial_s if self._backoff == 0 else min(self._backoff * 2, self.retry_max_s)
        )
        self._retry_at = self._clock() + self._backoff
        return self._backoff

    def _succeeded(self) -> None:
        self._backoff = 0.0
        self._retry_at = None

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._wake.wait(seconds)
        self._wake.clear()

    def _sync_follower_stats(self) -> None:
        self.observer.follower_stats(self.follower.stats)
