"""The window of recent samples each version is scored on: bounded, whole batches, no copies."""

from __future__ import annotations

import pytest
import torch

from publisher.dlrm import SparseBatch
from publisher.served_loss import ScoredBatch
from trainer.recent_samples import RecentSamples


def _add(window: RecentSamples, size: int, value: float) -> torch.Tensor:
    dense = torch.full((size, 2), value)
    ids = SparseBatch(torch.arange(size), torch.arange(size))
    window.add(ScoredBatch.of(dense, {"user": ids}, torch.zeros(size)))
    return dense


def test_the_window_keeps_the_latest_batches_covering_its_capacity() -> None:
    window = RecentSamples(1000)
    for i in range(10):
        _add(window, 300, float(i))
    taken = window.take()
    kept = taken.batches
    assert taken.fresh == 4  # every batch still in the window came since the last take
    assert all(isinstance(b, ScoredBatch) for b in kept)
    # 4 batches: the oldest of them is needed to cover 1000 samples, a fifth is not.
    assert [float(b.dense[0, 0]) for b in kept if isinstance(b, ScoredBatch)] == [6, 7, 8, 9]
    last = kept[-1]
    assert len(window) == 1200 and isinstance(last, ScoredBatch)
    assert last.sparse["user"][0].shape == (300,)


def test_a_kept_batch_is_a_view_and_take_is_immutable() -> None:
    window = RecentSamples(10)
    dense = _add(window, 5, 1.0)
    taken = window.take().batches
    (kept,) = taken
    assert isinstance(kept, ScoredBatch)
    assert kept.dense.ctypes.data == dense.data_ptr()  # no copy on the training thread
    _add(window, 5, 2.0)
    again = window.take()
    assert len(taken) == 1 and len(again.batches) == 2 and again.fresh == 1


def test_a_zero_window_keeps_nothing() -> None:
    window = RecentSamples(0)
    _add(window, 5, 1.0)
    assert window.take().batches == () and len(window) == 0
    with pytest.raises(ValueError):
        RecentSamples(-1)
