"""A checkpoint holding NaN or inf is never committed: in a table's rows, its optimizer columns,
a dense parameter or the dense optimizer state. `on_non_finite="stop"` ends training with the
error, `"skip"` counts the snapshot and folds its rows into the next one, so the chain loses
nothing once the values are finite again."""

from __future__ import annotations

import json
import math
import re
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from publisher.codecs import OutOfRangeRowsError
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import FileStore
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.snapshot import NonFiniteSnapshotError, Snapshot, TableRows
from schemas.manifest import Position
from trainer.checkpointer import IncrementalCheckpointer
from trainer.cli import main


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(ids)).squeeze(1)
        return out


def setup(tmp_path: Path, on_non_finite: str = "stop") -> tuple[Tiny, IncrementalCheckpointer]:
    torch.manual_seed(0)
    model = Tiny()
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.Adagrad([model.emb.weight], lr=0.1),  # its `sum` travels as aux columns
        torch.optim.Adam(model.head.parameters(), lr=0.01),
    ]
    ckpt = IncrementalCheckpointer(
        model,
        optimizers,
        store=f"file://{tmp_path}",
        model_name="tiny",
        policy="consecutive",
        codec="fp32",
        interval_samples=1_000_000,
        on_non_finite=on_non_finite,  # type: ignore[arg-type]
    )
    return model, ckpt


def train(model: Tiny, ckpt: IncrementalCheckpointer, ids: list[int]) -> None:
    batch = torch.tensor(ids)
    loss = nn.functional.binary_cross_entropy_with_logits(model(batch), (batch % 2).float())
    for o in ckpt.optimizers:
        o.zero_grad()
    torch.autograd.backward(loss)
    for o in ckpt.optimizers:
        o.step()
    ckpt.step(len(ids))


def head_version(tmp_path: Path) -> int | None:
    ref = Catalog(FileStore(tmp_path), "tiny").latest()
    return None if ref is None else ref.version


def poison_dense(model: Tiny, ckpt: IncrementalCheckpointer) -> None:
    model.head.bias.data[0] = math.nan


def poison_row_state(model: Tiny, ckpt: IncrementalCheckpointer) -> None:
    ckpt.optimizers[0].state[model.emb.weight]["sum"][5, 2] = math.inf


def poison_adam(model: Tiny, ckpt: IncrementalCheckpointer) -> None:
    ckpt.optimizers[1].state[model.head.weight]["exp_avg"][0, 1] = -math.inf


@pytest.mark.parametrize(
    ("poison", "where"),
    [
        (poison_dense, "dense tensor 'head.bias'"),
        (poison_row_state, "table 'emb' row 5 (optimizer columns)"),
        (poison_adam, "optimizer tensor 'optimizers.1.state.0.exp_avg'"),
    ],
    ids=["dense", "row-state", "adam"],
)
def test_a_non_finite_snapshot_is_never_committed(
    tmp_path: Path, poison: Callable[[Tiny, IncrementalCheckpointer], None], where: str
) -> None:
    model, ckpt = setup(tmp_path)
    with pytest.raises(NonFiniteSnapshotError, match=re.escape(where)), ckpt:
        train(model, ckpt, [1, 2, 5])
        ckpt.checkpoint_now({"offset": 1})
        ckpt.flush()
        train(model, ckpt, [5, 6])
        poison(model, ckpt)
        ckpt.checkpoint_now({"offset": 2})
        try:
            ckpt.flush()
        finally:
            assert head_version(tmp_path) == 1  # the poisoned snapshot committed nothing
    # Training stops at the next batch: the failure is re-raised before any more work.
    with pytest.raises(NonFiniteSnapshotError):
        ckpt.background.raise_if_failed()


def test_stop_raises_on_the_training_thread_at_the_next_batch(tmp_path: Path) -> None:
    model, ckpt = setup(tmp_path)
    train(model, ckpt, [1, 2])
    model.emb.weight.data[2, 0] = math.nan
    ckpt.checkpoint_now({"offset": 1})
    with pytest.raises(NonFiniteSnapshotError, match=r"table 'emb' row 2 \(weights\)"):
        ckpt.flush()
    with pytest.raises(NonFiniteSnapshotError):  # called after every batch
        ckpt.maybe_checkpoint({"offset": 2})
    with pytest.raises(NonFiniteSnapshotError):  # closing with a flush reports it too
        ckpt.close()
    assert head_version(tmp_path) is None


