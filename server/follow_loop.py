"""The consumer loop: bootstrap, then turn the follower's versions into served versions.

    loop = FollowLoop(live, follower, metrics=metrics)
    applied = loop.run(max_messages=3, timeout=10.0)   # tests: bounded
    loop.run()                                          # the server's background thread
    loop.stop()                                         # from anywhere: only sets an event

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
  the same way; nothing escapes `run` except KeyboardInterrupt/SystemExit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from publisher.codecs import CodecError
from publisher.id_map import IdMapError
from publisher.memory_budget import MemoryBudgetError
from publisher.read.follower import VersionFollower
from publisher.store import IntegrityError, StoreError
from schemas.errors import BadDataError, FormatError
from server.errors import ApplyError, NonFiniteError, PinnedError, ShuttingDownError
from server.live_model import LiveModel
from server.metrics import ServerMetrics

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


class FollowLoop:
    """Bootstraps the live model, then follows new versions until stopped."""

    def __init__(
        self,
        live: LiveModel,
        follower: VersionFollower,
        *,
        metrics: ServerMetrics | None = None,
        poll_timeout_s: float = 1.0,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.live = live
        self.follower = follower
        self.metrics = metrics or live.metrics
        self.poll_timeout_s = poll_timeout_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._backoff = 0.0
        self._retry_at: float | None = None
        self.rejected = 0
        self.errors = 0
        self.last_error: str | None = None
        self._waiting_logged = False
        self._reading_started = False

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

    def run(self, max_messages: int | None = None, timeout: float | None = None) -> list[int]:
        """Follow until stopped, `max_messages` versions applied, or `timeout` seconds passed.

        Returns the versions applied, in order (a bootstrap counts its whole chain).
        """
        deadline = None if timeout is None else self._clock() + timeout
        applied: list[int] = []
        while not self._stop.is_set():
            if max_messages is not None and len(applied) >= max_messages:
                break
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                break
            wait = self.poll_timeout_s if remaining is None else min(self.poll_timeout_s, remaining)
            applied += self._step(wait)
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
                    log.info(
                        "model %s: no committed version yet; waiting for one", self.live.model_name
                    )
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
        self.metrics.rejected.inc(labels=[reason])
        self.last_error = f"{type(exc).__name__}: {exc}"
        delay = self._next_delay()
        log.warning(
            "model %s: rejected %s (%s: %s); still serving v%s, retrying from HEAD in %.1f s",
            self.live.model_name,
            "a version" if version is None else f"v{version}",
            type(exc).__name__,
            exc,
            self.live.version,
            delay,
        )

    def _failed(self, kind: str, exc: BaseException) -> None:
        self.errors += 1
        self.metrics.follow_errors.inc(labels=[kind])
        self.last_error = f"{type(exc).__name__}: {exc}"
        delay = self._next_delay()
        if kind == "store":
            log.warning(
                "model %s: store unavailable (%s); retrying in %.1f s",
                self.live.model_name,
                exc,
                delay,
            )
        else:
            log.exception(
                "model %s: follow loop error; retrying in %.1f s",
                self.live.model_name,
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
        stats = self.follower.stats
        counts = {f"ignored_{k}": v for k, v in stats.ignored.items()}
        counts.update(
            received=stats.received,
            reconciles=stats.reconciles,
            coalesced=stats.coalesced,
            head_polls=stats.head_polls,
            store_errors=stats.store_errors,
        )
        for reason, value in counts.items():
            seen = self.metrics.follower_events.value(labels=[reason])
            if value > seen:
                self.metrics.follower_events.inc(value - seen, labels=[reason])
