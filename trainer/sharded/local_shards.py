"""The rows of each embedding table this rank holds, as views into the live TorchRec model.

DistributedModelParallel keeps every table of an EmbeddingBagCollection in FBGEMM's fused
kernels: `dmp.state_dict()` holds a ShardedTensor per table weight, and
`dmp.fused_optimizer.state_dict()` one per row-wise accumulator (EXACT_ROWWISE_ADAGRAD's
`momentum1`), whose `local_shards()` are this rank's parts. On CPU both are views of the
kernels' own storage (measured: writing a row through them changes what the next lookup
reads), so a snapshot copies out of them and a restore writes into them, with no copy of the
whole table.

Any model DistributedModelParallel shards works, its tables in EmbeddingBagCollections or
EmbeddingCollections anywhere in it: every ShardedTensor of its state_dict is a table. A table is
named as the same model, unsharded, names it for `IncrementalCheckpointer`: by its module path
(`sparse.bags.embedding_bags.user`; `table_namer`), so a version of the sharded job resumes in
one process into the unsharded model, and its `restore --model-only` state_dict loads into it. A
model may name its tables itself with a method `checkpoint_table_name(path)`: the sharded DLRM
(trainer/sharded/model.py) gives publisher/dlrm.py's names (`embeddings.user`), so versions move
between the one-process DLRM trainer and a sharded job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from trainer.errors import CheckpointError

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


def table_namer(model: nn.Module) -> Callable[[str], str]:
    """How the checkpoints of `model` (a DistributedModelParallel, or the module it wraps) name
    the table at a module path: the model's own `checkpoint_table_name(path)` if it has one, else
    the path itself."""
    module = getattr(model, "module", model)
    own: Callable[[str], str] | None = getattr(module, "checkpoint_table_name", None)
    return own if callable(own) else _module_path


def _module_path(path: str) -> str:
    return path


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
    name_of = table_namer(model)
    tables: dict[str, ShardedTable] = {}
    for key, value in model.state_dict().items():
        if not hasattr(value, "local_shards"):
            continue
        path = key.removesuffix(_WEIGHT_SUFFIX)
        # The fused optimizer keys a table's state by the TorchRec table name, the path's last
        # part (`user.momentum1` of `sparse.bags.embedding_bags.user.weight`).
        short = path.rsplit(".", 1)[-1]
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
        name = name_of(path)
        tables[name] = ShardedTable(
            name, rows, dim, tuple(sorted(shards, key=lambda s: s.row_start))
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
