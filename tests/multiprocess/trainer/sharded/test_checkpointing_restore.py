"""A version of the one-process trainer restores into a sharded job, at any world size, bitwise
(fp32): every rank's rows and accumulators, the dense parameters and the dense optimizer."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.sharded_job import CONFIG, SPARSE_LR, batch, run_ranks, sharded_job
from publisher.dlrm import DLRM, DLRMConfig, SparseFeature
from publisher.id_map import IdMap
from publisher.memory_budget import MemoryBudget
from publisher.read.catalog import Catalog
from publisher.store import FileStore
from schemas.manifest import Head
from schemas.store_keys import head_key
from tests.unit.trainer.sharded.job import assert_holds_expected, sharded_state
from trainer.checkpointer import IncrementalCheckpointer
from trainer.errors import CheckpointError
from trainer.online import OptimizerSettings, build_optimizers

pytest.importorskip("torchrec")

MODEL = "ranker"


def _one_process_version(
    root: Path, config: DLRMConfig = CONFIG, id_maps: dict[str, IdMap] | None = None
) -> dict[str, np.ndarray]:
    """Train the one-process DLRM a few steps, publish fp32 versions; its state at the last."""
    torch.manual_seed(3)
    model = DLRM(config)
    optimizers = build_optimizers(model, OptimizerSettings(sparse_lr=SPARSE_LR))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        with IncrementalCheckpointer(
            model,
            optimizers,
            store=FileStore(root),
            model_name=MODEL,
            policy="consecutive",
            codec="fp32",
            preallocate=False,
            id_maps=id_maps,
        ) as ckpt:
            for step in range(6):
                dense, sparse, labels = batch(step, 32, config)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    model(dense, sparse), labels
                )
                for o in optimizers:
                    o.zero_grad(set_to_none=True)
                loss.backward()
                for o in optimizers:
                    o.step()
                ckpt.step(32)
                if step % 3 == 2:
                    ckpt.checkpoint_now(reader={"offset": 32 * (step + 1)})
    expected: dict[str, np.ndarray] = {}
    sparse_opt, dense_opt = optimizers
    for f in config.sparse:
        weight = model.embeddings[f.name].weight
        expected[f"table/embeddings.{f.name}"] = weight.detach().clone().numpy()
        expected[f"acc/embeddings.{f.name}"] = sparse_opt.state[weight]["sum"].clone().numpy()
    for key, value in model.state_dict().items():
        if not key.startswith("embeddings."):
            expected[f"dense/{key}"] = value.clone().numpy()
    for i, per in dense_opt.state_dict()["state"].items():
        for k, v in per.items():
            expected[f"opt/{i}/{k}"] = v.clone().numpy()
    return expected


def _restore_and_compare(rank: int, world: int, root: str, sharding: str) -> None:
    from trainer.sharded.local_shards import local_shards
    from trainer.sharded.restore_shards import restore_sharded

    job = sharded_job(sharding, seed=100 + rank)
    store = FileStore(root)
    head = Catalog(store, MODEL).latest()
    assert head is not None
    # On 2 ranks a rank restores half the tables or half the rows: its budget is its own.
    whole = head.manifest.full_fp32_bytes
    budget = MemoryBudget(whole - 1 if world > 1 else whole)
    position = restore_sharded(job.model, job.dense_optimizer, store, MODEL, budget=budget)
    assert (position.step, position.samples_seen) == (6, 192)
    assert_holds_expected(job, root)
    if world > 1 and sharding == "table_wise":  # a rank restored only the tables it holds
        held = [name for name, t in local_shards(job.model).items() if t.shards]
        assert 0 < len(held) < len(CONFIG.sparse)


@pytest.mark.parametrize(
    ("world", "sharding"), [(2, "row_wise"), (2, "table_wise"), (1, "table_wise")]
)
def test_one_process_version_restores_bitwise(tmp_path: Path, world: int, sharding: str) -> None:
    expected = _one_process_version(tmp_path / "store")
    np.savez(tmp_path / "store" / "expected.npz", **expected)
    run_ranks(_restore_and_compare, world, str(tmp_path / "store"), sharding)


def test_a_table_with_an_id_map_restores_whole_on_every_rank(tmp_path: Path) -> None:
    # A one-process trainer fed raw ids writes its tables' id maps; a map covers every row, so
    # a row-wise rank restores such a table whole and keeps its own rows (it used to refuse:
    # "carries an id map: it restores whole, not rows [..)").
    users = next(f.rows for f in CONFIG.sparse if f.name == "user")
    expected = _one_process_version(
        tmp_path / "store", id_maps={"embeddings.user": IdMap(users, hashed=True)}
    )
    head = Catalog(FileStore(tmp_path / "store"), MODEL).latest()
    assert head is not None and head.manifest.table("embeddings.user").id_map is not None
    np.savez(tmp_path / "store" / "expected.npz", **expected)
    run_ranks(_restore_with_map, 2, str(tmp_path / "store"))


def _restore_with_map(rank: int, world: int, root: str) -> None:
    from trainer.sharded.restore_shards import restore_sharded

    job = sharded_job("row_wise", seed=100 + rank)
    position = restore_sharded(job.model, job.dense_optimizer, FileStore(root), MODEL)
    assert (position.step, position.samples_seen) == (6, 192)
    assert_holds_expected(job, root)


def _refuse_and_keep(rank: int, world: int, root: str) -> None:
    from trainer.sharded.restore_shards import restore_sharded

    job = sharded_job("table_wise")
    before = sharded_state(job)
    with pytest.raises(CheckpointError, match=r"table 'embeddings.user' is \(101, 8\) here"):
        restore_sharded(job.model, job.dense_optimizer, FileStore(root), MODEL)
    after = sharded_state(job)
    assert sorted(before) == sorted(after)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_a_version_of_another_shape_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    other = replace(CONFIG, sparse=(SparseFeature("user", 99), *CONFIG.sparse[1:]))
    _one_process_version(tmp_path / "store", other)
    run_ranks(_refuse_and_keep, 1, str(tmp_path / "store"))


class _StaleHead(FileStore):
    """A store whose HEAD still names version 1: what a rank reads while another writer is
    committing a newer one."""

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        if key == head_key(MODEL):
            first = Catalog(FileStore(self.root), MODEL).versions()[0]
            return Head(model=MODEL, version=first.version, manifest=first.key).to_json()
        return super().get(key, max_bytes)


def _resume_latest(rank: int, world: int, root: str) -> None:
    from trainer.sharded.checkpointing import ShardedCheckpointer
    from trainer.sharded.collective import TorchCollective

    job = sharded_job("table_wise")
    store = _StaleHead(root) if rank == 0 else FileStore(root)
    with ShardedCheckpointer(
        job.model,
        job.dense_optimizer,
        store=store,
        model_name=MODEL,
        collective=TorchCollective.new(timeout_s=30.0),
        sparse_hyper={"lr": SPARSE_LR, "eps": 1e-8},
        policy="consecutive",
        codec="fp32",
        interval_samples=64,
        model_config=CONFIG.to_json(),
    ) as ckpt:
        position = ckpt.resume()
        assert ckpt.resumed_from == 1
        assert (position.step, position.samples_seen) == (3, 96)


def test_every_rank_resumes_the_latest_version_rank_0_read(tmp_path: Path) -> None:
    # Rank 0 read HEAD before another writer committed version 2, rank 1 after: every rank
    # must load the version rank 0 read.
    _one_process_version(tmp_path / "store")
    assert [v.version for v in Catalog(FileStore(tmp_path / "store"), MODEL).versions()] == [1, 2]
    run_ranks(_resume_latest, 2, str(tmp_path / "store"))
