"""The read side of a model's store layout: HEAD, manifests and the committed versions.

Everything fetched is validated (schemas/) and checked to belong to the model asked for. A version
is committed iff it is reachable from HEAD through `parent_manifest` links (docs/FORMAT.md
section 2), so listing walks that chain and never shows an orphan of a crashed publish.

A manifest on that chain that cannot be read (bytes that do not validate, a link that disagrees)
cuts the chain: what lies behind it can no longer be told from a crash's orphans. `versions`
(restore, inspect, follow) raises its typed error; `history` (ls, gc) returns the versions above
it and names it (`UnreadableManifest`), so one bad old manifest does not hide the whole model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from publisher.store import NotFoundError, ObjectStore
from publisher.tunables import DEFAULT_TUNABLES
from schemas.errors import BadDataError, ManifestError
from schemas.manifest import (
    MAX_HEAD_BYTES,
    MAX_MANIFEST_BYTES,
    Head,
    Manifest,
    check_model_name,
)
from schemas.store_keys import head_key, key_version, manifests_prefix, model_prefix


class CatalogError(BadDataError):
    """A model's versions cannot be read as asked."""


class NoVersionError(CatalogError):
    """The model has no committed version, or not the one asked for."""


class ModelNotFoundError(NoVersionError):
    """The store holds nothing of the model, not even a lease: a typo, or the wrong store."""


@dataclass(frozen=True)
class VersionRef:
    """A committed manifest and the key it was read from."""

    manifest: Manifest
    key: str

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass(frozen=True)
class UnreadableManifest:
    """A manifest that cannot be read as a version, and why.

    `version` is the one the key was expected to hold: what HEAD or the child naming it says, or,
    for a manifest found by listing (`Catalog.stored_below`), what its key's name says.
    """

    key: str
    version: int | None
    error: BadDataError

    @property
    def reason(self) -> str:
        """The typed error and its message, on one line."""
        return f"{type(self.error).__name__}: {' '.join(str(self.error).split())}"


@dataclass(frozen=True)
class History:
    """HEAD's chain as far as it can be read: its committed versions, oldest first, and the
    manifest the walk stopped at (`unreadable`) when one on the chain could not be read."""

    versions: list[VersionRef]
    unreadable: UnreadableManifest | None = None


