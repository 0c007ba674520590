"""The memory budget: what a version makes a reader allocate, computed from its manifest and
checked before anything is fetched or allocated (publisher/memory_budget.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.synthetic_run import SyntheticRun, small_config
from publisher.dlrm import DLRM, DLRMConfig, SparseFeature
from publisher.memory_budget import MemoryBudget, MemoryBudgetError, machine_memory_bytes
from publisher.read.catalog import Catalog
from publisher.read.restore import RestoreError, restore
from publisher.store import FileStore


@pytest.mark.parametrize(
    "config",
    [
        small_config(),
        small_config(rows=(7,), bag_rows=None, n_dense=0),
        DLRMConfig(
            sparse=tuple(SparseFeature(f"f{i}", 3 + i) for i in range(9)),
            dense=("a", "b", "c"),
            embedding_dim=4,
            bottom_mlp=(5, 6),
            top_mlp=(7, 2, 3),
        ),
    ],
)
def test_nbytes_is_what_the_model_allocates(config: DLRMConfig) -> None:
    model = DLRM(config)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    pairs = model.pair_rows.numel()
    held += 8 * (pairs + model.pair_cols.numel())
    # and the (2, pairs) int64 tensor the two index rows were copied from, while they were
    assert config.nbytes == held + 2 * 8 * pairs


def test_the_default_budget_is_a_share_of_the_machine() -> None:
    memory = machine_memory_bytes()
    assert 0 < MemoryBudget.of_machine().limit_bytes < memory
    assert MemoryBudget.from_setting(None) == MemoryBudget.of_machine()
    assert MemoryBudget.from_setting(123).limit_bytes == 123


class CountingStore(FileStore):
    """Records the blobs read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.blobs_read: list[str] = []

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if "/blobs/" in key:
            self.blobs_read.append(key)
        return super().get_range(key, start, length)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[SyntheticRun]:
    store = CountingStore(tmp_path / "store")
    r = SyntheticRun(store, "m", small_config(), codec="fp32")
    r.train(2)
    r.publish("full")
    r.train(2)
    r.publish("delta")
    yield r
    r.close()


def test_restore_refuses_a_version_over_the_budget_before_fetching(run: SyntheticRun) -> None:
    store = run.store
    assert isinstance(store, CountingStore)
    needed = Catalog(store, "m").find(2).manifest.full_fp32_bytes
    assert restore(store, "m", 2, budget=MemoryBudget(needed)).version == 2
    store.blobs_read.clear()
    with pytest.raises(RestoreError, match="over the memory budget") as caught:
        restore(store, "m", 2, budget=MemoryBudget(needed - 1))
    assert isinstance(caught.value.__cause__, MemoryBudgetError)
    assert store.blobs_read == []


def _rewrite_manifest(root: Path, key: str, change: Any) -> None:
    doc = json.loads((root / key).read_bytes())
    change(doc)
    (root / key).write_text(json.dumps(doc))


def test_a_forged_baseline_is_refused_before_its_blob_is_fetched(
    run: SyntheticRun, tmp_path: Path
) -> None:
    # The target (v2) is within budget; its baseline v1 is rewritten to declare a 2^20 x 64
    # table (its blob replaced by one of that shape, size and sha256 made to agree): its decode
    # caps would admit 256 MiB, so the chain's shapes are compared before any blob is read.
    store = run.store
    assert isinstance(store, CountingStore)
    root = tmp_path / "store"
    v1 = Catalog(store, "m").find(1)
    entry = v1.manifest.tables[0]
    blob = b"forged blob of 2^20 rows"
    (root / entry.blob.key).write_bytes(blob)

    def bigger(doc: dict[str, Any]) -> None:
        table = doc["tables"][0]
        table.update(rows=2**20, rows_in_checkpoint=2**20, dim=64, aux_dim=0, codec="fp32")
        table["blob"].update(size=len(blob), sha256=hashlib.sha256(blob).hexdigest())

    _rewrite_manifest(root, v1.key, bigger)
    with pytest.raises(RestoreError, match=f"is {2**20}x64 \\(\\+0\\), version 2 says 1000x8"):
        restore(store, "m", 2)
    assert entry.blob.key not in store.blobs_read
