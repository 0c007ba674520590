"""One unreadable manifest does not take the model down: `ls` lists the versions around it and
names it, `gc` keeps working and deletes nothing a kept version may need, while `inspect` and
`restore` of a version whose chain needs it still fail with its typed error."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from publisher.cli import EXIT_ERROR, main
from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.read.retention import plan_gc, run_gc
from publisher.store import FileStore
from publisher.write.version_writer import CommitStage, VersionWriter
from schemas.errors import ManifestError
from schemas.store_keys import key_version
from tests.unit.publisher.test_retention import age_everything, draft


def publish(store: FileStore, kinds: str, first_step: int = 1) -> None:
    """Commit one version per letter of `kinds` (F: full, d: delta on its parent)."""
    with VersionWriter(store, "m") as w:
        for step, kind in enumerate(kinds, start=first_step):
            w.commit(draft("full" if kind == "F" else "delta", step))


def crash_publish(store: FileStore, step: int) -> None:
    """A publish that dies once its manifest is written: an orphan version, never committed."""

    def crash(stage: CommitStage) -> None:
        if stage == "manifest_written":
            raise RuntimeError("crash")

    writer = VersionWriter(store, "m", crash_hook=crash)
    with pytest.raises(RuntimeError):
        writer.commit(draft("delta", step))
    writer.close()


def manifest_of(store: FileStore, version: int) -> str:
    """The key of the (only) manifest stored for `version`."""
    (key,) = (i.key for i in store.list("m/manifests/") if key_version("m", i.key) == version)
    return key


def _bad_json(data: bytes) -> bytes:
    return b"{not json" + data


def _bad_sha(data: bytes) -> bytes:
    doc = json.loads(data)
    doc["tables"][0]["blob"]["sha256"] = "not-a-sha256"
    return json.dumps(doc).encode()


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "bad_json": _bad_json,
    "bad_sha": _bad_sha,
    "truncated": _truncated,
}


def corrupt(store: FileStore, version: int, how: str = "bad_json") -> str:
    """Corrupt the manifest of `version` the way `how` says; returns its key."""
    key = manifest_of(store, version)
    store.put(key, CORRUPTIONS[how](store.get(key)))
    return key


def ls(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    status = main(["ls", "--store", f"file://{tmp_path}", "--model", "m", *extra])
    out, err = capsys.readouterr()
    return status, out, err


def gc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_baselines: int, *extra: str
) -> tuple[int, str, str]:
    argv = ["gc", "--store", f"file://{tmp_path}", "--model", "m", "--grace", "0"]
    status = main([*argv, "--keep-baselines", str(keep_baselines), *extra])
    out, err = capsys.readouterr()
    return status, out, err


def stored(store: FileStore) -> dict[str, bytes]:
    return {i.key: store.get(i.key) for i in store.list("m/")}


def versions_named(store: FileStore) -> set[int]:
    """The versions the keys under `manifests/` and `blobs/` name."""
    return {v for i in store.list("m/") if (v := key_version("m", i.key)) is not None}


def readable_chains(store: FileStore, versions: list[int]) -> None:
    """Every blob `versions`' restore plans read is in the store, as its manifest says."""
    catalog = Catalog(store, "m")
    for version in versions:
        for ref in restore_plan(catalog, version):
            for blob in ref.manifest.blobs:
                store.get_verified(blob.key, blob.size, blob.sha256)


