"""A rank's shards cut into chunks of at most the chunk size, copied chunk by chunk, and brought
to the shards' state at the last stop by copying the rows changed meanwhile again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.errors import CheckpointError
from trainer.sharded.host_copies import (
    ChunkedShardFull,
    ShardRowCopier,
    chunk_plan,
    row_bytes,
)
from trainer.sharded.local_shards import LocalShard, ShardedTable


def _tables() -> dict[str, ShardedTable]:
    """`a`: rows 10-33 of a row-wise table of dim 4; `b`: a whole table of dim 2; `c`: none."""
    g = torch.Generator().manual_seed(0)
    a = LocalShard(10, 33, torch.randn(23, 4, generator=g), torch.rand(23, generator=g))
    b = LocalShard(0, 9, torch.randn(9, 2, generator=g), torch.rand(9, generator=g))
    return {
        "a": ShardedTable("a", 40, 4, (a,)),
        "c": ShardedTable("c", 5, 3, ()),
        "b": ShardedTable("b", 9, 2, (b,)),
    }


def test_chunks_cover_every_row_once_in_table_order_each_at_most_the_chunk_size() -> None:
    tables = _tables()
    chunk = 3 * row_bytes(4)  # 3 rows of `a`, 5 of `b`
    chunks = chunk_plan(tables, chunk)
    sizes = [sum((p.stop - p.start) * row_bytes(tables[p.table].dim) for p in c) for c in chunks]
    assert all(0 < size <= chunk for size in sizes)
    parts = [(p.table, p.start, p.stop) for c in chunks for p in c]
    a_rows = [r for t, lo, hi in parts if t == "a" for r in range(lo, hi)]
    b_rows = [r for t, lo, hi in parts if t == "b" for r in range(lo, hi)]
    assert a_rows == list(range(23)) and b_rows == list(range(9))
    assert [t for t, _, _ in parts] == sorted(t for t, _, _ in parts)  # `a` first, then `b`
    # 23 rows of `a` (20 bytes each): 7 full chunks, then 2 rows whose chunk has room for 1
    # row of `b` (12 bytes each), then `b`'s 8 other rows in 2 chunks.
    assert len(chunks) == 10
    # A row larger than the chunk is a chunk of its own.
    assert len(chunk_plan(tables, 1)) == 23 + 9
    with pytest.raises(CheckpointError, match="chunk_bytes must be >= 1"):
        chunk_plan(tables, 0)


def test_a_full_copied_in_chunks_is_the_shards_at_the_last_stop() -> None:
    tables = _tables()
    copier = ShardRowCopier(tables, "fp32")
    full = ChunkedShardFull(tables, chunk_plan(tables, 4 * row_bytes(4)), copier)
    changed: dict[str, set[int]] = {"a": set(), "b": set()}
    stops = 0
    while not full.copied:
        assert full.copy_chunk() <= 4 * row_bytes(4)
        stops += 1
        # Training moves rows already copied and rows not copied yet.
        for name, row in (("a", 10 + stops), ("a", 32), ("b", stops % 9)):
            shard = tables[name].shards[0]
            shard.weight[row - shard.row_start] += 1.0
            shard.accumulator[row - shard.row_start] += 0.5
            changed[name].add(row)
    assert full.copy_chunk() == 0
    full.refresh({name: np.array(sorted(rows), dtype=np.int64) for name, rows in changed.items()})
    rows = {t.name: t for t in full.table_rows()}
    assert sorted(rows) == ["a", "b"]
    for name, table_rows in rows.items():
        shard = tables[name].shards[0]
        assert np.array_equal(table_rows.values, shard.weight.numpy())
        assert np.array_equal(table_rows.aux.reshape(-1), shard.accumulator.numpy())
        assert table_rows.row_ids.tolist() == list(range(shard.row_start, shard.row_end))
    assert rows["a"].row_range == (10, 33) and rows["b"].row_range is None


def test_reserved_buffers_are_the_ones_a_full_copies_into() -> None:
    tables = _tables()
    copier = ShardRowCopier(tables, "fp32")
    copier.reserve_full()
    full_bytes = sum(row_bytes(t.dim) * s.rows for t in tables.values() for s in t.shards)
    assert copier.buffers.allocated_bytes == full_bytes
    full = ChunkedShardFull(tables, chunk_plan(tables, 64), copier)
    assert copier.buffers.allocated_bytes == full_bytes  # taken from the pool, none allocated
    while not full.copied:
        full.copy_chunk()
    assert np.array_equal(full.values["a"], tables["a"].shards[0].weight.numpy())
