"""How the embedding tables are split over the ranks: TorchRec's planner, given one sharding.

Every table gets the same sharding type, and the fused kernel that runs its optimizer in the
backward pass (FBGEMM's EXACT_ROWWISE_ADAGRAD, the algorithm of trainer/rowwise_adagrad.py):

- `table_wise` (the default): each table lives whole on one rank, the planner balancing them;
- `row_wise`: every table is split into contiguous row ranges, one per rank; a table too small
  to give every rank a row is placed table-wise instead (`never_empty`).

The planner is never left to pick data-parallel or column-wise shards: a table replicated on
every rank, or split by columns, is not what docs/FORMAT.md 3.3 stores.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ShardingPlan

from trainer.sharded import SHARDINGS

#: what trainer/rowwise_adagrad.py's RowWiseAdagrad adds to a squared-gradient root.
ROWWISE_ADAGRAD_EPS = 1e-8


class RowWiseOnCpuSharder(EmbeddingBagCollectionSharder):  # type: ignore[misc]
    """An EmbeddingBagCollectionSharder that also offers row-wise shards on CPU.

    TorchRec 1.8 refuses them there: `BaseEmbeddingSharder.sharding_types("cpu")` lists
    data_parallel, table_wise, column_wise and table_column_wise, and adds row_wise only for
    "cuda" (and "mtia"), so the planner fails with `RuntimeError: No available sharding type and
    compute kernel combination ... compute device: cpu`. The fused CPU kernel trains row-wise
    shards correctly (tests/multiprocess/trainer/sharded: 2 ranks equal 1), so this sharder
    offers them.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SHARDINGS)


def embedding_sharder(device_type: str, sparse_lr: float) -> EmbeddingBagCollectionSharder:
    """The sharder of the tables on `device_type` ("cpu" or "cuda"), their optimizer fused."""
    fused_params: dict[str, Any] = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": sparse_lr,
        "eps": ROWWISE_ADAGRAD_EPS,
    }
    if device_type == "cpu":
        return RowWiseOnCpuSharder(fused_params=fused_params)
    return EmbeddingBagCollectionSharder(fused_params=fused_params)


def row_wise_leaves_a_rank_empty(rows: int, world_size: int) -> bool:
    """True if TorchRec's row-wise split of `rows` over `world_size` ranks (blocks of
    ceil(rows / world_size) rows, torchrec.distributed.sharding_plan
    `_calculate_rw_shard_sizes_and_offsets`) gives some rank no row."""
    return (world_size - 1) * -(-rows // world_size) >= rows


def never_empty(
    per_table: Mapping[str, str], rows: Mapping[str, int], world_size: int
) -> dict[str, str]:
    """`per_table` with every row-wise table that would leave a rank an empty shard made
    table-wise.

    FBGEMM's fused CPU backward (EXACT_ROWWISE_ADAGRAD, fbgemm-gpu-cpu 1.8.0) sizes each table
    from `hash_size_cumsum`, stepping past tables of 0 rows: when a rank's last table is an
    empty shard it reads past the end of that array, and fails at random with `RuntimeError:
    CPU exact rowwise adagrad currently doesn't support embedding tables with more than 2B rows`
    (seen in CI, a 1-row table on 2 ranks). A table that small gains nothing from a split.
    """
    return {
        name: "table_wise"
        if kind == "row_wise" and row_wise_leaves_a_rank_empty(rows[name], world_size)
        else kind
        for name, kind in per_table.items()
    }


def sharding_plan(
    module: nn.Module,
    sharder: EmbeddingBagCollectionSharder,
    *,
    tables: Mapping[str, int],
    sharding: str | Mapping[str, str],
    device_type: str,
    group: dist.ProcessGroup,
) -> ShardingPlan:
    """The plan every rank agrees on (rank 0 plans, the others receive it over `group`):
    `sharding` for every table (name -> rows), or per table name."""
    per_table = {t: sharding if isinstance(sharding, str) else sharding[t] for t in tables}
    for kind in per_table.values():
        if kind not in SHARDINGS:
            raise ValueError(f"sharding {kind!r} is not one of {SHARDINGS}")
    world_size = dist.get_world_size(group)
    per_table = never_empty(per_table, tables, world_size)
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world_size, local_world_size=world_size),
        kernel_config=KernelConfig(compute_device=device_type),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints={
            name: ParameterConstraints(
                sharding_types=[kind], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
            )
            for name, kind in per_table.items()
        },
    )
    plan: ShardingPlan = planner.collective_plan(module, [sharder], group)
    return plan
