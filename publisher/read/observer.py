"""What a subscriber tells whoever watches it: every version applied, every rejection, every
failure, and the follower's counters. `checknrun serve` turns these into Prometheus metrics
(server/metrics.py); the default does nothing, and logs are the subscriber's own."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from publisher.read.catalog import VersionRef
    from publisher.read.consistency import UpdateResult
    from publisher.read.follower import FollowerStats


class SubscriberObserver:
    """Called on the subscriber's thread; each method must return quickly and never raise."""

    def applied(
        self, plan: Sequence[VersionRef], result: UpdateResult, seconds: float, kind: str
    ) -> None:
        """`plan` was applied in `seconds`: `kind` is "bootstrap", "catch_up", "pin", or the
        first version's kind ("full", "delta") when following."""

    def fetched(self, nbytes: int) -> None:
        """`nbytes` of blobs were fetched and verified."""

    def rejected(self, reason: str) -> None:
        """A version was rejected as bad data (`reason`: `rejection_reason`'s label)."""

    def failed(self, kind: str) -> None:
        """Following failed for now ("store": unreachable or refused; "error": anything
        else); it is retried with backoff."""

    def follower_stats(self, stats: FollowerStats) -> None:
        """The follower's counters after a poll (cumulative)."""
