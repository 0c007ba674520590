"""The read side of a model's store layout: HEAD, manifests and the committed versions.

Everything fetched is validated (schemas/) and checked to belong to the model asked for. A version
is committed iff it is reachable from HEAD through `parent_manifest` links (docs/FORMAT.md
section 2), so listing walks that chain and never shows an orphan of a crashed publish.
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
from schemas.store_keys import head_key, model_prefix


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
        """Committed versions newer than `since`, oldest first (walks back from HEAD)."""
        found: list[VersionRef] = []
        ref = self.latest()
        while ref is not None and ref.version > since:
            found.append(ref)
            parent_key = ref.manifest.parent_manifest
            if parent_key is None:
                break
            try:
                parent = self.manifest(parent_key)
            except NotFoundError:
                break  # history before this version was removed by gc
            if parent.version != ref.manifest.parent:
                raise ManifestError(
                    f"{ref.key} names parent {ref.manifest.parent} but {parent_key} holds "
                    f"{parent.version}"
                )
            ref = VersionRef(parent, parent_key)
        found.reverse()
        return found

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
