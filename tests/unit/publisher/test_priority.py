"""The background publisher runs below the training thread's CPU priority (Linux: per thread),
and the threads it starts (the upload pool) inherit that; the training thread keeps its own."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from publisher.store import FileStore
from publisher.tunables import DEFAULT_TUNABLES
from publisher.write import priority
from publisher.write.background import BackgroundPublisher
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.policies import make_policy
from publisher.write.process_publisher import ProcessPublisher, ProcessPublisherConfig
from publisher.write.publishing import PublishResult
from publisher.write.snapshot import Snapshot
from tests.unit.publisher.test_restore import TABLES, FakeTraining

pytestmark = pytest.mark.skipif(not priority.PER_THREAD, reason="nice is per thread on Linux")


def _in_thread(fn: object) -> list[object]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    thread.start()
    thread.join()
    return out


def test_lowering_one_thread_leaves_the_caller_alone() -> None:
    mine = priority.this_thread_nice()
    assert mine is not None
    ((new, seen),) = _in_thread(
        lambda: (priority.lower_this_thread(5), priority.this_thread_nice())
    )
    assert new == seen == min(19, mine + 5)
    assert priority.this_thread_nice() == mine
    assert _in_thread(lambda: priority.lower_this_thread(0)) == [None]  # 0: unchanged


class _NiceStore(FileStore):
    """A file store that notes the nice value of every thread that writes a version's blobs or
    manifest (the lease is taken and released by the constructing and closing thread)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.nice_seen: set[int | None] = set()

    def put(self, key: str, data: bytes) -> str:
        if "/blobs/" in key or "/manifests/" in key:
            self.nice_seen.add(priority.this_thread_nice())
        return super().put(key, data)


@pytest.mark.parametrize("nice", [10, 0])
def test_the_worker_and_its_upload_pool_run_at_the_set_nice(tmp_path: Path, nice: int) -> None:
    mine = priority.this_thread_nice()
    assert mine is not None
    store = _NiceStore(tmp_path)
    training = FakeTraining()
    policy = make_policy("consecutive", {n: r for n, (r, _) in TABLES.items()})
    seen: list[int | None] = []

    class Noting(CheckpointPublisher):
        def publish(self, snapshot: Snapshot) -> PublishResult:
            seen.append(priority.this_thread_nice())
            return super().publish(snapshot)

    background = BackgroundPublisher(Noting(store, "m"), nice=nice)
    try:
        for _ in range(2):
            plan = policy.plan(training.interval())
            background.submit(training.snapshot(plan.rows, plan.kind, plan.relative_to, "int4"))
            background.wait()  # one version each, none folded into the next
    finally:
        background.close()
    expected = min(19, mine + nice)
    assert seen == [expected] * len(seen) and seen
    assert store.nice_seen == {expected}  # blobs and manifests, from the pool and the worker
    assert priority.this_thread_nice() == mine  # the submitting (training) thread
    assert [r.ref.version for r in background.results] == [1, 2]


@pytest.mark.multiprocess  # the publisher runs in a child process
def test_a_publisher_process_runs_below_its_parent(tmp_path: Path) -> None:
    mine = priority.this_thread_nice()
    assert mine is not None
    config = ProcessPublisherConfig(
        store_url=f"file://{tmp_path}",
        model="m",
        tunables=replace(DEFAULT_TUNABLES, publisher_nice=10),
    )
    child = ProcessPublisher(config)
    try:
        pid = child._process.pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + 10)
    finally:
        child.close()
