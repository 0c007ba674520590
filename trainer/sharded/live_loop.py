"""The training loop of a sharded job on a live topic: each rank trains the events it reads.

    report = train_sharded_live(model, dense_optimizer, part, StepAgreement.new(60.0),
                                stop_at_end=True, checkpointer=ckpt)

Each rank reads its own partitions (trainer/sharded/topic_part.py). Before every step the ranks
vote (trainer/sharded/live_steps.py) and all do the same: step, wait and poll again, or stop. A
step trains every rank's events in hand, each rank's padded to the largest share with weight-0
samples, so the local batch sizes match as TorchRec's collectives need; the loss scale is the
step's samples over all ranks (trainer/sharded/data.py), so the gradient is the mean over them.

Checkpoints come where the job's sample clock says, at the same step on every rank: each rank's
snapshot carries its own reader (its partitions' offsets: `position.ranks`), the committed
version the union (`position.reader`, publisher/write/job_publishing.py), and metrics summed
over the ranks (bad events by reason, consumer lag) by one all_reduce then. A run ends with a
version when it trained anything since the last one or some rank's reader moved (past bad
records) since then, as the one-process loop's does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torchrec.distributed import DistributedModelParallel

from trainer.sharded.checkpointing import ShardedCheckpointer
from trainer.sharded.data import padded_batch
from trainer.sharded.live_steps import Decision, RankVote, StepAgreement, plan_step
from trainer.sharded.loop import ShardedReport, train_step
from trainer.sharded.model import sharded_config
from trainer.streams.base import Batch

#: how long a rank with no events in hand waits for its reader before it votes, when the last
#: vote found no events anywhere (its peers wait for its vote as long).
POLL_S = 0.05
#: the same after a step: a rank whose partitions are quiet must not hold up the ranks that have
#: events (measured with 0.05 s here: 3 ranks on a topic of 2 partitions, one of them drained,
#: took 55 ms a step instead of ~5); a rank whose reader is behind votes 0 and its peers step.
STEP_POLL_S = 0.0

Reader = Mapping[str, int | str | dict[str, int]]


class RankEvents(Protocol):
    """What the loop needs of a rank's part of the stream (trainer/sharded/topic_part.py)."""

    def poll(self, timeout_s: float) -> int:
        """Good events in hand, after waiting up to `timeout_s` for some if there were none."""

    @property
    def at_end(self) -> bool:
        """Nothing in hand and the rank's part read to its end."""

    def take(self, n: int) -> Batch | None:
        """The first `n` events in hand (None for 0)."""

    def reader(self) -> Reader:
        """Where this rank stops."""

    def metrics(self) -> dict[str, float]:
        """This rank's counters that the job sums."""


def train_sharded_live(
    model: DistributedModelParallel,
    dense_optimizer: torch.optim.Optimizer,
    events: RankEvents,
    agreement: StepAgreement,
    *,
    device: torch.device | None = None,
    stop_at_end: bool = False,
    stop_event: threading.Event | None = None,
    max_samples: int | None = None,
    checkpointer: ShardedCheckpointer | None = None,
    on_step: Callable[[ShardedReport], None] | None = None,
) -> ShardedReport:
    """Train this rank's events until the ranks agree to stop: a stop asked on any rank
    (`stop_event`), `max_samples` samples of the job in this run, or (`stop_at_end`) every
    rank's partitions read to where they ended when reading began. `samples` and `steps` of the
    report are the job's; `end_offset` counts this rank's samples."""
    device = device or torch.device("cpu")
    config = sharded_config(model)
    features = [f.name for f in config.sparse]
    rank = agreement.rank
    model.train()
    report = ShardedReport(0, 0, 0, 0, 0.0, float("nan"))
    loss_sum = 0.0
    checkpointed_at = 0  # the step of the last checkpoint
    checkpointed_reader = events.reader()

    def job_metrics() -> dict[str, float]:
        return agreement.sum_counters(events.metrics())

    started = time.perf_counter()
    wait = POLL_S
    try:
        while True:
            held = events.poll(wait)
            stop = stop_event is not None and stop_event.is_set()
            votes = agreement.votes(RankVote(held, events.at_end, stop))
            remaining = None if max_samples is None else max_samples - report.samples
            plan = plan_step(votes, stop_at_end=stop_at_end, remaining=remaining)
            if plan.decision is Decision.STOP:
                break
            if plan.decision is Decision.WAIT:
                wait = POLL_S
                continue
            wait = STEP_POLL_S
            mine = plan.take[rank]
            local = padded_batch(
                events.take(mine), plan.local_size, plan.global_size, features, len(config.dense)
            )
            loss_sum += train_step(model, dense_optimizer, local.to(device), agreement.world_size)
            report.end_offset += mine
            report.samples += plan.global_size
            report.steps += 1
            report.seconds = time.perf_counter() - started
            report.loss = loss_sum / max(report.end_offset, 1)
            if checkpointer is not None:
                checkpointer.step(plan.global_size, mine)
                reader = events.reader()
                if checkpointer.maybe_checkpoint(reader, job_metrics) is not None:
                    checkpointed_at, checkpointed_reader = report.steps, reader
            if on_step is not None:
                on_step(report)
            if plan.last:
                break
        if checkpointer is not None and report.steps:
            reader = events.reader()
            # A reader also moves past bad records, which train nothing: one vote of all ranks.
            (moved,) = agreement.sum([int(reader != checkpointed_reader)])
            if report.steps > checkpointed_at or moved:
                checkpointer.checkpoint_now(reader, job_metrics)
    finally:
        if checkpointer is not None:
            checkpointer.close()
    report.seconds = time.perf_counter() - started
    return report
