"""The release gate of one model's publisher: each committed version is scored on the events
after it, next to the released version, and released, held, or rolled back (docs/FORMAT.md 9,
docs/RELEASE.md).

    gate = ReleaseGate(store, "movielens", GateConfig(), announce=bus.announce)
    gate.committed(ref)               # the served copy now holds `ref` as servers will
    ...the trainer trains on the next interval's events; its snapshot brings them...
    gate.evaluate(meter, fresh)       # before the copy moves on: judge `ref` on them

It rides on the served-loss meter's copy (publisher/served_loss.py): between two versions that
copy holds the version just committed exactly as servers hold it, so scoring the next
snapshot's fresh samples (the events trained on after the version was taken, which it never
saw) on it, before the copy is overlaid with the next version, is progressive validation of the
version itself, off the training thread. Next to it the gate keeps its own copy of the released
version (and, while that one is on probation, of the one released before it), built from the
store when RELEASED names a version it does not hold (a restart, a person's release), and
scores them on the same events: the paired comparison that `publisher.release.rules` judges.

Nothing here may stop publishing: a store or broker failure is logged and the version is left
undecided (it stays pending); RELEASED moved by someone else is read again at the next version.
Memory: up to two more copies of the model (released, last good).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from publisher.read.catalog import VersionRef
from publisher.read.module_state import load_module_state
from publisher.read.restore import restore
from publisher.release.log import ReleaseConflictError, ReleasedRef, ReleaseLog
from publisher.release.rules import GateConfig, Reference, Verdict, judge, probabilities
from publisher.served_loss import KeptSample, ServedLossMeter
from publisher.store import ObjectStore
from schemas.announcement import Announcement
from schemas.errors import CheckNRunError
from schemas.release import Action, Window

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """A copy of one version as served, kept by the gate."""

    version: int
    module: nn.Module


@dataclass(frozen=True)
class GateOutcome:
    """What the gate did for one version: its verdict, and the moves it made."""

    verdict: Verdict
    released: bool
    rolled_back_to: int | None
    #: wall and CPU (this thread's) seconds the evaluation took: scoring, judging, the store.
    seconds: float
    cpu_s: float = 0.0


@dataclass(frozen=True)
class GateWord:
    """What a trainer tells a person about one judged version (its published line, `--json`):
    plain values, so it crosses a publisher process and a job's collectives as JSON."""

    version: int
    decision: str
    reason: str
    released: bool
    rolled_back_to: int | None
    #: what judging it cost the publisher (GateOutcome).
    seconds: float = 0.0
    cpu_s: float = 0.0

    @classmethod
    def of(cls, outcome: GateOutcome) -> GateWord:
        e = outcome.verdict.evaluation
        return cls(
            e.version,
            e.decision,
            e.reason,
            outcome.released,
            outcome.rolled_back_to,
            round(outcome.seconds, 4),
            round(outcome.cpu_s, 4),
        )

    def to_json(self) -> dict[str, JSONScalar]:
        return {
            "version": self.version,
            "decision": self.decision,
            "reason": self.reason,
            "released": self.released,
            "rolled_back_to": self.rolled_back_to,
            "seconds": self.seconds,
            "cpu_s": self.cpu_s,
        }

    @classmethod
    def from_json(cls, doc: object) -> GateWord | None:
        """The word `to_json` gave (None for None or anything else)."""
        if not isinstance(doc, dict):
            return None
        back = doc.get("rolled_back_to")
        return cls(
            int(doc["version"]),
            str(doc["decision"]),
            str(doc["reason"]),
            bool(doc["released"]),
            None if back is None else int(back),
            float(doc.get("seconds", 0.0)),
            float(doc.get("cpu_s", 0.0)),
        )

    def text(self) -> str:
        """One line's worth: `v4 released`, `v4 held: worse than v3: ...`."""
        back = "" if self.rolled_back_to is None else f" (v{self.rolled_back_to} restored first)"
        if self.released:
            return f"v{self.version} released{back}"
        return f"v{self.version} held: {self.reason}{back}"


JSONScalar = str | int | float | bool | None


