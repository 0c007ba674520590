"""The stall copies: the planned rows with their optimizer columns, the dense state, and nothing
that still points into the live model."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from publisher.id_map import IdMap
from publisher.write.policies import make_policy
from publisher.write.tracker import attach, find_embedding_tables
from schemas.manifest import Position
from trainer.rowwise_adagrad import RowWiseAdagrad
from trainer.snapshot_capture import SnapshotCapture


def test_take_copies_the_dirty_rows_and_resets_the_bitmaps() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(50, 4, mode="sum"), "head": nn.Linear(4, 1)})
    sparse = RowWiseAdagrad([model["emb"].weight], lr=0.1)
    dense = torch.optim.Adam(model["head"].parameters(), lr=0.1)
    tables = find_embedding_tables(model)
    capture = SnapshotCapture(model, tables, [sparse, dense], {"emb": "int8"}, {"a": 1})
    capture.preallocate()
    policy = make_policy("consecutive", {"emb": 50})
    tracked = attach(model)

    def train(ids: list[int]) -> None:
        out = model["head"](model["emb"](torch.tensor([ids]))).sum()
        out.backward()
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad()

    train(list(range(50)))
    first = capture.take(tracked.tracker, policy, Position(step=1, samples_seen=1), {}, sequence=1)
    assert first.snapshot.kind == "full" and first.snapshot.tables[0].n_rows == 50
    train([3, 7, 7])
    taken = capture.take(
        tracked.tracker, policy, Position(step=2, samples_seen=2), {"auc": 0.7}, sequence=2
    )
    snap = taken.snapshot
    assert set(taken.breakdown_ms) == {"bitmaps_and_plan", "copy"}
    assert taken.dirty["emb"].tolist() == [3, 7] and tracked.tracker.peek("emb").size == 0
    assert (snap.kind, snap.relative_to, snap.policy, snap.sequence) == (
        "delta",
        "parent",
        "consecutive",
        2,
    )
    assert snap.metrics == {"auc": 0.7} and snap.model_config == {"a": 1}
    rows = snap.tables[0]
    assert rows.codec == "int8" and rows.row_ids.tolist() == [3, 7]
    weight = model["emb"].weight.detach()
    np.testing.assert_array_equal(rows.values, weight[[3, 7]].numpy())
    np.testing.assert_array_equal(rows.aux[:, 0], sparse.state[model["emb"].weight]["sum"][[3, 7]])
    assert set(snap.dense) == {"head.weight", "head.bias"}
    assert {"optimizers.1.state.0.exp_avg"} <= set(snap.optimizer)

    # Copies: training on does not reach into the snapshot.
    before = (rows.values.copy(), rows.aux.copy(), snap.dense["head.weight"].copy())
    train([3, 7])
    np.testing.assert_array_equal(rows.values, before[0])
    np.testing.assert_array_equal(rows.aux, before[1])
    np.testing.assert_array_equal(snap.dense["head.weight"], before[2])
    tracked.detach()
    capture.close()


def test_take_copies_the_id_map_entries_of_the_copied_rows() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(20, 4, sparse=True), "other": nn.Embedding(5, 2)})
    sparse = torch.optim.SGD(model.parameters(), lr=0.1)
    tables = find_embedding_tables(model)
    id_map = IdMap(20)
    for row in range(1, 20):
        id_map.assign(f"u{row}", row)
        id_map.counts[row] = row
    capture = SnapshotCapture(
        model, tables, [sparse], {"emb": "fp32", "other": "fp32"}, {}, {"emb": id_map}
    )
    policy = make_policy("consecutive", {"emb": 20, "other": 5})
    tracked = attach(model)

    def train(ids: list[int]) -> None:
        (model["emb"](torch.tensor(ids)).sum() + model["other"](torch.tensor([0])).sum()).backward()
        sparse.step()
        sparse.zero_grad()

    train([1])
    first = capture.take(tracked.tracker, policy, Position(step=1, samples_seen=1), {}, sequence=1)
    full = first.snapshot.tables[0].id_map_entries()
    assert first.snapshot.kind == "full" and full is not None
    assert full.keys == ("", *(f"u{r}" for r in range(1, 20)))
    assert first.snapshot.tables[1].id_entries is None  # a table without a map
    assert "id_maps" in first.breakdown_ms and first.breakdown_ms["id_maps"] >= 0.0

    train([3, 7])
    id_map.release(3)
    id_map.assign("new", 3)
    id_map.counts[3] = 1
    tracked.tracker.mark("emb", np.array([12]))  # an eviction marks its row
    id_map.release(12)
    taken = capture.take(tracked.tracker, policy, Position(step=2, samples_seen=2), {}, sequence=2)
    rows = taken.snapshot.tables[0]
    assert rows.row_ids.tolist() == [3, 7, 12]
    # The map changing on (an eviction, an admission, counts) does not reach into the
    # snapshot, whose keys are gathered only now.
    id_map.counts[7] = 100
    id_map.release(3)
    id_map.assign("newer", 12)
    entries = rows.id_map_entries()
    assert entries is not None
    assert entries.keys == ("new", "u7", "")
    assert entries.counts.tolist() == [1, 7, 0]
    assert entries.assigned.tolist() == [True, True, False]
    tracked.detach()
    capture.close()
