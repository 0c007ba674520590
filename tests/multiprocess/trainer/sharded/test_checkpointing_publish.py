"""A sharded job publishes versions through ShardedCheckpointer, every rank its own shards; the
version restores bitwise (fp32) on 2 ranks, on 1 rank and into the one-process trainer."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.sharded_job import (
    CONFIG,
    EPS,
    SPARSE_LR,
    Job,
    batch,
    run_ranks,
    sharded_job,
    train_sharded,
)
from publisher.dlrm import DLRM
from publisher.memory_budget import MemoryBudget
from publisher.read.catalog import Catalog
from publisher.read.planner import restore_plan
from publisher.store import FileStore
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from tests.unit.publisher.test_restore import CountingStore
from tests.unit.trainer.sharded.job import assert_holds_expected, sharded_state
from trainer.checkpointer import IncrementalCheckpointer
from trainer.online import OptimizerSettings, build_optimizers

pytest.importorskip("torchrec")

MODEL = "ranker"
#: the user table split by rows over the ranks, the others held whole by one rank each.
MIXED = {"user": "row_wise", "item": "table_wise", "ad": "table_wise"}
STEPS, BATCH = 6, 8


def checkpointer(
    job: Job,
    root: str,
    world: int,
    *,
    timeout_s: float = 30.0,
    tunables: Tunables = DEFAULT_TUNABLES,
) -> object:
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
        tunables=tunables,
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


#: 10 rows a chunk: a row of this rank's shards is 8 float32 weights and its accumulator.
CHUNK_ROWS = 10
CHUNKED = Tunables(full_copy_chunk_bytes=CHUNK_ROWS * 4 * (CONFIG.embedding_dim + 1))


def _job_chunks(job: Job) -> int:
    """The job's chunk count: the most chunks of any rank's shards (a collective call)."""
    import torch.distributed as dist

    from trainer.sharded.local_shards import local_shards

    rows = sum(s.rows for t in local_shards(job.model).values() for s in t.shards)
    counts = torch.tensor([-(-rows // CHUNK_ROWS)])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return int(counts.item())


def _rows_in_shards(job: Job, seeds: list[int]) -> int:
    """Rows of this rank's shards the batches `seeds` (of every rank) look up."""
    from trainer.sharded.local_shards import local_shards

    count = 0
    for name, table in local_shards(job.model).items():
        feature = name.removeprefix("embeddings.")
        ids = np.unique(np.concatenate([batch(seed, BATCH)[1][feature].values for seed in seeds]))
        for s in table.shards:
            count += int(((ids >= s.row_start) & (ids < s.row_end)).sum())
    return count


def _assert_state(job: Job, want: dict[str, np.ndarray]) -> None:
    got = sharded_state(job)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert np.array_equal(got[key].reshape(value.shape), value), key


