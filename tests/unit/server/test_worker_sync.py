"""The pieces of `serve --workers` in one process: the gate's flip and drain (threads, and a
forked process), and the apply side's syncs keeping a worker's mirror equal to its copies,
version after version of a model trained from raw events (rows, dense state and id maps)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.synthetic_live import SyntheticLiveRun
from publisher.read import Subscriber
from publisher.read.sinks import dlrm_sink
from publisher.store import FileStore
from server.workers.gate import ReadGate
from server.workers.links import make_links
from server.workers.messages import CopySync, RowSync
from server.workers.mirror import MirrorSlot, SyncReceiver
from server.workers.shared_slot import SharedDoubleBufferSlot
from tests.unit.server.test_raw_id_api import SPEC, TS, train

CTX = multiprocessing.get_context("fork")


def _gates(processes: int = 2) -> list[ReadGate]:
    apply_side, workers = make_links(CTX, processes)
    return [apply_side.gate, *(w.gate for w in workers)]


def test_a_drain_waits_for_the_readers_of_the_old_slot_in_any_process() -> None:
    apply_gate, worker_gate = _gates()
    entered, release = threading.Event(), threading.Event()

    def read() -> None:
        with worker_gate.enter() as slot:
            assert slot == 0
            entered.set()
            release.wait()

    reader = threading.Thread(target=read)
    reader.start()
    entered.wait()
    apply_gate.flip(1)
    with worker_gate.enter() as slot:
        assert slot == 1  # a reader after the flip reads the new slot
    drained = threading.Event()
    drainer = threading.Thread(
        target=lambda: (apply_gate.drain(0, warn_after_s=60, warn=print), drained.set())
    )
    drainer.start()
    assert not drained.wait(0.2)  # the reader of slot 0 still reads
    release.set()
    assert drained.wait(10)
    reader.join()
    drainer.join()
    assert apply_gate.readers(0) == apply_gate.readers(1) == 0


def _hold(gate: ReadGate, held: object, release: object) -> None:
    with gate.enter():
        held.set()  # type: ignore[attr-defined]
        release.wait(30)  # type: ignore[attr-defined]


def test_the_gate_counts_a_reader_in_another_process() -> None:
    apply_gate, worker_gate = _gates()
    held, release = CTX.Event(), CTX.Event()
    child = CTX.Process(target=_hold, args=(worker_gate, held, release))
    child.start()
    try:
        assert held.wait(30)
        apply_gate.flip(1)
        assert apply_gate.readers(0) == 1
        started = time.monotonic()
        threading.Timer(0.3, release.set).start()
        apply_gate.drain(0, warn_after_s=60, warn=print)
        assert time.monotonic() - started >= 0.25
    finally:
        release.set()
        child.join(30)
    assert child.exitcode == 0


@pytest.fixture
def synced(tmp_path: Path) -> Iterator[tuple[SyntheticLiveRun, Subscriber, MirrorSlot, list[str]]]:
    run = SyntheticLiveRun(FileStore(tmp_path / "store"), "m", spec=SPEC)
    train(run, [f"u{i}" for i in range(5)])
    run.publish()
    apply_side, (worker,) = make_links(CTX, 2)
    sent: list[str] = []
    broadcast = apply_side.pipes.broadcast

    def recording(message: CopySync | RowSync) -> None:
        sent.append(type(message).__name__)
        broadcast(message)

    apply_side.pipes.broadcast = recording  # type: ignore[method-assign]
    sink = dlrm_sink()
    sink.slot = SharedDoubleBufferSlot.replacing(sink.slot, apply_side.gate, apply_side.pipes)
    mirror = MirrorSlot(worker.gate)
    SyncReceiver(mirror, worker.control).start()
    subscriber = Subscriber(FileStore(tmp_path / "store"), "m", sink)
    yield run, subscriber, mirror, sent
    subscriber.close()
    run.close()
    worker.control.close()


def _same(subscriber: Subscriber, mirror: MirrorSlot) -> None:
    with subscriber.live.sink.reader() as mine, mirror.reader() as theirs:
        assert theirs is not mine  # the worker's own objects...
        assert theirs.version == mine.version
        assert theirs.digest() == mine.digest()  # ...holding the same rows, dense and maps
        for name, table in mine.tables.items():  # the tables are in shared memory
            assert table.tensor.is_shared() and theirs.tables[name].tensor.is_shared()


def test_the_mirror_holds_what_the_apply_side_serves_version_by_version(
    synced: tuple[SyntheticLiveRun, Subscriber, MirrorSlot, list[str]],
) -> None:
    run, subscriber, mirror, sent = synced
    subscriber.live.bootstrap()
    assert sent == ["CopySync", "CopySync"]  # the new copy, then its clone
    _same(subscriber, mirror)
    for version in (2, 3, 4):
        train(run, [f"new-{version}", "u1", f"u{version}"], ts=TS + version)
        assert run.publish() == version
        sent.clear()
        assert subscriber.live.catch_up() == [version]
        assert sent == ["RowSync", "RowSync"]  # the standby written, then the old one levelled
        _same(subscriber, mirror)
        with mirror.reader() as copy:
            assert f"new-{version}" in copy.id_maps["embeddings.user"]._row_of
    # and the copy the workers are not reading was levelled too: both slots agree
    standby = mirror._slots[1 - mirror.gate.live]
    live = mirror._slots[mirror.gate.live]
    assert standby is not None and live is not None and standby.digest() == live.digest()
