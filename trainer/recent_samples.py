"""The most recent progressive-validation samples, kept to score each version on.

Each version's manifest records what quantization costs it as a server holds it, scored on the
samples the run saw last whose rows the version carries (publisher/served_loss.py: all of them in
a full version, at least those of the version's own interval in a delta). The training thread
only appends the batch it just scored and drops the oldest whole batches beyond `capacity`
samples; a checkpoint hands the window over as an immutable tuple. A batch is a `ScoredBatch`
for the built-in DLRM (numpy views of its tensors, no copy: the streams build fresh tensors, or
views of columns nobody writes, for every batch) or a `KeptBatch` for any other model (copies
of its inputs), so a kept batch never changes under the publisher.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from publisher.served_loss import KeptSample


@dataclass(frozen=True)
class KeptWindow:
    """The window at a checkpoint: its batches, oldest first, and how many of the newest ones
    were kept since the checkpoint before (`fresh`: events no earlier version trained on)."""

    batches: tuple[KeptSample, ...]
    fresh: int


class RecentSamples:
    """A bounded window of the latest batches: at most `capacity` samples (0: keeps nothing)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 samples, got {capacity}")
        self.capacity = capacity
        self._batches: deque[KeptSample] = deque()
        self._held = 0
        #: batches added since the last `take`.
        self._fresh = 0

    def add(self, batch: KeptSample) -> None:
        """Keep one batch (dropping the oldest ones the window no longer needs)."""
        if self.capacity == 0:
            return
        self._batches.append(batch)
        self._held += batch.size
        self._fresh += 1
        while self._held - self._batches[0].size >= self.capacity:
            self._held -= self._batches.popleft().size

    def take(self) -> KeptWindow:
        """The window now, oldest first, and how many of its batches came since the last
        `take` (the window itself goes on)."""
        window = KeptWindow(tuple(self._batches), min(self._fresh, len(self._batches)))
        self._fresh = 0
        return window

    def __len__(self) -> int:
        """Samples held."""
        return self._held
