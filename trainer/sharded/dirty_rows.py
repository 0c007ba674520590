"""Which rows of a sharded model changed since the last checkpoint: this rank's and the job's.

Recording is TorchRec's own `ModelDeltaTracker` (torchrec.distributed.model_tracker, ID_ONLY
mode), attached with `DistributedModelParallel.init_torchrec_delta_tracker`. It works on CPU
with this model: it hooks the sharded EmbeddingBagCollection after the input all-to-all, so on
each rank it records the ids its own shards were asked for by every rank's batch, as
shard-local rows (global row - the shard's first row), per table. Those are exactly the rows the
fused EXACT_ROWWISE_ADAGRAD may have changed on this rank (a row that is not looked up gets no
gradient, so neither its weight nor its accumulator moves), with no hook of ours on the lookup
path and no `observe` call in the training loop. It records every forward, evaluation ones
included: rows looked up without an update are written again, which costs bytes, never
correctness.

The policy (publisher/write/policies.py) must take the same decision on every rank, so at a
checkpoint one all_reduce(MAX) of per-table bitmaps over the training group gives every rank
the rows any rank changed: one byte per row of the model per checkpoint, which is what a
machine of this size can afford; past it (docs/SCALE.md) the ranks would exchange the policy's
inputs (dirty counts) instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from publisher.write.tracker import RowIds
from trainer.errors import CheckpointError
from trainer.sharded.local_shards import ShardedTable, table_namer
from trainer.sharded.training_group import all_reduce_max, shard_devices


class ShardDirtyRows:
    """The rows of this rank's shards looked up since the last `take`, and the job's union."""

    def __init__(
        self,
        model: nn.Module,
        tables: Mapping[str, ShardedTable],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """`model`: the DistributedModelParallel; `tables`: its `local_shards`; `group`: the
        training group the bitmaps are reduced over (None: the default group)."""
        from torchrec.distributed.model_tracker.types import DeltaTrackerConfig

        init = getattr(model, "init_torchrec_delta_tracker", None)
        if init is None:
            raise CheckpointError(
                f"{type(model).__name__} is not a TorchRec DistributedModelParallel"
            )
        self.tracker = init(DeltaTrackerConfig())
        self.tables = dict(tables)
        self.group = group
        #: the GPU the bitmaps are reduced on with NCCL: the shards' (None: the current one).
        self.device = next(iter(shard_devices(self.tables)), None)
        self._name_of = table_namer(model)
        #: rows changed without a lookup since the last `take` (`mark`), per table.
        self._marked: dict[str, list[RowIds]] = {}

    def mark(self, table: str, rows: RowIds) -> None:
        """Count global `rows` of this rank's shard of `table` as changed: rows an owner of a
        dynamic id space re-initialised or gave to an id (trainer/sharded/owned_ids.py)."""
        self._marked.setdefault(table, []).append(np.asarray(rows, dtype=np.int64))

    def take(self) -> dict[str, RowIds]:
        """Global rows of this rank's shards looked up (or marked) since the last call, per
        table (sorted, int64); resets the record."""
        # The tracker keys ids by the table's module path.
        looked_up = {self._name_of(fqn): ids for fqn, ids in self.tracker.get_unique_ids().items()}
        marked, self._marked = self._marked, {}
        rows: dict[str, RowIds] = {}
        for name, table in self.tables.items():
            local = looked_up.get(name)
            extra = marked.get(name, [])
            if local is None or local.numel() == 0 or not table.shards:
                rows[name] = (
                    np.unique(np.concatenate(extra))
                    if extra and table.shards
                    else (np.empty(0, dtype=np.int64))
                )
                continue
            ids = local.to("cpu", torch.int64)  # a GPU shard's tracker holds device ids
            # One shard per table and rank is what TorchRec's planner makes; several would
            # need the tracker's ids split per shard, which it does not record.
            if len(table.shards) != 1:
                raise CheckpointError(
                    f"table {name!r}: {len(table.shards)} shards on one rank; one is supported"
                )
            rows[name] = np.unique(
                np.concatenate([(ids + table.shards[0].row_start).numpy(), *extra])
            )
        return rows

    def union(self, mine: Mapping[str, RowIds]) -> dict[str, RowIds]:
        """The rows any rank's `take` gave (a collective call: every rank makes it)."""
        sizes = [t.rows for t in self.tables.values()]
        bitmap = torch.zeros(sum(sizes), dtype=torch.uint8)
        start = 0
        for name, rows in zip(self.tables, sizes, strict=True):
            bitmap[start + torch.from_numpy(mine[name])] = 1
            start += rows
        bitmap = all_reduce_max(bitmap, self.group, self.device)
        union: dict[str, RowIds] = {}
        start = 0
        for name, rows in zip(self.tables, sizes, strict=True):
            union[name] = torch.nonzero(bitmap[start : start + rows]).flatten().numpy()
            start += rows
        return union
