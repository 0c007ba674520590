"""A sharded job publishes versions through ShardedCheckpointer, every rank its own shards; the
version restores bitwise (fp32) on 2 ranks, on 1 rank and into the one-process trainer."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.sharded_job import CONFIG, EPS, SPARSE_LR, Job, run_ranks, sharded_job, train_sharded
from publisher.dlrm import DLRM
from publisher.memory_budget import MemoryBudget
from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.store import FileStore
from tests.unit.publisher.test_restore import CountingStore
from tests.unit.trainer.sharded.job import assert_holds_expected, sharded_state
from trainer.checkpointer import IncrementalCheckpointer
from trainer.online import OptimizerSettings, build_optimizers

pytest.importorskip("torchrec")

MODEL = "ranker"
#: the user table split by rows over the ranks, the others held whole by one rank each.
MIXED = {"user": "row_wise", "item": "table_wise", "ad": "table_wise"}
STEPS, BATCH = 6, 8


def checkpointer(job: Job, root: str, world: int, *, timeout_s: float = 30.0) -> object:
    """Each rank trains BATCH samples a step: the job's clock counts world * BATCH."""
    from trainer.sharded.checkpointing import ShardedCheckpointer
    from trainer.sharded.collective import TorchCollective

    return ShardedCheckpointer(
        job.model,
        job.dense_optimizer,
        store=FileStore(root),
        model_name=MODEL,
        collective=TorchCollective.new(timeout_s=timeout_s),
        sparse_hyper={"lr": SPARSE_LR, "eps": EPS},
        policy="consecutive",
        codec="fp32",
        interval_samples=2 * world * BATCH,
        model_config=CONFIG.to_json(),
        timeout_s=timeout_s,
    )


def _train_and_publish(rank: int, world: int, root: str) -> None:
    from trainer.sharded.checkpointing import ShardedCheckpointer

    job = sharded_job(MIXED)
    ckpt = checkpointer(job, root, world)
    assert isinstance(ckpt, ShardedCheckpointer)
    with ckpt:
        for step in range(STEPS):
            train_sharded(job, seed=10 * step + rank, size=BATCH)
            ckpt.step(world * BATCH, BATCH)
            if ckpt.maybe_checkpoint(reader={"offset": (step + 1) * BATCH}) is not None:
                ckpt.flush()  # one version per checkpoint (else a busy publisher folds them)
    kinds = [r.kind for r in ckpt.records]
    assert kinds == ["full", "delta", "delta"], kinds
    assert ckpt.last_version == 3
    np.savez(Path(root) / f"rank{rank}.npz", **sharded_state(job))


def _global_state(root: Path, world: int) -> dict[str, np.ndarray]:
    """Every rank's saved state put together: global tables and accumulators, rank 0's dense
    parameters and optimizer, keyed like the restore test's `expected.npz`."""
    parts: dict[str, dict[int, np.ndarray]] = {}
    expected: dict[str, np.ndarray] = {}
    for rank in range(world):
        with np.load(root / f"rank{rank}.npz") as data:
            for key, value in data.items():
                if key.startswith(("dense/", "opt/")):
                    expected.setdefault(key, value)
                    continue
                name, start, part = key.split("/")
                kind = "table" if part == "w" else "acc"
                parts.setdefault(f"{kind}/{name}", {})[int(start)] = value
    for key, shards in parts.items():
        expected[key] = np.concatenate([shards[s] for s in sorted(shards)])
    return expected


def _restore_and_compare(rank: int, world: int, root: str, sharding: str) -> None:
    from trainer.sharded.restore_shards import restore_sharded

    job = sharded_job(sharding, seed=100 + rank)
    store = CountingStore(Path(root))
    chain = restore_plan(Catalog(store, MODEL))
    # Row-wise on 2 ranks, a rank restores about half of every table: its budget is its own.
    whole = chain[-1].manifest.full_fp32_bytes
    budget = MemoryBudget(whole - 1 if world > 1 else whole)
    position = restore_sharded(job.model, job.dense_optimizer, store, MODEL, budget=budget)
    assert position.step == STEPS
    assert position.samples_seen == 2 * STEPS * BATCH  # the job's: both ranks' samples
    assert_holds_expected(job, root)
    # The user table's shard blobs (one per rank) are fetched by the rank restoring its rows.
    shards = [ref.manifest.table("embeddings.user").shards or () for ref in chain]
    mine = {parts[rank].blob.key for parts in shards}
    others = {p.blob.key for parts in shards for p in parts} - mine
    assert mine <= set(store.fetched) and bool(others & set(store.fetched)) == (world == 1)


def test_two_ranks_publish_and_restore_bitwise_on_two_ranks_one_rank_and_one_process(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    root.mkdir()
    run_ranks(_train_and_publish, 2, str(root))
    head = Catalog(FileStore(root), MODEL).latest()
    assert head is not None and head.version == 3
    user = next(t for t in head.manifest.tables if t.name == "embeddings.user")
    assert user.blob is None and user.shards is not None
    assert [(s.row_start, s.row_end) for s in user.shards] == [(0, 51), (51, 101)]
    assert all(t.shards is None for t in head.manifest.tables if t.name != "embeddings.user")
    ranks = head.manifest.position.ranks
    assert ranks is not None and [r.reader for r in ranks] == [{"offset": 48}] * 2

    expected = _global_state(root, 2)
    np.savez(root / "expected.npz", **expected)
    run_ranks(_restore_and_compare, 2, str(root), "row_wise")
    run_ranks(_restore_and_compare, 1, str(root), "table_wise")

    # The one-process trainer resumes the job's version: same tables, accumulators and Adam.
    model = DLRM(CONFIG)
    optimizers = build_optimizers(model, OptimizerSettings(sparse_lr=SPARSE_LR))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        ckpt = IncrementalCheckpointer(
            model,
            optimizers,
            store=FileStore(root),
            model_name=MODEL,
            codec="fp32",
            preallocate=False,
        )
        ckpt.resume()
        ckpt.close(flush=False)
    sparse_opt, dense_opt = optimizers
    for f in CONFIG.sparse:
        weight = model.embeddings[f.name].weight
        assert torch.equal(weight, torch.from_numpy(expected[f"table/embeddings.{f.name}"]))
        assert torch.equal(
            sparse_opt.state[weight]["sum"], torch.from_numpy(expected[f"acc/embeddings.{f.name}"])
        )
    for key, value in model.state_dict().items():
        if not key.startswith("embeddings."):
            assert torch.equal(value, torch.from_numpy(expected[f"dense/{key}"])), key
    for i, per in dense_opt.state_dict()["state"].items():
        for k, v in per.items():
            assert np.array_equal(v.numpy().reshape(-1), expected[f"opt/{i}/{k}"].reshape(-1))
