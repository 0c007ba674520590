"""A job of several ranks (threads) commits one version per round, as one writer would."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.sharded_run import (
    Layout,
    job_publishers,
    on_ranks,
    row_wise,
    split_snapshot,
    table_wise,
)
from bench.synthetic_run import SyntheticRun, small_config
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import FileStore, NotFoundError, ObjectStore
from publisher.write.background import BackgroundPublisher
from publisher.write.job_publishing import (
    CollectiveError,
    JobMismatchError,
    JobPublisher,
    RankFailedError,
    ThreadCollective,
    retryable,
)
from publisher.write.publishing import PublishResult
from publisher.write.snapshot import NonFiniteSnapshotError, Snapshot
from publisher.write.version_writer import PartsError
from schemas.errors import UnavailableError
from schemas.store_keys import head_key

CONFIG = small_config(rows=(300, 101), bag_rows=20, dim=8)
TABLE_ROWS = {"embeddings." + f.name: f.rows for f in CONFIG.sparse}


def _run(tmp_path: Path, name: str, seed: int = 0) -> SyntheticRun:
    return SyntheticRun(FileStore(tmp_path / name), "m", CONFIG, seed=seed)


def _snapshots(run: SyntheticRun, versions: int) -> list[Snapshot]:
    """The union snapshots of `versions` intervals (a full, then deltas), each also published
    by the run's own single writer (the reference)."""
    out = []
    for i in range(versions):
        run.train(2)
        kind = "full" if i == 0 else "delta"
        snapshot = replace(run.snapshot(kind), sequence=i + 1)
        run.publish(kind)  # the single writer's version of the same state
        out.append(snapshot)
    return out


def _publish(publishers: list[JobPublisher], parts: list[Snapshot]) -> list[PublishResult]:
    results = on_ranks(len(publishers), lambda r: publishers[r].publish(parts[r]))
    for result in results:
        if isinstance(result, Exception):
            raise result
    return [r for r in results if isinstance(r, PublishResult)]


