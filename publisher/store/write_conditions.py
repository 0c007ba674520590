"""Whether a store enforces conditional writes, checked before anything relies on them.

The single-writer lease and HEAD's compare-and-swap (docs/FORMAT.md section 2) are `put_if` calls.
An S3 server that accepts `If-None-Match` / `If-Match` and ignores them (older SeaweedFS releases
do) applies every conditional write: two trainers both take the lease, both move HEAD, and the
chain silently interleaves. Nothing in a successful answer tells the difference, so a writer
probes the store with two conditional writes that must fail before it takes the lease.
"""

from __future__ import annotations

import contextlib

from publisher.store.base import ObjectStore, PreconditionFailedError, StoreError


class ConditionalWritesIgnoredError(StoreError):
    """The store applied a conditional write whose condition did not hold."""


def check_conditional_writes(store: ObjectStore, key: str) -> None:
    """ConditionalWritesIgnoredError unless `store` refuses the conditional writes that must fail.

    Creates the scratch object `key`, then tries to create it again (`If-None-Match: *`) and to
    replace it against an ETag it never had (`If-Match`): each must raise
    PreconditionFailedError. The object is deleted afterwards. Three small writes and a delete.
    """
    etag = store.put_if(key, b"probe", etag=None)
    never = "0" * 32 if etag != "0" * 32 else "1" * 32
    try:
        for what, condition in (
            ("a create-if-absent (If-None-Match: *) of an existing object", None),
            ("a replace-if-unchanged (If-Match) against an ETag the object never had", never),
        ):
            try:
                store.put_if(key, b"must not be written", etag=condition)
            except PreconditionFailedError:
                continue
            raise ConditionalWritesIgnoredError(
                f"{store.url} ignores conditional writes: {what} succeeded. The writer lease and "
                "HEAD's compare-and-swap rely on them (with them ignored, two trainers both "
                "commit and the chain interleaves), so nothing is published to this store: use "
                "a server that enforces If-None-Match and If-Match (MinIO, AWS S3, a SeaweedFS "
                "release that does)"
            )
    finally:
        with contextlib.suppress(StoreError):
            store.delete(key)
