"""Merge on backlog: with the store blocked, snapshots merge into one pending snapshot (memory
bounded, trainer never waits); once the store is back everything is committed and the restored
fp32 state equals the trainer's, bitwise."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from publisher.read.restore import restore
from publisher.store import FileStore
from trainer.checkpointer import IncrementalCheckpointer
from trainer.online import build_dlrm, build_optimizers, train_online
from trainer.streams.synthetic import SyntheticConfig, SyntheticStream


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


class GatedStore(FileStore):
    """A file store whose writes block while the gate is closed (a store that is away)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def put(self, key: str, data: bytes) -> str:
        if "/blobs/" in key and not self.gate.is_set():  # the lease and HEAD still work
            self.blocked.set()
            if not self.gate.wait(timeout=30):
                raise TimeoutError("test gate never opened")
        return super().put(key, data)


def test_snapshots_merge_while_the_store_is_blocked(tmp_path: Path) -> None:
    stream = SyntheticStream(
        SyntheticConfig(cardinalities=(30, 2000, 8000, 5, 600), seed=2, chunk=512, drift=1.0)
    )
    model = build_dlrm(stream.features, stream.dense_names, seed=0)
    optimizers = build_optimizers(model)
    store = GatedStore(tmp_path)
    ckpt = IncrementalCheckpointer(
        model,
        optimizers,
        store=store,
        model_name="backlog",
        policy="consecutive",
        codec="fp32",
        interval_samples=1000,
    )
    with ckpt:
        # The first snapshot (a full) blocks in the store; the next ones pile up behind it.
        def after_batch(batch: object, metrics: object) -> None:
            if len(ckpt.records) == 1:  # let the worker pick up the first snapshot
                assert store.blocked.wait(timeout=30)

        report = train_online(
            model,
            optimizers,
            stream,
            batch_size=250,
            stop=6000,
            checkpointer=ckpt,
            on_batch=after_batch,
        )
        assert store.blocked.is_set() and not store.gate.is_set()
        assert len(report.records) == 6
        assert ckpt.background.backlog
        assert ckpt.last_version is None  # nothing committed, yet training went on
        full_bytes = report.records[0].snapshot_bytes  # every row once: the bound
        assert ckpt.background.peak_pending_bytes <= 2 * full_bytes  # folded, not piled up
        assert max(r.stall_ms for r in report.records) < 2000  # never waited for storage
        store.gate.set()
        ckpt.flush(timeout=30)
        assert ckpt.background.merges == 4

    records = ckpt.records
    assert [r.version for r in records] == [1, None, None, None, None, 2]
    assert [r.merged_into for r in records] == [None, 2, 2, 2, 2, None]
    assert records[-1].published_kind == "delta"

    restored = restore(FileStore(tmp_path), "backlog")
    assert restored.version == 2
    assert restored.position.samples_seen == 6000
    sparse_opt = optimizers[0]
    for name, table in ckpt.tables.items():
        np.testing.assert_array_equal(restored.tables[name].weights, table.weight.detach().numpy())
        acc = sparse_opt.state[table.weight]["sum"].numpy()
        np.testing.assert_array_equal(restored.tables[name].aux[:, 0], acc)
    for key, value in model.state_dict().items():
        if not key.startswith("embeddings."):
            assert torch.equal(torch.from_numpy(restored.dense[key]), value), key


@pytest.mark.multiprocess  # the publisher runs in a child process
def test_process_publisher_commits_the_same_state(tmp_path: Path) -> None:
    """Encode + commit in a child process: versions land, restored fp32 state is bitwise the
    trainer's, the lease is released at close."""
    stream = SyntheticStream(SyntheticConfig(cardinalities=(30, 2000, 500), seed=4, chunk=512))
    model = build_dlrm(stream.features, stream.dense_names, seed=0)
    optimizers = build_optimizers(model)
    published: list[int | None] = []
    ckpt = IncrementalCheckpointer(
        model,
        optimizers,
        store=f"file://{tmp_path}",
        model_name="proc",
        policy="consecutive",
        codec="fp32",
        interval_samples=1000,
        publish_in="process",
        on_published=lambda record: published.append(record.version),
    )
    with ckpt:
        train_online(model, optimizers, stream, batch_size=250, stop=3000, checkpointer=ckpt)
    # A slow child (a loaded machine) may merge a waiting snapshot into the next one; either way
    # every snapshot is settled, versions are consecutive, and the last snapshot is committed.
    records = ckpt.records
    assert len(records) == 3
    assert all(r.published for r in records)
    versions = [r.version for r in records if r.version is not None]
    assert versions == list(range(1, len(versions) + 1))
    assert records[-1].version == versions[-1]
    for r in records:
        if r.version is None:
            assert r.merged_into is not None and r.merged_into in versions
    assert sorted(v for v in published if v is not None) == versions
    restored = restore(FileStore(tmp_path), "proc")
    for name, table in ckpt.tables.items():
        np.testing.assert_array_equal(restored.tables[name].weights, table.weight.detach().numpy())
    # The child released the lease: another writer can start at once.
    IncrementalCheckpointer(
        model, optimizers, store=f"file://{tmp_path}", model_name="proc", interval_samples=10
    ).close()
