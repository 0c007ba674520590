"""A committed version into a sharded model, at any world size.

A version is one manifest of global tables however many ranks wrote it (docs/FORMAT.md 2.1,
3.3), so every rank rebuilds it with publisher/read/restore.py and copies the rows of its own
shards into the live weights and accumulators (views, trainer/sharded/local_shards.py); the
dense parameters and the dense optimizer go to every rank (data-parallel: the same on all).
A version of N ranks thus restores on M, and one of the one-process trainer on a sharded job,
bitwise with the fp32 codec. A rank fetches only the tables it holds a shard of (table-wise,
1/N of the tables each); of a row-wise table it still rebuilds every row, and the memory budget
is still checked against the whole version: past this machine's models a rank would fetch only
the shard blobs that cover its rows (docs/SCALE.md).
"""

from __future__ import annotations

import torch
from torch import nn

from publisher.memory_budget import MemoryBudget
from publisher.read.restore import RestoredState, restore
from publisher.store import ObjectStore
from schemas.manifest import Position
from trainer.errors import CheckpointError
from trainer.sharded.local_shards import ShardedTable, local_shards
from trainer.sharded.optimizer_state import accumulator_column, load_dense_optimizer


def restore_sharded(
    model: nn.Module,
    dense_optimizer: torch.optim.Optimizer,
    store: ObjectStore,
    model_name: str,
    version: int | None = None,
    *,
    budget: MemoryBudget | None = None,
) -> Position:
    """Load `version` (the latest when None) into this rank's shards, its dense parameters and
    `dense_optimizer`; returns the version's position. Every rank calls it."""
    held = {name for name, table in local_shards(model).items() if table.shards}
    state = restore(store, model_name, version, budget=budget, tables=held)
    load_sharded(state, model, dense_optimizer)
    return state.position


def load_sharded(
    state: RestoredState, model: nn.Module, dense_optimizer: torch.optim.Optimizer
) -> None:
    """Put a restored version into a sharded model (see `restore_sharded`); CheckpointError
    when it does not fit: its tables, accumulators and dense tensors are checked before anything
    is written, the dense optimizer's state by torch as it is loaded, last."""
    tables = local_shards(model)
    _check_tables(state, tables)
    held = {name: table for name, table in tables.items() if table.shards}
    missing = set(held) - set(state.tables)
    if missing:
        raise CheckpointError(f"tables {sorted(missing)} of this rank were not restored")
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
    with torch.no_grad():
        for name, table in held.items():
            weights = torch.from_numpy(state.tables[name].weights)
            accumulator = torch.from_numpy(accumulators[name])
            for shard in table.shards:
                rows = slice(shard.row_start, shard.row_end)
                shard.weight.copy_(weights[rows])
                shard.accumulator.copy_(accumulator[rows])
        for key in dense_keys:
            live[key].copy_(torch.from_numpy(state.dense[key]))
    load_dense_optimizer(state, dense_optimizer)


def _check_tables(state: RestoredState, tables: dict[str, ShardedTable]) -> None:
    """The version's tables (its manifest's, restored or not) are the model's, shape for
    shape."""
    entries = {t.name: t for t in state.manifest.tables}
    if set(entries) != set(tables):
        raise CheckpointError(
            f"version {state.version} has tables {sorted(entries)}, this model {sorted(tables)}"
        )
    for name, table in tables.items():
        shape = (entries[name].rows, entries[name].dim)
        if shape != (table.rows, table.dim):
            raise CheckpointError(
                f"table {name!r} is {(table.rows, table.dim)} here, {shape} in version "
                f"{state.version}"
            )
