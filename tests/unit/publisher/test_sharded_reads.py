"""Reading a version whose tables are row-range shards: restore, gc, inspect, hostile shards."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.sharded_run import job_publishers, on_ranks, publish_step, row_wise, split_snapshot
from bench.synthetic_run import SyntheticRun, small_config
from publisher.cli import main
from publisher.read.catalog import Catalog
from publisher.read.restore import RestoreError, read_blob, restore
from publisher.read.retention import plan_gc, run_gc
from publisher.store import FileStore
from publisher.write.job_publishing import JobPublisher
from schemas.delta_blob import DeltaBlob, decode_delta_blob, encode_delta_blob
from schemas.errors import BadDataError, BlobTooLargeError, ManifestError
from schemas.manifest import TableEntry

CONFIG = small_config(rows=(300, 101), bag_rows=20, dim=8)
TABLE_ROWS = {"embeddings." + f.name: f.rows for f in CONFIG.sparse}


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[FileStore, SyntheticRun]]:
    """Three versions (a full, two deltas) of a 2-rank row-wise job, and the single writer's
    run of the same state."""
    run = SyntheticRun(FileStore(tmp_path / "single"), "m", CONFIG)
    store = FileStore(tmp_path / "job")
    publishers = job_publishers(store, "m", 2)
    layout = row_wise(TABLE_ROWS, 2)
    for i in range(3):
        publish_step(run, publishers, layout, i)
    for publisher in publishers:
        publisher.close()
    yield store, run
    run.close()


def _rewrite(store: FileStore, version: int, change: Callable[[dict[str, Any]], None]) -> None:
    """Change version `version`'s manifest in place (what a hostile store writer can do)."""
    ref = Catalog(store, "m").find(version)
    doc = json.loads(ref.manifest.to_json())
    change(doc)
    store.put(ref.key, json.dumps(doc).encode())


def _forge_shard(
    store: FileStore, version: int, make: Callable[[DeltaBlob], DeltaBlob]
) -> dict[str, Any]:
    """Replace the second shard blob of the first table with `make(decoded)`, its manifest
    entry agreeing on size and sha256; return that shard entry."""
    shard = Catalog(store, "m").find(version).manifest.tables[0].shards[1]  # type: ignore[index]
    blob = decode_delta_blob(store.get(shard.blob.key))
    data = encode_delta_blob(make(blob))
    store.put(shard.blob.key, data)
    size, sha = len(data), hashlib.sha256(data).hexdigest()

    def agree(doc: dict[str, Any]) -> None:
        doc["tables"][0]["shards"][1]["blob"].update(size=size, sha256=sha)

    _rewrite(store, version, agree)
    return {"size": size, "sha256": sha}


def test_a_sharded_version_restores_like_the_unsharded_one(
    job: tuple[FileStore, SyntheticRun],
) -> None:
    store, run = job
    for version in (1, 2, 3):
        sharded, whole = restore(store, "m", version), restore(run.store, "m", version)
        for name, table in whole.tables.items():
            assert sharded.tables[name].weights.tobytes() == table.weights.tobytes()
    entry = Catalog(store, "m").find(3).manifest.table("embeddings.f0")
    blob = read_blob(store, entry)
    assert blob.table_rows == 300 and blob.n_rows == entry.rows_in_checkpoint
    assert np.all(np.diff(blob.row_ids) > 0)  # global ids, the shards' in order


def test_a_shard_blob_declaring_the_whole_table_is_refused(
    job: tuple[FileStore, SyntheticRun],
) -> None:
    store, _ = job
    _forge_shard(store, 2, lambda b: replace(b, table_rows=300, row_ids=b.row_ids + 150))
    entry = Catalog(store, "m").find(2).manifest.tables[0]
    with pytest.raises(BlobTooLargeError, match="table_rows 300 exceeds the cap of 150"):
        read_blob(store, entry)
    with pytest.raises(BadDataError):
        restore(store, "m", 2)


def test_a_shard_blob_with_more_rows_than_its_entry_is_refused(
    job: tuple[FileStore, SyntheticRun],
) -> None:
    store, _ = job
    entry = Catalog(store, "m").find(1).manifest.tables[0]
    assert entry.shards is not None

    # The entry claims one row fewer than the (untouched) blob holds.
    doc = json.loads(entry.model_dump_json())
    doc["shards"][1]["rows_in_checkpoint"] -= 1
    doc["rows_in_checkpoint"] -= 1
    forged = TableEntry.model_validate_json(json.dumps(doc))
    with pytest.raises(RestoreError, match=r"8, 150, 150, 0\), the manifest says .*149"):
        read_blob(store, forged)


