"""Which committed version a follower serves: its track (docs/FORMAT.md 9.4).

    target = TrackTarget(catalog, "released")
    ref = target.read()          # RELEASED's version; HEAD's while the model has no RELEASED

- `released` (the default): the version RELEASED names, which the release gate (or a person)
  moves forward or back; a model that has never had a RELEASED is served at HEAD, as before the
  gate existed, unless its versions say a gate judges them (`release_gate` in the manifest's
  metrics): then nothing is served until the gate releases a version.
- `candidate`: HEAD's, every committed version as it comes (a slice of the fleet serving
  candidates before they are released).

A released follower's target may move back (a rollback), so "newer than what I serve" is not
its test: "not what I serve" is (`moves_back`).
"""

from __future__ import annotations

from typing import Final, Literal

from publisher.read.catalog import Catalog, VersionRef
from publisher.release.log import ReleaseLog
from schemas.release import RELEASE_GATE_METRIC

Track = Literal["released", "candidate"]
TRACKS: Final[tuple[Track, ...]] = ("released", "candidate")


class TrackTarget:
    """The committed version a track serves, read from the store."""

    def __init__(self, catalog: Catalog, track: Track = "released") -> None:
        if track not in TRACKS:
            raise ValueError(f"track {track!r} unknown, expected one of {TRACKS}")
        self.catalog = catalog
        self.track: Track = track
        self._releases = ReleaseLog(catalog.store, catalog.model, catalog)
        #: the last read found a RELEASED: the model has a gate, whose target may move back.
        self.gated = False

    @property
    def moves_back(self) -> bool:
        """Whether the target may be older than the version served (a rollback)."""
        return self.track == "released" and self.gated

    def released(self) -> VersionRef | None:
        """RELEASED's version on the released track (None: the candidate track, or a model
        without RELEASED, whose released track is HEAD)."""
        if self.track != "released":
            return None
        found = self._releases.released_version()
        self.gated = found is not None
        return found

    def read(self) -> VersionRef | None:
        """The version to serve now; None when nothing is committed, or (released track) when
        the model's versions are judged by a release gate that has released none yet."""
        released = self.released()
        if released is not None:
            return released
        head = self.catalog.latest()
        if (
            head is not None
            and self.track == "released"
            and head.manifest.metrics.get(RELEASE_GATE_METRIC) == 1.0
        ):
            return None  # a gated model: nothing is served before the gate releases it
        return head

    def wants(self, version: int, current: int | None) -> bool:
        """Whether a target `version` means a move from `current`."""
        if current is None:
            return True
        return version != current if self.moves_back else version > current