# --- ls ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_ls_lists_the_versions_around_an_unreadable_manifest_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    store = FileStore(tmp_path)
    publish(store, "FdddFd")  # fulls at 1 and 5
    bad = corrupt(store, 3, how)
    status, out, err = ls(tmp_path, capsys, "--json")
    assert status == 0
    doc = json.loads(out)
    assert [r["version"] for r in doc["versions"]] == [4, 5, 6]  # committed: linked to HEAD
    assert [r["version"] for r in doc["unverified"]] == [1, 2]  # behind it: no link to HEAD
    (unreadable,) = doc["unreadable"]
    assert unreadable["version"] == 3 and unreadable["manifest"] == bad
    assert unreadable["error"] == "ManifestError" and unreadable["message"]
    assert f"warning: unreadable manifests: {bad} (version 3)" in err

    status, out, err = ls(tmp_path, capsys)
    assert status == 0 and bad in err
    lines = out.splitlines()
    assert "served AUC loss" in lines[0]
    assert [line.split()[0] for line in lines[1:7]] == ["1", "2", "3", "4", "5", "6"]
    assert lines[3].split()[:3] == ["3", "UNREADABLE", f"{bad}:"]
    assert "ManifestError: " in lines[3]
    assert all(line.endswith("(unverified)") for line in lines[1:3])
    assert not any("(unverified)" in line for line in lines[4:7])
    assert "nothing links it to HEAD" in lines[-1]


def test_ls_names_every_unreadable_manifest_behind_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileStore(tmp_path)
    publish(store, "FdddFd")
    first, second = corrupt(store, 4, "truncated"), corrupt(store, 2, "bad_sha")
    status, out, _ = ls(tmp_path, capsys, "--json")
    doc = json.loads(out)
    assert status == 0 and [r["version"] for r in doc["versions"]] == [5, 6]
    assert [(u["manifest"], u["version"]) for u in doc["unreadable"]] == [(first, 4), (second, 2)]
    assert [r["version"] for r in doc["unverified"]] == [1, 3]


def test_ls_fails_when_heads_own_manifest_is_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileStore(tmp_path)
    publish(store, "Fdd")
    bad = corrupt(store, 3)
    status, out, err = ls(tmp_path, capsys, "--json")
    assert status == EXIT_ERROR
    assert json.loads(out)["error"]["type"] == "CatalogError"
    assert f"latest version 3 cannot be read, so no version can be listed: {bad}" in err


def test_a_healthy_listing_reports_nothing_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    publish(FileStore(tmp_path), "Fd")
    status, out, err = ls(tmp_path, capsys, "--json")
    doc = json.loads(out)
    assert status == 0 and err == ""
    assert (doc["unreadable"], doc["unverified"]) == ([], [])
    assert [r["version"] for r in doc["versions"]] == [1, 2]


# --- inspect and restore -----------------------------------------------------------------------


