"""Retention (`checknrun gc`): old chains and orphans go, what a kept version needs stays."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.read.retention import GcPlan, RetentionError, plan_gc, run_gc
from publisher.store import FileStore
from publisher.write.version_writer import CommitStage, TableBlob, VersionDraft, VersionWriter
from schemas.errors import ManifestError
from schemas.manifest import Position


def draft(kind: str, step: int) -> VersionDraft:
    return VersionDraft(
        kind=kind,  # type: ignore[arg-type]
        relative_to=None if kind == "full" else "parent",
        policy="intermittent",
        position=Position(step=step, samples_seen=step),
        tables=[TableBlob("t", 4, 2, "fp32", 4 if kind == "full" else 1, 0, b"x" * (10 + step))],
        dense=b"d" * step,
    )


def publish(store: FileStore, kinds: str) -> None:
    with VersionWriter(store, "m") as w:
        for i, k in enumerate(kinds):
            w.commit(draft("full" if k == "F" else "delta", i + 1))


def age_everything(root: Path, seconds: float) -> None:
    past = time.time() - seconds
    for dirpath, _, files in os.walk(root):
        for f in files:
            os.utime(Path(dirpath) / f, (past, past))


def test_keeps_newest_baselines_and_their_chains(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    publish(store, "FddFddFdd")  # versions 1..9, fulls at 1, 4, 7
    plan = plan_gc(store, "m", keep_baselines=2, grace_s=0)
    assert plan.deleted_versions == [1, 2, 3]
    assert plan.kept_versions == [4, 5, 6, 7, 8, 9]
    before = sum(i.size for i in store.list("m/"))
    run_gc(store, plan)
    after = sum(i.size for i in store.list("m/"))
    assert after < before
    catalog = Catalog(store, "m")
    assert [r.version for r in catalog.versions()] == [4, 5, 6, 7, 8, 9]
    for version in (4, 6, 9):  # every kept version is still fully readable
        for ref in restore_plan(catalog, version):
            for blob in ref.manifest.blobs:
                store.get_verified(blob.key, blob.size, blob.sha256)


def test_grace_protects_recent_versions(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    publish(store, "FdFd")
    plan = plan_gc(store, "m", keep_baselines=1, grace_s=3600)
    assert plan.deleted_versions == [] and plan.orphan_keys == []


def test_orphans_of_crashed_publishes_are_removed_after_grace(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    publish(store, "Fd")

    def crash(stage: CommitStage) -> None:
        if stage == "manifest_written":
            raise RuntimeError("crash")

    w = VersionWriter(store, "m", crash_hook=crash)
    with pytest.raises(RuntimeError):
        w.commit(draft("delta", 3))
    w.close()
    young = plan_gc(store, "m", keep_baselines=1, grace_s=600)
    assert young.orphan_keys == []  # could be a publish in progress
    age_everything(tmp_path, 3600)
    old = plan_gc(store, "m", keep_baselines=1, grace_s=600)
    assert len(old.orphan_keys) == 3  # the crashed version 3: table blob, dense blob, manifest
    assert all("000000000003-" in k for k in old.orphan_keys)
    run_gc(store, old)
    assert [r.version for r in Catalog(store, "m").versions()] == [1, 2]
    assert plan_gc(store, "m", keep_baselines=1, grace_s=600).orphan_keys == []


def test_long_run_with_periodic_gc_stays_bounded(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    sizes = []
    with VersionWriter(store, "m") as w:
        for i in range(60):
            w.commit(draft("full" if i % 5 == 0 else "delta", i + 1))
            if i % 5 == 4:
                run_gc(store, plan_gc(store, "m", keep_baselines=2, grace_s=0))
                sizes.append(sum(info.size for info in store.list("m/")))
    assert max(sizes[3:]) <= 1.2 * min(sizes[3:])
    assert len(Catalog(store, "m").versions()) == 10


def test_dry_run_deletes_nothing(tmp_path: Path) -> None:
    from publisher.cli import main

    store = FileStore(tmp_path)
    publish(store, "FdFd")
    keys = [i.key for i in store.list("")]
    assert (
        main(
            [
                "gc",
                "--store",
                f"file://{tmp_path}",
                "--model",
                "m",
                "--keep-baselines",
                "1",
                "--grace",
                "0",
                "--dry-run",
                "--json",
            ]
        )
        == 0
    )
    assert [i.key for i in store.list("")] == keys


def test_a_key_the_store_refuses_is_refused_in_the_manifest_before_gc_deletes(
    tmp_path: Path,
) -> None:
    # `m/./...` passed the manifest's key check but not the store's, so gc deleted the old
    # manifest and then stopped at its blob with BadKeyError: half a version gone. One key rule
    # (schemas/store_keys.py) refuses the manifest when it is read, so gc never reads a key out
    # of it: the manifest is unreadable old history, and gc deletes only keys it listed.
    store = FileStore(tmp_path)
    publish(store, "FdFd")
    old = Catalog(store, "m").find(1)
    path = tmp_path / old.key
    blob_key = old.manifest.tables[0].blob.key
    path.write_bytes(path.read_bytes().replace(blob_key.encode(), b"m/./" + blob_key[2:].encode()))
    age_everything(tmp_path, 3600)
    with pytest.raises(ManifestError, match="not a safe key"):
        Catalog(store, "m").versions()
    plan = plan_gc(store, "m", keep_baselines=1, grace_s=0)
    assert plan.unreadable is not None and plan.unreadable.key == old.key
    assert "not a safe key" in plan.unreadable.reason
    listed = {i.key for i in store.list("m/")}
    assert set(plan.delete_keys) | set(plan.orphan_keys) <= listed
    run_gc(store, plan)
    assert [r.version for r in Catalog(store, "m").versions()] == [3, 4]
    assert not any("/000000000001-" in i.key for i in store.list("m/"))


def test_gc_never_deletes_head_or_lease_an_old_manifest_names_as_blobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 11.3: an old manifest naming HEAD and LEASE as blob keys made gc delete them. Such
    a manifest does not validate: gc names it as unreadable and never reads a key out of it."""
    from publisher.cli import main

    store = FileStore(tmp_path)
    publish(store, "FdFd")  # fulls at 1 and 3: keeping one baseline drops versions 1 and 2
    v1 = next(i.key for i in store.list("m/manifests/") if "/000000000001-" in i.key)
    doc = json.loads(store.get(v1))
    doc["tables"][0]["blob"]["key"] = "m/HEAD"
    doc["dense"]["key"] = "m/LEASE"
    store.put(v1, json.dumps(doc).encode())
    before = {i.key: store.get(i.key) for i in store.list("") if "/manifests/" not in i.key}
    assert {"m/HEAD", "m/LEASE"} <= set(before)
    args = ["gc", "--store", f"file://{tmp_path}", "--model", "m", "--keep-baselines", "1"]
    assert main([*args, "--grace", "0", "--json"]) == 0
    (unreadable,) = json.loads(capsys.readouterr().out)["unreadable"]
    assert unreadable["manifest"] == v1 and "not under 'm/blobs/'" in unreadable["message"]
    for key in ("m/HEAD", "m/LEASE"):
        assert store.get(key) == before[key]
    assert [r.version for r in Catalog(store, "m").versions()] == [3, 4]


@pytest.mark.parametrize("key", ["m/HEAD", "m/LEASE", "n/blobs/x", "m/other/x"])
def test_run_gc_deletes_only_under_manifests_and_blobs(tmp_path: Path, key: str) -> None:
    """Whatever a plan says, gc deletes nothing outside MODEL/manifests/ and MODEL/blobs/."""
    store = FileStore(tmp_path)
    for k in ("m/manifests/000000000001-aa.json", "m/blobs/000000000001-aa/t.cnrd", key):
        store.put(k, b"x")
    plan = GcPlan("m", delete_keys=["m/manifests/000000000001-aa.json", key], orphan_keys=[key])
    with pytest.raises(RetentionError, match=key):
        run_gc(store, plan)
    assert len(list(store.list(""))) == 3  # refused before deleting anything
    assert run_gc(store, GcPlan("m", orphan_keys=["m/blobs/000000000001-aa/t.cnrd"])) == 1
