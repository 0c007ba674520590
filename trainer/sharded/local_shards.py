"""The rows of each embedding table this rank holds, as views into the live TorchRec model.

DistributedModelParallel keeps every table of an EmbeddingBagCollection in FBGEMM's fused
kernels: `dmp.state_dict()` holds a ShardedTensor per table weight, and
`dmp.fused_optimizer.state_dict()` one per row-wise accumulator (EXACT_ROWWISE_ADAGRAD's
`momentum1`), whose `local_shards()` are this rank's parts. On CPU both are views of the
kernels' own storage (measured: writing a row through them changes what the next lookup
reads), so a snapshot copies out of them and a restore writes into them, with no copy of the
whole table.

A table is named as in a one-process model: the EmbeddingBagCollection's module path and the
table's name (`embeddings.user` for table `user` of the collection at `embeddings`), the name
publisher/dlrm.py's `nn.ModuleDict` of tables gives the same table, so versions move between
the one-process trainer and a sharded job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.errors import CheckpointError

#: what TorchRec puts between an EmbeddingBagCollection's path and its tables' names.
_TABLES_INFIX = ".embedding_bags."
_WEIGHT_SUFFIX = ".weight"


@dataclass(frozen=True)
class LocalShard:
    """Global rows [row_start, row_end) of one table, held by this rank."""

    row_start: int
    row_end: int
    #: float32 (row_end - row_start, dim): a view of the live weights.
    weight: torch.Tensor
    #: float32 (row_end - row_start,): a view of the live row-wise accumulator.
    accumulator: torch.Tensor

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class ShardedTable:
    """One table of the model: its global shape and the shards this rank holds (maybe none)."""

    name: str
    rows: int
    dim: int
    shards: tuple[LocalShard, ...]

    @property
    def whole(self) -> bool:
        """Whether this rank holds every row (table-wise sharding, or one rank)."""
        return len(self.shards) == 1 and self.shards[0].rows == self.rows


def table_name(state_key: str) -> str:
    """The checkpoint name of the table whose weight has state_dict key `state_key`."""
    # The leading dot also finds the tables of a collection at the root (`embedding_bags.t`).
    path, _, rest = f".{state_key.removesuffix(_WEIGHT_SUFFIX)}".partition(_TABLES_INFIX)
    return f"{path[1:]}.{rest}" if path else rest


def local_shards(model: nn.Module) -> dict[str, ShardedTable]:
    """Every sharded table of a DistributedModelParallel model by checkpoint name (in its
    state_dict's order), with the shards this rank holds."""
    fused = getattr(model, "fused_optimizer", None)
    if fused is None:
        raise CheckpointError(
            f"{type(model).__name__} has no fused_optimizer: expected a TorchRec "
            "DistributedModelParallel whose tables train with a fused row-wise optimizer"
        )
    optimizer_state = fused.state_dict()["state"]
    tables: dict[str, ShardedTable] = {}
    for key, value in model.state_dict().items():
        if _TABLES_INFIX not in f".{key}" or not hasattr(value, "local_shards"):
            continue
        short = key.removesuffix(_WEIGHT_SUFFIX).rsplit(".", 1)[-1]
        rows, dim = (int(n) for n in value.size())
        # A row-wise table of fewer rows than ranks leaves some ranks an empty shard.
        held = [s for s in value.local_shards() if int(s.tensor.shape[0]) > 0]
        # A rank holding none of a table's rows has no optimizer state for it.
        accumulators = (
            _accumulator_shards(optimizer_state, key, f"{short}.momentum1") if held else {}
        )
        shards = []
        for shard in held:
            start = int(shard.metadata.shard_offsets[0])
            weight = shard.tensor
            if int(shard.metadata.shard_offsets[1]) != 0 or int(weight.shape[1]) != dim:
                raise CheckpointError(
                    f"table {key!r}: a column-wise shard (offsets "
                    f"{list(shard.metadata.shard_offsets)}); only whole rows are supported"
                )
            shards.append(
                LocalShard(start, start + int(weight.shape[0]), weight, accumulators[start])
            )
        tables[table_name(key)] = ShardedTable(
            table_name(key), rows, dim, tuple(sorted(shards, key=lambda s: s.row_start))
        )
    return tables


def _accumulator_shards(
    optimizer_state: dict[str, dict[str, object]], weight_key: str, state_key: str
) -> dict[int, torch.Tensor]:
    """Row start -> this rank's accumulator shard of one table."""
    sharded = optimizer_state.get(weight_key, {}).get(state_key)
    if sharded is None or not hasattr(sharded, "local_shards"):
        raise CheckpointError(
            f"table {weight_key!r} has no row-wise accumulator {state_key!r} in the fused "
            "optimizer: train it with EmbOptimType.EXACT_ROWWISE_ADAGRAD"
        )
    return {int(s.metadata.shard_offsets[0]): s.tensor for s in sharded.local_shards()}
