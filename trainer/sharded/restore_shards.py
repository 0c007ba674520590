"""A committed version into a sharded model, at any world size.

A version is one manifest of global tables however many ranks wrote it (docs/FORMAT.md 2.1,
3.3), so every rank rebuilds it with publisher/read/restore.py and copies the rows of its own
shards into the live weights and accumulators (views, trainer/sharded/local_shards.py); the
dense parameters and the dense optimizer go to every rank (data-parallel: the same on all).
A version of N ranks thus restores on M, and one of the one-process trainer on a sharded job,
bitwise with the fp32 codec. Each rank reads the whole version: memory for one model copy per
rank, which is what this machine's models allow; past it a rank would fetch only the blobs
and shards that cover its rows.
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
    state = restore(store, model_name, version, budget=budget)
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
    accumulators = {name: accumulator_column(state, name) for name in tables}
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
        for name, table in tables.items():
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
    if set(state.tables) != set(tables):
        raise CheckpointError(
            f"version {state.version} has tables {sorted(state.tables)}, this model "
            f"{sorted(tables)}"
        )
    for name, table in tables.items():
        shape = state.tables[name].weights.shape
        if shape != (table.rows, table.dim):
            raise CheckpointError(
                f"table {name!r} is {(table.rows, table.dim)} here, {shape} in version "
                f"{state.version}"
            )
