"""The release gate's rules (docs/FORMAT.md 9.3): a candidate's scores on a window of events it
never saw, next to the released version's on the same events, become an evaluation and a
decision. Pure: no store, no model, no clock but `created_at`.

    verdict = judge(window, labels, candidate=p_c, released=p_r, reference=ref, rules=rules)
    verdict.evaluation.decision      # "release" | "hold", with its reason
    verdict.rollback                 # the released version failed its probation: roll back

The checks, in order (the first that fails holds the candidate):

1. finite: every score of the candidate is a number;
2. drift: the released version scores this window about as it scored the events it was judged
   on (its reference): a stream that moved (labels flipped, a feature's ids scrambled, a dense
   input scaled upstream) holds every candidate, since a candidate trained on it may well score
   such events better than the released version and would pass the paired checks;
3. calibration: the candidate's mean score over the positive rate can be within bounds;
4. AUC: not worse than the released version's beyond the tolerance, with confidence;
5. log loss: not worse than the released version's beyond the (relative) tolerance, with
   confidence.

"With confidence": a check fails only when the whole interval is past its tolerance, so noise
alone fails one of them rarely (each interval is two-sided at `level`: one side is 2.5% at
0.95, and only when the true difference is right at the tolerance). The tolerances are
measured defaults (docs/RELEASE.md), not guesses: on a clean MovieLens replay they hold < 1% of
the versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from publisher.paired_quality import (
    EPS,
    Interval,
    PairedQuality,
    auc_interval,
    calibration,
    log_losses,
    mean_interval,
    normal_quantile,
    paired_quality,
)
from schemas.manifest import utc_now
from schemas.release import (
    Evaluation,
    GateRules,
    Probation,
    Quality,
    Window,
)
from schemas.release import (
    Interval as IntervalDoc,
)


@dataclass(frozen=True)
class GateConfig:
    """The gate's tolerances (`checknrun train --gate-*`, docs/RELEASE.md)."""

    #: the two-sided confidence level of every interval.
    level: float = 0.95
    #: hold when the candidate's AUC is below the released one's by more than this, surely.
    auc_tolerance: float = 0.005
    #: hold when the candidate's log loss is above the released one's by more than this share
    #: of it, surely.
    logloss_tolerance: float = 0.05
    #: the candidate's calibration (mean score / positive rate) must be able to lie here.
    calibration: tuple[float, float] = (0.5, 2.0)
    #: hold every candidate while the released version's log loss on the window is above its
    #: reference by more than this share, surely,
    drift_tolerance: float = 0.15
    #: or its AUC below its reference by more than this, surely.
    drift_auc_tolerance: float = 0.05
    #: windows a released version is compared with the one released before it.
    probation_windows: int = 3
    #: a window of fewer examples, or fewer positives or negatives than `min_class`, is not
    #: judged (the version is left pending): at a click log's 0.6% a tail window of 3,000
    #: events holds ~18 positives, too few for the intervals' normal approximation (one read a
    #: log loss +55% [+23%, +87%] there).
    min_examples: int = 512
    min_class: int = 50
    #: every interval treats each run of this many consecutive events as a cluster: a stream's
    #: events come in runs of one user or session, alike within a run (publisher/
    #: paired_quality.py); 1 takes them as independent.
    block_examples: int = 128

    def __post_init__(self) -> None:
        GateRules.model_validate(self.rules().model_dump())  # the format's own checks
        if self.min_examples < 1 or self.min_class < 1:
            raise ValueError(
                f"min_examples and min_class must be >= 1, got {self.min_examples}, "
                f"{self.min_class}"
            )
        if self.block_examples < 1:
            raise ValueError(f"block_examples must be >= 1, got {self.block_examples}")

    def rules(self) -> GateRules:
        """The rules as an evaluation records them."""
        return GateRules(
            level=self.level,
            auc_tolerance=self.auc_tolerance,
            logloss_tolerance=self.logloss_tolerance,
            calibration=self.calibration,
            drift_tolerance=self.drift_tolerance,
            drift_auc_tolerance=self.drift_auc_tolerance,
            probation_windows=self.probation_windows,
            block_examples=self.block_examples,
        )


@dataclass(frozen=True)
class Reference:
    """What a released version's log loss and AUC on a window were, with their standard
    errors, and the window's positive rate (the drift check's baseline)."""

    logloss: float
    logloss_se: float
    auc: float | None = None
    auc_se: float | None = None
    #: the window's share of positives: its log loss is judged over this rate's entropy.
    rate: float = 0.5

    @classmethod
    def of(cls, quality: Quality, window: Window) -> Reference:
        return cls(
            quality.logloss,
            quality.logloss_se,
            quality.auc,
            quality.auc_se,
            window.positives / window.examples,
        )


@dataclass(frozen=True)
class Verdict:
    """The evaluation of one candidate, and what it means for the released version."""

    evaluation: Evaluation
    #: the released version failed its probation on this window: roll back to the last good
    #: one, and why.
    rollback: str | None
    #: the released version's figures on this window, when it showed no drift: its next
    #: reference (None: keep the one it has).
    next_reference: Reference | None


