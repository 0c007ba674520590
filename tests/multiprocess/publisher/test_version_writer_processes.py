"""The commit protocol against real processes: a writer killed by SIGKILL at each commit stage
leaves a consistent store, and the lease of a dead writer on this host is taken at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from publisher.read.catalog import Catalog
from publisher.store import FileStore
from publisher.write.version_writer import LeaseHeldError, VersionWriter
from schemas.manifest import Lease
from schemas.store_keys import lease_key
from tests.unit.publisher.test_version_writer import draft


def test_dead_local_writer_lease_is_taken_at_once(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(proc.stdout)
    lease = Lease(
        model="m",
        owner=f"{socket.gethostname()}:{dead_pid}",
        token="t",
        expires_at=time.time() + 3600,
    )
    store.put(lease_key("m"), lease.to_json())
    VersionWriter(store, "m").close()
    live = Lease(
        model="m",
        owner=f"{socket.gethostname()}:{os.getppid()}",
        token="t",
        expires_at=time.time() + 3600,
    )
    store.put(lease_key("m"), live.to_json())
    with pytest.raises(LeaseHeldError):
        VersionWriter(store, "m")


@pytest.mark.parametrize("stage", ["blob_written", "blobs_done", "manifest_written", "head_moved"])
def test_sigkill_at_each_stage(tmp_path: Path, stage: str) -> None:
    """A real process killed by SIGKILL mid-commit leaves a consistent store."""
    script = f"""
import sys
from publisher.store import FileStore
from publisher.write.version_writer import TableBlob, VersionDraft, VersionWriter
from schemas.manifest import Position
w = VersionWriter(FileStore({str(tmp_path)!r}), "m")
for i in range(3):
    w.commit(VersionDraft(kind="full" if i == 0 else "delta", relative_to="parent",
        policy="consecutive", position=Position(step=i, samples_seen=i),
        tables=[TableBlob("t", 4, 2, "fp32", 4 if i == 0 else 1, 0, b"x" * 10)], dense=b"d"))
"""
    env = {**os.environ, "CHECKNRUN_FAULT_KILL_AT": f"{stage}:2"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    latest = Catalog(FileStore(tmp_path), "m").latest()
    # blob_written:2 is the 2nd blob of version 1 (nothing committed); the others hit version 2.
    expected = {"blob_written": 0, "blobs_done": 1, "manifest_written": 1, "head_moved": 2}
    assert (0 if latest is None else latest.version) == expected[stage]
    # The dead writer's lease (same host, dead pid) is taken over at once; publishing goes on.
    with VersionWriter(FileStore(tmp_path), "m") as w:
        assert w.commit(draft("full")).version == expected[stage] + 1