class ReleaseGate:
    """Judges each committed version on the events after it (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        model: str,
        config: GateConfig | None = None,
        *,
        announce: Callable[[Announcement], None] | None = None,
    ) -> None:
        self.config = config or GateConfig()
        self.log = ReleaseLog(store, model)
        self.store = store
        self.model = model
        self.announce = announce
        #: the version the meter's copy holds as served, committed and not judged yet.
        self._pending: VersionRef | None = None
        self._released: _Held | None = None
        #: the version released before the released one, while that one is on probation.
        self._good: _Held | None = None
        self._probation_left = 0
        self._reference: Reference | None = None
        #: the last window was away from the released version's reference (rules.py).
        self._drifting = False

    # --- the publisher's calls --------------------------------------------------------------

    def committed(self, ref: VersionRef) -> None:
        """The meter's copy holds `ref` as served (its version was just committed)."""
        self._pending = ref

    def evaluate(self, meter: ServedLossMeter, fresh: Sequence[KeptSample]) -> GateOutcome | None:
        """Judge the pending version on `fresh` (samples it never trained on) while the meter's
        copy still holds it; None when there is nothing to judge (no pending version, a copy
        not yet whole, too few examples, one class only) or the store failed (logged)."""
        ref, self._pending = self._pending, None
        if ref is None or not meter.complete or not fresh:
            return None
        labels = np.concatenate([np.asarray(b.labels, dtype=np.float64) for b in fresh])
        positives = int((labels > 0.5).sum())
        fewest = min(positives, len(labels) - positives)
        if len(labels) < self.config.min_examples or fewest < self.config.min_class:
            log.debug(
                "release gate: v%d not judged: %d examples, %d positives after it",
                ref.version,
                len(labels),
                positives,
            )
            return None
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            outcome = self._evaluate(ref, meter, fresh, labels, positives, started)
        except (CheckNRunError, OSError) as exc:
            log.warning(
                "release gate: v%d left undecided (%s: %s); the next version is judged as usual",
                ref.version,
                type(exc).__name__,
                exc,
            )
            return None
        return replace(outcome, cpu_s=time.thread_time() - started_cpu)

    # --- one version -------------------------------------------------------------------------

    def _evaluate(
        self,
        ref: VersionRef,
        meter: ServedLossMeter,
        fresh: Sequence[KeptSample],
        labels: np.ndarray,
        positives: int,
        started: float,
    ) -> GateOutcome:
        current = self.log.released()
        self._sync(current, meter)
        candidate = _probabilities(meter, meter.served, fresh)
        released_scores = None
        if self._released is not None:
            released_scores = (
                self._released.version,
                _probabilities(meter, self._released.module, fresh),
            )
        probation = None
        if self._good is not None and self._released is not None and self._probation_left > 0:
            probation = (
                self._released.version,
                self._good.version,
                _probabilities(meter, self._good.module, fresh),
            )
        window = Window(
            after_samples=ref.manifest.position.samples_seen,
            examples=len(labels),
            positives=positives,
        )

        def verdict_against(
            base: tuple[int, np.ndarray] | None,
            probation_of: tuple[int, int, np.ndarray] | None,
        ) -> Verdict:
            return judge(
                model=self.model,
                version=ref.version,
                manifest=ref.key,
                window=window,
                labels=labels,
                candidate=candidate,
                released=base,
                reference=self._reference,
                probation=probation_of,
                config=self.config,
                drifting=self._drifting,
            )

        verdict = verdict_against(released_scores, probation)
        rolled_back_to = None
        if verdict.rollback is not None and self._good is not None and current is not None:
            # The released version failed its probation: back to the one before it, and the
            # candidate is judged against that one instead.
            good = self._good
            target = self.log.catalog.find(good.version)
            current = self._move(target, "rollback", verdict.rollback, current)
            rolled_back_to = good.version
            self._released, self._good, self._probation_left = good, None, 0
            self._reference = self._reference_of(good.version)
            probation_doc = verdict.evaluation.probation
            assert probation is not None  # a rollback is a failed probation: G was scored
            verdict = verdict_against((good.version, probation[2]), None)
            if probation_doc is not None:
                verdict = Verdict(
                    verdict.evaluation.model_copy(update={"probation": probation_doc}),
                    verdict.rollback,
                    verdict.next_reference,
                )
        elif verdict.evaluation.probation is not None:
            # The released version held up against the one before it on one more window.
            self._probation_left -= 1
            if self._probation_left <= 0:
                self._good = None  # its probation is over: that copy is not needed any more
        self._drifting = verdict.evaluation.drifting
        if verdict.next_reference is not None and self._released is not None:
            self._reference = verdict.next_reference
        evaluation = verdict.evaluation
        if not self.log.write_evaluation(evaluation):
            log.info("release gate: v%d was judged before (its first record stands)", ref.version)
        released = False
        if evaluation.decision == "release":
            self._move(ref, "release", evaluation.reason, current)
            released = True
            # The copy the meter holds is about to move on: the gate keeps its own.
            previous = self._released
            self._released = _Held(ref.version, _clone(meter.served))
            self._good, self._probation_left = (
                previous,
                (self.config.probation_windows if previous is not None else 0),
            )
            self._reference = Reference.of(evaluation.candidate, evaluation.window)
        log.debug(
            "release gate: v%d %s: %s",
            ref.version,
            "released" if released else "held",
            evaluation.reason,
        )
        return GateOutcome(verdict, released, rolled_back_to, time.perf_counter() - started)

    def _move(
        self, target: VersionRef, action: Action, reason: str, current: ReleasedRef | None
    ) -> ReleasedRef:
        try:
            moved = self.log.move(
                target,
                action=action,
                by="gate",
                reason=reason,
                expected=current,
            )
        except ReleaseConflictError:
            # A person (or another gate) moved it meanwhile: theirs stands; read again next time.
            self._released = None
            raise
        if self.announce is not None:
            try:
                self.announce(Announcement.of_release(target.manifest, target.key))
            except Exception:
                log.exception("announcing RELEASED v%d failed; followers poll", target.version)
        return moved

    # --- the copies ---------------------------------------------------------------------------

    def _sync(self, current: ReleasedRef | None, meter: ServedLossMeter) -> None:
        """Make the released copy (and the last good one, on probation) the versions RELEASED
        says, building from the store what the gate does not hold."""
        if current is None:
            self._released = self._good = None
            self._probation_left = 0
            return
        if self._released is not None and self._released.version == current.version:
            return
        # Moved by someone else (a person, a restart): start from what the store says.
        log.info(
            "release gate: RELEASED is v%d (moved by a %s); building its copy from the store",
            current.version,
            current.record.by,
        )
        previous = self._released
        self._released = _Held(current.version, self._build(meter, current.version, previous))
        self._reference = self._reference_of(current.version)
        self._drifting = self._last_drifting()
        self._good, self._probation_left = None, 0
        if current.record.action == "release":
            good = self.log.last_good(current)
            if good is not None:
                # A version released by a person (or before a restart) is on probation too.
                self._good = _Held(good, self._build(meter, good, previous))
                self._probation_left = self.config.probation_windows

    def _build(self, meter: ServedLossMeter, version: int, reuse: _Held | None) -> nn.Module:
        if reuse is not None and reuse.version == version:
            return reuse.module
        module = _clone(meter.served)
        load_module_state(module, restore(self.store, self.model, version))
        return module

    def _last_drifting(self) -> bool:
        """Whether the newest evaluation in the store found the stream away (a restart in the
        middle of a broken stretch keeps holding)."""
        judged = self.log.evaluated_versions()
        if not judged:
            return False
        newest = self.log.evaluation(judged[-1])
        return newest is not None and newest.drifting

    def _reference_of(self, version: int) -> Reference | None:
        """A released version's drift reference: its own evaluation's figures (None if it has
        none, e.g. released by a person before it was judged)."""
        evaluation = self.log.evaluation(version)
        return None if evaluation is None else Reference.of(evaluation.candidate, evaluation.window)


def _clone(module: nn.Module) -> nn.Module:
    """An own copy of a served copy (eval mode, no grad)."""
    return copy.deepcopy(module).eval().requires_grad_(False)


@torch.no_grad()
def _probabilities(
    meter: ServedLossMeter, module: nn.Module, fresh: Sequence[KeptSample]
) -> np.ndarray:
    return probabilities(meter.rule.score(module, fresh).numpy())
