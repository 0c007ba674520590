"""A worker process of `--workers`: mirrors of the apply side's two copies, read through the
shared gate, and a view of the live model whose status and admin actions are the apply side's.

`MirrorSlot` holds what the syncs (server/workers/messages.py) brought: per slot a `ModelCopy`
whose tables and dense tensors are the apply side's shared memory and whose id maps are this
process' own, kept equal to the apply side's by the same writes. `SyncReceiver` applies the
syncs on a thread of its own and acknowledges each. `MirrorLive` is what the routes read as the
live model (server/dependencies.py, `ServedModel`): its reads are this process', its status and
its admin actions (pin, unpin, digest) are asked of the apply side over the RPC pipe.
"""

from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager
from typing import Any

from publisher.read.consistency import ModelSlot, UpdateResult
from publisher.read.live_model import ApplyTimes, SinkView
from publisher.read.model_copy import ModelCopy, ServedVersion
from publisher.read.scheme_names import ConsistencyScheme
from publisher.read.sinks import VersionSink
from server.workers.gate import SLOTS, ReadGate
from server.workers.messages import CopySync, RowSync

log = logging.getLogger(__name__)


class MirrorSlot(ModelSlot):
    """A worker's copies: read like the apply side's, written only by its syncs."""

    scheme: ConsistencyScheme = "double-buffer"
    peak_copies = 2

    def __init__(self, gate: ReadGate) -> None:  # no builder: this slot never builds
        self.gate = gate
        self.max_reader_wait_s = 0.0
        self._slots: list[ModelCopy | None] = [None] * SLOTS

    def reader(self) -> AbstractContextManager[ModelCopy]:
        return self.gate.read(self._slots)

    def current(self) -> ModelCopy | None:
        return self._slots[self.gate.live]

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._slots if b is not None)

    def update(self, plan: Any, fetch: Any) -> UpdateResult:
        raise RuntimeError("a worker's copies are written by the apply side only")

    def apply(self, message: CopySync | RowSync) -> None:
        """Bring slot `message.slot` (not live: the apply side syncs only hidden copies) to the
        apply side's state."""
        if isinstance(message, CopySync):
            self._slots[message.slot] = message.copy
            return
        buffer = self._slots[message.slot]
        if buffer is None:
            raise RuntimeError(f"row writes for slot {message.slot}, which holds no copy")
        for name, writes in message.id_writes.items():
            for checked in writes:
                buffer.id_maps[name].write(checked)
        buffer.served = message.served


class MirrorSink(VersionSink):
    """The sink a worker's predictor reads: a `MirrorSlot`."""

    def __init__(self, slot: MirrorSlot) -> None:  # not VersionSink's: nothing to build
        self.slot = slot


class SyncReceiver:
    """Applies the apply side's syncs to a `MirrorSlot` on a thread, acknowledging each."""

    def __init__(self, slot: MirrorSlot, control: Any) -> None:
        self.slot = slot
        self.control = control
        self._thread = threading.Thread(target=self._run, name="worker-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                message = self.control.recv()
            except (EOFError, OSError):
                return  # the apply side has gone: the server is stopping
            problem: str | None = None
            try:
                self.slot.apply(message)
            except Exception as exc:  # reported to the apply side, which fails the update
                log.exception("a sync from the apply side failed")
                problem = f"{type(exc).__name__}: {exc}"
            try:
                self.control.send(problem)
            except (BrokenPipeError, OSError):
                return


class ApplySideError(RuntimeError):
    """The apply side could not answer a worker's request."""


class RpcClient:
    """Asks the apply side over this worker's RPC pipe, one question at a time."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def ask(self, op: str, arg: object = None) -> Any:
        with self._lock:
            try:
                self.conn.send((op, arg))
                ok, value = self.conn.recv()
            except (EOFError, OSError) as exc:
                raise ApplySideError(f"the apply side is gone ({exc})") from exc
        if not ok:
            raise value
        return value


class MirrorLive(SinkView):
    """The live model as a worker's routes read it (see the module docstring): its reads are
    this process' (`SinkView`), its status the apply side's."""

    def __init__(self, model_name: str, sink: MirrorSink, rpc: RpcClient) -> None:
        self.model_name = model_name
        self.sink = sink
        self.rpc = rpc

    def _status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.rpc.ask("status")
        return status

    @property
    def pinned(self) -> int | None:
        pinned: int | None = self._status()["pinned"]
        return pinned

    def staleness_s(self, now: float | None = None) -> float:
        return float(self._status()["staleness_s"])

    def latest_known(self) -> int | None:
        known: int | None = self._status()["latest_known"]
        return known

    @property
    def versions_applied(self) -> int:
        return int(self._status()["versions_applied"])

    @property
    def bytes_fetched(self) -> int:
        return int(self._status()["bytes_fetched"])

    @property
    def last_times(self) -> ApplyTimes | None:
        times: ApplyTimes | None = self._status()["last_times"]
        return times

    def nbytes(self) -> int:
        return int(self._status()["nbytes"])

    def pin(self, version: int) -> ServedVersion:
        served: ServedVersion = self.rpc.ask("pin", version)
        return served

    def unpin(self) -> bool:
        return bool(self.rpc.ask("unpin"))

    def digest(self) -> tuple[int, dict[str, str]]:
        """This process' own reading of the served copy (its id maps are its own): replicas
        and workers compare alike."""
        with self.reader() as buffer:
            assert buffer.served is not None
            return buffer.served.version, buffer.digest()


class WorkerFollower:
    """What a worker's app holds where a one-process server holds its subscriber."""

    def __init__(self, live: MirrorLive) -> None:
        self.live = live

    @property
    def rejected(self) -> int:
        return int(self.live.rpc.ask("status")["rejected"])

    def request_catch_up(self) -> None:
        self.live.rpc.ask("catch_up")
