"""Follows one model's committed versions: announcements are hints, the store is the truth.

    follower = VersionFollower(Catalog(store, "movielens"), open_source(bus_url))
    while running:
        for ref in follower.poll(current=live.version, timeout_s=1.0):
            live.apply(ref)              # the caller verifies blobs and checks ref.manifest

`poll` returns the committed versions to apply on top of `current`, in order. On the default
`released` track (publisher/read/tracks.py) of a model with a release gate the target is
RELEASED's version: any announcement of the model, a commit or a move of RELEASED, is a hint to
read RELEASED again (rate-limited as below), and the plan leads there, forward or back. Without
a RELEASED (no gate), and on the `candidate` track, the target is HEAD:

- An announcement whose parent is `current` is the fast path: its manifest is read, checked to
  be the one HEAD names (so it is committed, not an orphan of a crashed writer) and returned.
- Anything else newer than `current` means messages were missed (the bus lost them, the server
  started late, the topic was recreated): the follower reconciles from the store, reading HEAD
  and planning from `current` to it with `publisher.read.planner.plan_versions`: HEAD's restore
  chain (its full baseline, then the deltas its `applies_to` links lead through) without the
  part `current` already holds. So the plan starts at a full newer than `current` if there is
  one, is only HEAD for a one-shot HEAD, and is the whole chain when `current` is not in HEAD's
  lineage. Each delta in it is valid on top of the state before it (docs/FORMAT.md section 3).
- With `current=None` (nothing applied yet) the plan is what restoring HEAD reads: its full
  baseline, then the deltas its `applies_to` links lead through.
- When no announcement of this model arrives for `poll_head_after_s` seconds, HEAD is polled
  directly, so a dead bus only delays updates. The first poll reads HEAD at once.
- Store reads caused by announcements are rate-limited, since anyone who can write to the bus
  can forge them (2,000 junk gaps made 2,002 reconciles; 2,000 junk in-order announcements
  made 2,000 HEAD reads). Every reconcile (a gap, or HEAD ahead of an in-order announcement)
  runs at most once per `min_reconcile_interval_s`: within it an announcement only marks a
  reconcile wanted (`stats.coalesced`), and one reconcile runs when the interval ends. The fast
  path reads HEAD for the first in-order announcement on top of each `current`; more on the
  same `current` within the interval reuse that read (`stats.coalesced`). So a flood costs a
  few reads per interval, and a genuine next version is applied at once unless a forgery on
  top of the same version came first (then the HEAD retry poll, `retry_after_error_s`, or the
  wanted reconcile brings it).

Messages are hostile input (docs/FORMAT.md section 6): each is size-capped and validated, and a
bad one is dropped, logged and counted in `stats.ignored` by reason; nothing about a message, and
no store failure, ever raises out of `poll`. Store failures are logged and retried on a later
poll (`retry_after_error_s`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Final

from publisher.bus.base import AnnouncementSource
from publisher.read.catalog import Catalog, VersionRef
from publisher.read.planner import plan_versions
from publisher.read.tracks import TrackTarget
from schemas import strict_json
from schemas.announcement import MAX_ANNOUNCEMENT_BYTES, Announcement
from schemas.errors import AnnouncementError, CheckNRunError, ManifestError
from schemas.manifest import Head
from schemas.store_keys import check_key, is_manifest_key

log = logging.getLogger(__name__)

#: why a message was ignored, the keys of `FollowerStats.ignored`.
OVERSIZED: Final = "oversized"  # longer than max_message_bytes
BAD_JSON: Final = "bad_json"  # not strict UTF-8 JSON (schemas/strict_json.py), or not an object
UNKNOWN_SCHEMA: Final = "unknown_schema"  # schema_version is not 1
OTHER_MODEL: Final = "other_model"  # an announcement of another model (normal on a shared bus)
BAD_KEY: Final = "bad_key"  # manifest_key outside MODEL/manifests/, or unsafe
INVALID: Final = "invalid"  # any other schema violation
OLD: Final = "old"  # version <= current: a duplicate or a late message
OTHER_TRACK: Final = "other_track"  # a move of RELEASED, to a follower of HEAD
UNCOMMITTED: Final = "uncommitted"  # HEAD does not (yet) reach the announced manifest
MISMATCH: Final = "mismatch"  # the manifest at manifest_key disagrees with the announcement
REASONS: Final = (
    OVERSIZED,
    BAD_JSON,
    UNKNOWN_SCHEMA,
    OTHER_MODEL,
    BAD_KEY,
    INVALID,
    OLD,
    OTHER_TRACK,
    UNCOMMITTED,
    MISMATCH,
)

#: what reading the store may raise (any checknrun error, or the disk's); all of it is retried
#: later, never raised out of poll.
_STORE_FAILURES = (CheckNRunError, OSError)


@dataclass
class FollowerStats:
    """Counters of what the follower received and did."""

    received: int = 0  # raw messages taken from the source
    applied_candidates: int = 0  # versions returned by poll
    reconciles: int = 0  # catch-ups from the store because announcements had a gap
    #: announcements answered without a store read of their own: folded into a reconcile made
    #: or wanted, or checked against a HEAD read reused from earlier in the interval.
    coalesced: int = 0
    head_polls: int = 0  # HEAD reads on the timer (first poll, silence, retry after an error)
    store_errors: int = 0  # store reads that failed (retried later)
    ignored: dict[str, int] = field(default_factory=dict)  # by reason (see REASONS)

    @property
    def ignored_total(self) -> int:
        return sum(self.ignored.values())


class VersionFollower:
    """Turns announcements (or, without them, HEAD polls) into the versions a replica applies."""

    def __init__(
        self,
        catalog: Catalog,
        source: AnnouncementSource | None,
        *,
        poll_head_after_s: float = 5.0,
        max_message_bytes: int = MAX_ANNOUNCEMENT_BYTES,
        retry_after_error_s: float = 1.0,
        min_reconcile_interval_s: float = 1.0,
        target: TrackTarget | None = None,
    ) -> None:
        """`target`: the track followed (default: released, publisher/read/tracks.py)."""
        self.catalog = catalog
        self.target = target or TrackTarget(catalog)
        self.model = catalog.model
        self.source = source
        self.poll_head_after_s = poll_head_after_s
        self.max_message_bytes = max_message_bytes
        self.retry_after_error_s = retry_after_error_s
        self.min_reconcile_interval_s = min_reconcile_interval_s
        self.stats = FollowerStats()
        self._next_head_poll = 0.0  # the first poll reads HEAD at once
        self._reconciled_at = float("-inf")  # when the last reconcile started (monotonic)
        self._reconcile_wanted = False  # an announcement came while reconciles were limited
        self._fast_head: _HeadRead | None = None  # the fast path's last HEAD read
        #: wall-clock time (unix s) the versions the last poll returned became known: when
        #: their announcement came off the source, or when the HEAD read that found them began.
        self.heard_at: float | None = None

    def poll(self, current: int | None, timeout_s: float) -> list[VersionRef]:
        """Committed versions newer than `current` to apply, in order; [] after `timeout_s`.

        Returns as soon as there is something to apply. Never raises for bad messages or store
        failures (see the module docstring).
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            refs = self._step(current, deadline)
            if refs:
                self.stats.applied_candidates += len(refs)
                return refs
            if time.monotonic() >= deadline:
                return []

    def start_reading(self, timeout_s: float = 5.0) -> bool:
        """Fix the source's start before a bootstrap reads HEAD (see AnnouncementSource)."""
        if self.source is None:
            return True
        try:
            return self.source.start_reading(timeout_s)
        except Exception:
            log.exception("announcement source %r failed; relying on HEAD polls", self.source)
            return False

    def close(self) -> None:
        """Close the source."""
        if self.source is not None:
            self.source.close()

    # --- one round ---------------------------------------------------------------------------

    def _step(self, current: int | None, deadline: float) -> list[VersionRef]:
        now = time.monotonic()
        wanted_due = self._reconcile_wanted and now >= self._reconcile_allowed_at()
        if wanted_due or now >= self._next_head_poll:
            if wanted_due:
                self.stats.reconciles += 1
                self._reconciled_at = now
            else:
                self.stats.head_polls += 1
            self._reconcile_wanted = False  # HEAD is read now, whichever asked
            self._next_head_poll = now + self.poll_head_after_s
            self.heard_at = time.time()
            refs = self._guarded(partial(self._reconcile, current), "polling HEAD")
            if refs:
                return refs
        wake = self._next_head_poll
        if self._reconcile_wanted:
            wake = min(wake, self._reconcile_allowed_at())
        wait = max(0.0, min(deadline, wake) - time.monotonic())
        if self.source is None:
            time.sleep(wait)
            return []
        try:
            raw = self.source.poll(wait)
        except Exception:
            # Sources promise not to raise; if one does anyway, HEAD polling must go on.
            log.exception("announcement source %r failed; relying on HEAD polls", self.source)
            time.sleep(wait)
            return []
        if raw:
            self.heard_at = time.time()
        return self._handle(raw, current)

    def _handle(self, raw: list[bytes], current: int | None) -> list[VersionRef]:
        refs: list[VersionRef] = []
        cur = current
        for data in raw:
            self.stats.received += 1
            announcement = self._validate(data)
            if announcement is None:
                continue
            # Announcements of this model arrive: no need to poll HEAD for a while.
            self._next_head_poll = time.monotonic() + self.poll_head_after_s
            if self.target.track == "released" and (
                announcement.track == "released" or self.target.gated
            ):
                # A move of RELEASED (forward or back), or a commit of a gated model: read
                # RELEASED again, at most once per interval, whatever the message says.
                got = self._guarded(partial(self._gated_reconcile, cur), "following")
                if got is None:
                    break
                if got:
                    refs.extend(got)
                    cur = got[-1].version
                continue
            if announcement.track != "head":
                self._ignore(OTHER_TRACK, f"a move of RELEASED to v{announcement.version}")
                continue
            if cur is not None and announcement.version <= cur:
                self._ignore(OLD, f"version {announcement.version} <= current {cur}")
                continue
            got = self._guarded(partial(self._follow, announcement, cur), "following")
            if got is None:
                break  # the store is failing: the next HEAD poll retries, the rest are hints
            if got:
                refs.extend(got)
                cur = got[-1].version
        return refs

    def _guarded(self, read: Callable[[], list[VersionRef]], what: str) -> list[VersionRef] | None:
        """`read()`, or None (logged, counted, retried soon) if the store fails."""
        try:
            return read()
        except _STORE_FAILURES as exc:
            self.stats.store_errors += 1
            self._next_head_poll = min(
                self._next_head_poll, time.monotonic() + self.retry_after_error_s
            )
            log.warning(
                "%s %s: store read failed (%s: %s); retrying in %.1f s",
                what,
                self.model,
                type(exc).__name__,
                exc,
                self.retry_after_error_s,
            )
            return None

    # --- the two paths -----------------------------------------------------------------------

    def _follow(self, announcement: Announcement, current: int | None) -> list[VersionRef]:
        """The versions an announcement newer than `current` leads to."""
        if current is None or announcement.parent != current:
            return self._gated_reconcile(current)
        head = self._head_for(current)
        if head is None or head.version < announcement.version:
            # Announced before HEAD shows it (a lagging replica of the store) or never
            # committed at all: HEAD polls pick it up if and when it is.
            self._ignore(UNCOMMITTED, _describe(announcement, head))
            self._next_head_poll = min(
                self._next_head_poll, time.monotonic() + self.retry_after_error_s
            )
            return []
        if head.version == announcement.version and head.manifest != announcement.manifest_key:
            # Same number, another manifest: the announced one is a losing writer's orphan;
            # the committed one is read by the catch-up below.
            self._ignore(UNCOMMITTED, _describe(announcement, head))
        if head.version > announcement.version or head.manifest != announcement.manifest_key:
            return self._gated_reconcile(current, head)
        manifest = self.catalog.manifest(announcement.manifest_key)
        if (
            manifest.version != announcement.version
            or manifest.parent != announcement.parent
            or manifest.kind != announcement.kind
        ):
            self._ignore(
                MISMATCH,
                f"{announcement.manifest_key} holds version {manifest.version} (parent "
                f"{manifest.parent}, {manifest.kind}), the announcement says "
                f"{announcement.version} (parent {announcement.parent}, {announcement.kind})",
            )
            return []
        # The announced version's parent is `current`: the planner settles this without a read.
        return plan_versions(self.catalog, current, VersionRef(manifest, announcement.manifest_key))

    def _gated_reconcile(self, current: int | None, head: Head | None = None) -> list[VersionRef]:
        """`_reconcile`, or, within `min_reconcile_interval_s` of the last one, a reconcile
        marked wanted (run by `_step` when the interval ends) and nothing read now."""
        now = time.monotonic()
        if now < self._reconcile_allowed_at():
            self.stats.coalesced += 1
            self._reconcile_wanted = True
            return []
        self.stats.reconciles += 1
        self._reconciled_at = now
        return self._reconcile(current, head)

    def _reconcile_allowed_at(self) -> float:
        return self._reconciled_at + self.min_reconcile_interval_s

    def _head_for(self, current: int) -> Head | None:
        """HEAD for an in-order announcement on top of `current`: read from the store, or the
        fast path's read on top of the same `current` if it is younger than the interval.

        Reads made by reconciles are not reused: the next version may have been committed
        since a gap reconcile, and it must still be applied at once.
        """
        now = time.monotonic()
        last = self._fast_head
        if (
            last is not None
            and last.current == current
            and now < last.read_at + self.min_reconcile_interval_s
        ):
            self.stats.coalesced += 1
            return last.head
        head = self.catalog.head()
        self._fast_head = _HeadRead(now, current, head)
        return head

    def _reconcile(self, current: int | None, head: Head | None = None) -> list[VersionRef]:
        """The plan from `current` to the track's version (HEAD: `head` if already read; or
        RELEASED), read from the store."""
        released = self.target.released()
        if released is not None:
            if not self.target.wants(released.version, current):
                return []
            return plan_versions(self.catalog, current, released)
        latest = self.catalog.latest() if head is None else self.catalog.at_head(head)
        if latest is None:
            return []
        if current is not None and latest.version <= current:
            if latest.version < current:
                log.warning(
                    "HEAD of %s is version %d, behind the applied version %d: was the store "
                    "rolled back? keeping the current version",
                    self.model,
                    latest.version,
                    current,
                )
            return []
        return plan_versions(self.catalog, current, latest)

    # --- validation --------------------------------------------------------------------------

    def _validate(self, data: bytes) -> Announcement | None:
        """The announcement in `data` if it is a valid one of this model, else None (counted)."""
        if len(data) > self.max_message_bytes:
            self._ignore(OVERSIZED, f"{len(data)} bytes > {self.max_message_bytes}")
            return None
        try:
            obj = strict_json.loads(data, AnnouncementError, "announcement")
        except AnnouncementError as exc:
            self._ignore(BAD_JSON, str(exc)[:200])
            return None
        if not isinstance(obj, dict):
            self._ignore(BAD_JSON, f"a JSON {type(obj).__name__}, not an object")
            return None
        schema = obj.get("schema_version")
        if type(schema) is not int or schema != 1:  # `type` check: True == 1 in Python
            self._ignore(UNKNOWN_SCHEMA, f"schema_version {schema!r}")
            return None
        if obj.get("model") != self.model:
            self._ignore(OTHER_MODEL, f"model {str(obj.get('model'))[:140]!r}")
            return None
        key = obj.get("manifest_key")
        if not self._own_manifest_key(key):
            self._ignore(BAD_KEY, f"manifest_key {str(key)[:300]!r}")
            return None
        try:
            return Announcement.from_json(data)
        except AnnouncementError as exc:
            self._ignore(INVALID, str(exc)[:300])
            return None

    def _own_manifest_key(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        if not is_manifest_key(self.model, key):
            return False
        try:
            check_key(self.model, key)
        except ManifestError:
            return False
        return True

    def _ignore(self, reason: str, detail: str) -> None:
        count = self.stats.ignored.get(reason, 0) + 1
        self.stats.ignored[reason] = count
        # Logged at 1, 2, 4, 8... per reason: a flood of junk cannot flood the log. Other
        # models' messages and duplicates are routine on a shared bus, not worth a warning.
        if count & (count - 1) == 0:
            log.log(
                logging.DEBUG if reason in (OTHER_MODEL, OLD, OTHER_TRACK) else logging.WARNING,
                "ignored announcement for %s (%s, %d so far): %s",
                self.model,
                reason,
                count,
                detail,
            )


@dataclass(frozen=True)
class _HeadRead:
    """HEAD as the fast path read it, when (monotonic) and on top of which applied version."""

    read_at: float
    current: int
    head: Head | None


def _describe(announcement: Announcement, head: Head | None) -> str:
    where = "no HEAD" if head is None else f"HEAD is {head.version} at {head.manifest}"
    return f"version {announcement.version} at {announcement.manifest_key}; {where}"
