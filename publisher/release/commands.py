"""`checknrun release V` and `checknrun rollback [V]`: a person moves RELEASED.

    checknrun release 12 --store s3://models/prod --model ranker --reason "checked by hand"
    checknrun rollback --store s3://models/prod --model ranker          # to the last good one

Both write a release record `by: "person"` and move RELEASED by compare-and-swap
(docs/FORMAT.md 9.1), refusing a version that is not committed; with `--bus` they announce the
move, so released followers read RELEASED at once (without it they find it at their next read of
RELEASED: the next commit's announcement, or a HEAD poll). A version released by a person is on
probation like one the gate released: if the trainer's gate finds it worse than the version
released before it, it rolls it back.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from publisher.read.catalog import Catalog
from publisher.release.log import ReleaseError, ReleaseLog
from publisher.store import open_store
from schemas.announcement import Announcement
from schemas.release import Action


def cmd_release(args: argparse.Namespace) -> int:
    return _move(args, "release", args.version)


def cmd_rollback(args: argparse.Namespace) -> int:
    return _move(args, "rollback", args.version)


def _move(args: argparse.Namespace, action: Action, version: int | None) -> int:
    with open_store(args.store, create=False) as store:
        catalog = Catalog(store, args.model)
        log = ReleaseLog(store, args.model, catalog)
        current = log.released()
        if version is None:
            version = log.last_good(current) if current is not None else None
            if version is None:
                raise ReleaseError(
                    f"model {args.model!r} has no earlier released version to roll back to"
                    + ("" if current is None else f" (RELEASED is v{current.version})")
                )
        target = catalog.find(version)
        reason = args.reason or ("released" if action == "release" else "rolled back") + " by hand"
        moved = log.move(target, action=action, by="person", reason=reason, expected=current)
    if args.bus:
        from publisher.bus import open_announcer

        announcer = open_announcer(args.bus, args.model)
        try:
            announcer.announce(Announcement.of_release(target.manifest, target.key))
        finally:
            announcer.close()
    doc: dict[str, Any] = {
        "model": args.model,
        "released": moved.version,
        "previous": None if current is None else current.version,
        "sequence": moved.pointer.sequence,
        "action": action,
        "reason": moved.record.reason,
    }
    if args.json:
        print(json.dumps(doc))
    else:
        before = "none" if current is None else f"v{current.version}"
        print(f"{args.model}: RELEASED is v{moved.version} (was {before}): {moved.record.reason}")
    return 0
