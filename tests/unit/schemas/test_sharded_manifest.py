"""Row-range shards of a table and per-rank positions in a manifest (docs/FORMAT.md 3.3)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.errors import ManifestError
from schemas.manifest import Manifest
from schemas.store_keys import rank_blob_prefix, table_blob_name
from tests.unit.schemas.test_manifest import SHA, manifest_doc, parse, table_with


def shard(rank: int, start: int, end: int, held: int, key: str | None = None) -> dict[str, Any]:
    return {
        "rank": rank,
        "row_start": start,
        "row_end": end,
        "rows_in_checkpoint": held,
        "blob": {
            "key": key or f"m/blobs/000000000002-aa/r{rank:04d}/0000-user-{start}.cnrd",
            "size": 10 + rank,
            "sha256": SHA,
        },
    }


def sharded(*shards: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    return table_with(blob=None, shards=list(shards), **overrides)


def test_a_sharded_table_round_trips_and_counts_its_shards() -> None:
    doc = manifest_doc(tables=[sharded(shard(0, 0, 50, 3), shard(1, 50, 100, 4))])
    m = parse(doc)
    entry = m.table("user")
    assert entry.blob is None and entry.shards is not None
    assert [(p.row_start, p.rows) for p in entry.parts] == [(0, 50), (50, 50)]
    assert [b.size for b in entry.blobs] == [10, 11]
    assert entry.stored_bytes == 21
    assert [b.key for b in m.blobs][:2] == [s.blob.key for s in entry.shards]
    assert m.total_bytes == 21 + 5  # the shards and the dense blob
    assert m.full_fp32_bytes == 100 * (8 + 1) * 4 + 5
    assert Manifest.from_json(m.to_json()) == m
    limits = entry.blob_limits(entry.parts[1])
    assert limits.max_table_rows == 50 and limits.max_total_bytes >= 11


def test_an_unsharded_table_reads_as_one_part() -> None:
    entry = parse(manifest_doc()).table("user")
    (part,) = entry.parts
    assert (part.row_start, part.row_end, part.rows_in_checkpoint) == (0, 100, 7)
    assert entry.blob is not None and part.blob == entry.blob
    assert entry.blob_limits(part).max_table_rows == 100


@pytest.mark.parametrize(
    "table",
    [
        sharded(shard(0, 0, 50, 3), shard(1, 60, 100, 4)),  # gap
        sharded(shard(0, 0, 60, 3), shard(1, 50, 100, 4)),  # overlap
        sharded(shard(1, 50, 100, 4), shard(0, 0, 50, 3)),  # not sorted
        sharded(shard(0, 0, 50, 3), shard(1, 50, 90, 4)),  # short of rows
        sharded(shard(0, 0, 50, 3), shard(1, 50, 101, 4)),  # past rows
        sharded(shard(0, 10, 50, 3), shard(1, 50, 100, 4)),  # not from 0
        sharded(shard(0, 0, 50, 3), shard(1, 50, 100, 5)),  # sums disagree
        sharded(shard(0, 0, 50, 51), shard(1, 50, 100, 4)),  # more rows than the shard
        sharded(shard(0, 0, 0, 0), shard(1, 0, 100, 7)),  # an empty shard
        sharded(),  # no shard
        table_with(shards=[shard(0, 0, 100, 7)]),  # both blob and shards
        table_with(blob=None),  # neither
        sharded(shard(0, 0, 100, 7), id_map=table_with()["blob"]),  # an id map
        sharded(shard(0, 0, 50, 3, key="HEAD"), shard(1, 50, 100, 4)),  # key outside the model
        sharded(shard(0, 0, 50, 3, key="m/HEAD"), shard(1, 50, 100, 4)),  # not a blob key
    ],
)
def test_bad_shards_are_refused(table: dict[str, Any]) -> None:
    with pytest.raises(ManifestError):
        parse(manifest_doc(tables=[table]))


def test_a_full_version_holds_every_row_of_every_shard() -> None:
    full = {"kind": "full", "baseline": 2, "applies_to": None, "parent": None}
    full["parent_manifest"] = None
    every = sharded(shard(0, 0, 50, 50), shard(1, 50, 100, 50), rows_in_checkpoint=100)
    parse(manifest_doc(**full, tables=[every]))
    short = sharded(shard(0, 0, 50, 49), shard(1, 50, 100, 50), rows_in_checkpoint=99)
    with pytest.raises(ManifestError, match="full version holds every row"):
        parse(manifest_doc(**full, tables=[short]))


def test_position_ranks() -> None:
    ranks = [
        {"rank": 0, "samples_seen": 600, "reader": {"offset": 600}},
        {"rank": 1, "samples_seen": 400, "reader": {"topic": "t", "offsets": {"1": 7}}},
    ]
    position = {"step": 10, "samples_seen": 1000, "reader": {}, "ranks": ranks}
    m = parse(manifest_doc(position=position))
    assert m.position.ranks is not None and m.position.ranks[1].samples_seen == 400
    assert parse(manifest_doc()).position.ranks is None
    for bad in (ranks[::-1], ranks[1:], [], [{**ranks[0], "samples_seen": -1}]):
        with pytest.raises(ManifestError):
            parse(manifest_doc(position={**position, "ranks": bad}))


def test_rank_and_shard_keys() -> None:
    assert rank_blob_prefix("m", 3, "tok", None) == "m/blobs/000000000003-tok/"
    assert rank_blob_prefix("m", 3, "tok", 2) == "m/blobs/000000000003-tok/r0002/"
    assert table_blob_name(1, "embeddings.f0", "cnrd") == "0001-embeddings.f0.cnrd"
    assert table_blob_name(1, "emb f0", "cnrd", 150) == "0001-emb_f0-150.cnrd"
    assert table_blob_name(12, "t", "idmap") == "0012-t.idmap"


def test_a_single_process_manifest_is_written_as_before_shards_existed() -> None:
    """No `shards` or `ranks` keys where they are null: readers older than section 3.3 (extra
    fields forbidden) still read every manifest a single process writes."""
    doc = json.loads(parse(manifest_doc()).to_json())
    assert "shards" not in doc["tables"][0] and "ranks" not in doc["position"]
    job = parse(manifest_doc(tables=[sharded(shard(0, 0, 50, 3), shard(1, 50, 100, 4))]))
    assert "shards" in json.loads(job.to_json())["tables"][0]