class Catalog:
    """Reads one model's committed versions from a store.

    Manifests are cached by key, the `cache_size` most recently used ones: a server or trainer
    that lives for days meets a new version every second or so (a manifest is tens of KiB in
    memory), while a plan reads at most one restore chain, newest first, and following a
    version reads none (publisher/read/planner.py). A manifest that was evicted is read again.
    """

    def __init__(
        self,
        store: ObjectStore,
        model: str,
        *,
        cache_size: int = DEFAULT_TUNABLES.manifest_cache_size,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.store = store
        self.model = check_model_name(model)
        self.cache_size = cache_size
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        # The follow loop and an admin's pin read through one catalog from two threads.
        self._cache_lock = threading.Lock()

    def head(self) -> Head | None:
        """The HEAD record, or None when nothing was committed yet."""
        try:
            data = self.store.get(head_key(self.model), MAX_HEAD_BYTES)
        except NotFoundError:
            return None
        head = Head.from_json(data)
        if head.model != self.model:
            raise ManifestError(f"HEAD names model {head.model!r}, expected {self.model!r}")
        return head

    def manifest(self, key: str) -> Manifest:
        """The validated manifest stored at `key`."""
        with self._cache_lock:
            cached = self._manifests.get(key)
            if cached is not None:
                self._manifests.move_to_end(key)
                return cached
        manifest = Manifest.from_json(self.store.get(key, MAX_MANIFEST_BYTES))
        if manifest.model != self.model:
            raise ManifestError(f"{key} holds model {manifest.model!r}, expected {self.model!r}")
        self.remember(key, manifest)
        return manifest

    def require_model(self) -> None:
        """ModelNotFoundError unless the store holds some object of this model.

        A model whose trainer has started but not yet committed holds its lease, so it exists:
        "no version yet" and "no such model" are told apart.
        """
        if next(self.store.list(model_prefix(self.model)), None) is None:
            raise ModelNotFoundError(
                f"model {self.model!r} has no committed version: {self.store.url} holds nothing "
                "of it (check --model and --store)"
            )

    def remember(self, key: str, manifest: Manifest) -> None:
        """Cache a manifest (one this process wrote itself, or just read)."""
        with self._cache_lock:
            self._manifests[key] = manifest
            self._manifests.move_to_end(key)
            while len(self._manifests) > self.cache_size:
                self._manifests.popitem(last=False)

    def latest(self) -> VersionRef | None:
        """The version HEAD points to."""
        head = self.head()
        return None if head is None else self.at_head(head)

    def at_head(self, head: Head) -> VersionRef:
        """The version a HEAD record (read earlier) points to."""
        manifest = self.manifest(head.manifest)
        if manifest.version != head.version:
            raise ManifestError(
                f"HEAD says version {head.version} but {head.manifest} holds {manifest.version}"
            )
        return VersionRef(manifest, head.manifest)

    def versions(self, since: int = 0) -> list[VersionRef]:
        """Committed versions newer than `since`, oldest first (walks back from HEAD).

        The typed error of the first manifest on the way that cannot be read (`history`).
        """
        history = self.history(since)
        if history.unreadable is not None:
            raise history.unreadable.error
        return history.versions

    def history(self, since: int = 0) -> History:
        """Committed versions newer than `since`, oldest first, walking back from HEAD until
        `since`, the start of history (a parent manifest gc removed) or a manifest that cannot
        be read (`History.unreadable`: HEAD's own, missing, included). A HEAD record that cannot
        be read raises: then nothing is known."""
        head = self.head()
        if head is None:
            return History([])
        try:
            ref = self.at_head(head)
        except BadDataError as exc:
            return History([], UnreadableManifest(head.manifest, head.version, exc))
        found: list[VersionRef] = []
        unreadable = None
        while ref.version > since:
            found.append(ref)
            parent, parent_key = ref.manifest.parent, ref.manifest.parent_manifest
            if parent is None or parent_key is None or parent <= since:
                break
            try:
                ref = self._parent(ref, parent, parent_key)
            except NotFoundError:
                break  # history before this version was removed by gc
            except BadDataError as exc:
                unreadable = UnreadableManifest(parent_key, parent, exc)
                break
        found.reverse()
        return History(found, unreadable)

    def _parent(self, child: VersionRef, parent: int, parent_key: str) -> VersionRef:
        """The parent `child` names, its link checked."""
        manifest = self.manifest(parent_key)
        if manifest.version != parent:
            raise ManifestError(
                f"{child.key} names parent {parent} but {parent_key} holds {manifest.version}"
            )
        return VersionRef(manifest, parent_key)

    def stored_below(self, version: int) -> tuple[list[VersionRef], list[UnreadableManifest]]:
        """The manifests stored under the model's `manifests/` whose keys name a version older
        than `version`, read: those that validate (oldest first) and those that do not.

        Nothing says they are committed (a crash's orphan reads the same): this is what `ls`
        shows behind a manifest that cut HEAD's chain (`history`), marked as unverified.
        """
        readable: list[VersionRef] = []
        unreadable: list[UnreadableManifest] = []
        for info in self.store.list(manifests_prefix(self.model)):
            named = key_version(self.model, info.key)
            if named is None or named >= version:
                continue
            try:
                readable.append(VersionRef(self.manifest(info.key), info.key))
            except NotFoundError:
                continue  # deleted since it was listed (a gc)
            except BadDataError as exc:
                unreadable.append(UnreadableManifest(info.key, named, exc))
        readable.sort(key=lambda ref: (ref.version, ref.key))
        return readable, unreadable

    def find(self, version: int | None = None) -> VersionRef:
        """The committed `version` (the latest when None)."""
        if version is None:
            ref = self.latest()
            if ref is None:
                self.require_model()
                raise NoVersionError(f"model {self.model!r} has no committed version")
            return ref
        for ref in reversed(self.versions(since=version - 1)):
            if ref.version == version:
                return ref
        self.require_model()
        raise NoVersionError(f"model {self.model!r} has no committed version {version}")
