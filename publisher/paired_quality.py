"""Two models scored on the same examples, compared with the noise of those examples in view.

A version's quality on a window of events is a sample: on a click stream at 0.5% CTR a window of
15,000 events holds ~75 positives, and an AUC read from it moves by more than a codec or a bad
stretch of training does. What a release gate or a codec choice needs is the *difference*
between two models on the *same* events and how sure it is. Paired, most of the noise cancels
(both models see the same hard and easy examples); this module gives the difference and a
confidence interval for it:

- **AUC**: DeLong, DeLong and Clarke-Pearson (1988), the paired form: each model's structural
  components (per positive, the share of negatives it outranks; per negative, the share of
  positives that outrank it, ties one half) give the covariance of the two AUCs; computed from
  midranks in O(n log n) (Sun and Xu, 2014).
- **Log loss**: the mean of the per-example paired differences, with the normal interval of a
  mean (the differences are independent across examples).
- **Calibration**: each model's mean score over the observed positive rate (1.0 is calibrated),
  with a delta-method interval for the ratio.

    quality = paired_quality(labels, candidate_scores, released_scores)
    quality.auc_diff.high < -0.001    # the candidate ranks worse, beyond the noise

Differences are candidate minus baseline. Every interval is two-sided at `level` (0.95 by
default); None where a figure cannot be formed (one class absent: no AUC).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

#: scores are clipped to [EPS, 1 - EPS] for log loss: a confident mistake costs ~16.6, not inf.
EPS = 1e-7


@dataclass(frozen=True)
class Interval:
    """An estimate and its two-sided confidence interval."""

    estimate: float
    low: float
    high: float

    def excludes(self, value: float) -> bool:
        """Whether `value` lies outside the interval (the difference is significant)."""
        return value < self.low or value > self.high


@dataclass(frozen=True)
class PairedQuality:
    """A candidate and a baseline model on the same examples (see the module docstring)."""

    examples: int
    positives: int
    auc: tuple[float, float] | None  # (candidate, baseline)
    auc_diff: Interval | None
    logloss: tuple[float, float]
    logloss_diff: Interval
    calibration: tuple[Interval, Interval] | None  # mean score / positive rate, each


def normal_quantile(level: float) -> float:
    """z of a two-sided interval at `level` (1.96 at 0.95)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"a confidence level is in (0, 1), got {level}")
    # the normal quantile by bisection on erf: no scipy for one number
    target = 0.5 + level / 2.0
    low, high = 0.0, 10.0
    for _ in range(80):
        mid = (low + high) / 2.0
        if 0.5 * (1.0 + math.erf(mid / math.sqrt(2.0))) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


