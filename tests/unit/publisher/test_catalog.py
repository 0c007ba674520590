"""The catalog's manifest cache: bounded (least recently used evicted first), and a manifest it
evicted is simply read again."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

from publisher.read.catalog import Catalog
from publisher.store import FileStore
from publisher.tunables import Tunables
from publisher.write.version_writer import TableBlob, VersionDraft, VersionWriter
from schemas.manifest import Manifest, Position
from schemas.store_keys import manifest_key

MiB = 1024 * 1024


class CountingStore(FileStore):
    """Counts the manifests read from disk."""

    manifest_reads = 0

    def get_with_etag(self, key: str, max_bytes: int | None = None) -> tuple[bytes, str]:
        if "/manifests/" in key:
            self.manifest_reads += 1
        return super().get_with_etag(key, max_bytes)


def _draft(kind: str, step: int) -> VersionDraft:
    return VersionDraft(
        kind=kind,  # type: ignore[arg-type]
        relative_to=None if kind == "full" else "parent",
        policy="test",
        position=Position(step=step, samples_seen=step),
        tables=[TableBlob("t", 4, 2, "fp32", 4 if kind == "full" else 1, 0, b"x" * step)],
    )


def test_the_cache_keeps_the_most_recently_used_manifests(tmp_path: Path) -> None:
    store = CountingStore(tmp_path)
    with VersionWriter(store, "m", tunables=Tunables(manifest_cache_size=4)) as writer:
        for step in range(1, 13):
            writer.commit(_draft("full" if step == 1 else "delta", step))
    catalog = Catalog(store, "m", cache_size=4)
    refs = catalog.versions()  # newest first: versions 4, 3, 2, 1 are the last read
    assert [r.version for r in refs] == list(range(1, 13))
    store.manifest_reads = 0
    for ref in refs[:4]:
        assert catalog.manifest(ref.key) == ref.manifest
    assert store.manifest_reads == 0
    catalog.manifest(refs[-1].key)  # evicted long ago: read again, evicting version 1
    assert store.manifest_reads == 1
    catalog.manifest(refs[0].key)
    assert store.manifest_reads == 2
    catalog.manifest(refs[3].key)  # still cached
    assert store.manifest_reads == 2


def _big_manifest(version: int) -> bytes:
    """A delta manifest of 200 tables (~60 KiB of JSON, the issue's figure per version)."""
    sha = "ab" * 32
    doc = {
        "schema_version": 1,
        "model": "m",
        "version": version,
        "parent": version - 1,
        "parent_manifest": manifest_key("m", version - 1, "w"),
        "kind": "delta",
        "baseline": 1,
        "applies_to": version - 1,
        "policy": "consecutive",
        "created_at": "2026-11-29T12:00:00+00:00",
        "position": {"step": version, "samples_seen": version, "reader": {}},
        "tables": [
            {
                "name": f"embeddings.feature_{i:04d}",
                "rows": 100_000,
                "dim": 64,
                "codec": "int8",
                "rows_in_checkpoint": 10,
                "aux_dim": 1,
                "blob": {"key": f"m/blobs/{version:012d}-w/{i:04d}.cnrd", "size": 9, "sha256": sha},
            }
            for i in range(200)
        ],
        "model_config": {},
        "metrics": {},
    }
    return json.dumps(doc).encode()


def test_a_long_running_catalog_stays_bounded(tmp_path: Path) -> None:
    # One version per second for a day was gigabytes per server; now it is cache_size manifests.
    catalog = Catalog(FileStore(tmp_path), "m", cache_size=8)
    tracemalloc.start()
    try:
        for version in range(2, 122):
            data = _big_manifest(version)
            catalog.remember(manifest_key("m", version, "w"), Manifest.from_json(data))
            if version == 21:
                after_20, _ = tracemalloc.get_traced_memory()
        after_120, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after_120 - after_20 < 2 * MiB, f"{(after_120 - after_20) / MiB:.1f} MiB more"