def test_inspect_and_restore_refuse_what_needs_the_unreadable_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileStore(tmp_path)
    publish(store, "FdddFd")
    corrupt(store, 3)
    catalog = Catalog(store, "m")
    readable_chains(store, [5, 6])  # their chains start at the full 5
    with pytest.raises(ManifestError):
        restore_plan(catalog, 4)  # a delta whose chain runs through 3
    for version in (1, 3):  # behind it, and itself: reached only through it
        with pytest.raises(ManifestError):
            catalog.find(version)
    url = ["--store", f"file://{tmp_path}", "--model", "m"]
    assert main(["inspect", *url, "--version", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 4
    assert main(["inspect", *url, "--version", "2", "--json"]) == EXIT_ERROR
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "ManifestError"
    out_file = tmp_path / "v4.pt"
    assert main(["restore", *url, "--version", "4", "--out", str(out_file), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "ManifestError"
    assert not out_file.exists()


# --- gc ----------------------------------------------------------------------------------------


def test_gc_keeps_the_history_a_kept_version_may_need_behind_an_unreadable_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Too few fulls above it: retention would keep the history behind it, which without it
    cannot be told from a crash's orphans (the crashed version 3 below). All of it stays; above
    it gc works as always (the crashed version 7 goes)."""
    store = FileStore(tmp_path)
    publish(store, "Fd")
    crash_publish(store, 3)  # an orphan behind the unreadable manifest
    publish(store, "ddFd", first_step=3)  # versions 3..6, fulls at 1 and 5
    crash_publish(store, 7)  # an orphan above it
    bad = corrupt(store, 4, "bad_sha")
    age_everything(tmp_path, 3600)
    behind = {k: v for k, v in stored(store).items() if key_version("m", k) in range(5)}
    status, out, err = gc(tmp_path, capsys, 2)
    assert status == 0 and bad in err
    lines = out.splitlines()
    assert lines[0].startswith("m: deleted versions none and 3 orphan objects")
    assert lines[1].startswith(f"m: unreadable manifest {bad} (version 4): ManifestError: ")
    assert lines[2] == (
        f"m: it is kept, with the {len(behind)} objects of its version and older (a kept version "
        "may need them; without it they cannot be told from orphans)"
    )
    after = stored(store)
    assert {k: after.get(k) for k in behind} == behind  # nothing behind it touched
    assert versions_named(store) == {1, 2, 3, 4, 5, 6}  # the orphan above it went
    assert [r.version for r in Catalog(store, "m").history().versions] == [5, 6]
    readable_chains(store, [5, 6])


def test_gc_deletes_an_unreadable_manifest_no_kept_version_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fulls above it are enough: every kept version's chain starts at a readable full
    newer than it, so it and what lies behind it go, as old history does."""
    store = FileStore(tmp_path)
    publish(store, "FdFdFd")  # fulls at 1, 3, 5: keeping two keeps 3..6
    bad = corrupt(store, 2, "truncated")
    age_everything(tmp_path, 3600)
    status, out, err = gc(tmp_path, capsys, 2, "--json")
    doc = json.loads(out)
    assert status == 0 and bad in err
    assert doc["kept_versions"] == [3, 4, 5, 6] and doc["deleted_versions"] == []
    assert [u["manifest"] for u in doc["unreadable"]] == [bad]
    assert (doc["keeps_behind_unreadable"], doc["kept_behind_unreadable"]) == (False, 0)
    assert doc["orphans"] == 6  # versions 1 and 2: each a manifest, a table and a dense blob
    assert versions_named(store) == {3, 4, 5, 6}
    readable_chains(store, [3, 4, 5, 6])
    assert json.loads(ls(tmp_path, capsys, "--json")[1])["unreadable"] == []  # healed


def test_gc_with_heads_manifest_unreadable_deletes_nothing_of_its_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileStore(tmp_path)
    publish(store, "FdFd")
    bad = corrupt(store, 4)
    age_everything(tmp_path, 3600)
    before = stored(store)
    status, out, err = gc(tmp_path, capsys, 1)
    assert status == 0 and bad in err
    assert re.match(r"m: deleted versions none and 0 orphan objects \(0 bytes\)", out)
    assert f"unreadable manifest {bad} (version 4)" in out
    assert stored(store) == before


def test_gc_dry_run_names_the_unreadable_manifest_and_deletes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileStore(tmp_path)
    publish(store, "FdFdFd")
    bad = corrupt(store, 2)
    age_everything(tmp_path, 3600)
    before = stored(store)
    status, out, _ = gc(tmp_path, capsys, 2, "--dry-run")
    assert status == 0 and out.startswith("m: would delete versions none and 6 orphan objects")
    assert f"unreadable manifest {bad} (version 2)" in out
    assert stored(store) == before


def test_a_plan_behind_an_unreadable_manifest_deletes_only_what_it_listed(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    publish(store, "FdddFd")
    bad = corrupt(store, 3)
    age_everything(tmp_path, 3600)
    plan = plan_gc(store, "m", keep_baselines=2, grace_s=0)
    assert plan.unreadable is not None and plan.unreadable.key == bad
    assert plan.unreadable.version == 3 and plan.keeps_behind_unreadable
    assert plan.kept_versions == [4, 5, 6] and plan.delete_keys == plan.orphan_keys == []
    before = stored(store)
    assert run_gc(store, plan) == 0
    assert stored(store) == before
