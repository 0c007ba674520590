"""Committed versions with hostile blobs or manifests, as a following server meets them.

tests/unit/schemas/test_delta_blob.py proves each decoder rejection on hand-made bytes and
tests/unit/server/test_live_model.py a same-size sha256 mismatch. Here a real publish is tampered
with *consistently* (the manifest's size and sha256 updated to match the bad bytes, as a buggy
or malicious writer would), so the bytes get past the integrity check and reach the decoder and
the layout checks: every case must end in a counted rejection, the server keeps serving its
version bit for bit, `restore()` raises a typed error, and nothing allocates the sizes the
hostile input declares.
"""

from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.rejections import zstd_bomb
from bench.synthetic_run import SyntheticRun, small_config
from publisher.read import Catalog, RestoreError, Subscriber, SubscriberOptions, restore
from publisher.read.live_model import LiveModel
from publisher.store import FileStore, StoreError
from schemas.errors import FormatError
from tests.support import dlrm_sink

#: a hostile version must not make the server allocate more than this (its declared sizes are
#: up to terabytes).
ALLOCATION_CAP = 64 * 1024 * 1024


@dataclass
class Served:
    root: Path
    store: FileStore
    run: SyntheticRun
    live: LiveModel
    loop: Subscriber


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    store = FileStore(tmp_path / "store")
    run = SyntheticRun(store, "m", small_config(), codec="fp32")
    # No bus: HEAD polls only, so what is served is decided by the store alone.
    options = SubscriberOptions(
        poll_timeout_s=0.05, poll_head_after_s=0.05, retry_initial_s=0.05, retry_max_s=0.1
    )
    loop = Subscriber(store, "m", dlrm_sink(), options=options)
    run.train(2)
    run.publish("full")
    assert loop.run(max_versions=1, timeout=10) == [1]
    yield Served(tmp_path / "store", store, run, loop.live, loop)
    loop.close()
    run.close()


def _rewrite_blob(data: bytes, header_changes: dict[str, Any]) -> bytes:
    """A blob whose JSON header is changed and whose crc32 is made valid again."""
    (header_len,) = struct.unpack_from("<I", data, 12)
    header = json.loads(data[16 : 16 + header_len])
    header.update(header_changes)
    raw = json.dumps(header).encode()
    body = data[:12] + struct.pack("<I", len(raw)) + raw + data[16 + header_len : -4]
    return body + struct.pack("<I", zlib.crc32(body))


