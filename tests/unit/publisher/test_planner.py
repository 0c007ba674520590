"""plan_versions on hand-made lineages: every branch, every check, and how much it reads.

The manifests are remembered by a catalog over an empty store (the planner reads only through
the catalog), so a lineage can skip versions, lie about its links or lose its history.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import pytest

from publisher.read.catalog import Catalog, NoVersionError, VersionRef
from publisher.read.planner import plan_versions, restore_plan
from publisher.store import FileStore
from publisher.write.version_writer import TableBlob, VersionDraft, VersionWriter
from schemas.errors import ManifestError
from schemas.manifest import Manifest, Position
from schemas.store_keys import manifest_key

MODEL = "m"
_tokens = itertools.count()  # two versions of one number (a rewritten store) get two keys


class CountingCatalog(Catalog):
    """Counts manifest look-ups, cached or not."""

    reads = 0

    def manifest(self, key: str) -> Manifest:
        self.reads += 1
        return super().manifest(key)


@pytest.fixture
def catalog(tmp_path: Path) -> CountingCatalog:
    return CountingCatalog(FileStore(tmp_path), MODEL)


def add(
    catalog: Catalog,
    version: int,
    parent: VersionRef | None,
    kind: Literal["full", "delta"] = "delta",
    *,
    relative_to: Literal["parent", "baseline"] = "parent",
    applies_to: int | None = None,
    remember: bool = True,
) -> VersionRef:
    """A version on top of `parent`, as a writer makes it unless `applies_to` says otherwise."""
    if kind == "full":
        baseline = version
    else:
        baseline = parent.manifest.baseline if parent is not None else 1
        if applies_to is None:
            assert parent is not None
            applies_to = parent.version if relative_to == "parent" else baseline
    manifest = Manifest(
        model=MODEL,
        version=version,
        parent=None if parent is None else parent.version,
        parent_manifest=None if parent is None else parent.key,
        kind=kind,
        baseline=baseline,
        applies_to=applies_to,
        policy="test",
        created_at=datetime.now(UTC),
        position=Position(step=version, samples_seen=version),
        tables=(),
    )
    ref = VersionRef(manifest, manifest_key(MODEL, version, f"t{next(_tokens)}"))
    if remember:
        catalog.remember(ref.key, manifest)
    return ref


def lineage(catalog: Catalog, *kinds: str, relative_to: str = "parent") -> list[VersionRef]:
    """Versions 1, 2, ... of the given kinds, each on top of the one before."""
    refs: list[VersionRef] = []
    for version, kind in enumerate(kinds, start=1):
        refs.append(
            add(
                catalog,
                version,
                refs[-1] if refs else None,
                kind,  # type: ignore[arg-type]
                relative_to=relative_to,  # type: ignore[arg-type]
            )
        )
    return refs


def numbers(refs: list[VersionRef]) -> list[int]:
    return [r.version for r in refs]


def test_fresh_start_is_the_whole_chain(catalog: CountingCatalog) -> None:
    refs = lineage(catalog, "full", "delta", "delta")
    assert numbers(plan_versions(catalog, None, refs[-1])) == [1, 2, 3]
    assert numbers(plan_versions(catalog, None, refs[0])) == [1]


def test_fresh_start_of_a_one_shot_chain_skips_intermediate_deltas(
    catalog: CountingCatalog,
) -> None:
    refs = lineage(catalog, "full", "delta", "delta", "delta", relative_to="baseline")
    assert numbers(plan_versions(catalog, None, refs[-1])) == [1, 4]


def test_up_to_date_is_empty_and_reads_nothing(catalog: CountingCatalog) -> None:
    refs = lineage(catalog, "full", "delta")
    catalog.reads = 0
    assert plan_versions(catalog, 2, refs[-1]) == []
    assert catalog.reads == 0


def test_incremental_is_the_deltas_after_the_applied_version(catalog: CountingCatalog) -> None:
    refs = lineage(catalog, "full", "delta", "delta", "delta")
    assert numbers(plan_versions(catalog, 1, refs[-1])) == [2, 3, 4]
    assert numbers(plan_versions(catalog, 2, refs[-1])) == [3, 4]
    catalog.reads = 0
    assert plan_versions(catalog, 3, refs[-1]) == [refs[-1]]
    assert catalog.reads == 0  # the parent is applied: following costs no manifest read


def test_a_newer_full_starts_the_plan(catalog: CountingCatalog) -> None:
    refs = lineage(catalog, "full", "delta", "full", "delta", "delta")
    assert numbers(plan_versions(catalog, 2, refs[-1])) == [3, 4, 5]
    assert numbers(plan_versions(catalog, 1, refs[2])) == [3]
    assert numbers(plan_versions(catalog, 3, refs[-1])) == [4, 5]


def test_a_one_shot_delta_is_enough_on_any_version_of_its_chain(
    catalog: CountingCatalog,
) -> None:
    refs = lineage(catalog, "full", "delta", "delta", "delta", "delta", relative_to="baseline")
    for applied in (1, 2, 3, 4):
        assert plan_versions(catalog, applied, refs[-1]) == [refs[-1]]


def test_going_back_rebuilds_from_the_baseline(catalog: CountingCatalog) -> None:
    refs = lineage(catalog, "full", "delta", "delta", "delta")
    assert numbers(plan_versions(catalog, 4, refs[1])) == [1, 2]


def test_an_applied_version_outside_the_lineage_rebuilds_from_the_baseline(
    catalog: CountingCatalog,
) -> None:
    # 3 was served, then the store was rolled back to 2 and rewritten: 5's parent is 2.
    v1, v2 = lineage(catalog, "full", "delta")
    v5 = add(catalog, 5, v2)
    assert numbers(plan_versions(catalog, 3, v5)) == [1, 2, 5]
    # One-shot: 5 applies to 1 <= 3, but on top of a state 3 that is not in its lineage.
    os5 = add(catalog, 5, add(catalog, 2, v1, relative_to="baseline"), relative_to="baseline")
    assert numbers(plan_versions(catalog, 3, os5)) == [1, 5]


def test_a_broken_parent_link_is_refused(catalog: CountingCatalog) -> None:
    v1, _ = lineage(catalog, "full", "delta")
    lying = add(catalog, 3, v1, applies_to=2)
    lying = VersionRef(lying.manifest.model_copy(update={"parent": 2}), lying.key)
    with pytest.raises(ManifestError, match=r"names parent 2 but \S+ holds 1"):
        plan_versions(catalog, None, lying)


def test_a_delta_without_a_parent_is_refused(catalog: CountingCatalog) -> None:
    orphan = add(catalog, 2, None, applies_to=1)
    with pytest.raises(ManifestError, match="has no parent, but its chain needs version 1"):
        plan_versions(catalog, None, orphan)


def test_applies_to_outside_the_lineage_is_refused(catalog: CountingCatalog) -> None:
    v1 = add(catalog, 1, None, "full")
    skips = add(catalog, 3, v1, applies_to=2)  # 2 is not in its lineage
    with pytest.raises(ManifestError, match="applies to 2, which is not in its chain"):
        plan_versions(catalog, None, skips)
    with pytest.raises(ManifestError, match="applies to 2, which is not in its chain"):
        plan_versions(catalog, 2, skips)  # the lineage check sees 2 missing, then the chain


def test_history_removed_by_gc_is_no_version(catalog: CountingCatalog) -> None:
    v1 = add(catalog, 1, None, "full", remember=False)  # its manifest is gone
    v3 = add(catalog, 3, add(catalog, 2, v1))
    with pytest.raises(NoVersionError, match="version 1 is needed"):
        plan_versions(catalog, None, v3)
    assert numbers(plan_versions(catalog, 2, v3)) == [3]  # what is applied needs no history


def test_restore_plan_is_the_chain_of_a_committed_version(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with VersionWriter(store, MODEL) as writer:
        for step, kind in enumerate(("full", "delta", "delta")):
            writer.commit(
                VersionDraft(
                    kind=kind,  # type: ignore[arg-type]
                    relative_to=None if kind == "full" else "parent",
                    policy="test",
                    position=Position(step=step, samples_seen=step),
                    tables=[TableBlob("emb", 8, 2, "fp32", 8, 0, b"rows")],
                )
            )
    catalog = Catalog(store, MODEL)
    assert numbers(restore_plan(catalog)) == [1, 2, 3]
    assert numbers(restore_plan(catalog, 2)) == [1, 2]
    with pytest.raises(NoVersionError):
        restore_plan(catalog, 4)
