"""A real `checknrun train` on MinIO + Kafka, SIGKILLed at each step of a publish, then resumed.

What tests/unit/publisher/test_version_writer.py proves on a file store with a tiny writer script,
this proves end to end on s3:// with the real trainer: the store stays consistent at every stage, a
reader polling HEAD and restoring meanwhile never meets a half version, `--resume` continues from
the last committed version at exactly its reader offset, and gc removes the dead writer's orphans
once they are older than the grace period (and not before).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from publisher.faults import ENV_VAR
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import open_store
from tests.support import wait_for

from .conftest import PrivateServices, Processes, kafka_url, s3_url, train_args

INTERVAL = 2048
#: The killed run's budget: far more snapshots than its kill needs. The kill counts commits, and a
#: busy publisher folds the snapshots waiting behind it into one, so a short run (6 intervals)
#: can end with only 2 versions and never reach the 3rd commit. With this budget the run is
#: always killed; if the kill ever failed to fire, it ends (exit 0, not -9) within the timeout.
KILLED_MAX_SAMPLES = 200 * INTERVAL
#: The resumed run trains this much past the version it resumes from.
RESUMED_SAMPLES = 4 * INTERVAL
BLOBS_PER_VERSION = 28  # 26 tables + dense + optimizer
#: How long the reader may take to restore HEAD after the last commit (one chain restore over S3).
READER_TIMEOUT_S = 60


class HeadReader(threading.Thread):
    """Polls HEAD and restores every version it sees, as a server bootstrapping would."""

    def __init__(self, store_url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.store_url, self.model = store_url, model
        self.stop = threading.Event()
        self.seen: list[tuple[float, int]] = []  # (monotonic time, version) of each restore
        self.errors: list[str] = []

    def run(self) -> None:
        with open_store(self.store_url) as store:
            catalog = Catalog(store, self.model)
            last = 0
            while not self.stop.wait(0.1):
                try:
                    head = catalog.head()
                    if head is None or head.version == last:
                        continue
                    state = restore(store, self.model, head.version)
                except Exception as exc:  # any failure is a half version seen: record it
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if state.version != head.version:
                    self.errors.append(f"HEAD {head.version} restored as {state.version}")
                if head.version < last:
                    self.errors.append(f"HEAD went back from {last} to {head.version}")
                last = head.version
                self.seen.append((time.monotonic(), head.version))

    def wait_restored(self, version: int, timeout: float = READER_TIMEOUT_S) -> None:
        """Block until this reader has restored `version` (each poll restores a whole chain)."""

        def restored() -> bool:
            assert self.is_alive(), "the reader thread died"
            return bool(self.seen) and self.seen[-1][1] >= version

        wait_for(
            restored,
            timeout,
            lambda: (
                f"the reader to restore v{version}: saw {[v for _, v in self.seen]}, "
                f"errors {self.errors}"
            ),
            poll_s=0.1,
        )


def _orphans(store_url: str, model: str) -> set[str]:
    with open_store(store_url) as store:
        committed = Catalog(store, model).versions()
        referenced = {r.key for r in committed} | {
            b.key for r in committed for b in r.manifest.blobs
        }
        keys = {i.key for p in ("manifests/", "blobs/") for i in store.list(f"{model}/{p}")}
    return keys - referenced


@pytest.mark.parametrize(
    ("stage", "nth", "committed_before_kill"),
    [
        # The 40th blob is the 12th of version 2: a crash in the middle of an upload.
        ("blob_written", BLOBS_PER_VERSION + 12, 1),
        ("blobs_done", 3, 2),
        ("manifest_written", 3, 2),
        # HEAD moved to 3 but it was never announced: version 3 is committed all the same.
        ("head_moved", 3, 3),
    ],
)
def test_sigkill_at_commit_stage_then_resume(
    stage: str,
    nth: int,
    committed_before_kill: int,
    private_services: PrivateServices,
    procs: Processes,
    unique_name: str,
    s3_env: None,
) -> None:
    model, store_url = "crash", s3_url(unique_name)
    bus = kafka_url(private_services, unique_name)
    reader = HeadReader(store_url, model)
    reader.start()
    try:
        killed = procs.run(
            train_args_for(store_url, model, bus, max_samples=KILLED_MAX_SAMPLES),
            "killed",
            env={ENV_VAR: f"{stage}:{nth}"},
            timeout=300,
        )
        assert killed.returncode == -9, killed.stderr[-3000:]
        with open_store(store_url) as store:
            head = Catalog(store, model).find()
        assert head.version == committed_before_kill
        # Which snapshots merged is up to timing: the resumed run's target follows HEAD's offset.
        resume_offset = head.manifest.position.reader["offset"]
        assert isinstance(resume_offset, int) and resume_offset % INTERVAL == 0, resume_offset
        max_samples = resume_offset + RESUMED_SAMPLES
        orphans = _orphans(store_url, model)
        # Before HEAD moves, the dead writer's objects of the next version are orphans.
        assert bool(orphans) == (stage != "head_moved"), orphans

        resumed_at = time.monotonic()
        resumed = procs.run(
            train_args_for(store_url, model, bus, max_samples=max_samples, resume=True), "resumed"
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        with open_store(store_url) as store:
            last = Catalog(store, model).find().version
        reader.wait_restored(last)  # the reader restores every HEAD it sees, the last one included
    finally:
        reader.stop.set()
        reader.join(timeout=60)
    assert reader.errors == []
    report = resumed.report()
    assert report["resumed_from"] == committed_before_kill
    assert report["start_offset"] == resume_offset
    assert report["end_offset"] == max_samples

    with open_store(store_url) as store:
        versions = Catalog(store, model).versions()
    numbers = [r.version for r in versions]
    assert numbers == list(range(1, len(numbers) + 1))
    assert all(r.manifest.parent == r.version - 1 for r in versions[1:])
    # Resumed exactly at the committed reader offset: nothing trained twice, nothing skipped.
    offsets = [r.manifest.position.reader["offset"] for r in versions]
    assert report["start_offset"] == offsets[committed_before_kill - 1]
    # Checkpoints fall on interval boundaries; a busy publisher may merge two (fewer versions).
    assert offsets == sorted(set(offsets)) and all(o % INTERVAL == 0 for o in offsets)
    assert versions[-1].manifest.position.samples_seen == max_samples
    seen = [v for _, v in reader.seen]
    assert seen == sorted(seen) and seen[-1] == numbers[-1]
    first_new = next(t for t, v in reader.seen if v > committed_before_kill)

    # The dead writer's leftovers: kept while younger than the grace period, then deleted.
    young = _gc(procs, store_url, model, grace=3600)
    assert young["orphans"] == 0 and young["keys_deleted"] == 0
    assert _orphans(store_url, model) == orphans
    old = _gc(procs, store_url, model, grace=0)
    assert old["orphans"] == len(orphans) and old["deleted_versions"] == []
    assert _orphans(store_url, model) == set()
    with open_store(store_url) as store:
        assert restore(store, model).version == numbers[-1]
    print(
        f"RELIABILITY crash stage={stage}: killed at v{committed_before_kill + 1}, "
        f"{len(orphans)} orphans, resumed at offset {resume_offset}, "
        f"resume -> first new version {first_new - resumed_at:.1f} s, "
        f"resumed run {report['seconds']:.1f} s of training"
    )


def train_args_for(
    store_url: str, model: str, bus: str, *, max_samples: int, resume: bool = False
) -> list[str]:
    return train_args(
        store_url,
        model,
        bus=bus,
        max_samples=max_samples,
        interval_samples=INTERVAL,
        resume=resume,
    )


def _gc(procs: Processes, store_url: str, model: str, *, grace: int) -> dict[str, object]:
    done = procs.run(
        [
            sys.executable,
            "-m",
            "publisher.cli",
            "gc",
            "--store",
            store_url,
            "--model",
            model,
            "--keep-baselines",
            "100",
            "--grace",
            str(grace),
            "--json",
        ],
        f"gc-{grace}",
    )
    assert done.returncode == 0, done.stderr
    doc: dict[str, object] = json.loads(done.stdout)
    return doc
