"""Id maps through a real S3 server (MinIO): the checkpointer publishes each version's id-map
blobs beside its table blobs (from a thread and from the publisher process), restore rebuilds
every version's map exactly, resume loads it into the trainer's own maps, gc deletes the maps
of dropped versions, `inspect` shows them, and a tampered id-map object is refused."""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from publisher.cli import main as store_main
from publisher.read.catalog import Catalog
from publisher.read.restore import RestoreError, restore
from publisher.read.retention import plan_gc, run_gc
from publisher.store import IntegrityError, open_store
from publisher.store.s3_store import S3Store
from schemas.id_map_blob import IdEntries, encode_id_entries
from tests.integration.test_s3_store import empty, s3_environ
from tests.unit.trainer.test_id_map_checkpoints import ROWS, Trainer, same_map


@pytest.fixture
def url(services: Any, unique_name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # In the environment, so that the publisher process (a child) reaches MinIO too.
    for name, value in s3_environ(services).items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield f"s3://{unique_name}/idmaps"
    with open_store(f"s3://{unique_name}") as store:
        assert isinstance(store, S3Store)
        empty(store)


@pytest.mark.parametrize("publish_in", ["thread", "process"])
def test_maps_round_trip_through_minio(url: str, publish_in: str) -> None:
    first = Trainer(url, publish_in=publish_in)
    with first.ckpt:
        first.train(range(30))
        expected = first.versions()
    assert len(expected) == 10 and len(first.id_map) == ROWS - 1
    with open_store(url) as store:
        versions = Catalog(store, "live").versions()
        assert all(v.manifest.table("users").id_map is not None for v in versions)
        for version, id_map in expected.items():
            assert same_map(restore(store, "live", version).id_maps["users"], id_map), version

    second = Trainer(url, seed=3)
    id_map = second.id_map
    with second.ckpt:
        second.ckpt.resume()
        assert second.id_map is id_map and same_map(id_map, first.id_map)
        second.train(range(30, 36))
        after = second.versions()
    with open_store(url) as store:
        (newest,) = [v for v in after if v == max(after)]
        assert same_map(restore(store, "live").id_maps["users"], after[newest])


def test_gc_and_inspect_on_minio(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    t = Trainer(url)
    with t.ckpt:
        t.train(range(9))
        t.ckpt.checkpoint_now(reader={"offset": 9}, force_full=True)
        t.expected[t.ckpt.records[-1].index] = t.id_map.copy()
        t.train(range(9, 12))
        expected = t.versions()
    assert store_main(["inspect", "--store", url, "--model", "live", "--json"]) == 0
    (table,) = json.loads(capsys.readouterr().out)["tables"]
    assert table["id_map_bytes"] > 0 and table["ids_held"] == len(t.id_map)
    with open_store(url) as store:
        versions = Catalog(store, "live").versions()
        dropped = [v.manifest.table("users").id_map.key for v in versions[:3]]  # type: ignore[union-attr]
        plan = plan_gc(store, "live", keep_baselines=1, grace_s=0.0, now=time.time() + 10)
        assert plan.deleted_versions == [1, 2, 3] and set(dropped) <= set(plan.delete_keys)
        run_gc(store, plan)
        keys = {info.key for info in store.list("live/")}
        assert not set(dropped) & keys
        for v in versions[3:]:
            assert v.manifest.table("users").id_map.key in keys  # type: ignore[union-attr]
            assert same_map(restore(store, "live", v.version).id_maps["users"], expected[v.version])


def test_a_tampered_id_map_on_minio_is_refused(url: str) -> None:
    t = Trainer(url)
    with t.ckpt:
        t.train(range(6))
    with open_store(url) as store:
        ref = Catalog(store, "live").find(2)
        entry = ref.manifest.table("users")
        assert entry.id_map is not None
        good = store.get(entry.id_map.key)
        # Same size, one byte flipped: the sha256 in the manifest catches it.
        store.put(entry.id_map.key, good[:-1] + bytes([good[-1] ^ 1]))
        with pytest.raises(IntegrityError, match="sha256"):
            restore(store, "live", 2)
        # Rewritten consistently (the manifest agrees): the map's own rules catch it, here
        # one id on every row the delta carries.
        n = entry.rows_in_checkpoint
        assert n >= 2
        same = IdEntries(np.ones(n, dtype=bool), np.zeros(n, np.int64), np.zeros(n), ("x",) * n)
        forged = encode_id_entries(same, hashed=False)
        store.put(entry.id_map.key, forged)
        doc = json.loads(store.get(ref.key))
        doc["tables"][0]["id_map"].update(
            size=len(forged), sha256=hashlib.sha256(forged).hexdigest()
        )
        store.put(ref.key, json.dumps(doc).encode())
        with pytest.raises(RestoreError, match="'x' is assigned to rows"):
            restore(store, "live", 2)
        restore(store, "live", 1)  # the version before it is untouched
