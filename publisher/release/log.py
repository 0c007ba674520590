"""RELEASED, its records and the versions' evaluations in a store (docs/FORMAT.md section 9).

    log = ReleaseLog(store, "movielens")
    pointer = log.released()                       # None: no gate yet (the fleet follows HEAD)
    log.move(ref, action="release", by="gate", reason="passed: AUC +0.0012 [...]")
    log.write_evaluation(evaluation)               # once per version; a second write is refused
    for record in log.records(): ...               # newest first, from RELEASED's record back

Moving RELEASED follows HEAD's protocol: the record first (under this log's token), then the
pointer by compare-and-swap on its ETag, so a crash leaves at most an orphan record nothing
reaches. The version moved to must be committed (reachable from HEAD): `move` checks it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from publisher.read.catalog import Catalog, VersionRef
from publisher.store import NotFoundError, ObjectStore, PreconditionFailedError
from schemas.errors import BadDataError, ConflictError
from schemas.manifest import utc_now
from schemas.release import (
    MAX_REASON_CHARS,
    MAX_RELEASE_BYTES,
    Action,
    Evaluation,
    Mover,
    Released,
    ReleaseFormatError,
    ReleaseRecord,
)
from schemas.store_keys import (
    evaluation_key,
    evaluations_prefix,
    key_version_in,
    release_record_key,
    released_key,
)

log = logging.getLogger(__name__)


class ReleaseError(BadDataError):
    """A release or rollback that cannot be made as asked: a version that is not committed,
    nothing to roll back to."""


class ReleaseConflictError(ConflictError):
    """RELEASED moved while this mover meant to move it (another gate, or a person)."""


@dataclass(frozen=True)
class ReleasedRef:
    """RELEASED as read: the pointer, its ETag (what a move swaps against) and its record."""

    pointer: Released
    etag: str
    record: ReleaseRecord

    @property
    def version(self) -> int:
        return self.pointer.version


class ReleaseLog:
    """One model's release pointer, records and evaluations in `store`."""

    def __init__(self, store: ObjectStore, model: str, catalog: Catalog | None = None) -> None:
        self.store = store
        self.catalog = catalog or Catalog(store, model)
        self.model = self.catalog.model
        #: this mover's token, in the keys of the records it writes.
        self.token = uuid.uuid4().hex[:16]

    # --- reading ------------------------------------------------------------------------------

    def released(self) -> ReleasedRef | None:
        """RELEASED and its record; None when the model has none (no gate: HEAD is served)."""
        try:
            data, etag = self.store.get_with_etag(released_key(self.model), MAX_RELEASE_BYTES)
        except NotFoundError:
            return None
        pointer = Released.from_json(data)
        self._check_model(pointer.model, "RELEASED")
        record = self.record(pointer.record)
        if (record.sequence, record.version, record.manifest) != (
            pointer.sequence,
            pointer.version,
            pointer.manifest,
        ):
            raise ReleaseFormatError(
                f"RELEASED names v{pointer.version} (sequence {pointer.sequence}) but its record "
                f"{pointer.record} holds v{record.version} (sequence {record.sequence})"
            )
        return ReleasedRef(pointer, etag, record)

    def released_version(self) -> VersionRef | None:
        """The manifest RELEASED names, read and checked; None without RELEASED."""
        current = self.released()
        if current is None:
            return None
        manifest = self.catalog.manifest(current.pointer.manifest)
        if manifest.version != current.version:
            raise ReleaseFormatError(
                f"RELEASED says v{current.version} but {current.pointer.manifest} holds "
                f"v{manifest.version}"
            )
        return VersionRef(manifest, current.pointer.manifest)

    def record(self, key: str) -> ReleaseRecord:
        record = ReleaseRecord.from_json(self.store.get(key, MAX_RELEASE_BYTES))
        self._check_model(record.model, key)
        return record

    def records(self, limit: int | None = None) -> Iterator[ReleaseRecord]:
        """The release records, newest first, from RELEASED's back through `previous` links (at
        most `limit`); a record gone or unreadable ends the walk (logged)."""
        current = self.released()
        if current is None:
            return
        record: ReleaseRecord | None = current.record
        count = 0
        while record is not None and (limit is None or count < limit):
            yield record
            count += 1
            if record.previous is None:
                return
            try:
                older = self.record(record.previous)
            except (NotFoundError, BadDataError) as exc:
                log.warning("release records of %s end at %s: %s", self.model, record.previous, exc)
                return
            if older.sequence != record.sequence - 1:
                log.warning(
                    "release record %d names %s, which holds sequence %d; the walk stops there",
                    record.sequence,
                    record.previous,
                    older.sequence,
                )
                return
            record = older

    def evaluation(self, version: int) -> Evaluation | None:
        """Version `version`'s evaluation, or None when it has none (yet)."""
        try:
            data = self.store.get(evaluation_key(self.model, version), MAX_RELEASE_BYTES)
        except NotFoundError:
            return None
        evaluation = Evaluation.from_json(data)
        self._check_model(evaluation.model, f"evaluation of v{version}")
        if evaluation.version != version:
            raise ReleaseFormatError(f"the evaluation of v{version} holds v{evaluation.version}'s")
        return evaluation

    def evaluated_versions(self, since: int = 0) -> list[int]:
        """The versions newer than `since` that have an evaluation, oldest first."""
        found = []
        for info in self.store.list(evaluations_prefix(self.model)):
            version = key_version_in(evaluations_prefix(self.model), info.key)
            if version is not None and version > since:
                found.append(version)
        return sorted(found)

    # --- writing ------------------------------------------------------------------------------

    def write_evaluation(self, evaluation: Evaluation) -> bool:
        """Write `evaluation` if the version has none; False (nothing written) if it has."""
        if evaluation.model != self.model:
            raise ValueError(f"an evaluation of {evaluation.model!r} in {self.model!r}'s log")
        try:
            self.store.put_if(
                evaluation_key(self.model, evaluation.version), evaluation.to_json(), etag=None
            )
        except PreconditionFailedError:
            return False
        return True

    def move(
        self,
        target: VersionRef,
        *,
        action: Action,
        by: Mover,
        reason: str,
        expected: ReleasedRef | Literal["read"] | None = "read",
    ) -> ReleasedRef:
        """Move RELEASED to committed version `target` (docs/FORMAT.md 9.1): the record, then the
        pointer by compare-and-swap. `expected`: the RELEASED this move replaces, as read
        earlier (None: none), or "read" to read it now. ReleaseConflictError if it moved since;
        ReleaseError if `target` is not committed."""
        self._check_committed(target)
        current = self.released() if expected == "read" else expected
        sequence = 1 if current is None else current.pointer.sequence + 1
        record = ReleaseRecord(
            model=self.model,
            sequence=sequence,
            version=target.version,
            manifest=target.key,
            action=action,
            by=by,
            reason=_short(reason),
            previous=None if current is None else current.pointer.record,
            previous_version=None if current is None else current.version,
            created_at=utc_now(),
        )
        key = release_record_key(self.model, sequence, self.token)
        self.store.put(key, record.to_json())
        pointer = Released(
            model=self.model,
            version=target.version,
            manifest=target.key,
            sequence=sequence,
            record=key,
        )
        try:
            etag = self.store.put_if(
                released_key(self.model),
                pointer.to_json(),
                etag=None if current is None else current.etag,
            )
        except PreconditionFailedError as exc:
            raise ReleaseConflictError(
                f"RELEASED of {self.model!r} moved while moving it to v{target.version}: "
                "another gate, or a person, moved it first"
            ) from exc
        # The gate's releases are on the trainer's published lines; a rollback is news.
        log.log(
            logging.WARNING if action == "rollback" else logging.DEBUG,
            "model %s: RELEASED %s v%d (%s by the %s: %s)",
            self.model,
            "rolled back to" if action == "rollback" else "moved to",
            target.version,
            action,
            by,
            record.reason,
        )
        return ReleasedRef(pointer, etag, record)

    def last_good(self, before: ReleasedRef | None = None) -> int | None:
        """The version a rollback from RELEASED (or `before`) returns to: the newest version
        released before it that was not rolled back itself; None if there is none."""
        rolled_back: set[int] = set()
        current = before if before is not None else self.released()
        if current is None:
            return None
        seen_current = False
        for record in self.records():
            if record.action == "rollback" and record.previous_version is not None:
                rolled_back.add(record.previous_version)
            if not seen_current:
                seen_current = True  # the current release itself
                continue
            if record.version != current.version and record.version not in rolled_back:
                return record.version
        return None

    def _check_committed(self, target: VersionRef) -> None:
        head = self.catalog.latest()
        if head is None or target.version > head.version:
            raise ReleaseError(
                f"v{target.version} of {self.model!r} is not committed (HEAD is "
                f"{'absent' if head is None else f'v{head.version}'})"
            )
        committed = self.catalog.find(target.version)
        if committed.key != target.key:
            raise ReleaseError(
                f"{target.key} is not the committed v{target.version} ({committed.key} is)"
            )

    def _check_model(self, model: str, what: str) -> None:
        if model != self.model:
            raise ReleaseFormatError(f"{what} names model {model!r}, expected {self.model!r}")


def _short(reason: str) -> str:
    """A reason within the format's 1024 characters (cut, marked)."""
    reason = " ".join(reason.split()) or "-"
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    return reason[: MAX_REASON_CHARS - 3] + "..."
