"""The ObjectStore contract (publisher/store/base.py), run on every store: bytes by key, ranges,
ordered listing, idempotent delete, key safety, conditional writes with one winner, verified and
capped reads, and the commit protocol (lease + HEAD compare-and-swap) built on them.

To add a backend: write a factory like `file_store` below and add it to `STORES`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.store import (
    BadKeyError,
    FileStore,
    IntegrityError,
    NotFoundError,
    ObjectStore,
    ObjectTooLargeError,
    PreconditionFailedError,
    check_conditional_writes,
)
from publisher.write.version_writer import (
    HeadConflictError,
    LeaseHeldError,
    TableBlob,
    VersionDraft,
    VersionWriter,
)
from schemas.manifest import Head, Position
from schemas.store_keys import head_key

#: a store under test, built for one test from its fixtures and torn down after it.
StoreFactory = Callable[[pytest.FixtureRequest], Iterator[ObjectStore]]


def file_store(request: pytest.FixtureRequest) -> Iterator[ObjectStore]:
    """The embedded store in a fresh directory."""
    yield FileStore(request.getfixturevalue("tmp_path") / "store")


def s3_store(request: pytest.FixtureRequest) -> Iterator[ObjectStore]:
    """An S3Store on the test MinIO, in a fresh bucket, under a prefix (emptied afterwards)."""
    from publisher.store.s3_store import S3Store
    from tests.integration.test_s3_store import empty, s3_environ

    services = request.getfixturevalue("services")
    bucket = request.getfixturevalue("unique_name")
    store = S3Store.from_url(f"s3://{bucket}/some/prefix", environ=s3_environ(services))
    yield store
    empty(S3Store(bucket, "", settings=store.settings))
    store.close()


STORES = [
    pytest.param(file_store, id="file"),
    pytest.param(s3_store, id="s3", marks=pytest.mark.integration),
]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> Iterator[ObjectStore]:
    factory: StoreFactory = request.param
    yield from factory(request)


# --- bytes by key ------------------------------------------------------------------------------


def test_put_get_range_list_delete(store: ObjectStore) -> None:
    etag = store.put("m/blobs/a", b"hello world")
    assert store.get_with_etag("m/blobs/a") == (b"hello world", etag)
    assert store.get_range("m/blobs/a", 6, 5) == b"world"
    assert store.get_range("m/blobs/a", 6, 100) == b"world"  # short at the end
    assert store.get_range("m/blobs/a", 11, 4) == b""  # at the end
    assert store.get_range("m/blobs/a", 50, 4) == b""  # past it, like a file
    assert store.get_range("m/blobs/a", 3, 0) == b""
    store.put("m/blobs/b", b"")
    assert store.get("m/blobs/b") == b""
    store.put("m/HEAD", b"{}")
    store.put("other/x", b"1")
    listed = list(store.list("m/"))
    assert [i.key for i in listed] == ["m/HEAD", "m/blobs/a", "m/blobs/b"]  # in key order
    assert [i.size for i in listed] == [2, 11, 0]
    assert listed[1].etag == etag and listed[1].modified > time.time() - 600
    assert [i.key for i in store.list("m/blobs/")] == ["m/blobs/a", "m/blobs/b"]
    assert len(list(store.list(""))) == 4
    assert store.exists("m/blobs/a") and not store.exists("m/blobs/zz")
    store.delete("m/blobs/a")
    store.delete("m/blobs/a")  # absent: not an error
    assert not store.exists("m/blobs/a")
    with pytest.raises(NotFoundError):
        store.get("m/blobs/a")
    with pytest.raises(NotFoundError):
        store.get_range("m/blobs/a", 0, 1)


def test_an_overwrite_replaces_the_whole_object(store: ObjectStore) -> None:
    first = store.put("k", b"1" * 1000)
    second = store.put("k", b"2" * 10)
    assert second != first
    assert store.get_with_etag("k") == (b"2" * 10, second)
    assert [(i.key, i.size) for i in store.list("")] == [("k", 10)]


@pytest.mark.parametrize(
    "key", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a\\b", "a/./b", "a\x00b"]
)
def test_unsafe_keys_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(BadKeyError):
        store.put(key, b"x")
    with pytest.raises(BadKeyError):
        store.get(key)
    with pytest.raises(BadKeyError):
        store.put_if(key, b"x", etag=None)
    assert list(store.list("")) == []


@pytest.mark.parametrize("prefix", ["/m/", "m//", "../", "m/./", "m\\"])
def test_unsafe_list_prefixes_are_refused(store: ObjectStore, prefix: str) -> None:
    with pytest.raises(BadKeyError, match="unsafe list prefix"):
        list(store.list(prefix))


# --- conditional writes ------------------------------------------------------------------------


def test_put_if_creates_and_compares_and_swaps(store: ObjectStore) -> None:
    etag = store.put_if("m/LEASE", b"one", etag=None)
    with pytest.raises(PreconditionFailedError):
        store.put_if("m/LEASE", b"two", etag=None)  # exists already
    etag2 = store.put_if("m/LEASE", b"two", etag=etag)
    assert etag2 != etag
    assert store.get_with_etag("m/LEASE") == (b"two", etag2)
    with pytest.raises(PreconditionFailedError):
        store.put_if("m/LEASE", b"three", etag=etag)  # stale ETag
    with pytest.raises(PreconditionFailedError):
        store.put_if("m/absent", b"x", etag=etag2)  # an ETag on a missing object
    assert store.get("m/LEASE") == b"two" and not store.exists("m/absent")
    store.put("m/LEASE", b"four")  # an unconditional write moves the ETag on too
    with pytest.raises(PreconditionFailedError):
        store.put_if("m/LEASE", b"five", etag=etag2)


@pytest.mark.parametrize("create", [True, False], ids=["create", "replace"])
def test_racing_conditional_writes_have_one_winner(store: ObjectStore, create: bool) -> None:
    key = "m/HEAD"
    etag = None if create else store.put(key, b"start")
    barrier = threading.Barrier(8)
    wins: list[int] = []
    losses: list[int] = []

    def race(i: int) -> None:
        barrier.wait()
        try:
            store.put_if(key, f"writer {i}".encode(), etag=etag)
        except PreconditionFailedError:
            losses.append(i)
        else:
            wins.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 7
    assert store.get(key) == f"writer {wins[0]}".encode()


def test_the_conditional_write_probe_passes_and_leaves_nothing(store: ObjectStore) -> None:
    check_conditional_writes(store, "m/probe-test")
    assert list(store.list("")) == []


# --- verified and capped reads -----------------------------------------------------------------


def test_get_verified_checks_size_and_sha256(store: ObjectStore) -> None:
    data = b"delta blob bytes" * 1000
    sha = hashlib.sha256(data).hexdigest()
    store.put("m/blobs/t.cnrd", data)
    assert store.get_verified("m/blobs/t.cnrd", len(data), sha) == data
    with pytest.raises(IntegrityError, match="sha256"):
        store.get_verified("m/blobs/t.cnrd", len(data), "0" * 64)
    store.put("m/blobs/t.cnrd", data[:-1] + b"X")  # same size, one byte flipped
    with pytest.raises(IntegrityError, match="sha256"):
        store.get_verified("m/blobs/t.cnrd", len(data), sha)
    store.put("m/blobs/t.cnrd", data[:-1])
    with pytest.raises(IntegrityError, match="bytes"):
        store.get_verified("m/blobs/t.cnrd", len(data), sha)
    store.put("m/blobs/t.cnrd", data + b"!")  # longer than promised
    with pytest.raises(IntegrityError, match="bytes"):
        store.get_verified("m/blobs/t.cnrd", len(data), sha)
    empty_sha = hashlib.sha256(b"").hexdigest()
    store.put("m/blobs/empty", b"")
    assert store.get_verified("m/blobs/empty", 0, empty_sha) == b""
    store.put("m/blobs/empty", b"x")
    with pytest.raises(IntegrityError, match="not empty"):
        store.get_verified("m/blobs/empty", 0, empty_sha)


def test_a_capped_get_refuses_a_longer_object(store: ObjectStore) -> None:
    store.put("m/x", b"a" * 10)
    assert store.get("m/x", 10) == b"a" * 10
    assert store.get_with_etag("m/x", 10)[0] == b"a" * 10
    with pytest.raises(ObjectTooLargeError, match="longer than 9 bytes"):
        store.get("m/x", 9)
    store.put("m/empty", b"")
    assert store.get("m/empty", 0) == b""


# --- the commit protocol on the store ----------------------------------------------------------


def draft(kind: str, step: int) -> VersionDraft:
    """A small version of two tables: a full one, or a delta on its parent."""
    return VersionDraft(
        kind=kind,  # type: ignore[arg-type]
        relative_to=None if kind == "full" else "parent",
        policy="test",
        position=Position(step=step, samples_seen=step),
        tables=[
            TableBlob("emb.a", 64, 4, "fp32", 64 if kind == "full" else 3, 0, b"a" * (step + 1)),
            TableBlob("emb.b", 16, 4, "fp16", 16 if kind == "full" else 2, 1, b"b" * (step + 2)),
        ],
        dense=b"dense@%d" % step,
        model_config={"arch": "test"},
    )


class LeaselessWriter(VersionWriter):
    """A writer that ignores the lease, as a buggy or partitioned trainer would."""

    def _acquire_lease(self) -> None:
        pass

    def renew_lease(self) -> None:
        pass

    def close(self) -> None:
        self._stop.set()


def test_versions_commit_and_read_back(store: ObjectStore) -> None:
    kinds = ["full", "delta", "delta", "full", "delta"]
    with VersionWriter(store, "m") as writer:
        refs = [writer.commit(draft(k, i)) for i, k in enumerate(kinds)]
    catalog = Catalog(store, "m")
    assert [r.version for r in catalog.versions()] == [1, 2, 3, 4, 5]
    assert [r.version for r in restore_plan(catalog, 3)] == [1, 2, 3]
    assert [r.version for r in restore_plan(catalog)] == [4, 5]
    for ref in refs:
        for blob in ref.manifest.blobs:
            store.get_verified(blob.key, blob.size, blob.sha256)
    head = Head.from_json(store.get(head_key("m")))
    assert (head.version, head.manifest) == (5, refs[-1].key)


def test_a_second_writer_is_refused_by_the_lease(store: ObjectStore) -> None:
    with VersionWriter(store, "m") as first:
        first.commit(draft("full", 0))
        with pytest.raises(LeaseHeldError):
            VersionWriter(store, "m", owner="elsewhere:1")
        first.commit(draft("delta", 1))
    with VersionWriter(store, "m", owner="elsewhere:1") as second:  # released: now it may
        assert second.commit(draft("delta", 2)).version == 3


def test_head_compare_and_swap_makes_one_writer_lose(store: ObjectStore) -> None:
    with VersionWriter(store, "m") as w:
        w.commit(draft("full", 0))
    late = LeaselessWriter(store, "m")
    early = LeaselessWriter(store, "m")

    def interleave(stage: str) -> None:
        if stage == "manifest_written":  # `late` has read HEAD; `early` commits meanwhile
            late.crash_hook = None
            early.commit(draft("delta", 1))

    late.crash_hook = interleave  # type: ignore[assignment]
    with pytest.raises(HeadConflictError):
        late.commit(draft("delta", 1))
    latest = Catalog(store, "m").latest()
    assert latest is not None and latest.version == 2
    assert latest.key.split("-")[-1] == f"{early.token}.json"


def test_racing_writers_never_move_head_backwards(store: ObjectStore) -> None:
    with VersionWriter(store, "m") as w:
        w.commit(draft("full", 0))
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(Head.from_json(store.get(head_key("m"))).version)

    committed: list[int] = []
    conflicts: list[int] = []

    def write(i: int) -> None:
        writer = LeaselessWriter(store, "m")
        for step in range(4):
            try:
                committed.append(writer.commit(draft("delta", 10 * i + step)).version)
            except HeadConflictError:
                conflicts.append(i)

    watcher = threading.Thread(target=watch)
    watcher.start()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    watcher.join()
    assert conflicts, "four writers racing on one HEAD should have collided at least once"
    assert len(committed) == len(set(committed))  # no version number committed twice
    assert seen == sorted(seen)  # HEAD only ever moved forward
    versions = [r.version for r in Catalog(store, "m").versions()]
    assert versions == list(range(1, 2 + len(committed)))  # a linear chain, no holes
