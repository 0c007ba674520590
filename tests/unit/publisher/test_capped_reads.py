"""HEAD, LEASE and manifests are read no further than their caps (docs/FORMAT.md section 1): a
hostile object costs a reader the cap, not the object's size."""

from __future__ import annotations

import hashlib
import tracemalloc
from functools import partial
from pathlib import Path

import pytest

from publisher.read.catalog import Catalog
from publisher.store import FileStore, IntegrityError, ObjectTooLargeError
from publisher.write.version_writer import TableBlob, VersionDraft, VersionWriter
from schemas.manifest import MAX_MANIFEST_BYTES, Head, Position
from schemas.store_keys import head_key, lease_key, manifest_key
from tests.support import peak_of_refusal

MiB = 1024 * 1024
#: a hostile object's size: sparse on disk, so it costs the test nothing to write.
HUGE = 256 * MiB


def _huge(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(HUGE)


def _commit_one(store: FileStore) -> None:
    draft = VersionDraft(
        kind="full",
        relative_to=None,
        policy="test",
        position=Position(step=1, samples_seen=1),
        tables=[TableBlob("t", 4, 2, "fp32", 4, 0, b"x" * 10)],
    )
    with VersionWriter(store, "m") as writer:
        writer.commit(draft)


def test_get_stops_at_the_cap(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("m/x", b"a" * 10)
    assert store.get("m/x", 10) == b"a" * 10
    assert store.get_with_etag("m/x", 10)[0] == b"a" * 10
    with pytest.raises(ObjectTooLargeError, match="longer than 9 bytes"):
        store.get("m/x", 9)
    with pytest.raises(ObjectTooLargeError):
        store.get_with_etag("m/x", 0)
    assert store.get("m/x") == b"a" * 10  # no cap: the whole object


def test_an_empty_blob_entry_costs_one_byte_not_the_objects_size(tmp_path: Path) -> None:
    # A manifest entry of size 0 whose object was swapped for a huge one: read uncapped before.
    store = FileStore(tmp_path)
    _huge(tmp_path / "blob")
    empty = hashlib.sha256(b"").hexdigest()
    refuse = partial(store.get_verified, "blob", 0, empty)
    assert peak_of_refusal(refuse, IntegrityError) < MiB
    with pytest.raises(IntegrityError, match="not empty, the manifest says 0 bytes"):
        refuse()
    store.put("empty", b"")
    assert store.get_verified("empty", 0, empty) == b""


def test_a_huge_head_costs_the_cap_not_its_size(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    _commit_one(store)
    _huge(tmp_path / head_key("m"))
    assert peak_of_refusal(Catalog(store, "m").head, ObjectTooLargeError) < MiB


def test_a_huge_manifest_costs_the_cap_not_its_size(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    _commit_one(store)
    key = manifest_key("m", 2, "hostile")
    _huge(tmp_path / key)
    store.put(head_key("m"), Head(model="m", version=2, manifest=key).to_json())
    assert (
        peak_of_refusal(Catalog(store, "m").latest, ObjectTooLargeError)
        < MAX_MANIFEST_BYTES + 2 * MiB
    )


def test_a_huge_lease_costs_the_writer_the_cap_not_its_size(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    (tmp_path / "m").mkdir()
    _huge(tmp_path / lease_key("m"))
    assert peak_of_refusal(lambda: VersionWriter(store, "m"), ObjectTooLargeError) < MiB


def test_a_huge_head_at_commit_costs_the_writer_the_cap(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    _commit_one(store)
    _huge(tmp_path / head_key("m"))
    draft = VersionDraft(
        kind="full",
        relative_to=None,
        policy="test",
        position=Position(step=2, samples_seen=2),
        tables=[TableBlob("t", 4, 2, "fp32", 4, 0, b"y" * 10)],
    )
    with VersionWriter(store, "m") as writer:
        assert peak_of_refusal(lambda: writer.commit(draft), ObjectTooLargeError) < MiB


def test_a_small_object_read_under_a_large_cap_costs_its_size(tmp_path: Path) -> None:
    # A file read allocates what it is asked for: asking for the 16 MiB cap to read a 1 KiB
    # manifest cost 16 MiB per read.
    store = FileStore(tmp_path)
    store.put("m/x", b"a" * 1024)
    tracemalloc.start()
    try:
        assert store.get("m/x", MAX_MANIFEST_BYTES) == b"a" * 1024
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
