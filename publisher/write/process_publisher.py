"""Stages two and three (quantize, encode, commit, announce) in a child process.

Why a process: the publisher thread and the training thread share one GIL. Measured on
MovieLens-1M (1 torch thread, 10 checkpoints per 500k samples, int4): the thread publisher
added 35% wall-clock time to training against 11% of training-thread CPU time; the gap is the
training thread waiting for the GIL while the publisher runs Python-level encode and commit
code. In a child process that work runs beside training on the other core.

`ProcessPublisher` is a `SnapshotPublisher` (publishing.py): `BackgroundPublisher` calls its
`publish(snapshot)`, so merging on backlog, retries and error hand-off stay exactly as they are;
only the work moves. The child is `python -m publisher.write.process_publisher FD`, talking over
a socket pair. A snapshot travels as a pickle (protocol 5) whose numpy arrays go out of band:
each array's bytes are written to the pipe straight from the snapshot's memory and read by the
child into one preallocated buffer, with the GIL released during the system calls.

Wire protocol on a `multiprocessing.connection.Connection` (parent -> child, child -> parent)::

    ProcessPublisherConfig                        (first message)
    ("publish", pickle_bytes, [buffer sizes])  then each buffer via send_bytes
    ("close",)
    child replies ("ok", PublishResult) | ("error", exception) | ("ready",) after start-up
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from publisher.child_process import parent_connection, receive, start_child
from publisher.release.rules import GateConfig
from publisher.served_loss import ServedModel
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.policies import ServedLossCodecRule
from publisher.write.priority import lower_this_thread
from publisher.write.publishing import PublishResult
from publisher.write.snapshot import Snapshot
from schemas.errors import BadDataError, CheckNRunError, ConflictError, UnavailableError

#: how long start-up (imports, lease) may take before the parent gives up.
START_TIMEOUT_S = 120.0


class PublisherProcessError(CheckNRunError, RuntimeError):
    """The publisher process died or could not start, or failed with a checknrun error that
    cannot cross the pipe as itself (its message then starts with that error's type name)."""


class PublisherBadDataError(PublisherProcessError, BadDataError):
    """The publisher process refused bad input, with an error that cannot cross as itself."""


class PublisherUnavailableError(PublisherProcessError, UnavailableError):
    """The publisher process could not reach a service, with an error that cannot cross as
    itself (retried like any UnavailableError)."""


class PublisherConflictError(PublisherProcessError, ConflictError):
    """The publisher process met another writer, with an error that cannot cross as itself."""


#: the stand-in of each branch, so that exit statuses and retries do not depend on the mode.
_STAND_INS: tuple[tuple[type[CheckNRunError], type[PublisherProcessError]], ...] = (
    (BadDataError, PublisherBadDataError),
    (UnavailableError, PublisherUnavailableError),
    (ConflictError, PublisherConflictError),
)


@dataclass(frozen=True)
class ProcessPublisherConfig:
    """What the child needs to build its own store, publisher and announcer."""

    store_url: str
    model: str
    bus_url: str | None = None
    tunables: Tunables = DEFAULT_TUNABLES
    #: torch intra-op threads in the child (the codecs use torch kernels).
    threads: int = 1
    #: `CheckpointPublisher`'s options of the same names.
    measure_served_loss: bool = False
    codec_rule: ServedLossCodecRule | None = None
    #: pickled by reference: its `factory` and `score` importable functions, no `copy`.
    served_model: ServedModel | None = None
    gate: GateConfig | None = None


class ProcessPublisher:
    """A `SnapshotPublisher` whose `CheckpointPublisher` lives in a child process."""

    def __init__(self, config: ProcessPublisherConfig) -> None:
        self.config = config
        self.model = config.model
        self._process, self._conn = start_child("publisher.write.process_publisher")
        self._conn.send(config)
        if not self._conn.poll(START_TIMEOUT_S):
            self._process.kill()
            raise PublisherProcessError("the publisher process did not start in time")
        reply = self._recv()
        if reply[0] == "error":
            self._process.wait(timeout=10)
            raise reply[1]

    def publish(self, snapshot: Snapshot) -> PublishResult:
        """Send a snapshot to the child, wait for it to be committed, return the result."""
        buffers: list[pickle.PickleBuffer] = []
        payload = pickle.dumps(snapshot, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
        try:
            self._conn.send(("publish", payload, [v.nbytes for v in views]))
            for view in views:
                self._conn.send_bytes(view)
        except (BrokenPipeError, ConnectionError, OSError) as exc:
            raise PublisherProcessError(f"the publisher process is gone: {exc}") from exc
        del views, buffers
        reply = self._recv()
        if reply[0] == "error":
            raise reply[1]
        result: PublishResult = reply[1]
        return result

    def close(self) -> None:
        """Ask the child to release its lease and exit; kill it if it does not."""
        with contextlib.suppress(BrokenPipeError, ConnectionError, EOFError, OSError):
            self._conn.send(("close",))
            if self._conn.poll(30):
                self._conn.recv()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=5)
        self._conn.close()

    def _recv(self) -> tuple[Any, ...]:
        return receive(self._conn, self._process, PublisherProcessError, "publisher")


def _serve(conn: Connection) -> None:
    """The child's loop: build the publisher, then publish what arrives until told to close."""
    import torch

    from publisher.store import open_store
    from publisher.write.job_publishing import CheckpointPublisher

    config: ProcessPublisherConfig = conn.recv()
    # Before any thread starts, so that every thread of this process inherits it.
    lower_this_thread(config.tunables.publisher_nice)
    torch.set_num_threads(config.threads)
    announcer = None
    try:
        store = open_store(config.store_url)
        if config.bus_url is not None:
            from publisher.bus import open_announcer

            announcer = open_announcer(config.bus_url, config.model)
        publisher = CheckpointPublisher(
            store,
            config.model,
            announce=None if announcer is None else announcer.announce,
            tunables=config.tunables,
            measure_served_loss=config.measure_served_loss,
            codec_rule=config.codec_rule,
            served_model=config.served_model,
            gate=config.gate,
        )
    except BaseException as exc:  # handed to the parent
        conn.send(("error", _picklable(exc)))
        return
    conn.send(("ready",))
    try:
        while True:
            message = conn.recv()
            if message[0] == "close":
                break
            _, payload, sizes = message
            buffers = [np.empty(size, dtype=np.uint8) for size in sizes]
            for buf in buffers:
                conn.recv_bytes_into(buf)
            snapshot = pickle.loads(payload, buffers=buffers)
            try:
                conn.send(("ok", publisher.publish(snapshot)))
            except BaseException as exc:  # handed to the parent
                conn.send(("error", _picklable(exc)))
            del snapshot, buffers
    except (EOFError, ConnectionError):
        pass  # the parent is gone: release the lease below and exit
    finally:
        publisher.close()
        if announcer is not None:
            announcer.close()
        store.close()
        with contextlib.suppress(BrokenPipeError, ConnectionError, OSError):
            conn.send(("closed",))


def _picklable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling (same type, same message); else a stand-in
    carrying its type name and message: a checknrun error becomes the `PublisherProcessError` of
    its branch, so the parent reports it as thread mode would; anything else (a bug) becomes a
    RuntimeError and keeps its traceback."""
    try:
        again = pickle.loads(pickle.dumps(exc))
        if type(again) is type(exc) and str(again) == str(exc):
            return exc
    except Exception:  # any failure means: send a stand-in instead
        pass
    text = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, CheckNRunError):
        return RuntimeError(text)
    stand_in = next((s for branch, s in _STAND_INS if isinstance(exc, branch)), None)
    return (stand_in or PublisherProcessError)(text)


if __name__ == "__main__":
    _serve(parent_connection())
