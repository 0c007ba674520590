"""A committed version into a sharded model, at any world size.

A version is one manifest of global tables however many ranks wrote it (docs/FORMAT.md 2.1,
3.3), so every rank rebuilds its part of it with publisher/read/restore.py and copies the rows
of its own shards into the live weights and accumulators (views, trainer/sharded/local_shards.py);
the dense parameters and the dense optimizer go to every rank (data-parallel: the same on all).
A version of N ranks thus restores on M, and one of the one-process trainer on a sharded job,
bitwise with the fp32 codec.

A rank restores only the tables it holds a shard of (table-wise: 1/N of the tables each), and of
each only the range of rows from its first shard's start to its last shard's end (row-wise: 1/N
of the rows; TorchRec's row-wise plans give a rank one shard of a table: exactly its rows; a
table a one-process trainer wrote with an id map restores whole, as its map covers every row):
of a version written by a job only the shard blobs that overlap it are fetched, of a one-process
version the table's blob is fetched and the rows outside dropped. The memory budget counts what
the rank restores, so it is per rank.
"""

from __future__ import annotations

import torch
from torch import nn

from publisher.dlrm import init_embedding_rows
from publisher.memory_budget import MemoryBudget
from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.read.restore import RestoredState, RowRange, restore_chain
from publisher.store import ObjectStore
from schemas.manifest import Manifest, Position
from trainer.errors import CheckpointError
from trainer.sharded.local_shards import ShardedTable, local_shards
from trainer.sharded.optimizer_state import (
    accumulator_column,
    dense_optimizer_state,
    load_dense_optimizer,
)
from trainer.sharded.owned_ids import OwnedIds


def restore_sharded(
    model: nn.Module,
    dense_optimizer: torch.optim.Optimizer,
    store: ObjectStore,
    model_name: str,
    version: int | None = None,
    *,
    budget: MemoryBudget | None = None,
    ids: OwnedIds | None = None,
) -> Position:
    """Load `version` (the latest when None) into this rank's shards, its dense parameters and
    `dense_optimizer`; returns the version's position. Every rank calls it. A version whose
    tables are not the model's raises CheckpointError before any blob is fetched. `ids`: this
    rank's part of a dynamic id space, which takes the version's id maps, re-partitioned for
    this world size (trainer/sharded/owned_ids.py) before the rows are loaded."""
    tables = local_shards(model)
    chain = restore_plan(Catalog(store, model_name), version)
    target = chain[-1].manifest
    _check_tables(target, tables)
    held = {
        name: _rows_to_restore(target, name, table)
        for name, table in tables.items()
        if table.shards
    }
    state = restore_chain(store, chain, budget=budget, tables=set(held), rows=held)
    if ids is not None:
        ids.load(state)
    load_sharded(state, model, dense_optimizer)
    return state.position


def _rows_to_restore(target: Manifest, name: str, table: ShardedTable) -> RowRange:
    """The rows of `name` this rank restores: those its shards span, or all of them where the
    version's table carries an id map (a one-process trainer's, docs/FORMAT.md 3.3), which
    restores only whole (its map covers every row)."""
    entry = target.table(name)
    return (0, entry.rows) if entry.has_id_map else _held_rows(table)


def _held_rows(table: ShardedTable) -> RowRange:
    """The range of `table`'s rows this rank's shards span (it holds at least one)."""
    return table.shards[0].row_start, table.shards[-1].row_end


def load_sharded(
    state: RestoredState, model: nn.Module, dense_optimizer: torch.optim.Optimizer
) -> None:
    """Put a restored version into a sharded model (see `restore_sharded`); CheckpointError
    when it does not fit: its tables, accumulators and dense tensors are checked before anything
    is written, the dense optimizer's state too (it is loaded last)."""
    tables = local_shards(model)
    _check_tables(state.manifest, tables)
    held = {name: table for name, table in tables.items() if table.shards}
    missing = set(held) - set(state.tables)
    if missing:
        raise CheckpointError(f"tables {sorted(missing)} of this rank were not restored")
    for name, table in held.items():
        restored = state.tables[name]
        start, end = _held_rows(table)
        if start < restored.row_start or end > restored.row_start + len(restored.weights):
            raise CheckpointError(
                f"table {name!r}: this rank holds rows [{start}, {end}), the restored state "
                f"[{restored.row_start}, {restored.row_start + len(restored.weights)})"
            )
    accumulators = {name: accumulator_column(state, name) for name in held}
    live = model.state_dict()
    dense_keys = {k for k, v in live.items() if not hasattr(v, "local_shards")}
    if set(state.dense) != dense_keys:
        raise CheckpointError(
            f"version {state.version} has dense tensors {sorted(state.dense)}, this model "
            f"{sorted(dense_keys)}"
        )
    for key in dense_keys:
        if tuple(live[key].shape) != state.dense[key].shape:
            raise CheckpointError(
                f"dense tensor {key!r} is {tuple(live[key].shape)} here, "
                f"{state.dense[key].shape} in version {state.version}"
            )
    optimizer_state = dense_optimizer_state(state, dense_optimizer)
    with torch.no_grad():
        for name, table in held.items():
            weights = torch.from_numpy(state.tables[name].weights)
            accumulator = torch.from_numpy(accumulators[name])
            offset = state.tables[name].row_start
            unwritten = state.tables[name].unwritten
            for shard in table.shards:
                rows = slice(shard.row_start - offset, shard.row_end - offset)
                shard.weight.copy_(weights[rows])
                shard.accumulator.copy_(accumulator[rows])
                # The free rows a full left out (docs/FORMAT.md 7.1) restore as zero: they start
                # as the model initialises a row instead (their accumulator is 0), so an id
                # given one later starts as on a never-used row, as in one process.
                free = unwritten[(unwritten >= rows.start) & (unwritten < rows.stop)] - rows.start
                if len(free):
                    index = torch.from_numpy(free).to(shard.weight.device)
                    init_embedding_rows(shard.weight, index)
        for key in dense_keys:
            live[key].copy_(torch.from_numpy(state.dense[key]))
    load_dense_optimizer(state, dense_optimizer, optimizer_state)


def _check_tables(manifest: Manifest, tables: dict[str, ShardedTable]) -> None:
    """The version's tables (its manifest's, restored or not) are the model's, shape for
    shape."""
    entries = {t.name: t for t in manifest.tables}
    if set(entries) != set(tables):
        raise CheckpointError(
            f"version {manifest.version} has tables {sorted(entries)}, this model {sorted(tables)}"
        )
    for name, table in tables.items():
        shape = (entries[name].rows, entries[name].dim)
        if shape != (table.rows, table.dim):
            raise CheckpointError(
                f"table {name!r} is {(table.rows, table.dim)} here, {shape} in version "
                f"{manifest.version}"
            )
