"""Capped reads against a real MinIO server: HEAD, LEASE and manifests are read no further than
their caps (docs/FORMAT.md section 1), so a hostile object costs the cap, not its size."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from publisher.read.catalog import Catalog
from publisher.store import IntegrityError, ObjectTooLargeError
from publisher.store.s3_store import S3Store
from schemas.manifest import MAX_HEAD_BYTES, MAX_MANIFEST_BYTES, Head
from schemas.store_keys import head_key, manifest_key
from tests.integration.test_s3_store import empty, s3_environ
from tests.support import peak_of_refusal

MiB = 1024 * 1024


@pytest.fixture
def store(services: Any, unique_name: str) -> Iterator[S3Store]:
    s = S3Store.from_url(f"s3://{unique_name}/capped", environ=s3_environ(services))
    yield s
    empty(S3Store(unique_name, "", settings=s.settings))
    s.close()


def test_get_stops_at_the_cap_and_the_connection_pool_recovers(store: S3Store) -> None:
    store.put("m/x", b"a" * 10)
    assert store.get("m/x", 10) == b"a" * 10
    assert store.get_with_etag("m/x", 10)[0] == b"a" * 10
    with pytest.raises(ObjectTooLargeError, match="longer than 9 bytes"):
        store.get("m/x", 9)
    store.put("m/empty", b"")
    assert store.get("m/empty", 0) == b""
    store.put("m/big", b"b" * (24 * MiB))  # more than one response's socket buffers
    assert peak_of_refusal(lambda: store.get("m/big", MAX_HEAD_BYTES), ObjectTooLargeError) < MiB
    for _ in range(20):  # the connection dropped mid-body is not handed out again
        assert store.get("m/x", 10) == b"a" * 10


def test_a_huge_head_or_manifest_costs_the_cap(store: S3Store) -> None:
    store.put(head_key("m"), b" " * (24 * MiB))
    assert peak_of_refusal(Catalog(store, "m").head, ObjectTooLargeError) < MiB
    key = manifest_key("m", 1, "hostile")
    store.put(key, b" " * (40 * MiB))
    store.put(head_key("m"), Head(model="m", version=1, manifest=key).to_json())
    assert (
        peak_of_refusal(Catalog(store, "m").latest, ObjectTooLargeError)
        < MAX_MANIFEST_BYTES + 2 * MiB
    )


def test_an_empty_blob_entry_costs_one_byte_not_the_objects_size(store: S3Store) -> None:
    empty_sha = hashlib.sha256(b"").hexdigest()
    store.put("m/blobs/empty", b"")
    assert store.get_verified("m/blobs/empty", 0, empty_sha) == b""
    store.put("m/blobs/swapped", b"b" * (24 * MiB))
    refuse = partial(store.get_verified, "m/blobs/swapped", 0, empty_sha)
    assert peak_of_refusal(refuse, IntegrityError) < MiB
