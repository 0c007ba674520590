"""Retention: what `checknrun gc` may delete, and deleting it.

Kept: the newest `keep_baselines` full versions and every committed version after the oldest of
them (restoring any of those needs only that range), the restore chains of the released version
and of the one a rollback returns to (docs/FORMAT.md 9.1), every version created within the grace
period, and every object younger than the grace period (a publish in progress writes its blobs
and manifest before HEAD moves to them). Deleted: older committed versions, and orphans (objects
under `manifests/` or `blobs/` that no committed version references: leftovers of crashed
publishes). A version's manifest is deleted before its blobs, so a reader never finds a manifest
whose blobs are gone; readers treat a missing parent manifest as the start of history, so the
oldest kept version's `parent_manifest` naming a deleted manifest is normal (docs/FORMAT.md 2).

gc deletes only keys under the model's `manifests/` and `blobs/` prefixes, whatever a manifest
says: `run_gc` refuses a plan naming anything else (HEAD, LEASE, another model) before deleting
anything, so that guarantee does not rest on manifest validation alone.

A manifest on HEAD's chain that cannot be read (`Catalog.history`) hides what it references and
everything behind it, and gc never reads keys out of it. What gc does about it depends on
whether a kept version may need that history:

- the readable versions above it hold the `keep_baselines` fulls: every kept version's chain
  ends at a readable full newer than it, so it and all behind it is old history like any other,
  unreferenced by a kept version, and goes as orphans do (after the grace period);
- they do not (too few fulls above it, or it is HEAD's own manifest): normal retention would keep
  that history, and without the manifest its committed versions cannot be told from a crash's
  orphans, so every key naming its version or an older one (`key_version`) is kept
  (`GcPlan.kept_behind_unreadable`). Above it, gc works as always.

Either way the plan names it (`GcPlan.unreadable`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from publisher.read.catalog import Catalog, UnreadableManifest, VersionRef
from publisher.release.log import ReleaseLog
from publisher.store import ObjectStore
from schemas.errors import BadDataError
from schemas.store_keys import blobs_prefix, key_version, manifests_prefix


class RetentionError(BadDataError):
    """A gc plan names a key that is not gc's to delete."""


@dataclass
class GcPlan:
    """What a gc pass of `model` keeps and deletes."""

    model: str
    kept_versions: list[int] = field(default_factory=list)
    deleted_versions: list[int] = field(default_factory=list)
    delete_keys: list[str] = field(default_factory=list)
    orphan_keys: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    bytes_kept: int = 0
    #: the manifest that cut HEAD's chain, if one did (see the module docstring).
    unreadable: UnreadableManifest | None = None
    #: whether gc keeps what lies behind `unreadable` (a kept version may need it), and the
    #: keys that kept; False: it is old history, gone as orphans (see the module docstring).
    keeps_behind_unreadable: bool = False
    kept_behind_unreadable: int = 0


def plan_gc(
    store: ObjectStore, model: str, *, keep_baselines: int, grace_s: float, now: float | None = None
) -> GcPlan:
    """Decide what to delete without deleting anything."""
    if keep_baselines < 1:
        raise ValueError(f"keep_baselines must be >= 1, got {keep_baselines}")
    now = time.time() if now is None else now
    history = Catalog(store, model).history()
    versions = history.versions
    plan = GcPlan(model, unreadable=history.unreadable)
    if not versions and history.unreadable is None:
        return plan
    fulls = [r for r in versions if r.manifest.kind == "full"]
    oldest_kept = fulls[-keep_baselines].version if len(fulls) >= keep_baselines else 0
    # The released version and the one a rollback returns to stay restorable (FORMAT.md 9.1):
    # everything from the older of their baselines is kept.
    for released in _released_versions(store, model):
        ref = next((r for r in versions if r.version == released), None)
        if ref is not None and oldest_kept:
            oldest_kept = min(oldest_kept, ref.manifest.baseline)
    keep: list[VersionRef] = []
    drop: list[VersionRef] = []
    for ref in versions:
        recent = now - ref.manifest.created_at.timestamp() < grace_s
        (keep if ref.version >= oldest_kept or recent else drop).append(ref)
    referenced = {ref.key for ref in keep} | {b.key for ref in keep for b in ref.manifest.blobs}
    # Old versions: manifest first, then blobs (see the module docstring).
    for ref in sorted(drop, key=lambda r: r.version, reverse=True):
        plan.delete_keys.append(ref.key)
        plan.delete_keys.extend(b.key for b in ref.manifest.blobs if b.key not in referenced)
    dropped = set(plan.delete_keys)
    # No kept full above the unreadable manifest: kept versions may need what lies behind it.
    unknown = None if oldest_kept else history.unreadable
    plan.keeps_behind_unreadable = unknown is not None
    for prefix in (manifests_prefix(model), blobs_prefix(model)):
        for info in store.list(prefix):
            if info.key in referenced:
                plan.bytes_kept += info.size
            elif info.key in dropped:
                plan.bytes_freed += info.size
            elif unknown is not None and _behind(model, info.key, unknown):
                plan.kept_behind_unreadable += 1
                plan.bytes_kept += info.size
            elif now - info.modified >= grace_s:
                plan.orphan_keys.append(info.key)
                plan.bytes_freed += info.size
            else:
                plan.bytes_kept += info.size  # young: maybe a publish in progress
    plan.kept_versions = [r.version for r in keep]
    plan.deleted_versions = [r.version for r in drop]
    return plan


def _released_versions(store: ObjectStore, model: str) -> list[int]:
    """RELEASED's version and the one a rollback from it returns to (none without a gate)."""
    log = ReleaseLog(store, model)
    current = log.released()
    if current is None:
        return []
    good = log.last_good(current)
    return [current.version] if good is None else [current.version, good]


def _behind(model: str, key: str, unreadable: UnreadableManifest) -> bool:
    """Whether `key` may belong to `unreadable`'s version or an older one (a key whose name
    gives no version, or an unreadable manifest of unknown version: it may)."""
    named = key_version(model, key)
    return named is None or unreadable.version is None or named <= unreadable.version


def run_gc(store: ObjectStore, plan: GcPlan) -> int:
    """Delete what `plan` says (manifests of old versions first); return the number of keys.

    RetentionError, with nothing deleted, if the plan names a key outside the model's
    `manifests/` and `blobs/` prefixes.
    """
    owned = (manifests_prefix(plan.model), blobs_prefix(plan.model))
    foreign = [k for k in (*plan.delete_keys, *plan.orphan_keys) if not k.startswith(owned)]
    if foreign:
        raise RetentionError(
            f"gc of model {plan.model!r} refuses to delete {', '.join(map(repr, foreign[:5]))}: "
            f"only keys under {owned[0]!r} and {owned[1]!r} are gc's"
        )
    manifests = [k for k in plan.orphan_keys if "/manifests/" in k]
    blobs = [k for k in plan.orphan_keys if "/manifests/" not in k]
    for key in [*plan.delete_keys, *manifests, *blobs]:
        store.delete(key)
    return len(plan.delete_keys) + len(plan.orphan_keys)
