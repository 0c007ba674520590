"""The release gate: no version reaches the fleet before it is judged on events it never saw.

    from publisher.release import GateConfig, ReleaseLog

    log = ReleaseLog(store, "ranker")
    log.released()                                   # what the fleet serves (None: HEAD)
    log.move(ref, action="release", by="person", reason="checked by hand")

`ReleaseGate` (gate.py) runs in the trainer's publisher beside the served-loss meter; `rules.py`
holds the checks it applies (docs/FORMAT.md section 9, docs/RELEASE.md); `log.py` reads and
moves RELEASED and keeps the records and evaluations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.lazy_face import lazy_face

if TYPE_CHECKING:
    from publisher.release.gate import GateOutcome, ReleaseGate
    from publisher.release.log import (
        ReleaseConflictError,
        ReleasedRef,
        ReleaseError,
        ReleaseLog,
    )
    from publisher.release.rules import GateConfig, Reference, Verdict, judge

_EXPORTS = {
    "GateConfig": "publisher.release.rules",
    "GateOutcome": "publisher.release.gate",
    "Reference": "publisher.release.rules",
    "ReleaseConflictError": "publisher.release.log",
    "ReleaseError": "publisher.release.log",
    "ReleaseGate": "publisher.release.gate",
    "ReleaseLog": "publisher.release.log",
    "ReleasedRef": "publisher.release.log",
    "Verdict": "publisher.release.rules",
    "judge": "publisher.release.rules",
}
__getattr__ = lazy_face(__name__, _EXPORTS)

__all__ = [
    "GateConfig",
    "GateOutcome",
    "Reference",
    "ReleaseConflictError",
    "ReleaseError",
    "ReleaseGate",
    "ReleaseLog",
    "ReleasedRef",
    "Verdict",
    "judge",
]
