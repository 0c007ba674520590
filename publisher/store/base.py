"""The narrow object-store interface every backend implements, and its errors.

A store moves bytes by key and knows nothing of tensors or manifests. Besides plain put/get it
offers one conditional write, `put_if`, which the commit protocol builds on (docs/FORMAT.md
section 2): create only if absent, or replace only if the current ETag is unchanged.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from schemas.errors import BadDataError, CheckNRunError, ConflictError, UnavailableError
from schemas.store_keys import is_safe_key


class StoreError(CheckNRunError):
    """Base of every store failure; raised itself when the store refuses or is misconfigured."""


class NotFoundError(StoreError, BadDataError):
    """The key does not exist."""


class PreconditionFailedError(StoreError, ConflictError):
    """A conditional write lost: the object exists, or its ETag changed."""


class StoreUnavailableError(StoreError, UnavailableError):
    """The store cannot be reached (after retries)."""


class IntegrityError(StoreError, BadDataError):
    """Fetched bytes do not match the size or sha256 the manifest promises."""


class BadKeyError(StoreError, BadDataError):
    """A key that is not a safe relative path."""


class ObjectTooLargeError(StoreError, BadDataError):
    """An object is longer than its reader accepts; no more than that cap plus one byte was read."""


class StoreMissingError(StoreError):
    """The store itself (a file:// directory, an s3:// bucket) does not exist.

    Read-only opens (`open_store(url, create=False)`: ls, inspect, restore, gc, serve) raise it
    instead of creating the store.
    """


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object."""

    key: str
    size: int
    etag: str
    modified: float  # seconds since the epoch


def check_key(key: str) -> str:
    """Refuse keys that could escape the store's root or prefix (`schemas.store_keys`' rule)."""
    if not is_safe_key(key):
        raise BadKeyError(f"unsafe store key {key!r}")
    return key


def read_capped(
    key: str, read: Callable[[int | None], bytes], max_bytes: int | None, size: int | None = None
) -> bytes:
    """What `read(n)` (a file's or an HTTP body's read) returns for `key`, all of it when
    `max_bytes` is None, else at most `max_bytes` bytes: one byte more is read to tell a longer
    object, which raises ObjectTooLargeError.

    `size` is the object's length when known (a file's): a file read allocates its whole
    request up front, so a small object is not read into a buffer of the cap, and a longer one
    is refused unread.
    """
    if max_bytes is None:
        return read(None)
    too_long = ObjectTooLargeError(f"{key} is longer than {max_bytes} bytes, the most read")
    if size is not None and size > max_bytes:
        raise too_long
    data = read((max_bytes if size is None else size) + 1)
    if len(data) > max_bytes:
        raise too_long
    return data


class ObjectStore(ABC):
    """Bytes by key. Implementations: `FileStore` (file://), `S3Store` (s3://)."""

    url: str

    @abstractmethod
    def put(self, key: str, data: bytes) -> str:
        """Write `data` atomically (readers see the old object or the new one); return the ETag."""

    @abstractmethod
    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str:
        """Write only if the object is absent (`etag=None`) or its ETag is `etag`.

        Raises PreconditionFailedError when the condition does not hold.
        """

    @abstractmethod
    def get_with_etag(self, key: str, max_bytes: int | None = None) -> tuple[bytes, str]:
        """The whole object and its ETag; NotFoundError if absent.

        With `max_bytes`, at most `max_bytes + 1` bytes are read (`read_capped`) and a longer
        object raises ObjectTooLargeError: a hostile object costs the cap, not its size.
        """

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from offset `start` (fewer at the end of the object)."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; absent objects are not an error."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True if the object exists."""

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        """The whole object; NotFoundError if absent, ObjectTooLargeError past `max_bytes`."""
        return self.get_with_etag(key, max_bytes)[0]

    def get_verified(self, key: str, size: int, sha256: str) -> bytes:
        """The object, checked against the size and sha256 a manifest promises."""
        # Read at most one byte more than promised: an object swapped for a huge one is
        # refused without downloading it. An empty object takes a capped get instead (a range
        # read of no bytes is an error on S3), never an uncapped one.
        if size > 0:
            data = self.get_range(key, 0, size + 1)
        else:
            try:
                data = self.get(key, max_bytes=0)
            except ObjectTooLargeError as exc:
                raise IntegrityError(f"{key}: not empty, the manifest says 0 bytes") from exc
        if len(data) != size:
            raise IntegrityError(f"{key}: {len(data)} bytes, the manifest says {size}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise IntegrityError(f"{key}: sha256 {digest}, the manifest says {sha256}")
        return data

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release connections."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
