"""The embedded file:// store: atomic writes, conditional writes, listing, key safety."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from publisher.store import (
    BadKeyError,
    FileStore,
    IntegrityError,
    NotFoundError,
    PreconditionFailedError,
    StoreError,
    open_store,
)


def test_put_get_range_list_delete(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("m/a/1", b"hello")
    store.put("m/b", b"world!")
    store.put("n/c", b"x")
    assert store.get("m/a/1") == b"hello"
    assert store.get_range("m/b", 1, 3) == b"orl"
    assert store.get_range("m/b", 4, 100) == b"d!"
    assert [(i.key, i.size) for i in store.list("m/")] == [("m/a/1", 5), ("m/b", 6)]
    assert store.exists("m/b") and not store.exists("m/zz")
    store.delete("m/b")
    store.delete("m/b")  # absent: not an error
    assert not store.exists("m/b")
    with pytest.raises(NotFoundError):
        store.get("m/b")


def test_overwrite_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("k", b"1" * 1000)
    store.put("k", b"2" * 10)
    assert store.get("k") == b"2" * 10
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_put_if_create_and_compare_and_swap(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    etag = store.put_if("HEAD", b"v1", etag=None)
    with pytest.raises(PreconditionFailedError):
        store.put_if("HEAD", b"again", etag=None)
    etag2 = store.put_if("HEAD", b"v2", etag=etag)
    assert etag2 != etag
    with pytest.raises(PreconditionFailedError):
        store.put_if("HEAD", b"stale", etag=etag)
    assert store.get_with_etag("HEAD") == (b"v2", etag2)


def test_put_if_race_has_one_winner(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    etag = store.put_if("HEAD", b"0", etag=None)
    wins: list[int] = []
    barrier = threading.Barrier(8)

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            store.put_if("HEAD", str(i).encode(), etag=etag)
            wins.append(i)
        except PreconditionFailedError:
            pass

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.get("HEAD") == str(wins[0]).encode()


@pytest.mark.parametrize(
    "key", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a\\b", "a/./b", "a\x00b"]
)
def test_unsafe_keys_are_refused(tmp_path: Path, key: str) -> None:
    store = FileStore(tmp_path / "s")
    with pytest.raises(BadKeyError):
        store.put(key, b"x")
    with pytest.raises(BadKeyError):
        store.get(key)


def test_get_verified(tmp_path: Path) -> None:
    import hashlib

    store = FileStore(tmp_path)
    store.put("k", b"data")
    good = hashlib.sha256(b"data").hexdigest()
    assert store.get_verified("k", 4, good) == b"data"
    with pytest.raises(IntegrityError, match="bytes"):
        store.get_verified("k", 5, good)
    with pytest.raises(IntegrityError, match="sha256"):
        store.get_verified("k", 4, "0" * 64)


def test_open_store_urls(tmp_path: Path) -> None:
    assert isinstance(open_store(f"file://{tmp_path}"), FileStore)
    assert isinstance(open_store(str(tmp_path / "plain")), FileStore)
    with pytest.raises(StoreError, match="unsupported"):
        open_store("ftp://x/y")
