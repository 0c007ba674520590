"""The training loop every rank of a sharded job runs, over a step source: a file or a topic.

    report = train_steps(model, dense_optimizer, FileSteps(stream, 512, rank, n, features),
                         StepAgreement.new(60.0), checkpointer=ckpt, stop_event=stop)

Before every step the ranks vote (trainer/sharded/step_votes.py) and all do the same: step,
wait and poll again, or stop. A step trains each rank's samples of it (its slice of the file's
global batch, or the events it read from its partitions), padded with weight-0 samples to the
largest share, so the local batch sizes match as TorchRec's collectives need: forward through
the sharded model, the weighted loss, backward (which runs the tables' fused optimizer and DDP's
all-reduce of the dense gradients), then the dense optimizer's step. The loss scale is the
step's samples over all ranks (trainer/sharded/data.py), so the gradient is the mean over them.

The vote is where the ranks agree on what one process decides alone: a stop (SIGTERM or Ctrl-C
on any rank, file or topic alike: the job ends with a final version and exits 0), a checkpoint
by time (`--interval-seconds`: each rank's clock votes, every rank checkpoints after the same
step), the end of the data, a sample limit.

The checkpointer's seam (`RankCheckpointer`; trainer/sharded/checkpointing.py's
ShardedCheckpointer): per step `keep_scored(batch)` (the samples just scored, which rank 0 keeps
to measure each version's served loss on), `step(samples, rank_samples)` with the step's
samples and this rank's share of them, then `maybe_checkpoint(reader, metrics, due=...)` with
the source's reader position after the step; `checkpoint_now(reader, metrics)` when the loop
ends with something not yet in a version (steps, or a reader that moved past bad records);
`close()` at the end, also when training failed. It needs no ids from the loop: TorchRec's
ModelDeltaTracker records the rows inside the sharded model's forward. Every version carries
the job's metrics: the training loss and progressive metrics of its samples (scored before they
are trained on, summed over the ranks) and the source's counters (bad events, lag).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn import functional as F
from torchrec.distributed import DistributedModelParallel

from trainer.sharded.data import RankBatch, check_batch_size
from trainer.sharded.file_steps import FileSteps
from trainer.sharded.model import sharded_config
from trainer.sharded.step_metrics import StepMetrics
from trainer.sharded.step_votes import Decision, RankVote, StepAgreement, StepPlan, plan_step
from trainer.streams.base import InteractionStream

Reader = Mapping[str, int | str | dict[str, int]]
Metrics = Mapping[str, float] | Callable[[], Mapping[str, float]]

#: how long a rank with nothing in hand waits for its source before it votes, when the last vote
#: found nothing anywhere (its peers wait for its vote as long).
POLL_S = 0.05
#: the same after a step: a rank whose partitions are quiet must not hold up the ranks that have
#: events (measured with 0.05 s here: 3 ranks on a topic of 2 partitions, one of them drained,
#: took 55 ms a step instead of ~5); a rank whose reader is behind votes 0 and its peers step.
STEP_POLL_S = 0.0


class StepSource(Protocol):
    """A rank's part of the job's data (trainer/sharded/file_steps.py, topic_part.py)."""

    def poll(self, timeout_s: float) -> int:
        """This rank's samples ready for the next step, after waiting up to `timeout_s` for
        some if it holds none."""

    @property
    def at_end(self) -> bool:
        """Nothing in hand and this rank's part read to its end."""

    def step_batch(self, plan: StepPlan, rank: int) -> RankBatch:
        """This rank's local batch of the step the ranks agreed on."""

    @property
    def offset(self) -> int:
        """Where this rank is: a file's stream offset, or its samples of a topic in this run."""

    def reader(self) -> Reader:
        """Where this rank resumes after the samples it took."""

    def metrics(self) -> dict[str, float]:
        """This rank's counters that the job sums (bad events, lag)."""


