"""The file:// store holds regular files only (issue 11.4): whoever can write into the store
directory can plant a symbolic link, a FIFO or a device there, and no store operation may read,
write or delete through one, or hang on one."""

from __future__ import annotations

import os
import shutil
import tracemalloc
from pathlib import Path

import pytest

from publisher.read.catalog import Catalog
from publisher.store import FileStore, UnsafePathError
from tests.unit.publisher.test_retention import publish

SECRET = b"outside the store"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the store with a file no store operation may touch."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "victim").write_bytes(SECRET)
    return d


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


def reads_refused(store: FileStore, key: str) -> None:
    with pytest.raises(UnsafePathError):
        store.get(key)
    with pytest.raises(UnsafePathError):
        store.get_range(key, 0, 10)
    with pytest.raises(UnsafePathError):
        store.exists(key)
    assert key not in [i.key for i in store.list("")]


def test_a_link_at_a_key_is_never_read(store: FileStore, outside: Path) -> None:
    (store.root / "m").mkdir()
    (store.root / "m" / "HEAD").symlink_to(outside / "victim")
    reads_refused(store, "m/HEAD")


def test_a_linked_directory_is_never_entered(store: FileStore, outside: Path) -> None:
    (store.root / "m").symlink_to(outside)
    reads_refused(store, "m/victim")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        store.put("m/new", b"x")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        store.delete("m/victim")
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == SECRET


def test_head_linked_to_an_endless_device_is_refused_before_reading(store: FileStore) -> None:
    """Before: get() read /dev/zero until MemoryError. Now: refused, with no allocation."""
    (store.root / "m").mkdir()
    (store.root / "m" / "HEAD").symlink_to("/dev/zero")
    tracemalloc.start()
    try:
        with pytest.raises(UnsafePathError):
            Catalog(store, "m").head()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_a_fifo_at_a_key_cannot_hang_a_read(store: FileStore) -> None:
    """Before: open() of a FIFO waited for a writer forever (pytest-timeout stops it)."""
    (store.root / "m").mkdir()
    os.mkfifo(store.root / "m" / "HEAD")
    reads_refused(store, "m/HEAD")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        store.put_if("m/HEAD", b"x", etag=None)


def test_a_directory_at_a_key_is_not_an_object(store: FileStore) -> None:
    (store.root / "m" / "HEAD").mkdir(parents=True)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        store.get("m/HEAD")


def test_put_replaces_a_link_at_a_key_never_its_target(store: FileStore, outside: Path) -> None:
    (store.root / "m").mkdir()
    (store.root / "m" / "k").symlink_to(outside / "victim")
    store.put("m/k", b"new")
    assert not (store.root / "m" / "k").is_symlink() and store.get("m/k") == b"new"
    assert (outside / "victim").read_bytes() == SECRET


def test_put_if_never_follows_a_link(store: FileStore, outside: Path) -> None:
    (store.root / "m").mkdir()
    (store.root / "m" / "HEAD").symlink_to(outside / "victim")
    with pytest.raises(UnsafePathError):
        store.put_if("m/HEAD", b"x", etag=None)
    # The lock directory too: a link there would create lock files outside the store.
    shutil.rmtree(store.root / ".checknrun-locks", ignore_errors=True)
    (store.root / ".checknrun-locks").symlink_to(outside)
    with pytest.raises(UnsafePathError):
        store.put_if("m/LEASE", b"x", etag=None)
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_delete_removes_a_link_itself_never_its_target(store: FileStore, outside: Path) -> None:
    (store.root / "m").mkdir()
    (store.root / "m" / "k").symlink_to(outside / "victim")
    store.delete("m/k")
    assert not (store.root / "m" / "k").is_symlink()
    assert (outside / "victim").read_bytes() == SECRET


def test_list_skips_links_fifos_and_linked_directories(store: FileStore, outside: Path) -> None:
    store.put("m/blobs/a", b"1")
    (store.root / "m" / "blobs" / "link").symlink_to(outside / "victim")
    (store.root / "m" / "blobs" / "dir").symlink_to(outside)
    os.mkfifo(store.root / "m" / "blobs" / "fifo")
    assert [i.key for i in store.list("m/")] == ["m/blobs/a"]
    assert [i.key for i in store.list("m/blobs/a")] == ["m/blobs/a"]
    assert [i.key for i in store.list("n/")] == []


def test_gc_through_a_planted_blob_directory_link_deletes_nothing_outside(
    tmp_path: Path, store: FileStore, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a dropped version's blob directory swapped for a link to a directory holding
    files of the same names made gc delete those files, outside the store."""
    from publisher.cli import main

    publish(store, "FdFd")  # keeping one baseline drops versions 1 and 2
    blob_dir = next(p for p in (store.root / "m" / "blobs").iterdir() if "000000000001-" in p.name)
    names = [p.name for p in blob_dir.iterdir()]
    shutil.rmtree(blob_dir)
    for name in names:
        (outside / name).write_bytes(SECRET)
    blob_dir.symlink_to(outside)
    args = ["gc", "--store", store.url, "--model", "m", "--keep-baselines", "1", "--grace", "0"]
    assert main(args) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert sorted(p.name for p in outside.iterdir()) == sorted([*names, "victim"])
    assert all(p.read_bytes() == SECRET for p in outside.iterdir())


def test_restore_of_a_head_linked_to_dev_zero_fails_with_exit_1(
    store: FileStore, capsys: pytest.CaptureFixture[str]
) -> None:
    from publisher.cli import main

    publish(store, "F")
    (store.root / "m" / "HEAD").unlink()
    (store.root / "m" / "HEAD").symlink_to("/dev/zero")
    out = store.root.parent / "out.pt"
    assert main(["restore", "--store", store.url, "--model", "m", "--out", str(out)]) == 1
    assert "m/HEAD is a symbolic link" in capsys.readouterr().err
    assert not out.exists()
