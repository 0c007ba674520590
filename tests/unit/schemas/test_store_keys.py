"""One key rule: a key a manifest may name is exactly a key every store accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from publisher.store import BadKeyError, FileStore
from publisher.store.base import check_key as store_check_key
from schemas.errors import ManifestError
from schemas.store_keys import (
    blob_prefix,
    check_key,
    is_safe_key,
    is_safe_prefix,
    key_version,
    manifest_key,
)

KEYS = [
    "m/blobs/000000000001-aa/0000-t.cnrd",
    "m/manifests/000000000001-aa.json",
    "m/x",
    "m/./x",
    "m/x/.",
    "m/x/",
    "m//x",
    "m/../n/x",
    "m/x/..",
    "m\\x",
    "m/x\n",
    "m/" + "x" * 1022,
    "m/" + "x" * 1023,
    "m/.hidden",
    "m/..x",
]


@pytest.mark.parametrize("key", KEYS)
def test_manifest_and_store_key_checks_agree(key: str) -> None:
    try:
        check_key("m", key)
        manifest_ok = True
    except ManifestError:
        manifest_ok = False
    try:
        store_check_key(key)
        store_ok = True
    except BadKeyError:
        store_ok = False
    assert manifest_ok == store_ok == is_safe_key(key), key


@pytest.mark.parametrize("key", ["m/./x", "m/x/", "m/x/."])
def test_keys_the_stores_refuse_are_refused_in_manifests(key: str) -> None:
    with pytest.raises(ManifestError):
        check_key("m", key)


def test_a_manifest_key_must_also_be_the_models() -> None:
    assert is_safe_key("n/x")
    with pytest.raises(ManifestError):
        check_key("m", "n/x")


SAFE_PREFIXES = ["", "m/", "m/manifests/", "m/blobs/", "m/blobs/000000000003-", "m", "m/.hid"]
HOSTILE_PREFIXES = ["/", "/m/", "m//", "../", "m/../", "m/./", "..", "m\\", "m/\n", "x" * 1025]


@pytest.mark.parametrize("prefix", SAFE_PREFIXES + HOSTILE_PREFIXES)
def test_the_file_store_lists_by_the_one_prefix_rule(tmp_path: Path, prefix: str) -> None:
    # S3Store.list checks the same rule (tests/integration/test_s3_store.py).
    store = FileStore(tmp_path)
    key = "m/blobs/000000000003-aa/0000-t.cnrd"
    store.put(key, b"x")
    assert is_safe_prefix(prefix) == (prefix in SAFE_PREFIXES)
    if prefix in SAFE_PREFIXES:
        assert [info.key for info in store.list(prefix)] == [key] * key.startswith(prefix)
    else:
        with pytest.raises(BadKeyError, match="unsafe list prefix"):
            list(store.list(prefix))


@pytest.mark.parametrize(
    ("key", "version"),
    [
        (manifest_key("m", 7, "tok"), 7),
        (f"{blob_prefix('m', 12, 'tok')}r0001/0000-t.cnrd", 12),
        (manifest_key("m", 10**13, "tok"), 10**13),
        ("m/manifests/7-tok.json", None),  # not the layout's 12 digits
        ("m/blobs/" + "\u0661" * 12 + "-t/x", None),  # digits, but not ASCII ones
        (manifest_key("n", 7, "tok"), None),  # another model's
        ("m/HEAD", None),
        ("m/probe-000000000007-x", None),
    ],
)
def test_key_version_reads_the_version_a_key_names(key: str, version: int | None) -> None:
    assert key_version("m", key) == version
