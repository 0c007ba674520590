"""Reusable CPU buffers for the rows a snapshot copies, recycled when the snapshot is dropped.

Why: the training thread stalls while it copies rows. Copying into freshly allocated memory
costs a page fault per 4 KiB on first touch, which on this class of machine makes a copy of
1 GB about 15x slower than the same copy into memory touched before (measured: 190 ms vs 12 ms
for 187 MB). So each table keeps a few buffers and hands out views of them.

A view handed out belongs to the snapshot that holds it: its buffer goes back to the pool only
when the view (and everything that refers to it, e.g. a torch tensor sharing its memory) has
been garbage collected, so a snapshot still queued or being encoded is never overwritten.
Steady state is two buffers per table (the snapshot being published and the next one).

A pool made with `pinned=True` allocates page-locked memory (torch's pinned host allocator): the
rows a snapshot copies from a GPU land there by DMA, with no staging copy and no pinning during
the stall (trainer/sharded/checkpointing.py). It needs a CUDA build with a GPU.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

#: free buffers kept per (table, kind); more are dropped to bound memory.
MAX_FREE_PER_KEY = 2
#: a new buffer gets this much headroom so slightly larger deltas can reuse it.
GROWTH = 1.25


class RowBufferPool:
    """float32 (n, width) buffers by key, lent out as views and recycled on release."""

    def __init__(self, *, pinned: bool = False) -> None:
        self._free: dict[tuple[str, int], list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.pinned = pinned

    def _allocate(self, n: int, width: int) -> np.ndarray:
        if not self.pinned:
            return np.empty((n, width), dtype=np.float32)
        # The array's base is the tensor, which keeps the pinned memory alive.
        return torch.empty((n, width), dtype=torch.float32, pin_memory=True).numpy()

    def take(self, key: str, n: int, width: int, *, exact: bool = False) -> np.ndarray:
        """A float32 (n, width) array whose memory may have held an earlier snapshot's rows.

        `exact` allocates exactly n rows when a new buffer is needed (for full copies, whose
        size never changes).
        """
        if n == 0:  # nothing to hold: a free buffer would be tied up for the snapshot's life
            return np.empty((0, width), dtype=np.float32)
        slot = (key, width)
        with self._lock:
            free = self._free.get(slot, [])
            fits = [i for i, buf in enumerate(free) if buf.shape[0] >= n]
            buf = free.pop(min(fits, key=lambda i: free[i].shape[0])) if fits else None
        if buf is None:
            capacity = n if exact else max(n, int(n * GROWTH))
            buf = self._allocate(capacity, width)
            self.allocated_bytes += buf.nbytes
        view = buf[:n]
        weakref.finalize(view, self._give_back, slot, buf)
        return view

    def reserve(self, key: str, n: int, width: int) -> None:
        """Allocate and touch an (n, width) buffer now, so the first copy of that size does not
        pay the page faults during a stall."""
        buf = self._allocate(n, width)
        buf.fill(0.0)  # np.zeros would map lazily zeroed pages: the faults would come later
        self.allocated_bytes += buf.nbytes
        with self._lock:
            self._free.setdefault((key, width), []).append(buf)

    def _give_back(self, slot: tuple[str, int], buf: np.ndarray) -> None:
        with self._lock:
            free = self._free.setdefault(slot, [])
            free.append(buf)
            if len(free) > MAX_FREE_PER_KEY:
                free.sort(key=lambda b: b.shape[0])
                dropped = free.pop(0)
                self.allocated_bytes -= dropped.nbytes

    def clear(self) -> None:
        """Drop every free buffer (lent ones are dropped when released)."""
        with self._lock:
            self._free.clear()
