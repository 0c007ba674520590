"""The one version planner: which committed versions turn the applied state into a target's.

    plan_versions(catalog, applied=None, target=ref)   # bootstrap: baseline + deltas
    plan_versions(catalog, applied=5, target=ref)      # follow, catch up, pin: what 5 lacks
    restore_plan(catalog, version=7)                   # restore, resume: v7's chain

A plan is `target`'s restore chain (its full baseline, then each delta its `applies_to` links lead
through: a one-shot chain is baseline + one delta), cut after `applied` when that is allowed.
Applying a delta V on top of version C is valid iff C is in V's lineage (reachable from V through
`parent_manifest` links) and `applies_to <= C < V` (docs/FORMAT.md section 3). So:

- `applied` is None, not in `target`'s lineage (a store rolled back and rewritten), older than
  the chain's baseline, or newer than `target` (going back): the whole chain, from the baseline.
- `applied == target`: nothing.
- Otherwise the chain's deltas newer than `applied` (a one-shot target: only itself).

Manifests are read newest first, through the catalog's cache, and only back to the oldest
version the plan or the lineage check needs: a delta whose parent is `applied` needs none. Every
parent link read is checked. A lying manifest raises ManifestError; history the plan needs that
gc removed raises NoVersionError.
"""

from __future__ import annotations

from publisher.read.catalog import Catalog, NoVersionError, VersionRef
from publisher.store import NotFoundError
from schemas.errors import ManifestError


def plan_versions(catalog: Catalog, applied: int | None, target: VersionRef) -> list[VersionRef]:
    """The committed versions to apply, in order, to go from `applied` (None: nothing) to
    `target`, a committed version (see the module docstring)."""
    if applied == target.version:
        return []
    chain = [target]
    while chain[0].manifest.kind == "delta":
        first = chain[0]
        applies_to = first.manifest.applies_to
        assert applies_to is not None  # the manifest validator guarantees it for deltas
        above = first
        if applied is not None and applies_to <= applied < first.version:
            above = _oldest_above(catalog, first, applied)
            if above.manifest.parent == applied:
                return chain  # `applied` is in the lineage: the deltas after it are enough
            # The lineage skips `applied`: these deltas do not fit the applied state; rebuild.
        base = _parent(catalog, _oldest_above(catalog, above, applies_to), needed=applies_to)
        if base.version != applies_to:
            raise ManifestError(f"{first.key} applies to {applies_to}, which is not in its chain")
        chain.insert(0, base)
    return chain


def restore_plan(catalog: Catalog, version: int | None = None) -> list[VersionRef]:
    """What restoring committed `version` (the latest when None) reads: its full baseline, then
    each delta of its chain. NoVersionError if it is not committed."""
    return plan_versions(catalog, None, catalog.find(version))


def _oldest_above(catalog: Catalog, ref: VersionRef, floor: int) -> VersionRef:
    """The oldest version newer than `floor` in `ref`'s lineage (`ref` itself if its parent is
    not newer): the one whose parent number says whether `floor` is in the lineage."""
    while ref.manifest.parent is not None and ref.manifest.parent > floor:
        ref = _parent(catalog, ref, needed=floor)
    return ref


def _parent(catalog: Catalog, ref: VersionRef, *, needed: int) -> VersionRef:
    """`ref`'s parent, its link checked; `needed` is the version the walk is looking for."""
    parent, key = ref.manifest.parent, ref.manifest.parent_manifest
    if parent is None or key is None:
        raise ManifestError(f"{ref.key} has no parent, but its chain needs version {needed}")
    try:
        manifest = catalog.manifest(key)
    except NotFoundError as exc:
        raise NoVersionError(
            f"version {needed} is needed, but history before version {ref.version} was removed "
            f"({key} is gone)"
        ) from exc
    if manifest.version != parent:
        raise ManifestError(f"{ref.key} names parent {parent} but {key} holds {manifest.version}")
    return VersionRef(manifest, key)
