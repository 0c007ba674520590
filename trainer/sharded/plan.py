"""How the embedding tables are split over the ranks: TorchRec's planner, given one sharding.

Every table gets the same sharding type, and the fused kernel that runs its optimizer in the
backward pass (FBGEMM's EXACT_ROWWISE_ADAGRAD, the algorithm of trainer/rowwise_adagrad.py):

- `table_wise` (the default): each table lives whole on one rank, the planner balancing them;
- `row_wise`: every table is split into contiguous row ranges, one per rank.

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
    shards correctly (tests/unit/trainer/sharded: 2 ranks equal 1), so this sharder offers them.
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


def sharding_plan(
    module: nn.Module,
    sharder: EmbeddingBagCollectionSharder,
    *,
    tables: list[str],
    sharding: str | Mapping[str, str],
    device_type: str,
    group: dist.ProcessGroup,
) -> ShardingPlan:
    """The plan every rank agrees on (rank 0 plans, the others receive it over `group`):
    `sharding` for every table, or per table name."""
    per_table = {t: sharding if isinstance(sharding, str) else sharding[t] for t in tables}
    for kind in per_table.values():
        if kind not in SHARDINGS:
            raise ValueError(f"sharding {kind!r} is not one of {SHARDINGS}")
    world_size = dist.get_world_size(group)
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
