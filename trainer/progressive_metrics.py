"""Online metrics by progressive validation: each batch is scored before it is trained on.

AUC needs every score seen; keeping them all does not scale to an endless stream, so scores
are counted in a fixed histogram over the logit (2**16 bins over [-20, 20], 0.0006 wide) per
label. AUC is then exact up to pairs that fall in the same bin, which count one half (the usual
tie rule): the error is below 1e-4 for any realistic score distribution. Both a cumulative and
a windowed (since `take_window`) histogram are kept; everything is vectorised.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.nn import functional as F

BINS = 1 << 16
LOGIT_RANGE = 20.0


def auc_from_histograms(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC from per-bin counts of positives and negatives (bins in ascending score).

    P(score_pos > score_neg) + 0.5 P(equal bin); NaN when either class is absent.
    """
    n_pos, n_neg = float(pos.sum()), float(neg.sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    neg_below = np.cumsum(neg) - neg
    wins = float(np.dot(pos, neg_below + 0.5 * neg))
    return wins / (n_pos * n_neg)


class Counts:
    """Per-label score histograms, loss sum, samples and positives: what the metrics come from,
    and what the ranks of a job sum (`as_array`, `from_array`)."""

    def __init__(self) -> None:
        self.pos = np.zeros(BINS, dtype=np.int64)
        self.neg = np.zeros(BINS, dtype=np.int64)
        self.loss_sum = 0.0
        self.samples = 0
        self.positives = 0

    def as_array(self) -> np.ndarray:
        """Everything as one float64 array (counts are exact below 2**53)."""
        scalars = [self.loss_sum, self.samples, self.positives]
        return np.concatenate([self.pos, self.neg, np.array(scalars)]).astype(np.float64)

    @classmethod
    def from_array(cls, values: np.ndarray) -> Counts:
        """The counts `as_array` gave (or a sum of such arrays)."""
        counts = cls()
        counts.pos = np.rint(values[:BINS]).astype(np.int64)
        counts.neg = np.rint(values[BINS : 2 * BINS]).astype(np.int64)
        loss_sum, samples, positives = values[2 * BINS :]
        counts.loss_sum = float(loss_sum)
        counts.samples, counts.positives = int(samples), int(positives)
        return counts

    def metrics(self, suffix: str) -> dict[str, float]:
        if self.samples == 0:
            return {}
        return {
            f"auc{suffix}": auc_from_histograms(self.pos, self.neg),
            f"logloss{suffix}": self.loss_sum / self.samples,
            f"ctr{suffix}": self.positives / self.samples,
            f"samples{suffix}": float(self.samples),
        }


class ProgressiveMetrics:
    """Cumulative and windowed AUC / log loss of pre-update predictions."""

    def __init__(self) -> None:
        self._total = Counts()
        self._window = Counts()

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Count one batch: `logits` scored before the batch was trained on, `labels` 0/1."""
        logits = logits.detach().float().reshape(-1)
        labels = labels.detach().float().reshape(-1)
        loss = float(F.binary_cross_entropy_with_logits(logits, labels, reduction="sum"))
        # A diverged model scores NaN: bin it as no information (logit 0), not as a bad index.
        binned = torch.nan_to_num(logits, nan=0.0).clamp(-LOGIT_RANGE, LOGIT_RANGE)
        scaled = (binned + LOGIT_RANGE) * ((BINS - 1) / (2 * LOGIT_RANGE))
        bins = scaled.to(torch.int64).numpy()
        positive = labels.numpy() > 0.5
        pos = np.bincount(bins[positive], minlength=BINS)
        neg = np.bincount(bins[~positive], minlength=BINS)
        n, n_pos = int(labels.shape[0]), int(positive.sum())
        for counts in (self._total, self._window):
            counts.pos += pos
            counts.neg += neg
            counts.loss_sum += loss
            counts.samples += n
            counts.positives += n_pos

    def cumulative(self) -> dict[str, float]:
        """auc_cumulative, logloss_cumulative, ctr_cumulative, samples_cumulative: since this
        object was made, so a resumed trainer's start again (an AUC cannot be carried on from a
        manifest's: that needs the histograms, which no manifest keeps)."""
        return self._total.metrics("_cumulative")

    def window(self) -> dict[str, float]:
        """auc, logloss, ctr, samples over the current window (without resetting it)."""
        return self._window.metrics("")

    def take_window(self) -> dict[str, float]:
        """Window and cumulative metrics, then start a new window (called at checkpoints)."""
        values = {**self.window(), **self.cumulative()}
        self._window = Counts()
        return values

    def take_window_counts(self) -> tuple[Counts, Counts]:
        """The window's and the cumulative counts, then start a new window (a rank's part of
        a job's metrics, trainer/sharded/step_metrics.py)."""
        window, self._window = self._window, Counts()
        return window, self._total

    @staticmethod
    def metrics_of(window: Counts, total: Counts) -> dict[str, float]:
        """What `take_window` gives, from counts (a job's: summed over its ranks)."""
        return {**window.metrics(""), **total.metrics("_cumulative")}
