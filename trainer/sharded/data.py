"""A rank's part of a global batch: the deterministic split of a stream over the ranks.

Every rank reads the same stream and takes, of each global batch of b samples, the contiguous
slice [r * L, (r + 1) * L) with L = ceil(b / N): with b = B (the `--batch-size`, which N MUST
divide) that is r*B/N .. (r+1)*B/N. Only the stream's last batch may be shorter; a rank whose
slice is then short is padded with empty samples (no id in any bag, so no row is looked up, and
weight 0 in the loss), because TorchRec's collectives need the same local batch size on every
rank (a row-wise job with unequal ones fails in its backward pass: `ProcessGroupGloo::allgather:
invalid tensor size`). The loss of a rank is the sum of its samples' losses times N / b, so
that the mean over the ranks (what DDP and DMP average) is the mean over the b samples: the
gradient one process takes on the global batch.

A live topic is not split by sample index: each rank reads its own partitions, and a step's
global batch is what the ranks hold together (`padded_batch`: a rank's events padded to the
largest share; trainer/sharded/loop.py). The loss scale is the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torchrec import KeyedJaggedTensor

from publisher.dlrm import SparseBatch
from publisher.served_loss import ScoredBatch
from trainer.streams.base import Batch, DataError


class BatchSplitError(DataError):
    """A global batch size the ranks cannot share evenly."""


@dataclass(frozen=True)
class RankBatch:
    """This rank's slice of a global batch, padded to the local batch size."""

    dense: torch.Tensor  # float32 (L, n_dense)
    features: KeyedJaggedTensor  # L samples per feature
    labels: torch.Tensor  # float32 (L,)
    #: 1 for a sample of the stream, 0 for padding.
    weights: torch.Tensor  # float32 (L,)
    #: samples in the global batch (all ranks).
    global_size: int

    def to(self, device: torch.device) -> RankBatch:
        """This batch on `device`."""
        return RankBatch(
            self.dense.to(device),
            self.features.to(device),
            self.labels.to(device),
            self.weights.to(device),
            self.global_size,
        )


def check_batch_size(batch_size: int, world_size: int) -> None:
    """Refuse a global batch size that the ranks cannot split into equal slices."""
    if batch_size % world_size:
        nearest = batch_size - batch_size % world_size or world_size
        raise BatchSplitError(
            f"--batch-size {batch_size} is the global batch, split evenly over {world_size} "
            f"ranks: give a multiple of {world_size} (e.g. {nearest})"
        )


def rank_slice(batch: Batch, rank: int, world_size: int, features: Sequence[str]) -> RankBatch:
    """Rank `rank`'s samples of `batch` (see the module docstring), features in that order."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    local = -(-batch.size // world_size)
    lo = min(rank * local, batch.size)
    return _padded_rows(batch, lo, min(lo + local, batch.size), local, batch.size, features)


def padded_batch(
    batch: Batch | None,
    local_size: int,
    global_size: int,
    features: Sequence[str],
    n_dense: int,
) -> RankBatch:
    """All of `batch` (None: no samples) padded to `local_size` samples: a rank's part of a
    step whose `global_size` samples the ranks read each from its own source (a live topic's
    partitions, trainer/sharded/loop.py)."""
    if batch is None:
        return RankBatch(
            dense=torch.zeros(local_size, n_dense),
            features=KeyedJaggedTensor(
                keys=list(features),
                values=torch.zeros(0, dtype=torch.int64),
                lengths=torch.zeros(local_size * len(features), dtype=torch.int64),
            ),
            labels=torch.zeros(local_size),
            weights=torch.zeros(local_size),
            global_size=global_size,
        )
    if batch.size > local_size:
        raise ValueError(f"a batch of {batch.size} samples does not fit {local_size}")
    return _padded_rows(batch, 0, batch.size, local_size, global_size, features)


def _padded_rows(
    batch: Batch, lo: int, hi: int, local: int, global_size: int, features: Sequence[str]
) -> RankBatch:
    """Samples [lo, hi) of `batch` and weight-0 empty samples after them, `local` in all."""
    pad = local - (hi - lo)
    weights = torch.ones(local)
    weights[hi - lo :] = 0.0
    dense = batch.dense[lo:hi]
    return RankBatch(
        dense=torch.cat([dense, dense.new_zeros(pad, dense.shape[1])]) if pad else dense,
        features=keyed_features(batch.sparse, features, lo, hi, pad),
        labels=torch.cat([batch.labels[lo:hi], batch.labels.new_zeros(pad)]),
        weights=weights,
        global_size=global_size,
    )


def keyed_features(
    sparse: Mapping[str, SparseBatch], features: Sequence[str], lo: int, hi: int, pad: int = 0
) -> KeyedJaggedTensor:
    """Samples [lo, hi) of the id bags as a KeyedJaggedTensor (keys in `features` order), with
    `pad` empty bags after them."""
    values, lengths = [], []
    for name in features:
        bags = sparse[name]
        ends = torch.cat([bags.offsets[1:], bags.offsets.new_tensor([bags.values.numel()])])
        starts = bags.offsets
        if hi > lo:
            values.append(bags.values[starts[lo] : ends[hi - 1]])
        lengths.append(ends[lo:hi] - starts[lo:hi])
        lengths.append(torch.zeros(pad, dtype=torch.int64))
    return KeyedJaggedTensor(
        keys=list(features),
        values=torch.cat(values) if values else torch.zeros(0, dtype=torch.int64),
        lengths=torch.cat(lengths),
    )


def scored_batch(batch: RankBatch) -> ScoredBatch:
    """The real samples of a rank's batch (the padding after them left out) as the DLRM's kept
    batch (publisher/served_loss.py): what rank 0 scores each version on as served. Numpy views
    of the batch's tensors, no copy (a step's batch is built afresh and never changed), read
    from the KeyedJaggedTensor's flat values and lengths: one slice per feature."""
    n = int((batch.weights > 0).sum())
    kjt = batch.features
    values, lengths = kjt.values().cpu(), kjt.lengths().cpu()
    local = int(batch.labels.shape[0])
    sparse = {}
    start = 0
    for k, name in enumerate(kjt.keys()):
        mine = lengths[k * local : k * local + n]
        offsets = torch.zeros(n, dtype=torch.int64)
        if n > 1:
            offsets[1:] = torch.cumsum(mine[:-1], 0)
        taken = int(mine.sum())
        sparse[name] = (values[start : start + taken].numpy(), offsets.numpy())
        start += int(lengths[k * local : (k + 1) * local].sum())
    return ScoredBatch(
        dense=batch.dense[:n].detach().cpu().numpy(),
        sparse=sparse,
        labels=batch.labels[:n].detach().cpu().numpy(),
    )