def probabilities(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Logits as probabilities (float64; NaN stays NaN)."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def quality(
    labels: npt.NDArray[np.float64], p: npt.NDArray[np.float64], level: float, block: int = 1
) -> Quality:
    """One model's figures on a window (finite scores); intervals by runs of `block`."""
    z = normal_quantile(level)
    loss = mean_interval(log_losses(labels, p), z, block)
    cal = calibration(labels, p, z, block)
    ranking = auc_interval(labels, p, level, block=block)
    return Quality(
        auc=None if ranking is None else ranking.estimate,
        auc_se=None if ranking is None else (ranking.high - ranking.estimate) / z,
        logloss=loss.estimate,
        logloss_se=(loss.high - loss.estimate) / z,
        calibration=None if cal is None else _doc(cal),
    )


def judge(
    *,
    model: str,
    version: int,
    manifest: str,
    window: Window,
    labels: npt.ArrayLike,
    candidate: npt.ArrayLike,
    released: tuple[int, npt.ArrayLike] | None,
    reference: Reference | None,
    probation: tuple[int, int, npt.ArrayLike] | None,
    config: GateConfig,
    drifting: bool = False,
) -> Verdict:
    """The evaluation of `candidate` (probabilities on the window's examples, `labels`), next
    to `released` ((version, probabilities) or None: nothing released yet), with the released
    version's `reference` for the drift check (`drifting`: the last window was found away
    from it), and `probation` ((released, last good, the last good's probabilities), or None)
    judged first."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    c = np.asarray(candidate, dtype=np.float64).reshape(-1)
    level, block = config.level, config.block_examples
    finite = bool(np.isfinite(c).all())
    cand_quality = quality(y, c if finite else np.full_like(y, 0.5), level, block)
    fields: dict[str, object] = {
        "baseline": None,
        "released": None,
        "auc_diff": None,
        "logloss_diff": None,
        "drift": None,
        "auc_drift": None,
        "probation": None,
        "drifting": False,
    }
    rollback = None
    next_reference = None
    failed: str | None = None
    passed = "released: the first judged version" if released is None else ""
    if released is not None:
        base_version, base_scores = released
        r = np.asarray(base_scores, dtype=np.float64).reshape(-1)
        rel_quality = quality(y, r, level, block)
        fields["baseline"] = base_version
        fields["released"] = rel_quality
        drift = auc_drift = None
        if reference is not None:
            drift = _drift(rel_quality, window.positives / window.examples, reference, level)
            fields["drift"] = _doc(drift)
            auc_drift = _auc_drift(rel_quality, reference, level)
            fields["auc_drift"] = None if auc_drift is None else _doc(auc_drift)
        drifted_by = _drifted(drift, auc_drift, config, drifting)
        drifted = drifted_by is not None
        if not drifted:
            next_reference = Reference.of(rel_quality, window)
        if probation is not None and not drifted:
            rel_v, good_v, good_scores = probation
            g = np.asarray(good_scores, dtype=np.float64).reshape(-1)
            vs_good = paired_quality(y, r, g, level=level, block=block)
            good_loss = float(log_losses(y, g).mean())
            fields["probation"] = Probation(
                released=rel_v,
                last_good=good_v,
                auc_diff=None if vs_good.auc_diff is None else _doc(vs_good.auc_diff),
                logloss_diff=_doc(vs_good.logloss_diff),
            )
            worse = _worse(vs_good.auc_diff, vs_good.logloss_diff, good_loss, config)
            if worse is not None:
                rollback = (
                    f"v{rel_v} is worse than v{good_v} on the events after v{version}: " + worse
                )
        if finite:
            paired = paired_quality(y, c, r, level=level, block=block)
            fields["auc_diff"] = None if paired.auc_diff is None else _doc(paired.auc_diff)
            fields["logloss_diff"] = _doc(paired.logloss_diff)
        if not finite:
            failed = "its scores are not all finite"
        elif drifted_by is not None:
            failed = (
                f"the events moved away from what v{base_version} was judged on: {drifted_by}; "
                "labels, ids or inputs broken upstream? held until they come back, or a person "
                "releases a version"
            )
        else:
            failed = _calibration_failure(cand_quality, config) or _worse(
                paired.auc_diff, paired.logloss_diff, rel_quality.logloss, config
            )
            if failed is not None:
                failed = f"worse than v{base_version}: {failed}"
        if failed is None:
            passed = f"not worse than v{base_version}: " + _summary(paired)
    elif not finite:
        failed = "its scores are not all finite"
    else:
        failed = _calibration_failure(cand_quality, config)
    fields["drifting"] = released is not None and drifted
    evaluation = Evaluation(
        model=model,
        version=version,
        manifest=manifest,
        window=window,
        candidate=cand_quality,
        decision="hold" if failed else "release",
        reason=failed or passed,
        gate=config.rules(),
        created_at=utc_now(),
        **fields,  # type: ignore[arg-type]
    )
    return Verdict(evaluation, rollback, next_reference)


def _worse(
    auc_diff: Interval | None, logloss_diff: Interval, baseline_loss: float, config: GateConfig
) -> str | None:
    """Why a model is worse than its baseline beyond the tolerances, or None."""
    if auc_diff is not None and auc_diff.high < -config.auc_tolerance:
        return (
            f"AUC {auc_diff.estimate:+.4f} [{auc_diff.low:+.4f}, {auc_diff.high:+.4f}], "
            f"below -{config.auc_tolerance:g}"
        )
    limit = config.logloss_tolerance * baseline_loss
    if logloss_diff.low > limit:
        return (
            f"log loss {logloss_diff.estimate:+.4f} [{logloss_diff.low:+.4f}, "
            f"{logloss_diff.high:+.4f}], above +{limit:.4f} ({config.logloss_tolerance:.1%})"
        )
    return None


def _calibration_failure(candidate: Quality, config: GateConfig) -> str | None:
    cal = candidate.calibration
    low, high = config.calibration
    if cal is not None and (cal.low > high or cal.high < low):
        return (
            f"calibration {cal.estimate:.3f} [{cal.low:.3f}, {cal.high:.3f}] "
            f"outside [{low:g}, {high:g}]"
        )
    return None


def _summary(paired: PairedQuality) -> str:
    auc_diff, loss = paired.auc_diff, paired.logloss_diff
    auc = (
        "AUC n/a"
        if auc_diff is None
        else f"AUC {auc_diff.estimate:+.4f} [{auc_diff.low:+.4f}, {auc_diff.high:+.4f}]"
    )
    return f"{auc}, log loss {loss.estimate:+.4f} [{loss.low:+.4f}, {loss.high:+.4f}]"


def _drifted(
    drift: Interval | None, auc_drift: Interval | None, config: GateConfig, drifting: bool
) -> str | None:
    """How the released version's figures moved away from its reference beyond the drift
    tolerances, or None. Hysteresis: a stream seen away (`drifting`) is back only once both
    estimates are within half the tolerances, so a stretch that is still broken but reads a
    little less so on one window (its intervals are wide) does not release what trains on
    it."""
    loss_tol, auc_tol = config.drift_tolerance, config.drift_auc_tolerance
    if drifting:
        loss_away = drift is not None and drift.estimate > loss_tol / 2
        auc_away = auc_drift is not None and auc_drift.estimate < -auc_tol / 2
    else:
        loss_away = drift is not None and drift.low > loss_tol
        auc_away = auc_drift is not None and auc_drift.high < -auc_tol
    still = "still " if drifting else ""
    if loss_away:
        assert drift is not None
        tolerance = f"tolerance {loss_tol / 2 if drifting else loss_tol:.0%}"
        return f"its normalised log loss {still}{_pct(drift)} over its reference ({tolerance})"
    if auc_away:
        assert auc_drift is not None
        tolerance = f"tolerance -{auc_tol / 2 if drifting else auc_tol:g}"
        return (
            f"its AUC {still}{auc_drift.estimate:+.4f} [{auc_drift.low:+.4f}, "
            f"{auc_drift.high:+.4f}] from its reference ({tolerance})"
        )
    return None


def _auc_drift(now: Quality, reference: Reference, level: float) -> Interval | None:
    """The released version's AUC on this window minus its reference's, with the interval of
    a difference of two independent estimates."""
    if now.auc is None or now.auc_se is None or reference.auc is None or reference.auc_se is None:
        return None
    diff = now.auc - reference.auc
    half = normal_quantile(level) * math.sqrt(now.auc_se**2 + reference.auc_se**2)
    return Interval(diff, diff - half, diff + half)


def _drift(now: Quality, rate: float, reference: Reference, level: float) -> Interval:
    """The released version's normalised log loss on this window (its log loss over the
    entropy of the window's positive rate: what always predicting that rate would lose) over
    its reference's, minus one; the interval of a ratio of two independent estimates. Normalised,
    a window that merely holds more positives than the last (a click log's 100 +- 30 in 16k) is
    not a drift; flipped labels or broken inputs still are."""
    ratio = (now.logloss / _entropy(rate)) / (reference.logloss / _entropy(reference.rate))
    relative_se = math.hypot(
        now.logloss_se / max(now.logloss, EPS), reference.logloss_se / max(reference.logloss, EPS)
    )
    half = normal_quantile(level) * ratio * relative_se
    return Interval(ratio - 1.0, ratio - 1.0 - half, ratio - 1.0 + half)


def _entropy(rate: float) -> float:
    """The log loss of predicting `rate` for every example of a window with that rate."""
    p = min(max(rate, EPS), 1.0 - EPS)
    return -(p * math.log(p) + (1.0 - p) * math.log1p(-p))


def _doc(interval: Interval) -> IntervalDoc:
    return IntervalDoc(estimate=interval.estimate, low=interval.low, high=interval.high)


def _pct(interval: Interval) -> str:
    return f"{interval.estimate:+.1%} [{interval.low:+.1%}, {interval.high:+.1%}]"
