"""The apply side of `--workers`: a double buffer whose copies every worker process reads.

`SharedDoubleBufferSlot` is the one-process `DoubleBufferSlot` (publisher/read/consistency.py)
with its readers counted across processes (server/workers/gate.py) and a sync after every write:
each time a copy no reader sees has been written, every worker's mirror of it is brought to the
same state before it can go live, and the apply side waits for each worker's acknowledgement:

- a copy built or cloned, or changed beyond row writes (a table widened and replaced, an id map
  made or copied whole): `CopySync`, the copy itself, its tensors moved to shared memory first;
- a plan or its replay written in place: `RowSync`, the id-map writes and the served version
  (the tables' rows are already in the shared memory the workers map).

Then the swap flips the live index for every process at once, and the drain waits for the
readers of the old copy in every process. A rebuild peaks at 3 copies here, not 2: the workers
keep their mirror of the old copy until the new standby replaces it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from publisher.memory_budget import MemoryBudget
from publisher.read.consistency import DRAIN_WARN_S, DoubleBufferSlot
from publisher.read.copy_builders import CopyBuilder
from publisher.read.errors import ApplyError
from publisher.read.model_copy import ModelCopy, Touched
from server.workers.gate import SLOTS, ReadGate
from server.workers.messages import CopySync, RowSync

log = logging.getLogger(__name__)

#: how long a worker may take to acknowledge a sync (a worker still starting takes seconds).
ACK_TIMEOUT_S = 120.0


class WorkerPipes:
    """The apply side's ends of the workers' control pipes: broadcast a sync, wait for every
    acknowledgement."""

    def __init__(self, controls: Sequence[Any]) -> None:
        self.controls = list(controls)
        self._lock = threading.Lock()

    def broadcast(self, message: CopySync | RowSync) -> None:
        """Send `message` to every worker and wait until each has applied it (ApplyError if a
        worker fails to, or does not answer within ACK_TIMEOUT_S)."""
        with self._lock:
            w = 0
            try:
                for w, conn in enumerate(self.controls, 1):  # noqa: B007 (w: in the error)
                    conn.send(message)
                for w, conn in enumerate(self.controls, 1):
                    if not conn.poll(ACK_TIMEOUT_S):
                        raise ApplyError(
                            f"worker {w} did not apply a sync in {ACK_TIMEOUT_S:.0f} s"
                        )
                    problem = conn.recv()
                    if problem is not None:
                        raise ApplyError(f"worker {w} could not apply a sync: {problem}")
            except (EOFError, OSError) as exc:  # the supervisor stops the server
                raise ApplyError(f"worker {w} is gone ({type(exc).__name__})") from exc


class SharedDoubleBufferSlot(DoubleBufferSlot):
    """The double buffer of the apply side of `--workers` (see the module docstring)."""

    #: old copy (kept by the workers until replaced) + new one + its clone.
    peak_copies = 3

    def __init__(
        self,
        builder: CopyBuilder,
        budget: MemoryBudget,
        *,
        quantized: bool = True,
        gate: ReadGate,
        pipes: WorkerPipes,
    ) -> None:
        super().__init__(builder, budget, quantized=quantized)
        self.gate = gate
        self.pipes = pipes
        self._slots: list[ModelCopy | None] = [None] * SLOTS
        #: per slot: the copy the workers' mirror is of, and its tables and maps as sent.
        self._sent: list[tuple[weakref.ref[ModelCopy], tuple[int, ...]] | None] = [None] * SLOTS

    @classmethod
    def replacing(cls, slot: Any, gate: ReadGate, pipes: WorkerPipes) -> SharedDoubleBufferSlot:
        """A shared slot built as `slot` (a sink's new, empty double buffer) was."""
        if not isinstance(slot, DoubleBufferSlot) or slot.current() is not None:
            raise ValueError("--workers serves a double buffer (--consistency double-buffer)")
        return cls(slot.builder, slot.budget, quantized=slot.quantized, gate=gate, pipes=pipes)

    @contextmanager
    def reader(self) -> Iterator[ModelCopy]:
        with self.gate.read(self._slots) as buffer:
            yield buffer

    def _slot_of(self, buffer: ModelCopy) -> int:
        for slot, held in enumerate(self._slots):
            if held is buffer:
                return slot
        raise AssertionError("a copy the slot does not hold")

    def _written(self, buffer: ModelCopy, touched: Touched | None) -> None:
        slot = 1 - self.gate.live  # what is written is never the live copy
        self._slots[slot] = buffer
        shape = _shape(buffer)
        sent = self._sent[slot]
        whole_maps = touched is not None and any(n in buffer.id_maps for n in touched.whole)
        moved = sent is None or sent[0]() is not buffer or sent[1] != shape
        if touched is None or moved or whole_maps:
            buffer.share_memory()  # a no-op for the tensors already there
            self.pipes.broadcast(CopySync(slot, buffer))
        else:
            writes = {name: list(w) for name, w in touched.id_writes.items()}
            self.pipes.broadcast(RowSync(slot, buffer.served, writes))
        self._sent[slot] = (weakref.ref(buffer), shape)

    def _swap_in(self, buffer: ModelCopy) -> tuple[ModelCopy | None, float]:
        started = time.perf_counter()
        slot = self._slot_of(buffer)
        old, self._live = self._live, buffer
        self.gate.flip(slot)
        return old, time.perf_counter() - started

    def _drain(self, buffer: ModelCopy) -> None:
        slot = self._slot_of(buffer)
        self.gate.drain(slot, warn_after_s=DRAIN_WARN_S, warn=_warn_drain)
        self._slots[slot] = None  # freed here if the caller drops it (a rebuild)


def _shape(buffer: ModelCopy) -> tuple[int, ...]:
    """What identifies a copy's structure: its module, tables and id maps, by identity."""
    return (
        id(buffer.module),
        *(id(t) for _, t in sorted(buffer.tables.items())),
        *(id(m) for _, m in sorted(buffer.id_maps.items())),
    )


def _warn_drain(seconds: float) -> None:
    log.warning("a prediction has held the previous model for %.0f s", seconds)


def shared_slot_factory(
    gate: ReadGate, pipes: WorkerPipes
) -> Callable[[Any], SharedDoubleBufferSlot]:
    """What replaces a sink's slot on the apply side."""
    return lambda slot: SharedDoubleBufferSlot.replacing(slot, gate, pipes)
