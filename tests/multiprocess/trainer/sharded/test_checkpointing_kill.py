"""SIGKILL of one rank while the job publishes: HEAD stays on the previous version, intact, and
a restarted job resumes from it and publishes on."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from bench.sharded_job import exit_codes, run_ranks, sharded_job, train_sharded
from publisher.faults import ENV_VAR
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import FileStore
from schemas.errors import CheckNRunError
from tests.multiprocess.trainer.sharded.test_checkpointing_publish import (
    BATCH,
    MIXED,
    MODEL,
    checkpointer,
)
from tests.unit.trainer.sharded.job import sharded_state

pytest.importorskip("torchrec")


def _publish_then_die(rank: int, world: int, root: str) -> None:
    from trainer.sharded.checkpointing import ShardedCheckpointer

    job = sharded_job(MIXED)
    ckpt = checkpointer(job, root, world, timeout_s=5.0)
    assert isinstance(ckpt, ShardedCheckpointer)
    for step in range(2):
        train_sharded(job, seed=10 * step + rank, size=BATCH)
        ckpt.step(world * BATCH, BATCH)
        ckpt.maybe_checkpoint(reader={"offset": (step + 1) * BATCH})
    ckpt.flush()
    assert ckpt.last_version == 1
    np.savez(Path(root) / f"v1-rank{rank}.npz", **sharded_state(job))
    if rank == 1:
        os.environ[ENV_VAR] = "blob_written"  # SIGKILL at this rank's first blob of v2
    for step in range(2, 4):
        train_sharded(job, seed=10 * step + rank, size=BATCH)
        ckpt.step(world * BATCH, BATCH)
        ckpt.maybe_checkpoint(reader={"offset": (step + 1) * BATCH})
    # Only rank 0 gets here: it notices the dead rank when its report does not come.
    with pytest.raises(CheckNRunError):
        ckpt.flush(timeout=60.0)
    head = Catalog(FileStore(root), MODEL).latest()
    assert head is not None and head.version == 1
    # Its peer is dead: leave without the teardown barrier (and without releasing the lease,
    # as a killed job would).
    os._exit(0)


def _resume_and_publish(rank: int, world: int, root: str) -> None:
    from trainer.sharded.checkpointing import ShardedCheckpointer

    job = sharded_job(MIXED, seed=55)
    ckpt = checkpointer(job, root, world)
    assert isinstance(ckpt, ShardedCheckpointer)
    position = ckpt.resume()
    assert position.step == 2
    with np.load(Path(root) / f"v1-rank{rank}.npz") as data:
        at_v1 = dict(data)
    now = sharded_state(job)
    assert sorted(now) == sorted(at_v1)
    for key, value in at_v1.items():
        assert np.array_equal(now[key].reshape(value.shape), value), key
    with ckpt:
        for step in range(2, 4):
            train_sharded(job, seed=10 * step + rank, size=BATCH)
            ckpt.step(world * BATCH, BATCH)
            ckpt.maybe_checkpoint(reader={"offset": (step + 1) * BATCH})
    assert [r.kind for r in ckpt.records] == ["full"]
    assert ckpt.last_version == 2


def test_a_rank_killed_mid_publish_leaves_head_intact_and_the_job_resumes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    root.mkdir()
    codes = exit_codes(_publish_then_die, 2, str(root), timeout_s=300.0)
    assert codes == [0, -signal.SIGKILL]
    store = FileStore(root)
    head = Catalog(store, MODEL).latest()
    assert head is not None and head.version == 1
    restore(store, MODEL)  # every blob of v1 still verifies against its sha256
    # v2's blobs that rank 0 put before the failure are orphans under the dead job's token.
    run_ranks(_resume_and_publish, 2, str(root))
    head = Catalog(store, MODEL).latest()
    assert head is not None and head.version == 2 and head.manifest.kind == "full"
    # The resumed ranks count on from their own samples: the job's sum is right.
    position = head.manifest.position
    assert (position.step, position.samples_seen) == (4, 4 * 2 * BATCH)
    assert position.ranks is not None
    assert [r.samples_seen for r in position.ranks] == [4 * BATCH, 4 * BATCH]
