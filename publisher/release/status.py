"""What the release gate did with each version, for a person (`checknrun ls`, the status page).

    statuses = release_statuses(ReleaseLog(store, "movielens"), [1, 2, 3])
    statuses[3].status, statuses[3].reason      # ("held", "worse than v2: AUC -0.0120 [...]")

A version's status, from the release records (newest first) and its evaluation:

    released      RELEASED names it now
    superseded    it was released, and a later release replaced it
    rolled_back   it was released, then a rollback moved RELEASED away from it
    held          its evaluation held it (the reason says which check)
    passed        its evaluation passed, but RELEASED never moved to it (a crash between the two,
                  or a person moved RELEASED first)
    pending       not judged yet (its window has not closed), or never (the trainer stopped)
    unreadable    its evaluation cannot be read (named; the others are listed all the same)
    -             the model has no gate: no RELEASED and no evaluation
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from publisher.release.log import ReleaseLog
from schemas.errors import BadDataError
from schemas.release import Evaluation, ReleaseRecord

Status = Literal[
    "released", "superseded", "rolled_back", "held", "passed", "pending", "unreadable", "-"
]


@dataclass(frozen=True)
class VersionRelease:
    """One version's status and why (`reason`: the gate's or a person's words)."""

    status: Status
    reason: str | None = None
    #: "gate" or "person", for a version RELEASED named at some point.
    by: str | None = None
    #: when RELEASED moved to it, or away from it in a rollback.
    at: datetime | None = None
    evaluation: Evaluation | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "status": self.status,
            "reason": self.reason,
            "by": self.by,
            "at": None if self.at is None else self.at.isoformat(),
            "decision": None if self.evaluation is None else self.evaluation.decision,
            "baseline": None if self.evaluation is None else self.evaluation.baseline,
        }


def release_statuses(
    log: ReleaseLog, versions: Iterable[int], records: Sequence[ReleaseRecord] | None = None
) -> dict[int, VersionRelease]:
    """Each of `versions`' status (see the module docstring); `records`: the log's, newest
    first, when the caller has read them already."""
    wanted = sorted(set(versions))
    records = list(log.records()) if records is None else records
    latest = records[0] if records else None
    current = None if latest is None else latest.version
    released: dict[int, ReleaseRecord] = {}  # the latest record that released each version
    rolled_back: dict[int, ReleaseRecord] = {}  # the rollback that moved RELEASED away from it
    for record in reversed(records):  # oldest first
        if record.action == "rollback" and record.previous_version is not None:
            rolled_back[record.previous_version] = record
        if record.action == "release":
            released[record.version] = record
            rolled_back.pop(record.version, None)
    since = min(wanted, default=1) - 1
    evaluated = set(log.evaluated_versions(since))
    gated = current is not None or bool(evaluated)
    out: dict[int, VersionRelease] = {}
    for version in wanted:
        evaluation, unreadable = None, None
        if version in evaluated:
            try:
                evaluation = log.evaluation(version)
            except BadDataError as exc:  # named, and the other versions listed all the same
                unreadable = f"unreadable evaluation: {type(exc).__name__}: {exc}"
        status = _status(version, latest, released, rolled_back, evaluation, gated)
        if unreadable is not None and status.status in ("pending", "-"):
            status = VersionRelease("unreadable", unreadable)
        out[version] = status
    return out


def _status(
    version: int,
    latest: ReleaseRecord | None,
    released: dict[int, ReleaseRecord],
    rolled_back: dict[int, ReleaseRecord],
    evaluation: Evaluation | None,
    gated: bool,
) -> VersionRelease:
    record = released.get(version)
    if latest is not None and version == latest.version:
        # Why it is served now: the move that made it so (a release, or a rollback to it).
        return VersionRelease("released", latest.reason, latest.by, latest.created_at, evaluation)
    if version in rolled_back:
        back = rolled_back[version]
        return VersionRelease("rolled_back", back.reason, back.by, back.created_at, evaluation)
    if record is not None:
        return VersionRelease("superseded", record.reason, record.by, record.created_at, evaluation)
    if evaluation is not None:
        status: Status = "held" if evaluation.decision == "hold" else "passed"
        return VersionRelease(status, evaluation.reason, evaluation=evaluation)
    return VersionRelease("pending" if gated else "-")


@dataclass(frozen=True)
class HistoryRow:
    """One committed version as the status page shows it."""

    version: int
    kind: str
    created_at: datetime
    samples_seen: int
    release: VersionRelease


@dataclass(frozen=True)
class ReleaseHistory:
    """The newest committed versions, oldest first, with their release status; HEAD and
    RELEASED (None: no gate)."""

    model: str
    head: int | None
    released: int | None
    rows: list[HistoryRow]

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "head": self.head,
            "released": self.released,
            "versions": [
                {
                    "version": r.version,
                    "kind": r.kind,
                    "created_at": r.created_at.isoformat(),
                    "samples_seen": r.samples_seen,
                    "release": r.release.to_json(),
                    "evaluation": None
                    if r.release.evaluation is None
                    else r.release.evaluation.model_dump(mode="json"),
                }
                for r in self.rows
            ],
        }


def release_history(log: ReleaseLog, last: int = 60) -> ReleaseHistory:
    """The newest `last` committed versions and what the gate did with each (one walk of
    HEAD's chain, the release records, and the versions' evaluations)."""
    head = log.catalog.head()
    if head is None:
        return ReleaseHistory(log.model, None, None, [])
    refs = log.catalog.history(since=max(0, head.version - last)).versions
    records = list(log.records())
    statuses = release_statuses(log, [r.version for r in refs], records)
    rows = [
        HistoryRow(
            r.version,
            r.manifest.kind,
            r.manifest.created_at,
            r.manifest.position.samples_seen,
            statuses[r.version],
        )
        for r in refs
    ]
    return ReleaseHistory(log.model, head.version, records[0].version if records else None, rows)