def _chunked_full_then_delta(rank: int, world: int, root: str) -> None:
    from trainer.sharded.checkpointing import ShardedCheckpointer
    from trainer.sharded.restore_shards import restore_sharded

    job = sharded_job(MIXED)
    ckpt = checkpointer(job, root, world, tunables=CHUNKED)
    assert isinstance(ckpt, ShardedCheckpointer)
    chunks = _job_chunks(job)
    assert chunks > 3
    steps = 0

    def train() -> object:
        nonlocal steps
        train_sharded(job, seed=10 * steps + rank, size=BATCH)
        ckpt.step(world * BATCH, BATCH)
        steps += 1
        return ckpt.maybe_checkpoint(reader={"offset": steps * BATCH})

    with ckpt:
        assert train() is None and not ckpt.copying_full
        assert train() is None and ckpt.copying_full  # due: the full's first chunk
        at_begin = sharded_state(job)
        while (full := train()) is None:
            assert steps < 2 + chunks
        # Every rank finishes at the same step, the job's chunk count after the first.
        assert steps == 2 + chunks and not ckpt.copying_full
        at_finish = sharded_state(job)
        ckpt.flush()
        train_sharded(job, seed=10 * steps + rank, size=BATCH)
        ckpt.step(world * BATCH, BATCH)
        delta = ckpt.checkpoint_now(reader={"offset": (steps + 1) * BATCH})
        at_delta = sharded_state(job)
    (first, second) = ckpt.records
    assert first is full and second is delta
    assert (first.kind, first.step, first.version) == ("full", 2 + chunks, 1)
    # Every stop of the full is recorded: its first, one per step after it, and the last.
    assert len(first.pauses_ms) == chunks
    breakdown = first.stall_breakdown_ms
    assert breakdown["longest_chunk_pause"] == max(first.pauses_ms)
    assert breakdown["chunk_pauses"] == sum(first.pauses_ms)
    assert first.stall_ms >= max(first.pauses_ms)
    # The next delta holds exactly the rows the step after the full changed: those changed
    # while it was copied are in the full, taken off the tracker at its last stop.
    assert (second.kind, second.version) == ("delta", 2)
    assert second.rows_copied == _rows_in_shards(job, [10 * steps + r for r in range(world)])
    assert any(not np.array_equal(at_begin[k], at_finish[k]) for k in at_finish)

    # Restored, each version is the model at its own last stop, bitwise: the full the model
    # at its finishing step (not at its first), every shard, accumulator, dense and Adam.
    store = FileStore(root)
    for version, state in ((1, at_finish), (2, at_delta)):
        other = sharded_job(MIXED, seed=77)
        position = restore_sharded(other.model, other.dense_optimizer, store, MODEL, version)
        assert position.step == (2 + chunks if version == 1 else 3 + chunks)
        _assert_state(other, state)


def test_a_full_baseline_is_copied_in_chunks_and_is_the_model_at_its_last_stop(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    root.mkdir()
    run_ranks(_chunked_full_then_delta, 2, str(root))


def _close_during_chunked_full(rank: int, world: int, root: str) -> None:
    from trainer.sharded.checkpointing import ShardedCheckpointer

    job = sharded_job(MIXED)
    ckpt = checkpointer(job, root, world, tunables=CHUNKED)
    assert isinstance(ckpt, ShardedCheckpointer)
    with ckpt:
        for step in range(3):
            train_sharded(job, seed=10 * step + rank, size=BATCH)
            ckpt.step(world * BATCH, BATCH)
            assert ckpt.maybe_checkpoint(reader={"offset": (step + 1) * BATCH}) is None
        assert ckpt.copying_full  # begun at step 2, one more chunk copied at step 3
        at_close = sharded_state(job)
    (record,) = ckpt.records
    assert (record.kind, record.step, record.version, len(record.pauses_ms)) == ("full", 3, 1, 2)

    # A new job resumes from it, the model at close, and publishes on.
    again = sharded_job(MIXED, seed=55)
    resumed = checkpointer(again, root, world, tunables=CHUNKED)
    assert isinstance(resumed, ShardedCheckpointer)
    assert resumed.resume().step == 3
    _assert_state(again, at_close)
    with resumed:
        for step in range(3, 5):
            train_sharded(again, seed=10 * step + rank, size=BATCH)
            resumed.step(world * BATCH, BATCH)
            assert resumed.maybe_checkpoint(reader={"offset": (step + 1) * BATCH}) is None
        assert resumed.copying_full  # due at step 5: a full after a resume, in chunks
        train_sharded(again, seed=99 + rank, size=BATCH)
        resumed.step(world * BATCH, BATCH)
        # checkpoint_now completes the full being copied, in one stop, whatever it asks for.
        now = resumed.checkpoint_now(reader={"offset": 6 * BATCH}, force_full=True)
        at_now = sharded_state(again)
    assert (now.kind, now.step, len(now.pauses_ms)) == ("full", 6, 1)
    assert resumed.last_version == 2 and not resumed.copying_full
    from trainer.sharded.restore_shards import restore_sharded

    other = sharded_job(MIXED, seed=77)
    assert restore_sharded(other.model, other.dense_optimizer, FileStore(root), MODEL).step == 6
    _assert_state(other, at_now)


def test_close_or_checkpoint_now_during_a_chunked_full_commits_it_and_the_job_resumes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    root.mkdir()
    run_ranks(_close_during_chunked_full, 2, str(root))
