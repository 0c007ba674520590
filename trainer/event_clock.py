"""How far ahead an event's time may be, and the stream clock: docs/FORMAT.md section 8.1.

    clock = EventClock(max_lead_s=300.0)
    ts = clock.bound(raw.ts)      # each event's time, lowered where it runs ahead of the reader
    clock.now                     # the stream clock: what eviction is judged against

An event's `ts` is the producer's word: one event at `1e300` would hold its row for good and
make the trainer evict every other id as stale. `bound` lowers each time to at most `max_lead_s`
ahead of the reader's wall clock; the stream clock is the median of the last `window` bounded
times, never moving back, so no single event, nor any share of events under half the window,
moves it. A replay of history keeps its own times, however much of it one batch spans.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from schemas.events import MAX_EVENT_LEAD_S

#: the default `--max-event-lead-s`.
DEFAULT_MAX_LEAD_S = MAX_EVENT_LEAD_S
#: bounded event times the stream clock is the median of.
WINDOW = 1024


class EventClock:
    """The bound on each event's time, and the stream's event time, robust to outliers."""

    def __init__(
        self,
        max_lead_s: float = DEFAULT_MAX_LEAD_S,
        *,
        window: int = WINDOW,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not max_lead_s >= 0:
            raise ValueError(f"max_lead_s must be >= 0, got {max_lead_s}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.max_lead_s = max_lead_s
        self.wall = wall
        #: events whose time `bound` lowered (cumulative; continued across a resume).
        self.clamped = 0
        #: the stream clock (0 before the first event).
        self.now = 0.0
        self._recent = np.zeros(window, dtype=np.float64)
        self._filled = 0
        self._next = 0

    def bound(self, ts: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """Each event's time of a batch, lowered to at most `max_lead_s` ahead of the reader's
        clock; the stream clock moves on with the batch."""
        if not len(ts):
            return ts
        bounded = np.minimum(ts, self.wall() + self.max_lead_s)
        self.clamped += int(np.count_nonzero(bounded < ts))
        self._remember(bounded)
        self.now = max(self.now, float(np.median(self._recent[: self._filled])))
        return bounded

    def _remember(self, ts: npt.NDArray[np.float64]) -> None:
        """Put a batch's times into the ring of the last `window`."""
        size = len(self._recent)
        if len(ts) >= size:
            self._recent[:] = ts[-size:]
            self._filled, self._next = size, 0
            return
        end = self._next + len(ts)
        if end <= size:
            self._recent[self._next : end] = ts
        else:
            split = size - self._next
            self._recent[self._next :] = ts[:split]
            self._recent[: end - size] = ts[split:]
        self._next = end % size
        self._filled = min(size, self._filled + len(ts))


__all__ = ["DEFAULT_MAX_LEAD_S", "EventClock"]
