"""Which copy is live, and who reads which, across processes: `ReadGate`.

Two slots (the double buffer's copies) and one live index, in shared memory, with a reader
count per process and slot, each guarded by that process's lock (a POSIX semaphore: its
acquire and release order memory across processes, where plain loads and stores of shared
memory would not):

    reader in process w:  with lock[w]: k = live; busy[w][k] += 1   ... read slot k ...
                          with lock[w]: busy[w][k] -= 1
    flip to slot k:       take every lock[w], live = k, release them
    drain slot j:         for every w: wait until busy[w][j] == 0 (read under lock[w])

A reader takes its lock either before the flip took it (then its count is seen by the drain)
or after (then it reads the new index): once the drain returns, no reader in any process reads
slot j until it is flipped to again. Locks are held for a few instructions, never for a read,
so readers in one process do not wait for each other and the apply side never waits for a
prediction to finish except in the drain (one prediction's time at most).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from publisher.read.errors import NotBootstrappedError

T = TypeVar("T")

#: slots per gate: the double buffer's two copies.
SLOTS = 2


class ReadGate:
    """One process's side of the gate (`index` 0: the apply side). Picklable to a spawned
    process: the locks and shared arrays are multiprocessing's."""

    def __init__(self, index: int, locks: Sequence[Any], live: Any, busy: Any) -> None:
        self.index = index
        self.locks = list(locks)
        self._live = live  # RawValue('q')
        self._busy = busy  # RawArray('q', processes * SLOTS)

    @property
    def processes(self) -> int:
        return len(self.locks)

    @property
    def live(self) -> int:
        """The live slot (as this process reads it: for metadata, not for reading a copy)."""
        return int(self._live.value)

    @contextmanager
    def enter(self) -> Iterator[int]:
        """Read the live slot: yields its index, counted as read by this process until exit."""
        lock = self.locks[self.index]
        with lock:
            slot = int(self._live.value)
            self._busy[self.index * SLOTS + slot] += 1
        try:
            yield slot
        finally:
            with lock:
                self._busy[self.index * SLOTS + slot] -= 1

    @contextmanager
    def read(self, slots: Sequence[T | None]) -> Iterator[T]:
        """`enter`, yielding what `slots` holds at the live slot (a process' copies);
        NotBootstrappedError while it holds nothing."""
        with self.enter() as slot:
            held = slots[slot]
            if held is None:
                raise NotBootstrappedError("no version is served yet")
            yield held

    def flip(self, slot: int) -> None:
        """Make `slot` live in every process at once (apply side only)."""
        for lock in self.locks:
            lock.acquire()
        try:
            self._live.value = slot
        finally:
            for lock in reversed(self.locks):
                lock.release()

    def readers(self, slot: int) -> int:
        """Readers of `slot` in every process now."""
        total = 0
        for w, lock in enumerate(self.locks):
            with lock:
                total += int(self._busy[w * SLOTS + slot])
        return total

    def drain(self, slot: int, *, warn_after_s: float, warn: Any) -> None:
        """Wait until no process reads `slot` (which is not live); `warn(seconds)` once if
        that takes longer than `warn_after_s`."""
        started = time.monotonic()
        pause = 1e-4
        warned = False
        while self.readers(slot):
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
            if not warned and time.monotonic() - started > warn_after_s:
                warn(time.monotonic() - started)
                warned = True