@pytest.mark.parametrize(
    "change",
    [
        lambda shards: shards[1].update(row_start=shards[1]["row_start"] + 1),  # a gap
        lambda shards: shards[0].update(row_end=shards[0]["row_end"] + 1),  # an overlap
    ],
    ids=["gap", "overlap"],
)
def test_a_manifest_with_a_gap_or_overlap_is_refused(
    job: tuple[FileStore, SyntheticRun], change: Callable[[list[dict[str, Any]]], None]
) -> None:
    store, _ = job
    _rewrite(store, 3, lambda doc: change(doc["tables"][0]["shards"]))
    with pytest.raises(ManifestError, match="cover"):
        restore(store, "m", 3)


def test_gc_deletes_the_shard_blobs_of_dropped_versions(
    job: tuple[FileStore, SyntheticRun],
) -> None:
    store, run = job
    (snapshot,) = [replace(run.snapshot("full"), sequence=4)]
    publishers = job_publishers(store, "m", 2)
    parts = split_snapshot(snapshot, row_wise(TABLE_ROWS, 2), 2)
    on_ranks(2, lambda r: publishers[r].publish(parts[r]))
    for publisher in publishers:
        publisher.close()
    old = [b.key for v in (1, 2, 3) for b in Catalog(store, "m").find(v).manifest.blobs]
    assert any("/r0001/" in k and k.endswith("-150.cnrd") for k in old)
    plan = plan_gc(store, "m", keep_baselines=1, grace_s=0)
    assert plan.deleted_versions == [1, 2, 3]
    assert set(old) <= set(plan.delete_keys)
    run_gc(store, plan)
    assert restore(store, "m", 4).version == 4


def test_inspect_lists_the_shards(
    job: tuple[FileStore, SyntheticRun], capsys: pytest.CaptureFixture[str]
) -> None:
    store, _ = job
    assert main(["inspect", "--store", store.url, "--model", "m", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    f0 = doc["tables"][0]
    assert f0["key"] is None and [s["row_start"] for s in f0["shards"]] == [0, 150]
    assert f0["bytes"] == sum(s["bytes"] for s in f0["shards"])
    assert main(["inspect", "--store", store.url, "--model", "m"]) == 0
    assert "in 2 row-range shards" in capsys.readouterr().out
    assert main(["ls", "--store", store.url, "--model", "m"]) == 0
    listed = capsys.readouterr().out
    manifest = Catalog(store, "m").find(3).manifest
    assert f"{manifest.written_bytes:,}" in listed


def test_jobs_of_one_rank_write_whole_tables(tmp_path: Path) -> None:
    """A rank whose TableRows carry no row range writes ordinary entries (table-wise)."""
    run = SyntheticRun(FileStore(tmp_path / "single"), "m", CONFIG)
    store = FileStore(tmp_path / "job")
    (publisher,) = job_publishers(store, "m", 1)
    assert isinstance(publisher, JobPublisher)
    run.train(1)
    result = publisher.publish(replace(run.snapshot("full"), sequence=1))
    publisher.close()
    run.close()
    assert all(t.shards is None for t in result.manifest.tables)
    assert result.manifest.position.ranks is not None and len(result.manifest.position.ranks) == 1


def test_shards_carry_an_id_map_all_or_none_and_never_beside_the_entrys(
    job: tuple[FileStore, SyntheticRun],
) -> None:
    store, _ = job
    manifest = Catalog(store, "m").find(1).manifest
    doc = json.loads(manifest.to_json())
    assert all("id_map" not in s for t in doc["tables"] for s in t["shards"])  # omitted: null
    table = doc["tables"][0]
    ref = table["shards"][0]["blob"]
    both = {**table, "shards": [{**s, "id_map": ref} for s in table["shards"]]}
    entry = TableEntry.model_validate_json(json.dumps(both))
    assert entry.has_id_map and entry.id_map_refs == (entry.parts[0].blob,) * 2
    assert entry.blobs[-2:] == entry.id_map_refs
    one = {**table, "shards": [{**table["shards"][0], "id_map": ref}, *table["shards"][1:]]}
    with pytest.raises(ValueError, match=r"every shard of table .* has an id map or none"):
        TableEntry.model_validate_json(json.dumps(one))
    with pytest.raises(ValueError, match="carries its id map in its shards"):
        TableEntry.model_validate_json(json.dumps({**both, "id_map": ref}))