def _midranks(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """1-based ranks of `values`, ties given the mean of their ranks."""
    order = np.argsort(values, kind="stable")
    _, first, counts = np.unique(values[order], return_index=True, return_counts=True)
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    return ranks


def _components(
    scores: npt.NDArray[np.float64], positive: npt.NDArray[np.bool_]
) -> tuple[float, npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(AUC, per-positive component, per-negative component) of one model (DeLong)."""
    m, n = int(positive.sum()), int((~positive).sum())
    all_ranks = _midranks(scores)
    pos_ranks = _midranks(scores[positive])
    neg_ranks = _midranks(scores[~positive])
    v10 = (all_ranks[positive] - pos_ranks) / n  # negatives each positive outranks
    v01 = 1.0 - (all_ranks[~positive] - neg_ranks) / m  # positives outranking each negative
    return float(v10.mean()), v10, v01


def delong_auc_diff(
    labels: npt.ArrayLike, candidate: npt.ArrayLike, baseline: npt.ArrayLike, level: float = 0.95
) -> tuple[float, float, Interval] | None:
    """(AUC of candidate, AUC of baseline, their difference's interval), paired DeLong; None
    unless both classes are present. Scores may be any finite numbers (logits too): only their
    order counts."""
    y, a, b = _checked(labels, candidate, baseline, probabilities=False)
    positive = y > 0.5
    m, n = int(positive.sum()), int((~positive).sum())
    if m == 0 or n == 0:
        return None
    auc_a, v10_a, v01_a = _components(a, positive)
    auc_b, v10_b, v01_b = _components(b, positive)
    var = _pair_var(v10_a, v10_b) / m + _pair_var(v01_a, v01_b) / n
    half = normal_quantile(level) * math.sqrt(max(var, 0.0))
    diff = auc_a - auc_b
    return auc_a, auc_b, Interval(diff, diff - half, diff + half)


def _pair_var(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> float:
    """var(x) + var(y) - 2 cov(x, y), sample (n - 1) normalised; 0 for a single value."""
    if len(x) < 2:
        return 0.0
    d = x - y
    return float(d.var(ddof=1))


def _checked(
    labels: npt.ArrayLike,
    candidate: npt.ArrayLike,
    baseline: npt.ArrayLike,
    *,
    probabilities: bool = True,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    a = np.asarray(candidate, dtype=np.float64).reshape(-1)
    b = np.asarray(baseline, dtype=np.float64).reshape(-1)
    if not (len(y) == len(a) == len(b)):
        raise ValueError(f"labels and scores differ in length: {len(y)}, {len(a)}, {len(b)}")
    if not len(y):
        raise ValueError("no examples to compare on")
    for name, values in (("labels", y), ("candidate", a), ("baseline", b)):
        if not np.isfinite(values).all():
            raise ValueError(f"{name} hold a value that is not finite")
    if ((y != 0.0) & (y != 1.0)).any():
        raise ValueError("labels are 0 or 1")
    if probabilities and ((a < 0).any() or (a > 1).any() or (b < 0).any() or (b > 1).any()):
        raise ValueError("scores are probabilities in [0, 1]")
    return y, a, b


def log_losses(y: npt.NDArray[np.float64], p: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Each example's binary log loss, the scores clipped to [EPS, 1 - EPS]."""
    q = np.clip(p, EPS, 1.0 - EPS)
    out: npt.NDArray[np.float64] = -(y * np.log(q) + (1.0 - y) * np.log1p(-q))
    return out


def _calibration(
    y: npt.NDArray[np.float64], p: npt.NDArray[np.float64], z: float
) -> Interval | None:
    """mean(p) / mean(y) with a delta-method interval; None without positives."""
    rate = float(y.mean())
    if rate == 0.0:
        return None
    ratio = float(p.mean()) / rate
    n = len(y)
    if n < 2:
        return Interval(ratio, ratio, ratio)
    # var(P/Y) ~ (var P - 2 r cov(P, Y) + r^2 var Y) / (n Ybar^2), per-example P and Y
    cov = np.cov(p, y, ddof=1)
    var = (cov[0, 0] - 2 * ratio * cov[0, 1] + ratio**2 * cov[1, 1]) / (n * rate**2)
    half = z * math.sqrt(max(float(var), 0.0))
    return Interval(ratio, ratio - half, ratio + half)


def paired_quality(
    labels: npt.ArrayLike,
    candidate: npt.ArrayLike,
    baseline: npt.ArrayLike,
    *,
    level: float = 0.95,
) -> PairedQuality:
    """Candidate vs baseline on the same examples (see the module docstring); ValueError for
    inputs of different lengths, none, labels other than 0/1, or scores outside [0, 1]."""
    y, a, b = _checked(labels, candidate, baseline)
    z = normal_quantile(level)
    loss_a, loss_b = log_losses(y, a), log_losses(y, b)
    d = loss_a - loss_b
    half = z * float(d.std(ddof=1)) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    mean_d = float(d.mean())
    auc = delong_auc_diff(y, a, b, level)
    cal_a, cal_b = _calibration(y, a, z), _calibration(y, b, z)
    return PairedQuality(
        examples=len(y),
        positives=int(y.sum()),
        auc=None if auc is None else (auc[0], auc[1]),
        auc_diff=None if auc is None else auc[2],
        logloss=(float(loss_a.mean()), float(loss_b.mean())),
        logloss_diff=Interval(mean_d, mean_d - half, mean_d + half),
        calibration=None if cal_a is None or cal_b is None else (cal_a, cal_b),
    )
