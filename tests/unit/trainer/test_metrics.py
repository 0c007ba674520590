"""Progressive-validation metrics: histogram AUC against the exact rank AUC, log loss, windows."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.progressive_metrics import BINS, LOGIT_RANGE, ProgressiveMetrics, auc_from_histograms


def histogram_bins(logits: np.ndarray) -> np.ndarray:
    """The bin of each logit, computed as ProgressiveMetrics bins them."""
    clamped = torch.from_numpy(logits).float().clamp(-LOGIT_RANGE, LOGIT_RANGE)
    return ((clamped + LOGIT_RANGE) * ((BINS - 1) / (2 * LOGIT_RANGE))).to(torch.int64).numpy()


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score_pos > score_neg) + 0.5 P(tie), by brute force over all pairs."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(2, 600), signal=st.floats(0.0, 3.0))
def test_histogram_auc_matches_exact_auc(seed: int, n: int, signal: float) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n).astype(np.float32)
    logits = (rng.normal(size=n) * 2 + signal * labels).astype(np.float32)
    metrics = ProgressiveMetrics()
    for lo in range(0, n, 97):  # several batches
        metrics.update(
            torch.from_numpy(logits[lo : lo + 97]), torch.from_numpy(labels[lo : lo + 97])
        )
    got = metrics.cumulative()
    if labels.min() == labels.max():
        assert math.isnan(got["auc_cumulative"])
        return
    # Exact up to the (positive, negative) pairs that share a histogram bin, which count one
    # half: with no shared bin the two agree to rounding, and never by more than half the
    # shared pairs (a small n can put a pair in one bin; the old fixed 2e-3 then failed).
    pos_bins, neg_bins = histogram_bins(logits[labels == 1]), histogram_bins(logits[labels == 0])
    shared = np.bincount(pos_bins, minlength=BINS) @ np.bincount(neg_bins, minlength=BINS)
    bound = 0.5 * shared / (len(pos_bins) * len(neg_bins))
    assert abs(got["auc_cumulative"] - exact_auc(logits, labels)) <= bound + 1e-12
    expected_loss = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.from_numpy(logits), torch.from_numpy(labels)
    )
    assert abs(got["logloss_cumulative"] - float(expected_loss)) < 1e-4
    assert got["samples_cumulative"] == n


def test_ties_count_half_and_window_resets() -> None:
    assert auc_from_histograms(np.array([0, 1]), np.array([0, 1])) == 0.5
    assert auc_from_histograms(np.array([0, 1]), np.array([1, 0])) == 1.0
    metrics = ProgressiveMetrics()
    metrics.update(torch.tensor([3.0, -3.0]), torch.tensor([1.0, 0.0]))
    first = metrics.take_window()
    assert first["auc"] == 1.0 and first["auc_cumulative"] == 1.0
    assert metrics.window() == {}
    metrics.update(torch.tensor([-3.0, 3.0]), torch.tensor([1.0, 0.0]))
    assert metrics.window()["auc"] == 0.0
    assert metrics.cumulative()["auc_cumulative"] == 0.5


def test_nan_scores_of_a_diverged_model_count_as_no_information() -> None:
    # The trainer goes on to its checkpoint, which refuses the NaN state (test_non_finite.py).
    m = ProgressiveMetrics()
    m.update(torch.tensor([math.nan, 2.0, -2.0, math.nan]), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    window = m.window()
    assert window["samples"] == 4 and window["auc"] == 0.875  # the two NaNs tie at logit 0
    assert math.isnan(window["logloss"])
