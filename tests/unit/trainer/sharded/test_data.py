"""The split of a global batch over the ranks, and its KeyedJaggedTensor."""

from __future__ import annotations

import pytest
import torch

from publisher.dlrm import SparseBatch
from trainer.sharded.data import (
    BatchSplitError,
    check_batch_size,
    padded_batch,
    rank_slice,
    scored_batch,
)
from trainer.streams.base import Batch


def _batch(n: int) -> Batch:
    """n samples: `one` holds id i for sample i; `bag` holds ids [i, i+1, ...] (i % 3 of them)."""
    sizes = [i % 3 for i in range(n)]
    bag_values = torch.tensor([i + k for i in range(n) for k in range(sizes[i])], dtype=torch.int64)
    bag_offsets = torch.tensor([sum(sizes[:i]) for i in range(n)], dtype=torch.int64)
    return Batch(
        dense=torch.arange(2 * n, dtype=torch.float32).reshape(n, 2),
        sparse={
            "one": SparseBatch(torch.arange(n), torch.arange(n)),
            "bag": SparseBatch(bag_values, bag_offsets),
        },
        labels=torch.ones(n),
        offset=100,
    )


def test_each_rank_takes_its_contiguous_slice() -> None:
    batch = _batch(8)
    for rank in range(2):
        part = rank_slice(batch, rank, 2, ["one", "bag"])
        own = range(4 * rank, 4 * rank + 4)
        assert torch.equal(part.dense, batch.dense[4 * rank : 4 * rank + 4])
        assert part.weights.tolist() == [1.0] * 4
        assert part.global_size == 8
        features = part.features.to_dict()
        assert features["one"].values().tolist() == list(own)
        assert features["bag"].lengths().tolist() == [i % 3 for i in own]
        assert features["bag"].values().tolist() == [i + k for i in own for k in range(i % 3)]


def test_a_short_last_batch_is_padded_with_empty_samples_of_weight_zero() -> None:
    batch = _batch(5)
    first, second = (rank_slice(batch, rank, 2, ["one", "bag"]) for rank in range(2))
    assert first.weights.tolist() == [1.0, 1.0, 1.0]
    assert second.weights.tolist() == [1.0, 1.0, 0.0]
    assert second.features.to_dict()["one"].lengths().tolist() == [1, 1, 0]
    assert second.features.to_dict()["one"].values().tolist() == [3, 4]
    assert second.dense[2].tolist() == [0.0, 0.0]
    # Fewer samples than ranks: a rank may hold padding only.
    last = rank_slice(_batch(2), 3, 4, ["one", "bag"])
    assert last.weights.tolist() == [0.0]
    assert last.features.values().numel() == 0


def test_a_global_batch_the_ranks_cannot_share_evenly_is_refused() -> None:
    check_batch_size(64, 2)
    with pytest.raises(BatchSplitError, match=r"--batch-size 63 .* multiple of 2 \(e.g. 62\)"):
        check_batch_size(63, 2)


def test_a_ranks_kept_batch_is_its_real_samples_with_their_bags() -> None:
    batch = Batch(
        dense=torch.arange(6, dtype=torch.float32).reshape(3, 2),
        sparse={
            "a": SparseBatch(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3])),
            "b": SparseBatch(torch.tensor([7, 8, 9]), torch.tensor([0, 1, 2])),
        },
        labels=torch.tensor([1.0, 0.0, 1.0]),
        offset=0,
    )
    kept = scored_batch(padded_batch(batch, 5, 3, ["a", "b"], 2))  # 2 padding samples
    assert kept.size == 3
    assert {k: (v.tolist(), o.tolist()) for k, (v, o) in kept.sparse.items()} == {
        "a": ([1, 2, 3, 4], [0, 1, 3]),
        "b": ([7, 8, 9], [0, 1, 2]),
    }
    assert kept.labels.tolist() == [1.0, 0.0, 1.0]
    assert kept.dense.tolist() == batch.dense.tolist()
