"""What the sharded tests run in their rank processes (module level, so spawn can import it):
a tiny deterministic stream, and a rank that trains on it and saves what it holds."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from publisher.dlrm import DLRM, SparseBatch, SparseFeature, table_weight_names
from trainer.online import DLRMSettings, dense_optimizer, dlrm_config
from trainer.sharded.data import keyed_features, rank_slice
from trainer.sharded.local_shards import local_shards
from trainer.sharded.loop import train_sharded
from trainer.sharded.model import (
    build_sharded_dlrm,
    dense_parameters,
    dense_state_dict,
)
from trainer.streams.base import ColumnarStream, IdColumn

FEATURES = (
    SparseFeature("user", 23),
    SparseFeature("item", 41),
    SparseFeature("genre", 7, bag=True),
    SparseFeature("one", 1),  # fewer rows than ranks: placed table-wise under row_wise
)
#: 10 global batches of 32, then a last one of 5 (3 + 2 on two ranks: one sample of padding).
SAMPLES = 325
BATCH = 32


def tiny_stream(samples: int = SAMPLES) -> ColumnarStream:
    """A few hundred samples over tiny tables, the same in every process."""
    rng = np.random.default_rng(7)
    bag_sizes = rng.integers(0, 4, samples)
    splits = np.zeros(samples + 1, dtype=np.int64)
    np.cumsum(bag_sizes, out=splits[1:])
    columns = {
        "user": IdColumn(rng.integers(0, 23, samples)),
        "item": IdColumn(rng.integers(0, 41, samples)),
        "genre": IdColumn(rng.integers(0, 7, int(splits[-1])), splits),
        "one": IdColumn(np.zeros(samples, dtype=np.int64)),
    }
    return ColumnarStream(
        source="tiny",
        features=FEATURES,
        columns=columns,
        dense_names=("x", "y"),
        dense=rng.normal(size=(samples, 2)).astype(np.float32),
        labels=(rng.random(samples) < 0.3).astype(np.float32),
        fingerprint_parts=("tiny",),
    )


def train_and_save(
    out: Path,
    sharding: str,
    rank: int,
    world_size: int,
    local_rank: int,
    *,
    device_type: str = "cpu",
) -> None:
    """Train the tiny stream and save this rank's shards and dense state to out/rank<r>.npz."""
    torch.set_num_threads(1)
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    stream = tiny_stream()
    config = dlrm_config(
        stream.features,
        stream.dense_names,
        DLRMSettings(embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,)),
    )
    model = build_sharded_dlrm(config, sharding=sharding, device=device, seed=3, sparse_lr=0.1)
    optimizer = dense_optimizer(dense_parameters(model), "adam", 0.01)
    train_sharded(
        model,
        optimizer,
        stream,
        batch_size=BATCH,
        rank=rank,
        world_size=world_size,
        device=device,
        checkpointer=_Recorder(out / f"calls{rank}.json"),
    )
    arrays = {f"dense/{k}": v.detach().cpu().numpy() for k, v in dense_state_dict(model).items()}
    for table, held in local_shards(model).items():
        for s in held.shards:
            arrays[f"weight/{table}/{s.row_start}"] = s.weight.detach().cpu().numpy().copy()
            arrays[f"acc/{table}/{s.row_start}"] = s.accumulator.detach().cpu().numpy().copy()
    np.savez(out / f"rank{rank}.npz", **arrays)


class _Recorder:
    """A checkpointer that writes down the loop's calls (trainer/sharded/loop.py's seam)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: list[list[object]] = []

    def step(self, samples: int, rank_samples: int | None = None) -> None:
        self.calls.append(["step", samples, rank_samples])

    @property
    def time_due(self) -> bool:
        return False

    def keep_scored(self, batch: object) -> None:
        pass

    def maybe_checkpoint(
        self, reader: Mapping[str, object], metrics: object = None, *, due: bool = False
    ) -> None:
        self.calls.append(["maybe_checkpoint", reader["offset"]])

    def checkpoint_now(self, reader: Mapping[str, object], metrics: object = None) -> None:
        self.calls.append(["checkpoint_now", reader["offset"]])

    def close(self) -> None:
        self.calls.append(["close"])
        self.path.write_text(json.dumps(self.calls))


def saved_model(out: Path) -> dict[str, np.ndarray]:
    """The whole model the ranks saved in `out`: every table assembled from its shards."""
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    model: dict[str, np.ndarray] = {}
    for path in sorted(out.glob("rank*.npz")):
        with np.load(path) as saved:
            for key in saved.files:
                kind, _, rest = key.partition("/")
                if kind == "dense":
                    model.setdefault(key, saved[key])
                    continue
                table, _, start = rest.rpartition("/")
                parts.setdefault(f"{kind}/{table}", []).append((int(start), saved[key]))
    for key, shards in parts.items():
        shards.sort(key=lambda s: s[0])
        expected = 0
        for start, rows in shards:
            assert start == expected, f"{key}: shards do not tile the table ({start} != {expected})"
            expected += rows.shape[0]
        model[key] = np.concatenate([rows for _, rows in shards])
    return model


def fail_on_rank_one(rank: int, world_size: int, local_rank: int) -> None:
    """Rank 1 raises; rank 0 waits for it in a collective (and is terminated by the spawner)."""
    if rank == 1:
        raise ValueError("rank one broke")
    torch.distributed.barrier()


def die_on_rank_one(rank: int, world_size: int, local_rank: int) -> None:
    """Rank 1 is killed outright (no exception, no teardown)."""
    if rank == 1:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    torch.distributed.barrier()


def check_local_shards(rank: int, world_size: int, local_rank: int) -> None:
    """In a 1-rank job: local shards write through into the tables and the optimizer state, and
    the dense state with those tables is a `DLRM` computing the same logits."""
    stream = tiny_stream()
    config = dlrm_config(stream.features, stream.dense_names, DLRMSettings(embedding_dim=4))
    model = build_sharded_dlrm(
        config, sharding="table_wise", device=torch.device("cpu"), seed=1, sparse_lr=0.1
    )
    batch = next(stream.batches(16))
    local = rank_slice(batch, 0, 1, [f.name for f in FEATURES])
    shards = local_shards(model)
    assert sorted(shards) == sorted(config.table_names.values())
    reference = DLRM(config)
    missing, unexpected = reference.load_state_dict(dense_state_dict(model), strict=False)
    assert unexpected == [] and sorted(missing) == sorted(table_weight_names(reference).values())
    with torch.no_grad():
        for table, held in shards.items():
            [shard] = held.shards
            assert (shard.row_start, shard.row_end) == (
                0,
                reference.get_parameter(f"{table}.weight").shape[0],
            )
            reference.get_parameter(f"{table}.weight").copy_(shard.weight)
        torch.testing.assert_close(
            model(local.dense, local.features), reference(batch.dense, batch.sparse)
        )
        # Writes into a shard's views change what the model looks up and its optimizer state.
        [user] = shards["embeddings.user"].shards
        user.weight[5] = 7.0
        user.accumulator[5] = 4.0
        empty = SparseBatch(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        ids = {f.name: empty for f in FEATURES} | {
            "user": SparseBatch(torch.tensor([5]), torch.tensor([0]))
        }
        names = [f.name for f in FEATURES]
        looked_up = model.module.embeddings(keyed_features(ids, names, 0, 1))
    assert looked_up.to_dict()["user"].tolist() == [[7.0] * 4]
    state = model.fused_optimizer.state_dict()["state"]["embeddings.embedding_bags.user.weight"]
    [acc] = state["user.momentum1"].local_shards()
    assert float(acc.tensor[5]) == 4.0
