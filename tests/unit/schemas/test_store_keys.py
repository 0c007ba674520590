"""One key rule: a key a manifest may name is exactly a key every store accepts."""

from __future__ import annotations

import pytest

from publisher.store import BadKeyError
from publisher.store.base import check_key as store_check_key
from schemas.errors import ManifestError
from schemas.store_keys import check_key, is_safe_key

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