def _assert_same_state(
    job_store: ObjectStore,
    single_store: ObjectStore,
    version: int,
    single_version: int | None = None,
) -> None:
    job = restore(job_store, "m", version)
    single = restore(single_store, "m", single_version or version)
    assert job.tables.keys() == single.tables.keys()
    for name, table in single.tables.items():
        assert job.tables[name].weights.tobytes() == table.weights.tobytes(), name
        assert job.tables[name].aux.tobytes() == table.aux.tobytes(), name
    assert job.dense.keys() == single.dense.keys()
    for name, value in single.dense.items():
        assert job.dense[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize(
    ("ranks", "layout"),
    [
        (2, table_wise(list(TABLE_ROWS), 2)),
        (2, row_wise(TABLE_ROWS, 2)),
        (3, row_wise(TABLE_ROWS, 3)),
        (3, table_wise(list(TABLE_ROWS), 3)),
    ],
    ids=["2-table-wise", "2-row-wise", "3-row-wise", "3-table-wise"],
)
def test_job_versions_restore_to_the_single_writers_state(
    tmp_path: Path, ranks: int, layout: Layout
) -> None:
    run = _run(tmp_path, "single")
    job_store = FileStore(tmp_path / "job")
    publishers = job_publishers(job_store, "m", ranks)
    try:
        for snapshot in _snapshots(run, 4):
            results = _publish(publishers, split_snapshot(snapshot, layout, ranks))
            # Every rank learns the same committed version.
            assert len({(r.ref.key, r.manifest.version) for r in results}) == 1
            manifest = results[0].manifest
            _assert_same_state(job_store, run.store, manifest.version)
            assert [t.name for t in manifest.tables] == list(TABLE_ROWS)  # the model's order
            assert manifest.position.ranks is not None
            assert [r.rank for r in manifest.position.ranks] == list(range(ranks))
            assert manifest.position.samples_seen == snapshot.position.samples_seen
            for table in manifest.tables:
                pieces = layout[table.name]
                if pieces[0][1] is None:
                    assert table.shards is None and table.blob is not None
                    assert f"/r{pieces[0][0]:04d}/" in table.blob.key
                else:
                    assert table.shards is not None and table.blob is None
                    got = [(s.rank, (s.row_start, s.row_end)) for s in table.shards]
                    assert got == pieces
                    for shard in table.shards:
                        key = f"/r{shard.rank:04d}/"
                        assert key in shard.blob.key and shard.blob.key.endswith(
                            f"-{shard.row_start}.cnrd"
                        )
            assert manifest.dense is not None and "/r0000/" in manifest.dense.key
    finally:
        for publisher in publishers:
            publisher.close()


class _FailingStore(FileStore):
    """A store whose puts under one rank's prefix fail while `failing` is set."""

    failing = True

    def put(self, key: str, data: bytes) -> str:
        if self.failing and "/r0001/" in key:
            raise OSError(f"disk full writing {key}")
        return super().put(key, data)


def test_a_rank_failing_its_upload_fails_the_version_on_every_rank(tmp_path: Path) -> None:
    run = _run(tmp_path, "single")
    store = _FailingStore(tmp_path / "job")
    store.failing = False
    publishers = job_publishers(store, "m", 2)
    layout = row_wise(TABLE_ROWS, 2)
    try:
        first, second, third = _snapshots(run, 3)
        _publish(publishers, split_snapshot(first, layout, 2))
        head = store.get(head_key("m"))
        store.failing = True
        results = on_ranks(2, lambda r: publishers[r].publish(split_snapshot(second, layout, 2)[r]))
        for result in results:
            assert isinstance(result, RankFailedError)
            assert result.rank == 1 and "disk full" in result.error
        assert store.get(head_key("m")) == head  # nothing committed
        # Every rank finished the failed round: the next one commits (the job's choice is to go
        # on after a failure every rank reported; see the module docstring).
        store.failing = False
        merged = second.merge(third)
        results_ok = _publish(publishers, split_snapshot(merged, layout, 2))
        assert results_ok[0].manifest.version == 2
        _assert_same_state(store, run.store, 2, single_version=3)
    finally:
        for publisher in publishers:
            publisher.close()


class _DownStore(FileStore):
    """A store that rank 1 cannot reach for its first `down` puts."""

    down = 3

    def put(self, key: str, data: bytes) -> str:
        if self.down and "/r0001/" in key:
            self.down -= 1
            raise UnavailableError(f"connection refused writing {key}")
        return super().put(key, data)


def test_a_store_down_for_one_rank_is_retried_by_every_rank(tmp_path: Path) -> None:
    run = _run(tmp_path, "single")
    store = _DownStore(tmp_path / "job")
    publishers = job_publishers(store, "m", 2)
    parts = [split_snapshot(s, row_wise(TABLE_ROWS, 2), 2) for s in _snapshots(run, 2)]
    published: list[list[PublishResult]] = [[], []]

    def rank(r: int) -> None:
        background = BackgroundPublisher(
            publishers[r], on_published=published[r].append, retry_initial_s=0.01
        )
        for part in parts:
            background.submit(part[r])
        background.close()

    for error in on_ranks(2, rank):
        assert error is None
    assert store.down == 0  # the failed rounds were retried, not given up
    versions = [[(p.ref.version, p.sequence) for p in ranks] for ranks in published]
    assert versions[0] == versions[1] and versions[0][-1][1] == 2
    _assert_same_state(store, run.store, versions[0][-1][0], single_version=2)


def test_a_lost_store_is_retryable_and_a_silent_rank_is_not() -> None:
    assert retryable(RankFailedError(1, "UnavailableError: refused", retryable=True))
    assert not retryable(RankFailedError(1, "OSError: disk full"))
    assert retryable(UnavailableError("refused")) and retryable(ConnectionError())
    assert not retryable(CollectiveError("ranks [1] did not report"))


def test_a_rank_that_never_answers_times_out_and_commits_nothing(tmp_path: Path) -> None:
    run = _run(tmp_path, "single")
    store = FileStore(tmp_path / "job")
    collectives = ThreadCollective.group(2, timeout_s=0.5)
    built = on_ranks(2, lambda r: JobPublisher(store, "m", collectives[r]))
    publishers = [p for p in built if isinstance(p, JobPublisher)]
    (first,) = _snapshots(run, 1)
    with pytest.raises(CollectiveError, match=r"ranks \[1\] did not report"):
        publishers[0].publish(split_snapshot(first, row_wise(TABLE_ROWS, 2), 2)[0])
    with pytest.raises(NotFoundError):
        store.get(head_key("m"))
    assert isinstance(CollectiveError("x"), UnavailableError)
    # Rank 0 stopped the job: no further round, and the lease is released.
    with pytest.raises(CollectiveError):
        publishers[0].publish(split_snapshot(first, row_wise(TABLE_ROWS, 2), 2)[0])
    assert publishers[0].writer is not None and publishers[0].writer._stop.is_set()


def _rank_1_fails_and_nothing_is_committed(
    tmp_path: Path, spoil: Callable[[Snapshot], Snapshot], *error: str
) -> None:
    """Two ranks publish the first version, rank 1's part spoiled: both fail, naming rank 1
    and every string of `error`, and no version is committed."""
    run = _run(tmp_path, "single")
    store = FileStore(tmp_path / "job")
    publishers = job_publishers(store, "m", 2)
    (first,) = _snapshots(run, 1)
    parts = split_snapshot(first, row_wise(TABLE_ROWS, 2), 2)
    parts[1] = spoil(parts[1])
    results = on_ranks(2, lambda r: publishers[r].publish(parts[r]))
    for result in results:
        assert isinstance(result, RankFailedError) and result.rank == 1
        assert all(e in result.error for e in error)
    with pytest.raises(NotFoundError):
        store.get(head_key("m"))
    for publisher in publishers:
        publisher.close()


def test_ranks_that_disagree_commit_nothing(tmp_path: Path) -> None:
    _rank_1_fails_and_nothing_is_committed(
        tmp_path, lambda part: replace(part, sequence=7), JobMismatchError.__name__, "sequence"
    )


def _spoil(part: Snapshot, row: int = 3) -> Snapshot:
    """The part with a NaN in its first table's `row`-th row (its arrays copied first)."""
    values = part.tables[0].values.copy()
    assert len(values) > row
    values[row, 1] = float("nan")
    table = replace(part.tables[0], codec="int4", values=values)
    return replace(part, tables=(table, *part.tables[1:]))


def test_a_rank_holding_nan_commits_nothing(tmp_path: Path) -> None:
    # The codec trusts the job publisher's one check of the snapshot (its kernel path would
    # quantise NaN to code 0 without a word): every rank refuses the version before anything
    # is written, with the same error naming the rank.
    run = _run(tmp_path, "single")
    store = FileStore(tmp_path / "job")
    publishers = job_publishers(store, "m", 2)
    (first,) = _snapshots(run, 1)
    parts = split_snapshot(first, row_wise(TABLE_ROWS, 2), 2)
    parts[1] = _spoil(parts[1])
    results = on_ranks(2, lambda r: publishers[r].publish(parts[r]))
    for result in results:
        assert isinstance(result, NonFiniteSnapshotError)
        assert str(result).startswith("rank 1: ") and "NaN or inf" in str(result)
    with pytest.raises(NotFoundError):
        store.get(head_key("m"))
    assert [o.key for o in store.list("")] == ["m/LEASE"]  # no blob: checked before uploads
    for publisher in publishers:
        publisher.close()


def test_skip_holds_a_non_finite_version_back_on_every_rank_and_folds_it_into_the_next(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path, "single")
    store = FileStore(tmp_path / "job")
    publishers = job_publishers(store, "m", 2)
    layout = row_wise(TABLE_ROWS, 2)
    parts = [split_snapshot(s, layout, 2) for s in _snapshots(run, 3)]
    # rank 1's part of the second version, on a row the third rewrites (until a snapshot
    # rewrites it, a folded NaN row keeps every version refused)
    second, third = parts[1][1].tables[0], parts[2][1].tables[0]
    rewritten = np.flatnonzero(np.isin(second.row_ids, third.row_ids))
    assert rewritten.size
    parts[1][1] = _spoil(parts[1][1], int(rewritten[0]))
    published: list[list[PublishResult]] = [[], []]
    skipped = [0, 0]

    def rank(r: int) -> None:
        background = BackgroundPublisher(
            publishers[r], on_published=published[r].append, on_non_finite="skip"
        )
        for part in parts:
            background.submit(part[r])
            background.wait()
        background.close()
        skipped[r] = background.non_finite_skipped

    for error in on_ranks(2, rank):
        assert error is None
    assert skipped == [1, 1]
    assert [[(p.ref.version, p.sequence) for p in ranks] for ranks in published] == [
        [(1, 1), (2, 3)],
        [(1, 1), (2, 3)],
    ]
    # the held version's rows are in the next one: the chain is the single writer's at 3
    _assert_same_state(store, run.store, 2, single_version=3)


@pytest.mark.parametrize(
    "layout",
    [
        # A row range missing: rows [150, 300) of f0 on no rank.
        {**row_wise(TABLE_ROWS, 2), "embeddings.f0": [(0, (0, 150))]},
        # Overlapping ranges.
        {**row_wise(TABLE_ROWS, 2), "embeddings.f0": [(0, (0, 160)), (1, (150, 300))]},
        # A table no rank sent.
        {k: v for k, v in row_wise(TABLE_ROWS, 2).items() if k != "embeddings.tags"},
    ],
    ids=["gap", "overlap", "missing-table"],
)
def test_a_bad_layout_is_refused_before_a_commit(tmp_path: Path, layout: Layout) -> None:
    run = _run(tmp_path, "single")
    store = FileStore(tmp_path / "job")
    publishers = job_publishers(store, "m", 2)
    (first,) = _snapshots(run, 1)
    first = replace(
        first, tables=tuple(t for t in first.tables if t.name in layout)
    )  # a table no rank holds is not in any part
    results = on_ranks(2, lambda r: publishers[r].publish(split_snapshot(first, layout, 2)[r]))
    for result in results:
        assert isinstance(result, RankFailedError) and result.rank == 0
        assert PartsError.__name__ in result.error
    with pytest.raises(NotFoundError):
        store.get(head_key("m"))
    for publisher in publishers:
        publisher.close()


def test_background_ranks_at_different_speeds_publish_the_same_sequence(tmp_path: Path) -> None:
    run = _run(tmp_path, "single")
    store = FileStore(tmp_path / "job")
    publishers = job_publishers(store, "m", 2)
    layout = row_wise(TABLE_ROWS, 2)
    snapshots = _snapshots(run, 5)
    parts = [split_snapshot(s, layout, 2) for s in snapshots]
    published: list[list[PublishResult]] = [[], []]

    def rank(r: int) -> None:
        background = BackgroundPublisher(publishers[r], on_published=published[r].append)
        for i, part in enumerate(parts):
            background.submit(part[r])
            time.sleep(0.002 if r == 0 else 0.05 * (i % 2))  # rank 1 lags behind
        background.close()

    for error in on_ranks(2, rank):
        assert error is None
    versions = [[(p.ref.version, p.sequence) for p in ranks] for ranks in published]
    assert versions[0] == versions[1] and versions[0][-1][1] == 5
    for (_, sequence), result in zip(versions[0], published[0], strict=True):
        assert result.manifest.position.step == snapshots[sequence - 1].position.step
    latest = Catalog(store, "m").find(None)
    job = restore(store, "m", latest.version)
    single = restore(run.store, "m", 5)
    for name, table in single.tables.items():
        assert job.tables[name].weights.tobytes() == table.weights.tobytes()


def test_a_rank_without_the_picked_snapshot_fails_the_round_on_every_rank(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path, "single")
    store = FileStore(tmp_path / "job")
    publishers = job_publishers(store, "m", 2, timeout_s=5)
    publishers[1].timeout_s = 0.2  # how long rank 1 waits for its trainer's snapshot
    (first,) = _snapshots(run, 1)
    parts = split_snapshot(first, row_wise(TABLE_ROWS, 2), 2)

    def rank(r: int) -> BaseException | None:
        background = BackgroundPublisher(publishers[r])
        if r == 0:
            background.submit(parts[0])
            with pytest.raises(RankFailedError) as failed:
                background.close()
            return failed.value
        background.close(flush=False)  # rank 1's trainer stopped before sequence 1
        with pytest.raises(RankFailedError) as failed:
            background.raise_if_failed()
        return failed.value

    errors = on_ranks(2, rank)
    for error in errors:
        assert isinstance(error, RankFailedError) and error.rank == 1
        assert "no snapshot of sequence 1" in error.error
    with pytest.raises(NotFoundError):
        store.get(head_key("m"))
