"""Dirty rows of a sharded job: each rank gets the rows of its own shards that any rank's batch
looked up (and only those changed), and the union is the same on every rank."""

from __future__ import annotations

import numpy as np
import pytest

from bench.sharded_job import CONFIG, batch, run_ranks, sharded_job, train_sharded
from tests.unit.trainer.sharded.job import sharded_state

pytest.importorskip("torchrec")


def _looked_up(seeds: list[int], size: int) -> dict[str, np.ndarray]:
    """Global rows every batch of `seeds` looks up, per table."""
    rows: dict[str, set[int]] = {f"embeddings.{f.name}": set() for f in CONFIG.sparse}
    for seed in seeds:
        _, sparse, _ = batch(seed, size)
        for feature, b in sparse.items():
            rows[f"embeddings.{feature}"].update(b.values.tolist())
    return {name: np.array(sorted(ids), dtype=np.int64) for name, ids in rows.items()}


def _check_dirty_rows(rank: int, world: int, sharding: str) -> None:
    from trainer.sharded.dirty_rows import ShardDirtyRows
    from trainer.sharded.local_shards import local_shards

    job = sharded_job(sharding)
    tables = local_shards(job.model)
    dirty = ShardDirtyRows(job.model, tables)
    for step in range(2):
        before = sharded_state(job)
        train_sharded(job, seed=10 * step + rank, size=8)
        mine = dirty.take()
        union = dirty.union(mine)
        touched = _looked_up([10 * step + r for r in range(world)], 8)
        assert {k: v.tolist() for k, v in union.items()} == {
            k: v.tolist() for k, v in touched.items()
        }
        after = sharded_state(job)
        for name, table in tables.items():
            for s in table.shards:
                in_shard = touched[name][
                    (touched[name] >= s.row_start) & (touched[name] < s.row_end)
                ]
                assert mine[name].tolist() == in_shard.tolist()
                # Every row outside the dirty set is bitwise unchanged, weight and accumulator.
                clean = np.setdiff1d(np.arange(s.row_start, s.row_end), mine[name]) - s.row_start
                for part in ("w", "acc"):
                    key = f"{name}/{s.row_start}/{part}"
                    assert np.array_equal(before[key][clean], after[key][clean]), key
                    assert not np.array_equal(before[key], after[key]), key


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_each_rank_gets_its_shards_rows_and_the_job_union(sharding: str) -> None:
    run_ranks(_check_dirty_rows, 2, sharding)
