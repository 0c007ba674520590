"""A full baseline copied in chunks between training steps is still one consistent model state:
the model at the stop that completes it, rows, optimizer columns and dense state alike."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import FileStore
from publisher.tunables import DEFAULT_TUNABLES
from publisher.write.policies import make_policy
from publisher.write.tracker import attach, find_embedding_tables
from schemas.manifest import Position
from trainer.checkpointer import IncrementalCheckpointer
from trainer.rowwise_adagrad import RowWiseAdagrad
from trainer.snapshot_capture import SnapshotCapture


def bag_model() -> tuple[nn.ModuleDict, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"emb": nn.EmbeddingBag(50, 4, mode="sum", sparse=True), "head": nn.Linear(4, 1)}
    )
    sparse = RowWiseAdagrad([model["emb"].weight], lr=0.1)
    dense = torch.optim.Adam(model["head"].parameters(), lr=0.1)
    return model, [sparse, dense]


def test_rows_changed_after_their_chunk_was_copied_are_copied_again() -> None:
    model, optimizers = bag_model()
    capture = SnapshotCapture(model, find_embedding_tables(model), optimizers, {"emb": "fp32"}, {})
    tracked = attach(model, optimizers=optimizers)
    policy = make_policy("consecutive", {"emb": 50})

    def train(ids: list[int]) -> None:
        model["head"](model["emb"](torch.tensor([ids]))).sum().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()

    train(list(range(50)))
    # 4 weights + 1 row-wise Adagrad column = 20 bytes a row: 7 rows a chunk, 8 chunks.
    capture.begin(tracked.tracker, policy, chunk_bytes=140)
    assert capture.copying_full
    stops = 1
    train([2, 45])  # row 2 was copied by begin's chunk, row 45 is not copied yet
    while capture.copying_full:
        capture.copy_chunk()
        stops += 1
        train([3])  # changed after its chunk, every time
    taken = capture.finish(tracked.tracker, Position(step=9, samples_seen=9), {}, sequence=1)
    assert stops == 8 and len(taken.pauses_ms) == 8
    assert {"chunk_pauses", "longest_chunk_pause"} <= set(taken.breakdown_ms)
    snap = taken.snapshot
    assert snap.kind == "full" and snap.position.step == 9
    rows = snap.tables[0]
    np.testing.assert_array_equal(rows.row_ids, np.arange(50))
    np.testing.assert_array_equal(rows.values, model["emb"].weight.detach().numpy())
    np.testing.assert_array_equal(rows.aux[:, 0], optimizers[0].state[model["emb"].weight]["sum"])
    np.testing.assert_array_equal(snap.dense["head.weight"], model["head"].weight.detach())
    # The rows changed while copying are in the baseline, not in the next delta.
    assert tracked.tracker.peek("emb").size == 0
    train([7])
    delta = capture.take(
        tracked.tracker, policy, Position(step=10, samples_seen=10), {}, sequence=2
    )
    assert delta.snapshot.kind == "delta" and delta.dirty["emb"].tolist() == [7]


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(300, 8, sparse=True)
        self.items = nn.Embedding(500, 8, sparse=True)
        self.head = nn.Linear(16, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.cat([self.users(users), self.items(items)], 1))
        return out.squeeze(1)


def test_every_version_equals_the_model_at_its_position(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TwoTower()
    opts: list[torch.optim.Optimizer] = [
        RowWiseAdagrad([model.users.weight, model.items.weight], lr=0.1),
        torch.optim.Adam(model.head.parameters(), lr=0.01),
    ]
    # 800 rows x (8 + 1) floats = 28.8 kB: 4 kB chunks take 8 steps.
    tunables = replace(DEFAULT_TUNABLES, full_copy_chunk_bytes=4000)
    ckpt = IncrementalCheckpointer(
        model,
        opts,
        store=f"file://{tmp_path}",
        model_name="m",
        policy="intermittent",
        codec="fp32",
        interval_samples=32 * 3,
        tunables=tunables,
        preallocate=False,
    )
    states: dict[int, dict[str, Any]] = {}
    records = []
    with ckpt:
        ckpt.checkpoint_now(force_full=False)  # the first one, in one stop: nothing trained
        ckpt.flush()
        ckpt.policy.force_full()  # the next baseline is copied in chunks
        for step in range(40):
            g = torch.Generator().manual_seed(step)
            users = torch.randint(0, 300, (32,), generator=g)
            items = torch.randint(0, 500, (32,), generator=g)
            loss = model(users, items).pow(2).mean()
            for o in opts:
                o.zero_grad()
            loss.backward()
            for o in opts:
                o.step()
            ckpt.step(32)
            states[ckpt.step_count] = copy.deepcopy(model.state_dict())
            record = ckpt.maybe_checkpoint(reader={"offset": (step + 1) * 32})
            if record is not None:
                records.append(record)
                ckpt.flush()
    store = FileStore(tmp_path)
    versions = Catalog(store, "m").versions()
    full = [r for r in records if r.kind == "full"]
    assert full and "chunk_pauses" in full[0].stall_breakdown_ms
    # Due at step 3, copied in 8 stops: published at the step after the last chunk.
    assert full[0].step == 3 + 8
    assert [v.manifest.kind for v in versions][:3] == ["full", "full", "delta"]
    for v in versions[1:]:
        state = restore(store, "m", v.version)
        want = states[state.position.step]
        assert state.position.reader == {"offset": state.position.step * 32}
        for name in ("users", "items"):
            np.testing.assert_array_equal(state.tables[name].weights, want[f"{name}.weight"])


def test_close_publishes_a_full_still_being_copied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TwoTower()
    opts: list[torch.optim.Optimizer] = [
        RowWiseAdagrad([model.users.weight, model.items.weight], lr=0.1),
        torch.optim.Adam(model.head.parameters(), lr=0.01),
    ]
    ckpt = IncrementalCheckpointer(
        model,
        opts,
        store=f"file://{tmp_path}",
        model_name="m",
        policy="consecutive",
        codec="fp32",
        interval_samples=32,
        tunables=replace(DEFAULT_TUNABLES, full_copy_chunk_bytes=4000),
        preallocate=False,
    )
    with ckpt:
        model(torch.tensor([1]), torch.tensor([2])).sum().backward()
        for o in opts:
            o.step()
        ckpt.step(32)
        assert ckpt.maybe_checkpoint(reader={"offset": 32}) is None  # first chunk copied
        assert ckpt.capture.copying_full
    state = restore(FileStore(tmp_path), "m")
    assert state.position.step == 1 and state.position.reader == {"offset": 32}
    np.testing.assert_array_equal(state.tables["users"].weights, model.users.weight.detach())
    assert ckpt.records[0].kind == "full" and ckpt.last_dirty["users"].tolist() == [1]
    assert ckpt.records[0].stall_cpu_ms > 0
