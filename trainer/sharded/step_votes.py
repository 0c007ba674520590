"""How the ranks of a sharded job agree on each step, and how they split a live topic.

Rank r reads the partitions whose index in the sorted partition list (the topic's, or the URL's
`?partitions=`) is r mod N (`rank_partitions`): every partition has one reader, a rank may have
none (N > partitions) and still takes every step, with weight-0 padding.

Every step all ranks must join the same collectives (TorchRec's all-to-alls, the dense
all-reduce), but a topic gives each rank its events at its own pace, a signal reaches one rank
(or all, at different steps), and each rank's clock is its own. So before each step the ranks
exchange one small vote (`RankVote`: the samples it holds for the step, whether it has read its
part of the stream to its end, whether it was asked to stop, whether its clock says a
checkpoint is due) with one all_gather of an int64 tensor on a gloo group of their own, and
every rank derives the same `StepPlan` from the votes:

    any rank asked to stop (SIGTERM, Ctrl-C)        -> STOP (events in hand stay unread)
    samples somewhere                               -> STEP: each rank trains what it holds,
                                                       padded to the largest share; a
                                                       checkpoint follows when any clock
                                                       says one is due (--interval-seconds)
    none anywhere, --stop-at-end and all at end     -> STOP (a file always stops at its end)
    none anywhere                                   -> WAIT (poll again)

With a sample limit (`--max-samples`) the step that reaches it trains only the events up to it,
taken in rank order, and the job stops after it. On a file every rank holds its slice of the
same global batch (trainer/sharded/file_steps.py), so the plan is the batch.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from trainer.sharded.collective import GlooGroup


def rank_partitions(partitions: Sequence[int], rank: int, world_size: int) -> tuple[int, ...]:
    """The partitions rank `rank` of `world_size` reads: those at index rank mod world_size of
    the sorted list."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    return tuple(sorted(partitions)[rank::world_size])


@dataclass(frozen=True)
class RankVote:
    """What one rank says before a step."""

    #: good events it holds, ready to train.
    events: int
    #: it holds nothing and has read its partitions up to where they ended when it started
    #: (a rank without partitions always has).
    at_end: bool
    #: it was asked to stop.
    stop: bool
    #: its clock says a checkpoint is due (`--interval-seconds`: the ranks' clocks differ).
    due: bool = False

    def encode(self) -> torch.Tensor:
        fields = [self.events, int(self.at_end), int(self.stop), int(self.due)]
        return torch.tensor(fields, dtype=torch.int64)

    @classmethod
    def decode(cls, values: torch.Tensor) -> RankVote:
        events, at_end, stop, due = (int(v) for v in values.tolist())
        return cls(events, bool(at_end), bool(stop), bool(due))


class Decision(enum.Enum):
    STEP = "step"
    WAIT = "wait"
    STOP = "stop"


@dataclass(frozen=True)
class StepPlan:
    """What every rank does next; for STEP, the events each rank trains (rank order)."""

    decision: Decision
    take: tuple[int, ...] = ()
    #: the job stops after this step (it reaches the sample limit).
    last: bool = False
    #: every rank checkpoints after this step (some rank's clock said one is due).
    checkpoint: bool = False

    @property
    def local_size(self) -> int:
        """Samples of every rank's local batch (its events, then padding)."""
        return max(self.take, default=0)

    @property
    def global_size(self) -> int:
        """Samples the job trains in this step."""
        return sum(self.take)


def plan_step(
    votes: Sequence[RankVote], *, stop_at_end: bool, remaining: int | None = None
) -> StepPlan:
    """The plan every rank derives from the same votes (module docstring); `remaining`: samples
    left before the job's limit (None: no limit)."""
    if any(v.stop for v in votes) or (remaining is not None and remaining <= 0):
        return StepPlan(Decision.STOP)
    held = [v.events for v in votes]
    if not any(held):
        if stop_at_end and all(v.at_end for v in votes):
            return StepPlan(Decision.STOP)
        return StepPlan(Decision.WAIT)
    due = any(v.due for v in votes)
    if remaining is None or sum(held) < remaining:
        return StepPlan(Decision.STEP, tuple(held), checkpoint=due)
    take = []
    for n in held:
        take.append(min(n, remaining))
        remaining -= take[-1]
    return StepPlan(Decision.STEP, tuple(take), last=True, checkpoint=due)


class StepAgreement(GlooGroup):
    """The ranks' vote before each step, on a gloo group of their own (CPU tensors whatever the
    training backend; nothing else runs collectives on it, so it cannot interleave with the
    training collectives or the publishing thread's)."""

    def votes(self, mine: RankVote) -> list[RankVote]:
        """Every rank's vote, in rank order."""
        sent = mine.encode()
        parts = [torch.empty_like(sent) for _ in range(self.world_size)]
        self.run("the step vote", lambda: dist.all_gather(parts, sent, group=self.group))
        return [RankVote.decode(p) for p in parts]

    def sum(self, values: Sequence[int]) -> list[int]:
        """The element-wise sum of every rank's `values` (the same length on every rank)."""
        total = torch.tensor(list(values), dtype=torch.int64)
        self.run("a sum over the ranks", lambda: dist.all_reduce(total, group=self.group))
        return [int(v) for v in total.tolist()]

    def sum_floats(self, values: np.ndarray) -> np.ndarray:
        """The element-wise sum of every rank's float64 `values` (the same shape on every rank)."""
        total = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        self.run("a sum over the ranks", lambda: dist.all_reduce(total, group=self.group))
        return total.numpy()

    def sum_counters(self, mine: Mapping[str, float]) -> dict[str, float]:
        """Counters (whole numbers, the same names on every rank) summed over the ranks."""
        names = sorted(mine)
        if not names:  # a file's stream counts nothing, on every rank alike
            return {}
        return dict(zip(names, map(float, self.sum([round(mine[n]) for n in names])), strict=True))