def _bitflip(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0x10
    return bytes(out)


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _row_ids_past_the_table(data: bytes) -> bytes:
    # Claim a smaller table: the row ids written for the real one now lie outside it.
    return _rewrite_blob(data, {"table_rows": 1})


def _huge_row_count(data: bytes) -> bytes:
    return _rewrite_blob(data, {"n_rows": 2**31, "table_rows": 2**31})


def _huge_section(data: bytes) -> bytes:
    (header_len,) = struct.unpack_from("<I", data, 12)
    header = json.loads(data[16 : 16 + header_len])
    sections = header["sections"]
    sections[1] = {**sections[1], "compression": "zstd", "raw_len": 2**40}
    return _rewrite_blob(data, {"sections": sections})


#: what the zstd bomb inflates to: within the decoder's global caps (8 GiB), far past its table.
BOMB_BYTES = 256 * 1024 * 1024


def _zstd_bomb(data: bytes) -> bytes:
    """A valid blob of the same table name whose codes section is `BOMB_BYTES` of zeros,
    compressed to a few KiB: every check up to the manifest cross-check passes, so before the
    caps came from the manifest entry, all of it was inflated first."""
    (header_len,) = struct.unpack_from("<I", data, 12)
    return zstd_bomb(json.loads(data[16 : 16 + header_len])["table"], BOMB_BYTES)


BLOB_TAMPERING: dict[str, Callable[[bytes], bytes]] = {
    "bit flip": _bitflip,
    "truncated": _truncate,
    "row ids past the table": _row_ids_past_the_table,
    "huge declared row count": _huge_row_count,
    "huge declared section": _huge_section,
    "zstd bomb of another table's size": _zstd_bomb,
}


def _tamper_blob(s: Served, version: int, change: Callable[[bytes], bytes]) -> None:
    """Change table 0's blob of `version` and make its manifest agree (size and sha256)."""
    ref = Catalog(s.store, "m").find(version)
    doc = json.loads((s.root / ref.key).read_bytes())
    entry = doc["tables"][0]["blob"]
    bad = change((s.root / entry["key"]).read_bytes())
    (s.root / entry["key"]).write_bytes(bad)
    entry["size"], entry["sha256"] = len(bad), hashlib.sha256(bad).hexdigest()
    (s.root / ref.key).write_text(json.dumps(doc))


def _tamper_manifest(s: Served, version: int, change: Callable[[dict[str, Any]], None]) -> None:
    ref = Catalog(s.store, "m").find(version)
    doc = json.loads((s.root / ref.key).read_bytes())
    change(doc)
    (s.root / ref.key).write_text(json.dumps(doc))


def _huge_table(doc: dict[str, Any]) -> None:
    # Valid for the manifest schema (rows <= 2^31, dim <= 65536): 512 TiB of fp32 if believed.
    doc["tables"][0].update(rows=2**31, dim=65536)


def _lying_blob_size(doc: dict[str, Any]) -> None:
    doc["tables"][0]["blob"]["size"] = 2**40


MANIFEST_TAMPERING: dict[str, Callable[[dict[str, Any]], None]] = {
    "huge table declared": _huge_table,
    "blob size lie": _lying_blob_size,
}


def _assert_keeps_serving(s: Served, version_before: int) -> None:
    """The server rejects the new version, keeps `version_before`, and allocates little."""
    before = {n: t.clone() for n, t in _tables(s.live).items()}
    tracemalloc.start()
    try:
        applied = s.loop.run(timeout=0.5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert applied == []
    assert s.live.version == version_before
    assert s.loop.rejected >= 1
    assert peak < ALLOCATION_CAP, f"{peak / 2**20:.0f} MiB allocated for a hostile version"
    for name, table in _tables(s.live).items():
        assert np.array_equal(table.numpy(), before[name].numpy()), name


def _tables(live: LiveModel) -> dict[str, Any]:
    with live.reader() as buffer:
        return {name: buffer.values(name) for name in buffer.tables}


@pytest.mark.parametrize("case", list(BLOB_TAMPERING))
def test_tampered_blob_is_rejected_and_the_version_kept(served: Served, case: str) -> None:
    served.run.train(2)
    v2 = served.run.publish("delta").ref.version
    _tamper_blob(served, v2, BLOB_TAMPERING[case])
    _assert_keeps_serving(served, 1)
    with pytest.raises((RestoreError, FormatError, StoreError)):
        restore(served.store, "m", v2)


@pytest.mark.parametrize("case", list(MANIFEST_TAMPERING))
def test_tampered_manifest_is_rejected_and_the_version_kept(served: Served, case: str) -> None:
    served.run.train(2)
    v2 = served.run.publish("delta").ref.version
    _tamper_manifest(served, v2, MANIFEST_TAMPERING[case])
    _assert_keeps_serving(served, 1)
    with pytest.raises((RestoreError, FormatError, StoreError)):
        restore(served.store, "m", v2)


def test_restore_of_a_huge_declared_table_fails_before_allocating(served: Served) -> None:
    # A full's manifest must have rows_in_checkpoint == rows, so its schema already refuses
    # this; a delta's does not, and restoring the delta sizes every table from it.
    served.run.train(2)
    v2 = served.run.publish("delta").ref.version
    _tamper_manifest(served, v2, _huge_table)
    tracemalloc.start()
    try:
        with pytest.raises((RestoreError, FormatError, StoreError)):
            restore(served.store, "m", v2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOCATION_CAP


def test_a_zstd_bomb_is_refused_from_its_header_before_inflating(served: Served) -> None:
    # 256 MiB of zeros in a few KiB: valid against the decoder's global caps, but the manifest
    # entry says the table is 1000 x 8, so the caps derived from it refuse the header.
    served.run.train(2)
    v2 = served.run.publish("delta").ref.version
    _tamper_blob(served, v2, _zstd_bomb)
    entry = Catalog(served.store, "m").find(v2).manifest.tables[0]
    assert entry.blob.size < BOMB_BYTES // 1000
    tracemalloc.start()
    try:
        with pytest.raises(RestoreError, match="exceeds the cap"):
            restore(served.store, "m", v2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"{peak / 2**20:.0f} MiB allocated to refuse a zstd bomb"