class RankCheckpointer(Protocol):
    """What the loop calls on a rank's checkpointer (trainer/sharded/checkpointing.py)."""

    def step(self, samples: int, rank_samples: int | None = None) -> None:
        """One step over `samples` samples of all ranks, `rank_samples` of them this rank's."""

    @property
    def time_due(self) -> bool:
        """Whether this rank's clock says a checkpoint is due (its vote)."""

    def keep_scored(self, batch: RankBatch) -> None:
        """This rank's samples of the step, scored before it trained on them (what the
        served loss is measured on)."""

    def maybe_checkpoint(
        self, reader: Reader | None = None, metrics: Metrics | None = None, *, due: bool = False
    ) -> object:
        """Checkpoint if the interval has passed or `due` (None if not)."""

    def checkpoint_now(
        self, reader: Reader | None = None, metrics: Metrics | None = None
    ) -> object:
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
    #: why the loop ended: "end" of the data or the sample limit, or "stop" (a signal).
    stopped: str = "end"

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def train_steps(
    model: DistributedModelParallel,
    dense_optimizer: torch.optim.Optimizer,
    source: StepSource,
    agreement: StepAgreement,
    *,
    device: torch.device | None = None,
    stop_at_end: bool = True,
    stop_event: threading.Event | None = None,
    max_samples: int | None = None,
    checkpointer: RankCheckpointer | None = None,
    on_step: Callable[[ShardedReport], None] | None = None,
) -> ShardedReport:
    """Train this rank's part of `source` until the ranks agree to stop: a stop asked on any
    rank (`stop_event`), `max_samples` samples of the job in this run, or (`stop_at_end`) every
    rank's part read to its end. `samples` and `steps` of the report are the job's, its
    offsets the source's (`StepSource.offset`)."""
    device = device or torch.device("cpu")
    model.train()
    report = ShardedReport(source.offset, source.offset, 0, 0, 0.0, float("nan"))
    metrics = StepMetrics(agreement)
    checkpointed_at = 0  # the step of the last checkpoint
    checkpointed_reader = source.reader()

    def job_metrics() -> dict[str, float]:
        return {**metrics.job(), **agreement.sum_counters(source.metrics())}

    started = time.perf_counter()
    wait = POLL_S
    try:
        while True:
            held = source.poll(wait)
            stop = stop_event is not None and stop_event.is_set()
            due = checkpointer is not None and checkpointer.time_due
            votes = agreement.votes(RankVote(held, source.at_end, stop, due))
            remaining = None if max_samples is None else max_samples - report.samples
            plan = plan_step(votes, stop_at_end=stop_at_end, remaining=remaining)
            if plan.decision is Decision.STOP:
                report.stopped = "stop" if any(v.stop for v in votes) else "end"
                break
            if plan.decision is Decision.WAIT:
                wait = POLL_S
                continue
            wait = STEP_POLL_S
            mine = plan.take[agreement.rank]
            local = source.step_batch(plan, agreement.rank).to(device)
            logits = train_step(model, dense_optimizer, local, agreement.world_size)
            metrics.add(logits, local)
            report.end_offset = source.offset
            report.samples += plan.global_size
            report.steps += 1
            report.seconds = time.perf_counter() - started
            report.loss = metrics.rank_loss
            if checkpointer is not None:
                checkpointer.keep_scored(local)
                checkpointer.step(plan.global_size, mine)
                reader = source.reader()
                record = checkpointer.maybe_checkpoint(reader, job_metrics, due=plan.checkpoint)
                if record is not None:
                    checkpointed_at, checkpointed_reader = report.steps, reader
            if on_step is not None:
                on_step(report)
            if plan.last:
                break
        if checkpointer is not None:
            reader = source.reader()
            # A reader also moves past bad records, which train nothing: one vote of all ranks.
            (moved,) = agreement.sum([int(reader != checkpointed_reader)])
            if report.steps > checkpointed_at or moved:
                checkpointer.checkpoint_now(reader, job_metrics)
    finally:
        if checkpointer is not None:
            checkpointer.close()
    report.seconds = time.perf_counter() - started
    return report


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
    stop_event: threading.Event | None = None,
    agreement: StepAgreement | None = None,
) -> ShardedReport:
    """`train_steps` over a file or data set: every rank reads `stream` from offset `start` to
    `stop` (or its end) in global batches of `batch_size` samples and trains its slice of each
    (a collective call: it makes the ranks' vote group unless given `agreement`)."""
    check_batch_size(batch_size, world_size)
    features = [f.name for f in sharded_config(model).sparse]
    source = FileSteps(stream, batch_size, rank, world_size, features, start=start, stop=stop)
    return train_steps(
        model,
        dense_optimizer,
        source,
        agreement or StepAgreement.new(timeout_s=300.0),
        device=device,
        stop_event=stop_event,
        checkpointer=checkpointer,
        on_step=on_step,
    )


def train_step(
    model: DistributedModelParallel,
    dense_optimizer: torch.optim.Optimizer,
    batch: RankBatch,
    world_size: int,
) -> torch.Tensor:
    """One step on this rank's slice; returns its logits (scored before the update)."""
    logits: torch.Tensor = model(batch.dense, batch.features)
    losses = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
    weighted = (losses * batch.weights).sum()
    dense_optimizer.zero_grad(set_to_none=True)
    # Ranks average their gradients: N / b makes that the mean over the global batch's b.
    torch.autograd.backward(weighted * (world_size / batch.global_size))
    dense_optimizer.step()
    return logits.detach()
