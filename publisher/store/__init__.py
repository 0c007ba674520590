"""Object stores selected by URL: `file:///path` (embedded default) and `s3://bucket/prefix`."""

from __future__ import annotations

from publisher.store.base import (
    BadKeyError,
    IntegrityError,
    NotFoundError,
    ObjectInfo,
    ObjectStore,
    ObjectTooLargeError,
    PreconditionFailedError,
    StoreError,
    StoreMissingError,
    StoreUnavailableError,
)
from publisher.store.file_store import FileStore, UnsafePathError
from publisher.store.write_conditions import ConditionalWritesIgnoredError, check_conditional_writes


def open_store(url: str, *, create: bool = True) -> ObjectStore:
    """The store a URL names. S3 settings (endpoint, credentials) come from the environment.

    Writers (`train`) open with `create=True`: a missing directory or bucket is made (for S3
    unless CHECKNRUN_S3_CREATE_BUCKET=0). Read-only commands open with `create=False`, which
    creates nothing: a missing directory raises StoreMissingError here, a missing bucket at the
    first request (opening costs no request, so a server can start while S3 is unreachable).
    """
    if url.startswith("file://"):
        return FileStore(url.removeprefix("file://"), create=create)
    if url.startswith("s3://"):
        from publisher.store.s3_store import S3Store  # only S3 users pay for the minio import

        return S3Store.from_url(url, create=create)
    if "://" not in url:
        return FileStore(url, create=create)
    raise StoreError(f"unsupported store URL {url!r}: expected file:///PATH or s3://BUCKET/PREFIX")


__all__ = [
    "BadKeyError",
    "ConditionalWritesIgnoredError",
    "FileStore",
    "IntegrityError",
    "NotFoundError",
    "ObjectInfo",
    "ObjectStore",
    "ObjectTooLargeError",
    "PreconditionFailedError",
    "StoreError",
    "StoreMissingError",
    "StoreUnavailableError",
    "UnsafePathError",
    "check_conditional_writes",
    "open_store",
]
