"""The commit protocol: crash atomicity at every step, the single-writer lease, HEAD CAS.
A writer process killed at each stage, and a dead local writer's lease:
tests/multiprocess/publisher/test_version_writer_processes.py."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.store import (
    ConditionalWritesIgnoredError,
    FileStore,
    StoreError,
    check_conditional_writes,
)
from publisher.tunables import Tunables
from publisher.write.version_writer import (
    CommitStage,
    HeadConflictError,
    LeaseHeldError,
    TableBlob,
    VersionDraft,
    VersionWriter,
    WriterError,
)
from schemas.errors import UnavailableError
from schemas.manifest import Lease, Position
from schemas.store_keys import head_key, lease_key


def draft(kind: str = "full", step: int = 0, rows_in: int = 4) -> VersionDraft:
    n = 4 if kind == "full" else rows_in
    return VersionDraft(
        kind=kind,  # type: ignore[arg-type]
        relative_to=None if kind == "full" else "parent",
        policy="consecutive",
        position=Position(step=step, samples_seen=step * 10),
        tables=[TableBlob("emb.user", 4, 2, "fp32", n, 0, f"table@{step}".encode())],
        dense=f"dense@{step}".encode(),
        model_config={"arch": "test"},
        metrics={"auc": 0.5},
    )


class Crash(Exception):
    pass


def crash_at(stage: CommitStage):  # type: ignore[no-untyped-def]
    def hook(s: CommitStage) -> None:
        if s == stage:
            raise Crash(stage)

    return hook


def test_versions_chain_and_listing(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with VersionWriter(store, "m") as writer:
        refs = [
            writer.commit(draft("full" if i == 0 else "delta", step=i, rows_in=1)) for i in range(4)
        ]
    assert [r.version for r in refs] == [1, 2, 3, 4]
    m = refs[-1].manifest
    assert (m.parent, m.baseline, m.applies_to, m.kind) == (3, 1, 3, "delta")
    assert m.parent_manifest == refs[2].key
    catalog = Catalog(store, "m")
    assert [r.version for r in catalog.versions()] == [1, 2, 3, 4]
    assert [r.version for r in restore_plan(catalog, 3)] == [1, 2, 3]
    assert store.get(m.tables[0].blob.key) == b"table@3"


def test_id_map_blobs_are_written_beside_their_tables(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    tables = [
        TableBlob("emb.user", 4, 2, "fp32", 4, 0, b"users", id_map=b"user ids"),
        TableBlob("emb.item", 4, 2, "fp32", 4, 0, b"items"),
        TableBlob("emb.genre", 4, 2, "fp32", 4, 0, b"genres", id_map=b"genre ids"),
    ]
    full = draft()
    with VersionWriter(store, "m") as writer:
        ref = writer.commit(VersionDraft(**{**full.__dict__, "tables": tables}))
    user, item, genre = ref.manifest.tables
    assert item.id_map is None and user.id_map is not None and genre.id_map is not None
    assert user.id_map.key.endswith("0000-emb.user.idmap")
    assert genre.id_map.key.endswith("0002-emb.genre.idmap")
    assert store.get(user.id_map.key) == b"user ids" and store.get(genre.blob.key) == b"genres"
    assert (user.id_map.size, user.id_map.sha256) == (8, hashlib.sha256(b"user ids").hexdigest())
    # Part of what the version wrote, and of what gc keeps or deletes with it.
    assert {user.id_map, genre.id_map} <= set(ref.manifest.blobs)
    assert ref.manifest.written_bytes == len(ref.manifest.to_json()) + sum(
        len(b)
        for b in (b"users", b"user ids", b"items", b"genres", b"genre ids", full.dense or b"")
    )


def test_first_version_must_be_full(tmp_path: Path) -> None:
    with VersionWriter(FileStore(tmp_path), "m") as writer, pytest.raises(WriterError):
        writer.commit(draft("delta"))


@pytest.mark.parametrize("stage", ["blob_written", "blobs_done", "manifest_written"])
def test_crash_before_head_leaves_previous_version(tmp_path: Path, stage: CommitStage) -> None:
    store = FileStore(tmp_path)
    with VersionWriter(store, "m") as writer:
        writer.commit(draft("full", step=1))
    before = {i.key for i in store.list("m/")}
    writer = VersionWriter(store, "m", crash_hook=crash_at(stage))
    with pytest.raises(Crash):
        writer.commit(draft("delta", step=2))
    catalog = Catalog(store, "m")
    latest = catalog.latest()
    assert latest is not None and latest.version == 1
    assert [r.version for r in catalog.versions()] == [1]
    # Whatever the crash left is an orphan: nothing committed refers to it.
    committed_keys = {b.key for b in latest.manifest.blobs} | {latest.key}
    orphans = {i.key for i in store.list("m/")} - before
    assert orphans and not orphans & committed_keys
    # A new writer (after the crashed one's lease is released) goes on from version 1.
    writer.close()
    with VersionWriter(store, "m") as again:
        assert again.commit(draft("delta", step=3)).version == 2
    assert Catalog(store, "m").versions()[-1].manifest.position.step == 3


def test_crash_after_head_is_committed(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with VersionWriter(store, "m") as w:
        w.commit(draft("full", step=1))
    w = VersionWriter(store, "m", crash_hook=crash_at("head_moved"))
    with pytest.raises(Crash):
        w.commit(draft("delta", step=2))
    w.close()
    latest = Catalog(store, "m").latest()
    assert latest is not None and latest.version == 2


def test_second_writer_is_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    first = VersionWriter(store, "m", owner="hostA:1")
    try:
        with pytest.raises(LeaseHeldError, match="hostA:1"):
            VersionWriter(store, "m", owner="hostB:2")
    finally:
        first.close()
    # Released on close: the next writer gets it at once.
    VersionWriter(store, "m", owner="hostB:2").close()


def test_expired_lease_can_be_taken(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    stale = Lease(model="m", owner="elsewhere:1", token="t", expires_at=time.time() - 1)
    store.put(lease_key("m"), stale.to_json())
    VersionWriter(store, "m").close()


def test_head_conflict_when_lease_bypassed(tmp_path: Path) -> None:
    """Even if two writers both believe they hold the lease, HEAD CAS lets only one win."""
    store = FileStore(tmp_path)
    a = VersionWriter(store, "m", owner="a:1")
    a.commit(draft("full", step=1))
    store.delete(lease_key("m"))  # simulate a lease lost without a noticing
    b = VersionWriter(store, "m", owner="b:2")

    def b_commits_meanwhile(stage: CommitStage) -> None:
        if stage == "manifest_written":
            b.commit(draft("delta", step=2))
            a._lease_etag = store.get_with_etag(lease_key("m"))[1]  # a still thinks it owns it

    a.crash_hook = b_commits_meanwhile
    with pytest.raises(HeadConflictError):
        a.commit(draft("delta", step=3))
    head = Catalog(store, "m").head()
    assert head is not None and head.version == 2
    assert Catalog(store, "m").latest().manifest.position.step == 2  # type: ignore[union-attr]
    b.close()


def test_lease_renewal_keeps_it(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    w = VersionWriter(store, "m", tunables=Tunables(lease_ttl_s=3.0))  # renewed every 1 s
    first = Lease.from_json(store.get(lease_key("m")))
    deadline = time.monotonic() + 60
    while (lease := Lease.from_json(store.get(lease_key("m")))).expires_at == first.expires_at:
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.05)
    assert lease.token == w.token and lease.expires_at > first.expires_at
    with pytest.raises(LeaseHeldError):  # still held: a second writer is refused
        VersionWriter(store, "m")
    w.close()
    assert not store.exists(head_key("m"))


class IgnoresConditions(FileStore):
    """Answers conditional writes as plain writes, as older SeaweedFS releases do; `ignore`
    picks which condition it drops ("absent": If-None-Match, "etag": If-Match, or both)."""

    def __init__(self, root: Path, ignore: tuple[str, ...]) -> None:
        super().__init__(root)
        self.ignore = ignore

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str:
        if ("absent" if etag is None else "etag") in self.ignore:
            return self.put(key, data)
        return super().put_if(key, data, etag=etag)


@pytest.mark.parametrize("ignore", [("absent", "etag"), ("absent",), ("etag",)])
def test_writer_refuses_a_store_that_ignores_conditional_writes(
    tmp_path: Path, ignore: tuple[str, ...]
) -> None:
    """Issue 11.9: with the conditions ignored two trainers both commit; now neither starts."""
    store = IgnoresConditions(tmp_path, ignore)
    with pytest.raises(ConditionalWritesIgnoredError, match="ignores conditional writes") as info:
        VersionWriter(store, "m")
    assert isinstance(info.value, StoreError) and not isinstance(info.value, UnavailableError)
    assert list(store.list("")) == []  # no lease taken, and the probe object is gone


def test_the_probe_passes_on_the_file_store_and_leaves_nothing(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    check_conditional_writes(store, "m/probe-abc")
    assert list(store.list("")) == []
    with VersionWriter(store, "m") as writer:
        writer.commit(draft())
    assert sorted(i.key.split("/")[1] for i in store.list("m/")) == [
        "HEAD",
        "LEASE",
        "blobs",
        "blobs",
        "manifests",
    ]
