"""VersionFollower over a FileStore: announcements as hints, reconciliation from HEAD."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest

from publisher.bus.base import AnnouncementSource
from publisher.read.catalog import Catalog, VersionRef
from publisher.read.follower import (
    BAD_JSON,
    BAD_KEY,
    INVALID,
    MISMATCH,
    OLD,
    OTHER_MODEL,
    OVERSIZED,
    UNCOMMITTED,
    UNKNOWN_SCHEMA,
    VersionFollower,
)
from publisher.store import FileStore, ObjectStore, StoreUnavailableError
from publisher.write.version_writer import CommitStage, TableBlob, VersionDraft, VersionWriter
from schemas.announcement import Announcement
from schemas.manifest import Position

MODEL = "m"


class ListSource(AnnouncementSource):
    """Hands out queued batches; an empty queue waits out the timeout like a quiet bus."""

    def __init__(self) -> None:
        self.batches: deque[list[bytes]] = deque()
        self.polls = 0

    def push(self, *messages: bytes) -> None:
        self.batches.append(list(messages))

    def poll(self, timeout_s: float) -> list[bytes]:
        self.polls += 1
        if self.batches:
            return self.batches.popleft()
        time.sleep(min(timeout_s, 0.02))
        return []


class FlakyStore(FileStore):
    """A FileStore whose reads fail while `down` is set."""

    down = False

    def get_with_etag(self, key: str, max_bytes: int | None = None) -> tuple[bytes, str]:
        if self.down:
            raise StoreUnavailableError("injected outage")
        return super().get_with_etag(key, max_bytes)


def draft(
    kind: Literal["full", "delta"], step: int, relative_to: Literal["parent", "baseline"] = "parent"
) -> VersionDraft:
    return VersionDraft(
        kind=kind,
        relative_to=None if kind == "full" else relative_to,
        policy="test",
        position=Position(step=step, samples_seen=step),
        # The follower never decodes blobs: placeholder bytes are enough.
        tables=[TableBlob("emb", 8, 2, "fp32", 8 if kind == "full" else 2, 0, b"rows@%d" % step)],
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FlakyStore]:
    yield FlakyStore(tmp_path / "store")


@pytest.fixture
def writer(store: ObjectStore) -> Iterator[VersionWriter]:
    with VersionWriter(store, MODEL) as w:
        yield w


def commit(writer: VersionWriter, *kinds: str, relative_to: str = "parent") -> list[VersionRef]:
    return [
        writer.commit(draft(k, step=i, relative_to=relative_to))  # type: ignore[arg-type]
        for i, k in enumerate(kinds)
    ]


def wire(ref: VersionRef) -> bytes:
    return Announcement.of(ref.manifest, ref.key).to_json()


def follower(store: ObjectStore, source: AnnouncementSource | None, **kw: float) -> VersionFollower:
    kw.setdefault("poll_head_after_s", 60.0)  # tests opt in to HEAD polling
    return VersionFollower(Catalog(store, MODEL), source, **kw)  # type: ignore[arg-type]


def numbers(refs: list[VersionRef]) -> list[int]:
    return [r.version for r in refs]


def test_bootstrap_from_none_is_the_chain_of_head(store: FlakyStore, writer: VersionWriter) -> None:
    f = follower(store, ListSource())
    assert f.poll(None, 0.05) == []  # nothing committed yet
    commit(writer, "full", "delta", "delta")
    f._next_head_poll = 0.0
    assert numbers(f.poll(None, 1.0)) == [1, 2, 3]
    assert f.stats.head_polls == 2 and f.stats.applied_candidates == 3


def test_bootstrap_of_a_one_shot_chain_skips_intermediate_deltas(
    store: FlakyStore, writer: VersionWriter
) -> None:
    commit(writer, "full", "delta", "delta", relative_to="baseline")
    refs = follower(store, None).poll(None, 1.0)
    assert numbers(refs) == [1, 3]
    assert refs[1].manifest.applies_to == 1


def test_in_order_follow_is_the_fast_path(store: FlakyStore, writer: VersionWriter) -> None:
    (v1,) = commit(writer, "full")
    source = ListSource()
    f = follower(store, source)
    assert numbers(f.poll(None, 1.0)) == [1]
    current = 1
    for step in range(2, 5):
        ref = writer.commit(draft("delta", step))
        source.push(wire(ref))
        got = f.poll(current, 1.0)
        assert numbers(got) == [step]
        assert got[0].key == ref.key and got[0].manifest == ref.manifest
        current = step
    assert f.stats.reconciles == 0
    assert f.stats.received == 3 and f.stats.applied_candidates == 4
    assert f.stats.head_polls == 1  # only the first poll; announcements kept arriving
    del v1


def test_duplicates_and_old_versions_are_ignored(store: FlakyStore, writer: VersionWriter) -> None:
    v1, v2 = commit(writer, "full", "delta")
    source = ListSource()
    f = follower(store, source)
    f._next_head_poll = float("inf")
    source.push(wire(v2), wire(v2), wire(v1))
    assert f.poll(2, 0.1) == []
    assert f.stats.ignored == {OLD: 3}
    # In one batch, what an earlier message brought in makes the repeat old.
    source.push(wire(v2), wire(v2))
    assert numbers(f.poll(1, 0.1)) == [2]
    assert f.stats.ignored == {OLD: 4}


def test_gap_reconciles_from_the_store(store: FlakyStore, writer: VersionWriter) -> None:
    commit(writer, "full", "delta")
    source = ListSource()
    f = follower(store, source)
    f._next_head_poll = float("inf")
    refs = [writer.commit(draft("delta", s)) for s in (3, 4, 5)]
    source.push(wire(refs[-1]))  # 3 and 4 were lost
    got = f.poll(2, 1.0)
    assert numbers(got) == [3, 4, 5]
    assert [r.manifest.applies_to for r in got] == [2, 3, 4]
    assert f.stats.reconciles == 1
    # The lost ones arriving late are old news.
    source.push(wire(refs[0]), wire(refs[1]))
    assert f.poll(5, 0.1) == [] and f.stats.ignored == {OLD: 2}


class CountingStore(FileStore):
    """A FileStore that counts reads."""

    reads = 0

    def get_with_etag(self, key: str, max_bytes: int | None = None) -> tuple[bytes, str]:
        self.reads += 1
        return super().get_with_etag(key, max_bytes)


def forged_in_order(n: int, parent: int, first: int = 0) -> list[bytes]:
    """Valid-looking announcements on top of `parent`, each naming a manifest never committed."""
    return [
        announcement_json(
            version=parent + 1,
            parent=parent,
            manifest_key=f"{MODEL}/manifests/{parent + 1:012d}-forged{i}.json",
        )
        for i in range(first, first + n)
    ]


def forged_gaps(n: int, first: int = 100) -> list[bytes]:
    """Valid-looking announcements of never-committed versions whose parent is not current."""
    return [
        announcement_json(
            version=v, parent=v - 1, manifest_key=f"{MODEL}/manifests/{v:012d}-forged.json"
        )
        for v in range(first, first + n)
    ]


def test_a_flood_of_gap_announcements_costs_a_bounded_number_of_reads(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    with VersionWriter(store, MODEL) as writer:
        commit(writer, "full", "delta")
        source = ListSource()
        # No HEAD retry poll either (an uncommitted announcement schedules one): reads counted
        # below are those the announcements cause.
        f = follower(store, source, min_reconcile_interval_s=3600.0, retry_after_error_s=3600.0)
        f._next_head_poll = float("inf")
        reads = store.reads
        source.push(*forged_gaps(1000))
        source.push(*forged_gaps(1000, first=2000))
        assert f.poll(2, 0.3) == []
        assert f.stats.received == 2000
        assert f.stats.reconciles == 1 and f.stats.coalesced == 1999
        assert store.reads - reads <= 3, store.reads - reads  # one reconcile: HEAD + manifest

        # A genuine version announced in order is applied at once, flood or not.
        v3 = writer.commit(draft("delta", 3))
        source.push(*forged_gaps(500), wire(v3), *forged_gaps(500, first=5000))
        assert numbers(f.poll(2, 1.0)) == [3]

        # A genuine gap amid the flood is filled by the one reconcile wanted, when it is due.
        refs = [writer.commit(draft("delta", s)) for s in (4, 5)]
        source.push(*forged_gaps(500, first=7000), wire(refs[-1]))  # 4 was lost
        assert f.poll(3, 0.2) == []  # not due yet: the flood started the interval
        assert f.stats.reconciles == 1
        f.min_reconcile_interval_s = 0.05
        assert numbers(f.poll(3, 5.0)) == [4, 5]
        assert f.stats.reconciles == 2
        assert store.reads - reads <= 12, store.reads - reads

        # In-order forgeries (parent == current) of versions HEAD does not reach: one HEAD read,
        # reused for the rest of the interval.
        f.min_reconcile_interval_s = 3600.0
        reads, coalesced = store.reads, f.stats.coalesced
        source.push(*forged_in_order(1000, parent=5))
        assert f.poll(5, 0.3) == []
        assert f.stats.ignored[UNCOMMITTED] == 1000
        assert store.reads - reads <= 1, store.reads - reads
        assert f.stats.coalesced - coalesced == 999

        # In-order forgeries naming another manifest for HEAD's version, on top of a version the
        # caller keeps failing to apply: one reconcile per interval, not one per poll.
        for step in (6, 7):
            writer.commit(draft("delta", step))
        reads = store.reads
        for i in range(100):
            source.push(*forged_in_order(1, parent=6, first=i))
            assert f.poll(6, 0.0) == []
        assert store.reads - reads <= 1, store.reads - reads
        assert f.stats.reconciles == 2
        f.min_reconcile_interval_s = 0.05  # the reconcile wanted runs when the interval ends
        assert numbers(f.poll(6, 5.0)) == [7]
        assert f.stats.reconciles == 3


def test_a_full_in_the_gap_starts_the_plan(store: FlakyStore, writer: VersionWriter) -> None:
    refs = commit(writer, "full", "delta", "delta", "full", "delta", "full", "delta", "delta")
    source = ListSource()
    f = follower(store, source)
    f._next_head_poll = float("inf")
    source.push(wire(refs[-1]))
    assert numbers(f.poll(2, 1.0)) == [6, 7, 8]  # from the newest full, not from 3


def test_one_shot_gap_needs_only_the_newest_delta(store: FlakyStore, writer: VersionWriter) -> None:
    # Each one-shot delta holds every row since the baseline: 3 would be overwritten by 4.
    refs = commit(writer, "full", "delta", "delta", "delta", relative_to="baseline")
    source = ListSource()
    f = follower(store, source)
    f._next_head_poll = float("inf")
    source.push(wire(refs[-1]))
    got = f.poll(2, 1.0)
    assert numbers(got) == [4]
    assert got[0].key == refs[-1].key and got[0].manifest.applies_to == 1


def test_head_ahead_of_the_announcement_catches_up_at_once(
    store: FlakyStore, writer: VersionWriter
) -> None:
    v1, v2, _, _ = commit(writer, "full", "delta", "delta", "delta")
    source = ListSource()
    f = follower(store, source)
    f._next_head_poll = float("inf")
    source.push(wire(v2))  # parent == current, but HEAD already moved on
    assert numbers(f.poll(1, 1.0)) == [2, 3, 4]
    del v1


def announcement_json(**changes: object) -> bytes:
    base = {
        "schema_version": 1,
        "model": MODEL,
        "version": 9,
        "parent": 8,
        "kind": "delta",
        "manifest_key": f"{MODEL}/manifests/000000000009-abc.json",
        "created_at": "2026-01-01T00:00:00+00:00",
        "total_bytes": 1,
    }
    base.update(changes)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def test_every_bad_message_is_dropped_and_counted(store: FlakyStore, writer: VersionWriter) -> None:
    v1, v2 = commit(writer, "full", "delta")
    source = ListSource()
    f = follower(store, source)
    f._next_head_poll = float("inf")
    mismatched = json.loads(wire(v2))
    mismatched["kind"] = "full"
    source.push(
        b"x" * 5000,  # oversized
        b"{not json",
        b"\xff\xfe",  # not UTF-8
        b"[1, 2]",  # JSON, not an object
        b"[" * 3000,  # nested past the recursion limit, still under the size cap
        announcement_json(schema_version=2),
        announcement_json(schema_version=True),  # True == 1, but it is not the number 1
        announcement_json(model="other"),
        announcement_json(manifest_key="other/manifests/000000000009-abc.json"),
        announcement_json(manifest_key=f"{MODEL}/blobs/x.json"),
        announcement_json(manifest_key=f"{MODEL}/manifests/../../etc/passwd.json"),
        announcement_json(manifest_key=5),
        announcement_json(total_bytes=-1),
        announcement_json(version=...),  # missing field
        announcement_json(extra="field"),
        announcement_json(version=1, parent=None),  # old
        announcement_json(version=3, parent=1),  # never committed: HEAD is 2
        json.dumps(mismatched).encode(),
    )
    assert f.poll(1, 0.2) == []
    assert f.stats.ignored == {
        OVERSIZED: 1,
        BAD_JSON: 4,
        UNKNOWN_SCHEMA: 2,
        OTHER_MODEL: 1,
        BAD_KEY: 4,
        INVALID: 3,
        OLD: 1,
        UNCOMMITTED: 1,
        MISMATCH: 1,
    }
    assert f.stats.received == 18 and f.stats.applied_candidates == 0
    # After all that junk a good message still works.
    source.push(wire(v2))
    assert numbers(f.poll(1, 1.0)) == [2]
    del v1


def test_orphan_of_a_losing_writer_is_not_applied(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with VersionWriter(store, MODEL) as w:
        w.commit(draft("full", 1))

    orphans: list[VersionRef] = []

    class Crash(Exception):
        pass

    def crash(stage: CommitStage) -> None:
        if stage == "manifest_written":
            raise Crash

    with VersionWriter(store, MODEL, crash_hook=crash) as w, pytest.raises(Crash):
        w.commit(draft("delta", 2))
    orphan_key = next(
        i.key
        for i in store.list(f"{MODEL}/manifests/")
        if i.key.startswith(f"{MODEL}/manifests/000000000002")
    )
    catalog = Catalog(store, MODEL)
    orphans.append(VersionRef(catalog.manifest(orphan_key), orphan_key))
    source = ListSource()
    # No rate limit: the second message must read HEAD again, not reuse the first one's read.
    f = follower(store, source, min_reconcile_interval_s=0.0)
    f._next_head_poll = float("inf")
    source.push(wire(orphans[0]))  # announced by mistake (or by an attacker)
    assert f.poll(1, 0.1) == []
    assert f.stats.ignored == {UNCOMMITTED: 1}
    with VersionWriter(store, MODEL) as w:
        committed = w.commit(draft("delta", 2))
    f._next_head_poll = float("inf")  # the retry HEAD poll must not beat the message
    source.push(wire(orphans[0]))  # same number as the committed one, another manifest
    got = f.poll(1, 1.0)
    assert [(r.version, r.key) for r in got] == [(2, committed.key)]
    assert f.stats.ignored == {UNCOMMITTED: 2}


def test_head_is_polled_after_silence(store: FlakyStore, writer: VersionWriter) -> None:
    commit(writer, "full")
    source = ListSource()
    f = follower(store, source, poll_head_after_s=0.2)
    assert numbers(f.poll(None, 1.0)) == [1]
    assert f.poll(1, 0.1) == []
    threading.Timer(0.05, lambda: writer.commit(draft("delta", 2))).start()
    assert numbers(f.poll(1, 5.0)) == [2]  # never announced: found by a HEAD poll
    assert f.stats.head_polls >= 2 and f.stats.received == 0


def test_heard_at_is_when_the_announcement_or_the_head_poll_came(
    store: FlakyStore, writer: VersionWriter
) -> None:
    source = ListSource()
    f = follower(store, source, poll_head_after_s=0.2)
    assert f.heard_at is None
    commit(writer, "full")
    before = time.time()
    assert numbers(f.poll(None, 1.0)) == [1]  # the first poll reads HEAD
    assert f.heard_at is not None and before <= f.heard_at <= time.time()
    ref = writer.commit(draft("delta", 2))
    source.push(wire(ref))
    before = time.time()
    assert numbers(f.poll(1, 1.0)) == [2]
    assert before <= f.heard_at <= time.time()


def test_without_a_source_it_polls_head(store: FlakyStore, writer: VersionWriter) -> None:
    f = follower(store, None, poll_head_after_s=0.05)
    assert f.poll(None, 0.1) == []
    commit(writer, "full", "delta")
    assert numbers(f.poll(None, 1.0)) == [1, 2]
    writer.commit(draft("delta", 3))
    assert numbers(f.poll(2, 1.0)) == [3]
    assert f.poll(3, 0.1) == []


def test_store_errors_are_retried_not_raised(store: FlakyStore, writer: VersionWriter) -> None:
    _, v2 = commit(writer, "full", "delta")
    source = ListSource()
    f = follower(store, source, retry_after_error_s=0.05)
    store.down = True
    assert f.poll(None, 0.2) == []
    assert f.stats.store_errors >= 1
    source.push(wire(v2))  # the announcement comes while the store is still down
    assert f.poll(None, 0.1) == []
    store.down = False
    assert numbers(f.poll(None, 1.0)) == [1, 2]  # the next HEAD poll retried


def test_announcement_before_head_is_picked_up_by_a_later_head_poll(
    store: FlakyStore, writer: VersionWriter
) -> None:
    (v1,) = commit(writer, "full")
    source = ListSource()
    f = follower(store, source, retry_after_error_s=0.05)
    f._next_head_poll = float("inf")
    # An announcement of version 2 that HEAD does not show yet (a lagging store replica).
    source.push(announcement_json(version=2, parent=1, manifest_key=f"{MODEL}/manifests/x.json"))
    assert f.poll(1, 0.02) == []
    assert f.stats.ignored == {UNCOMMITTED: 1}
    writer.commit(draft("delta", 2))
    assert numbers(f.poll(1, 1.0)) == [2]  # retried soon, not after poll_head_after_s
    del v1


class RaisingSource(AnnouncementSource):
    def poll(self, timeout_s: float) -> list[bytes]:
        raise RuntimeError("broken source")


def test_a_raising_source_does_not_stop_head_polls(
    store: FlakyStore, writer: VersionWriter
) -> None:
    commit(writer, "full")
    f = follower(store, RaisingSource(), poll_head_after_s=0.05)
    assert numbers(f.poll(None, 1.0)) == [1]
    writer.commit(draft("delta", 2))
    assert numbers(f.poll(1, 1.0)) == [2]


def test_announcements_with_duplicate_keys_or_nan_are_bad_json(
    store: FlakyStore, writer: VersionWriter
) -> None:
    # The same strictness as blob headers and manifests (schemas/strict_json.py): two readers
    # that keep different copies of a duplicated key must never see different versions.
    _, v2 = commit(writer, "full", "delta")
    source = ListSource()
    f = follower(store, source)
    f._next_head_poll = float("inf")
    good = wire(v2)
    source.push(
        good.replace(b'"version":2', b'"version":7,"version":2'),
        good.replace(b'"total_bytes":', b'"total_bytes":NaN,"total_bytes":'),
    )
    assert f.poll(1, 0.2) == []
    assert f.stats.ignored == {BAD_JSON: 2}
    source.push(good)
    assert numbers(f.poll(1, 1.0)) == [2]
