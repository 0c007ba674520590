"""The training loop every rank of a sharded job runs, over the same global batches.

    report = train_sharded(model, dense_optimizer, stream, batch_size=512, rank=r, world_size=n)

Each global batch is split over the ranks (trainer/sharded/data.py); every rank trains its
slice: forward through the sharded model, the weighted loss, backward (which runs the tables'
fused optimizer and DDP's all-reduce of the dense gradients), then the dense optimizer's step.
All ranks iterate the same batches, so they take the same number of steps and their collectives
pair up.

The checkpointer's seam (`RankCheckpointer`; trainer/sharded/checkpointing.py's
ShardedCheckpointer): per step `step(samples, rank_samples)` with the global batch's sample
count and this rank's share of it, then `maybe_checkpoint(reader)` with the stream's reader
position after that batch; `checkpoint_now(reader)` after the last batch when it was not
checkpointed (a run ends with a version, as the one-process loop's does, so a `--resume` picks
up exactly where it stopped); `close()` at the end, also when training failed. It needs no ids from
the loop: TorchRec's ModelDeltaTracker records the rows inside the sharded model's forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn import functional as F
from torchrec.distributed import DistributedModelParallel

from trainer.sharded.data import RankBatch, check_batch_size, rank_slice
from trainer.sharded.model import sharded_config
from trainer.streams.base import InteractionStream

Reader = Mapping[str, int | str | dict[str, int]]


class RankCheckpointer(Protocol):
    """What the loop calls on a rank's checkpointer (trainer/sharded/checkpointing.py)."""

    def step(self, samples: int, rank_samples: int | None = None) -> None:
        """One step over `samples` samples of all ranks, `rank_samples` of them this rank's."""

    def maybe_checkpoint(self, reader: Reader) -> object:
        """Checkpoint if the interval has passed (None if not); `reader`: where the stream
        resumes."""

    def checkpoint_now(self, reader: Reader) -> object:
        """Checkpoint now."""

    def close(self) -> None:
        """Training is over (or failed)."""


@dataclass
class ShardedReport:
    """What one rank's run of the loop did (samples and steps are the job's)."""

    start_offset: int
    end_offset: int
    samples: int
    steps: int
    seconds: float
    #: mean training loss of this rank's samples (before each step's update).
    loss: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def train_sharded(
    model: DistributedModelParallel,
    dense_optimizer: torch.optim.Optimizer,
    stream: InteractionStream,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    device: torch.device | None = None,
    start: int = 0,
    stop: int | None = None,
    checkpointer: RankCheckpointer | None = None,
    on_step: Callable[[ShardedReport], None] | None = None,
) -> ShardedReport:
    """Train this rank's part of `stream` from offset `start` to `stop` (or its end) in global
    batches of `batch_size` samples; `on_step` sees the report after every step."""
    check_batch_size(batch_size, world_size)
    device = device or torch.device("cpu")
    features = [f.name for f in sharded_config(model).sparse]
    model.train()
    report = ShardedReport(start, start, 0, 0, 0.0, float("nan"))
    loss_sum = 0.0
    local_samples = 0
    checkpointed_at = 0  # the step of the last checkpoint
    started = time.perf_counter()
    try:
        for batch in stream.batches(batch_size, start=start, stop=stop):
            local = rank_slice(batch, rank, world_size, features).to(device)
            loss = train_step(model, dense_optimizer, local, world_size)
            loss_sum += loss
            mine = int(local.weights.sum())  # padding samples weigh 0
            local_samples += mine
            report.end_offset = batch.end
            report.samples += batch.size
            report.steps += 1
            report.seconds = time.perf_counter() - started
            report.loss = loss_sum / max(local_samples, 1)
            if checkpointer is not None:
                checkpointer.step(batch.size, mine)
                if checkpointer.maybe_checkpoint(stream.reader_state(batch.end)) is not None:
                    checkpointed_at = report.steps
            if on_step is not None:
                on_step(report)
        if checkpointer is not None and report.steps > checkpointed_at:
            checkpointer.checkpoint_now(stream.reader_state(report.end_offset))
    finally:
        if checkpointer is not None:
            checkpointer.close()
    return report


def train_step(
    model: DistributedModelParallel,
    dense_optimizer: torch.optim.Optimizer,
    batch: RankBatch,
    world_size: int,
) -> float:
    """One step on this rank's slice; returns the sum of its samples' losses."""
    logits = model(batch.dense, batch.features)
    losses = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
    weighted = (losses * batch.weights).sum()
    dense_optimizer.zero_grad(set_to_none=True)
    # Ranks average their gradients: N / b makes that the mean over the global batch's b.
    torch.autograd.backward(weighted * (world_size / batch.global_size))
    dense_optimizer.step()
    return float(weighted.detach())