def test_skip_holds_the_snapshot_back_and_loses_no_row(tmp_path: Path) -> None:
    model, ckpt = setup(tmp_path, "skip")
    with ckpt:
        train(model, ckpt, [1, 2])
        ckpt.checkpoint_now({"offset": 1})
        ckpt.flush()
        train(model, ckpt, [3, 4])  # rows 3 and 4 change only in this interval
        model.emb.weight.data[3, 1] = math.inf
        ckpt.checkpoint_now({"offset": 2})
        ckpt.flush()
        assert ckpt.non_finite_skipped == 1 and head_version(tmp_path) == 1
        model.emb.weight.data[3, 1] = 0.5  # repaired, then trained on again
        train(model, ckpt, [3, 7])
        ckpt.checkpoint_now({"offset": 3})
        ckpt.flush()
    assert ckpt.non_finite_skipped == 1 and head_version(tmp_path) == 2
    assert [r.version for r in ckpt.records] == [1, None, 2]
    assert ckpt.records[1].merged_into == 2
    state = restore(FileStore(tmp_path), "tiny")
    assert state.manifest.position.reader["offset"] == 3
    assert state.manifest.table("emb").rows_in_checkpoint == 3  # rows 3, 4 (held) and 7
    # Row 4 reached the store only through the held snapshot: the chain is exact.
    np.testing.assert_array_equal(state.tables["emb"].weights, model.emb.weight.detach().numpy())


def test_finding_the_bad_row_allocates_one_chunk_not_the_table() -> None:
    n, dim = 1 << 18, 64  # 64 MiB of rows, the NaN in the last one
    values = np.zeros((n, dim), dtype=np.float32)
    values[-1, -1] = math.nan
    rows = TableRows("t", n, "int8", np.arange(n, dtype=np.int64), values, values[:, :0])
    snapshot = Snapshot("full", None, "full", (rows,), Position(step=1, samples_seen=1))
    tracemalloc.start()
    try:
        with pytest.raises(NonFiniteSnapshotError, match=f"table 't' row {n - 1} "):
            snapshot.check_finite()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # a whole-table mask would be 16 MiB


DIVERGING = [
    "train",
    "--data",
    "synthetic",
    "--table-cap",
    "400",
    "--embedding-dim",
    "8",
    "--batch-size",
    "256",
    "--interval-samples",
    "2048",
    "--max-samples",
    "8192",
    "--dense-lr",
    "1e30",  # NaN within the first interval
    "--json",
    "--no-progress",
]


def test_cli_stops_or_skips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*DIVERGING, "--store", f"file://{tmp_path}/stop"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["type"] == "NonFiniteSnapshotError"
    assert err.count("\n") == 1 and "holds NaN or inf" in err and "--on-nonfinite skip" in err
    assert Catalog(FileStore(tmp_path / "stop"), "synthetic").latest() is None

    assert main([*DIVERGING, "--store", f"file://{tmp_path}/skip", "--on-nonfinite", "skip"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["non_finite_skipped"] == 4 and doc["summary"]["versions"] == 0
    assert Catalog(FileStore(tmp_path / "skip"), "synthetic").latest() is None


def test_the_check_measures_each_tables_largest_magnitude() -> None:
    values = np.array([[0.5, -3.0], [2.0, 1.0]], dtype=np.float32)
    rows = TableRows("t", 2, "int4", np.arange(2, dtype=np.int64), values, values[:, :0])
    empty = np.zeros((0, 2), dtype=np.float32)
    none = TableRows("u", 5, "int4", np.arange(0, dtype=np.int64), empty, empty[:, :0])
    snapshot = Snapshot("full", None, "full", (rows, none), Position(step=1, samples_seen=1))
    assert snapshot.check_finite() == {"t": 3.0, "u": 0.0}


@pytest.mark.parametrize("value", [-70000.0, 1e9])
def test_a_finite_row_fp16_cannot_hold_is_refused_by_the_publisher(
    tmp_path: Path, value: float
) -> None:
    # The publisher skips the fp16 field check only when the snapshot's magnitude allows it.
    values = np.full((4, 8), 0.25, dtype=np.float32)
    values[2, 3] = value
    rows = TableRows("t", 4, "int4", np.arange(4, dtype=np.int64), values, values[:, :0])
    snapshot = Snapshot("full", None, "full", (rows,), Position(step=1, samples_seen=1))
    publisher = CheckpointPublisher(FileStore(tmp_path), "m")
    try:
        with pytest.raises(OutOfRangeRowsError, match="row 2"):
            publisher.publish(snapshot)
    finally:
        publisher.close()
    assert Catalog(FileStore(tmp_path), "m").latest() is None
