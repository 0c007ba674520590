"""The sharded DLRM: publisher/dlrm.py's dense parts around a TorchRec EmbeddingBagCollection.

    model = build_sharded_dlrm(config, sharding="table_wise", device=cpu, seed=0, sparse_lr=0.05)
    logits = model(dense, features)      # features: this rank's KeyedJaggedTensor
    held = local_shards(model)           # trainer/sharded/local_shards.py: this rank's views

One table per sparse feature (table and feature name alike; the manifest's table name stays
`embeddings.<feature>`), SUM pooling, sharded by DistributedModelParallel (trainer/sharded/
plan.py) with the fused row-wise Adagrad. The dense part keeps DLRM's parameter names
(`bottom.*`, `top.*`), so its state loads into the servers' `DLRM`; DMP trains it data-parallel
(DDP averages its gradients over the ranks, and DMP divides the tables' by the world size, so a
mean loss per rank trains what one process trains on the global batch).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.optimizers import in_backward_optimizer_filter

from publisher.dlrm import (
    TABLE_PREFIX,
    DLRMConfig,
    bottom_input,
    bottom_mlp,
    dot_interaction,
    feature_pairs,
    init_embedding_rows,
    top_mlp,
)
from trainer.sharded.local_shards import local_shards
from trainer.sharded.plan import embedding_sharder, sharding_plan

#: rows drawn from one generator at initialisation: a row's initial value depends on the seed,
#: its table and its row only, never on where the shard boundaries fall (the world size).
INIT_BLOCK_ROWS = 1 << 16
#: the module path of the tables of `ShardedDLRM.embeddings`, less their names.
_TABLES_PATH = "embeddings.embedding_bags."


class ShardedDLRM(nn.Module):
    """DLRM's bottom MLP, dot interaction and top MLP around an EmbeddingBagCollection (built
    on the meta device: DMP allocates each rank's shards only)."""

    def __init__(self, config: DLRMConfig, device: torch.device) -> None:
        super().__init__()
        config.validate()
        self.config = config
        # Drawn on the CPU, then moved: the same initial values on any device.
        self.bottom = bottom_mlp(config).to(device)
        self.embeddings = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f.name,
                    embedding_dim=config.embedding_dim,
                    num_embeddings=f.rows,
                    feature_names=[f.name],
                    pooling=PoolingType.SUM,
                )
                for f in config.sparse
            ],
            device=torch.device("meta"),
        )
        self.top = top_mlp(config).to(device)
        self.features = [f.name for f in config.sparse]
        self.pair_rows, self.pair_cols = feature_pairs(len(config.sparse) + 1, device)

    def checkpoint_table_name(self, path: str) -> str:
        """The checkpoint name of the table at module path `path`: DLRM's (`embeddings.user`
        for `embeddings.embedding_bags.user`), so versions move between this model and the
        one-process DLRM (read by trainer/sharded/local_shards.py)."""
        return TABLE_PREFIX + path.removeprefix(_TABLES_PATH)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        x = self.bottom(bottom_input(dense))
        pooled = self.embeddings(features).to_dict()
        vectors = [pooled[name] for name in self.features]
        logits: torch.Tensor = self.top(
            dot_interaction(x, vectors, self.pair_rows, self.pair_cols)
        ).squeeze(1)
        return logits


def build_sharded_dlrm(
    config: DLRMConfig,
    *,
    sharding: str | Mapping[str, str],
    device: torch.device,
    seed: int,
    sparse_lr: float,
    group: dist.ProcessGroup | None = None,
) -> DistributedModelParallel:
    """The DLRM of `config` sharded over the ranks of `group` (default: the world), every
    initial weight a function of `seed` alone (the same model whatever the world size);
    `sharding` for every table, or per feature name."""
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError(
                "torch.distributed is not initialised: no process group to shard over"
            )
    torch.manual_seed(seed)  # the dense part: drawn alike on every rank
    module = ShardedDLRM(config, device)
    sharder = embedding_sharder(device.type, sparse_lr)
    plan = sharding_plan(
        module,
        sharder,
        tables={f.name: f.rows for f in config.sparse},
        sharding=sharding,
        device_type=device.type,
        group=group,
    )
    model = DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(group),
        device=device,
        plan=plan,
        sharders=[sharder],
    )
    _draw_initial_rows(model, seed)
    return model


def sharded_config(model: DistributedModelParallel) -> DLRMConfig:
    """The config the sharded model was built from."""
    module = model.module
    assert isinstance(module, ShardedDLRM)
    return module.config


def dense_state_dict(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """The dense parameters under DLRM's state_dict keys (what a version's dense blob holds)."""
    return {
        key: value
        for key, value in model.state_dict().items()
        if not key.startswith(TABLE_PREFIX) and isinstance(value, torch.Tensor)
    }


def dense_parameters(model: DistributedModelParallel) -> list[nn.Parameter]:
    """The parameters trained by the dense optimizer (the tables' optimizer is fused)."""
    return [p for _, p in in_backward_optimizer_filter(model.named_parameters())]


def initial_rows(seed: int, table: int, dim: int, rows: int, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of table number `table` (of `rows` rows) as initialised: uniform in
    +-1/sqrt(dim) (publisher/dlrm.py's `init_embedding_rows`), each block of INIT_BLOCK_ROWS
    rows drawn from a generator of its own, so any shard draws only the blocks it overlaps."""
    parts = []
    for block in range(start // INIT_BLOCK_ROWS, -(-end // INIT_BLOCK_ROWS)):
        lo = block * INIT_BLOCK_ROWS
        drawn = torch.empty(min(INIT_BLOCK_ROWS, rows - lo), dim)
        init_embedding_rows(
            drawn, generator=torch.Generator().manual_seed(_block_seed(seed, table, block))
        )
        parts.append(drawn[max(start - lo, 0) : end - lo])
    return torch.cat(parts)


def _block_seed(seed: int, table: int, block: int) -> int:
    return int(np.random.SeedSequence((seed, table, block)).generate_state(1, np.uint64)[0])


@torch.no_grad()
def _draw_initial_rows(model: DistributedModelParallel, seed: int) -> None:
    config = sharded_config(model)
    held = local_shards(model)
    for table, feature in enumerate(config.sparse):
        table_held = held.get(TABLE_PREFIX + feature.name)
        for shard in table_held.shards if table_held is not None else ():
            rows = initial_rows(
                seed, table, config.embedding_dim, feature.rows, shard.row_start, shard.row_end
            )
            shard.weight.copy_(rows)
