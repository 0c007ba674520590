"""A rank's part of a file or data set as a step source: its slice of each global batch.

    source = FileSteps(stream, batch_size=512, rank=r, world_size=n, features=names)

Every rank reads the same stream and, at each step, holds its slice of the same next global batch
(trainer/sharded/data.py `rank_slice`), so the ranks' votes (trainer/sharded/step_votes.py)
always agree to train the batch; the source is at its end once the stream is. Its reader is the
stream's position after the batches taken: the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from trainer.sharded.data import RankBatch, rank_slice
from trainer.sharded.step_votes import StepPlan
from trainer.streams.base import Batch, InteractionStream


class FileSteps:
    """The global batches of `stream` from `start` to `stop` (or its end), sliced for `rank`."""

    def __init__(
        self,
        stream: InteractionStream,
        batch_size: int,
        rank: int,
        world_size: int,
        features: Sequence[str],
        *,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        self.stream = stream
        self.rank = rank
        self.world_size = world_size
        self.features = list(features)
        #: the stream offset after the batches taken.
        self.offset = start
        self._batches: Iterator[Batch] = stream.batches(batch_size, start=start, stop=stop)
        self._next: tuple[Batch, RankBatch] | None = None
        self._ended = False

    def poll(self, timeout_s: float) -> int:
        """This rank's samples of the next global batch (0 past the end); never waits."""
        if self._next is None and not self._ended:
            batch = next(self._batches, None)
            if batch is None:
                self._ended = True
            else:
                local = rank_slice(batch, self.rank, self.world_size, self.features)
                self._next = (batch, local)
        return 0 if self._next is None else int(self._next[1].weights.sum())

    @property
    def at_end(self) -> bool:
        return self._next is None and self._ended

    def step_batch(self, plan: StepPlan, rank: int) -> RankBatch:
        """This rank's slice of the batch it voted with (the plan is that batch)."""
        assert self._next is not None, "a step without a polled batch"
        batch, local = self._next
        self._next = None
        self.offset = batch.end
        return local

    def reader(self) -> dict[str, int | str | dict[str, int]]:
        return self.stream.reader_state(self.offset)

    def metrics(self) -> dict[str, float]:
        return self.stream.metrics()
