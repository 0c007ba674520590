"""Paired comparison of two models on the same examples (publisher/paired_quality.py): DeLong's
AUC difference against its definition, interval coverage on simulated pairs of equal models,
a better model found, log loss and calibration, bad inputs refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from publisher.paired_quality import auc_interval, delong_auc_diff, paired_quality
from publisher.served_loss import roc_auc


def _pair(rng: np.random.Generator, n: int, noise_a: float, noise_b: float, rate: float = 0.3):
    signal = rng.normal(size=n)
    labels = (rng.random(n) < 1 / (1 + np.exp(-(signal * 2 + math.log(rate / (1 - rate)))))).astype(
        float
    )
    a = 1 / (1 + np.exp(-(signal + rng.normal(scale=noise_a, size=n))))
    b = 1 / (1 + np.exp(-(signal + rng.normal(scale=noise_b, size=n))))
    return labels, a, b


def _delong_by_definition(y: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(AUC difference, its variance) from the O(m n) kernel matrices of DeLong et al."""
    pos, neg = y > 0.5, y < 0.5

    def psi(s: np.ndarray) -> np.ndarray:
        x, z = s[pos][:, None], s[neg][None, :]
        return (x > z) + 0.5 * (x == z)

    pa, pb = psi(a), psi(b)
    m, n = pa.shape
    v10 = np.stack([pa.mean(1), pb.mean(1)])
    v01 = np.stack([pa.mean(0), pb.mean(0)])
    s10, s01 = np.cov(v10), np.cov(v01)
    contrast = np.array([1.0, -1.0])
    var = contrast @ s10 @ contrast / m + contrast @ s01 @ contrast / n
    return float(pa.mean() - pb.mean()), float(var)


def test_delong_matches_its_definition_with_ties() -> None:
    rng = np.random.default_rng(0)
    y, a, b = _pair(rng, 300, 0.5, 1.0)
    a, b = np.round(a, 2), np.round(b, 1)  # ties within and across classes
    got = delong_auc_diff(y, a, b)
    assert got is not None
    auc_a, auc_b, diff = got
    assert auc_a == pytest.approx(roc_auc(a, y)) and auc_b == pytest.approx(roc_auc(b, y))
    want, var = _delong_by_definition(y, a, b)
    assert diff.estimate == pytest.approx(want, abs=1e-12)
    assert (diff.high - diff.low) / 2 == pytest.approx(1.959964 * math.sqrt(var), rel=1e-5)


def test_intervals_of_two_equal_models_hold_zero_about_95_in_100() -> None:
    rng = np.random.default_rng(1)
    auc_cover = loss_cover = 0
    runs = 300
    for _ in range(runs):
        y, a, b = _pair(rng, 400, 1.0, 1.0)
        q = paired_quality(y, a, b)
        assert q.auc_diff is not None
        auc_cover += not q.auc_diff.excludes(0.0)
        loss_cover += not q.logloss_diff.excludes(0.0)
    # binomial(300, 0.95): 3 sd is +-3.8 points
    assert 0.91 <= auc_cover / runs <= 0.99, auc_cover
    assert 0.91 <= loss_cover / runs <= 0.99, loss_cover


def test_a_better_model_is_found_and_the_same_model_is_not() -> None:
    rng = np.random.default_rng(2)
    y, a, b = _pair(rng, 5000, 0.3, 1.5)
    q = paired_quality(y, a, b)
    assert q.auc_diff is not None and q.auc_diff.low > 0  # the candidate ranks better
    assert q.logloss_diff.high < 0  # and loses less
    same = paired_quality(y, a, a)
    assert same.auc_diff is not None
    assert same.auc_diff.estimate == same.auc_diff.low == same.auc_diff.high == 0.0
    assert same.logloss_diff.low == same.logloss_diff.high == 0.0
    assert q.examples == 5000 and q.positives == int(y.sum())


def test_calibration_is_near_one_for_calibrated_scores() -> None:
    rng = np.random.default_rng(3)
    p = rng.uniform(0.01, 0.2, 20_000)
    y = (rng.random(20_000) < p).astype(float)
    q = paired_quality(y, p, np.clip(p * 2, 0, 1))
    assert q.calibration is not None
    calibrated, doubled = q.calibration
    assert not calibrated.excludes(1.0)
    assert doubled.low > 1.8  # twice the observed rate


def test_one_class_has_no_auc_and_bad_inputs_are_refused() -> None:
    q = paired_quality([0, 0, 0], [0.1, 0.2, 0.3], [0.3, 0.2, 0.1])
    assert q.auc is None and q.auc_diff is None and q.calibration is None
    assert q.positives == 0 and q.logloss[0] < q.logloss[1]
    for labels, a, b, match in [
        ([0, 1], [0.5], [0.5, 0.5], "length"),
        ([], [], [], "no examples"),
        ([0, 2], [0.5, 0.5], [0.5, 0.5], "0 or 1"),
        ([0, 1], [0.5, 1.5], [0.5, 0.5], r"\[0, 1\]"),
        ([0, 1], [0.5, float("nan")], [0.5, 0.5], "not finite"),
    ]:
        with pytest.raises(ValueError, match=match):
            paired_quality(labels, a, b)
    with pytest.raises(ValueError, match="level"):
        paired_quality([0, 1], [0.2, 0.8], [0.3, 0.7], level=1.0)


def _clustered_pair(
    rng: np.random.Generator, runs: int, run: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two equally good models on examples that come in runs of `run` alike ones (a user's
    session): each run shares a random share of each model's error, so the runs' examples are
    correlated, within a model and across the pair."""
    n = runs * run
    signal = np.repeat(rng.normal(size=runs), run) + 0.5 * rng.normal(size=n)
    labels = (rng.random(n) < 1 / (1 + np.exp(-2 * signal))).astype(float)

    def model() -> np.ndarray:
        shared = np.repeat(rng.normal(scale=1.0, size=runs), run)
        return 1 / (1 + np.exp(-(signal + shared + 0.3 * rng.normal(size=n))))

    return labels, model(), model()


def test_blocked_intervals_cover_runs_of_alike_examples_where_independent_ones_do_not() -> None:
    rng = np.random.default_rng(4)
    cover = {1: [0, 0], 32: [0, 0]}
    trials = 200
    for _ in range(trials):
        y, a, b = _clustered_pair(rng, 64, 32)
        for block in cover:
            q = paired_quality(y, a, b, block=block)
            assert q.auc_diff is not None
            cover[block][0] += not q.auc_diff.excludes(0.0)
            cover[block][1] += not q.logloss_diff.excludes(0.0)
    # Blocks of the runs' length cover ~95%; taking the examples as independent, far less.
    assert all(0.89 <= c / trials <= 0.99 for c in cover[32]), cover
    assert all(c / trials < 0.8 for c in cover[1]), cover


def test_blocks_of_one_are_the_independent_intervals() -> None:
    rng = np.random.default_rng(5)
    y, a, b = _pair(rng, 2000, 0.5, 1.0)
    plain, blocked = paired_quality(y, a, b), paired_quality(y, a, b, block=1)
    assert plain == blocked
    wide = paired_quality(y, a, b, block=7)  # independent examples: about the same width
    assert plain.auc_diff is not None and wide.auc_diff is not None
    width = plain.auc_diff.high - plain.auc_diff.low
    assert 0.7 < (wide.auc_diff.high - wide.auc_diff.low) / width < 1.3
    single = auc_interval(y, a, block=7)
    assert single is not None and single.estimate == pytest.approx(roc_auc(a, y))
    assert single.low < single.estimate < single.high
