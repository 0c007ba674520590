"""One JSON rule for every document: blob headers, manifests, HEAD, LEASE and announcements refuse
duplicate keys, NaN/Infinity and lone surrogates alike (schemas/strict_json.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from schemas.announcement import Announcement
from schemas.errors import AnnouncementError, FormatError, ManifestError
from schemas.manifest import Head, Lease, Manifest
from schemas.strict_json import loads
from schemas.tensor_blob import TensorBlobError, decode_tensors
from tests.unit.schemas.test_manifest import ann_doc, manifest_doc

HEAD = b'{"schema_version":1,"model":"m","version":3,"manifest":"m/manifests/000000000003-aa.json"}'
LEASE = b'{"schema_version":1,"model":"m","owner":"host:1","token":"aa","expires_at":12.5}'
MANIFEST = json.dumps(manifest_doc()).encode()
ANNOUNCEMENT = ann_doc()

Parser = Callable[[bytes], Any]
DOCUMENTS: dict[str, tuple[bytes, Parser, type[FormatError]]] = {
    "HEAD": (HEAD, Head.from_json, ManifestError),
    "LEASE": (LEASE, Lease.from_json, ManifestError),
    "manifest": (MANIFEST, Manifest.from_json, ManifestError),
    "announcement": (ANNOUNCEMENT, Announcement.from_json, AnnouncementError),
}


def _duplicate_model(doc: bytes) -> bytes:
    # The first key again with another value: json.loads and pydantic would keep the last.
    return doc.replace(b'"model":', b'"model":"x","model":', 1).replace(
        b'"model": ', b'"model": "x", "model": ', 1
    )


@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_every_document_parses_valid_bytes(name: str) -> None:
    data, parse, _ = DOCUMENTS[name]
    parse(data)


@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_duplicate_keys_are_refused_in_every_document(name: str) -> None:
    data, parse, error = DOCUMENTS[name]
    hostile = _duplicate_model(data)
    assert hostile != data
    with pytest.raises(error, match="duplicate key 'model'"):
        parse(hostile)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(constant: str) -> None:
    # Float fields a hostile writer could fill: the lease's expiry, a manifest's metrics.
    with pytest.raises(ManifestError, match="expected plain JSON"):
        Lease.from_json(LEASE.replace(b"12.5", constant.encode()))
    with pytest.raises(ManifestError, match="expected plain JSON"):
        Manifest.from_json(MANIFEST.replace(b'"auc": 0.75', b'"auc": ' + constant.encode()))


def test_lone_surrogates_are_refused_but_escaped_pairs_are_not() -> None:
    policy = manifest_doc(policy="\U0001f600")  # json.dumps escapes it as a surrogate pair
    assert Manifest.from_json(json.dumps(policy).encode()).policy == "\U0001f600"
    lone = json.dumps(manifest_doc(policy="P")).encode().replace(b'"P"', b'"\\udc00"')
    with pytest.raises(ManifestError, match="not valid Unicode"):
        Manifest.from_json(lone)
    with pytest.raises(ManifestError, match="not valid Unicode"):
        loads(b'["\\ud800"]', ManifestError, "x")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xef\xbb\xbf{}", "not JSON"),
        (b"\xff{}", "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        (b"{}{}", "not JSON"),
    ],
)
def test_malformed_text(data: bytes, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        loads(data, ManifestError, "doc")


def test_tensor_blob_header_follows_the_same_rule() -> None:
    header = b'{"__metadata__":{"checknrun":"{}"},"__metadata__":{"checknrun":"{}"}}'
    data = len(header).to_bytes(8, "little") + header
    with pytest.raises(TensorBlobError, match="duplicate key '__metadata__'"):
        decode_tensors(data)
    header = b'{"__metadata__":{"checknrun":"{\\"lr\\": NaN}"}}'
    data = len(header).to_bytes(8, "little") + header
    with pytest.raises(TensorBlobError, match="expected plain JSON"):
        decode_tensors(data)
