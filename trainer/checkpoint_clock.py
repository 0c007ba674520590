"""When the next checkpoint is due: after `interval_samples` samples or `interval_seconds` seconds,
whichever comes first, counted from the last checkpoint (or the resumed position)."""

from __future__ import annotations

import time
from collections.abc import Callable

from trainer.errors import CheckpointError


class CheckpointClock:
    """Counts optimizer steps and samples, and says when an interval has passed.

    Neither interval set: never due (the caller checkpoints when it chooses).
    """

    def __init__(
        self,
        interval_samples: int | None = None,
        interval_seconds: float | None = None,
        *,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_samples is not None and interval_samples < 1:
            raise CheckpointError(f"interval_samples must be >= 1, got {interval_samples}")
        if interval_seconds is not None and interval_seconds <= 0:
            raise CheckpointError(f"interval_seconds must be > 0, got {interval_seconds}")
        self.interval_samples = interval_samples
        self.interval_seconds = interval_seconds
        self._now = now
        self.step_count = 0
        self.samples_seen = 0
        self._since_samples = 0
        self._since_time = now()

    def step(self, samples: int) -> None:
        """Count one optimizer step over `samples` samples."""
        self.step_count += 1
        self.samples_seen += samples
        self._since_samples += samples

    def due(self) -> bool:
        """Whether an interval has passed since the last `restart`."""
        return self.due_by_samples() or self.due_by_time()

    def due_by_samples(self) -> bool:
        """Whether `interval_samples` have passed (the same on every rank of a job: they count
        the job's samples)."""
        return self.interval_samples is not None and self._since_samples >= self.interval_samples

    def due_by_time(self) -> bool:
        """Whether `interval_seconds` have passed (this process's clock: the ranks of a job
        vote on it, trainer/sharded/step_votes.py)."""
        return (
            self.interval_seconds is not None
            and self._now() - self._since_time >= self.interval_seconds
        )

    def restart(self) -> None:
        """A checkpoint was taken: the next interval starts now."""
        self._since_samples = 0
        self._since_time = self._now()

    def resume_at(self, step: int, samples_seen: int) -> None:
        """Continue the counts of a restored checkpoint; its interval starts now."""
        self.step_count = step
        self.samples_seen = samples_seen
        self.restart()
