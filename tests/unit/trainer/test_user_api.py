"""The user-facing API on a custom model: nn.Embedding tables in nested modules, SparseAdam for
the rows (its moments travel as per-row aux columns), Adam for the dense layers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import FileStore
from publisher.write.tracker import UnsoundOptimizerError
from trainer.checkpointer import CheckpointError, IncrementalCheckpointer


class TwoTower(nn.Module):
    """A user's own model: embeddings under nested modules, a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.ModuleDict({"id": nn.Embedding(300, 8, sparse=True)})
        self.items = nn.Embedding(500, 8, sparse=True)
        self.head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.users["id"](users), self.items(items)], dim=1)
        out: torch.Tensor = self.head(x).squeeze(1)
        return out


def make(seed: int) -> tuple[TwoTower, list[torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    model = TwoTower()
    users = model.users["id"]
    assert isinstance(users, nn.Embedding)
    tables = [users.weight, model.items.weight]
    sparse = torch.optim.SparseAdam(tables, lr=0.01)
    dense = torch.optim.Adam(model.head.parameters(), lr=0.01)
    return model, [sparse, dense]


def train(model: TwoTower, opts: list[torch.optim.Optimizer], steps: range, ckpt: object) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        users = torch.randint(0, 300, (32,), generator=g)
        items = torch.randint(0, 40, (32,), generator=g)  # a hot subset: most rows stay clean
        labels = (users % 2).float()
        loss = nn.functional.binary_cross_entropy_with_logits(model(users, items), labels)
        for o in opts:
            o.zero_grad()
        torch.autograd.backward(loss)
        for o in opts:
            o.step()
        ckpt.step(32)  # type: ignore[attr-defined]
        if ckpt.maybe_checkpoint(reader={"offset": (step + 1) * 32}):  # type: ignore[attr-defined]
            ckpt.flush()  # type: ignore[attr-defined]  # one version per checkpoint, no merging


def test_custom_model_round_trips_through_incremental_checkpoints(tmp_path: Path) -> None:
    model, opts = make(0)
    ckpt = IncrementalCheckpointer(
        model,
        opts,
        store=f"file://{tmp_path}",
        model_name="towers",
        policy="consecutive",
        codec="fp32",
        interval_samples=32 * 5,
    )
    assert sorted(ckpt.tables) == ["items", "users.id"]
    with ckpt:
        train(model, opts, range(20), ckpt)
    versions = Catalog(FileStore(tmp_path), "towers").versions()
    assert [v.manifest.kind for v in versions] == ["full", "delta", "delta", "delta"]
    delta = versions[-1].manifest.table("items")
    assert 0 < delta.rows_in_checkpoint <= 40 and delta.aux_dim == 16  # exp_avg + exp_avg_sq
    assert versions[-1].manifest.model_config_["architecture"] == "custom"
    assert versions[-1].manifest.position.reader == {"offset": 640}

    state = restore(FileStore(tmp_path), "towers")
    np.testing.assert_array_equal(state.tables["items"].weights, model.items.weight.detach())
    exp_avg = opts[0].state[model.items.weight]["exp_avg"].numpy()
    np.testing.assert_array_equal(state.tables["items"].aux[:, :8], exp_avg)

    # Resume into a fresh model and keep training: same as never stopping.
    fresh, fresh_opts = make(1)
    ckpt2 = IncrementalCheckpointer(
        fresh,
        fresh_opts,
        store=f"file://{tmp_path}",
        model_name="towers",
        policy="consecutive",
        codec="fp32",
        interval_samples=32 * 5,
    )
    with ckpt2:
        position = ckpt2.resume()
        assert position.step == 20 and ckpt2.step_count == 20
        train(fresh, fresh_opts, range(20, 25), ckpt2)
    reference_ckpt = IncrementalCheckpointer(
        model,
        opts,
        store=f"file://{tmp_path}/ref",
        model_name="towers",
        policy="full",
        codec="fp32",
        interval_samples=10**9,
    )
    with reference_ckpt:
        train(model, opts, range(20, 25), reference_ckpt)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    for o1, o2 in zip(opts, fresh_opts, strict=True):
        s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
        assert s1.keys() == s2.keys()
        for j in s1:
            for name in s1[j]:
                assert torch.equal(torch.as_tensor(s1[j][name]), torch.as_tensor(s2[j][name]))


def test_unsound_optimizer_is_refused_unless_the_policy_is_full(tmp_path: Path) -> None:
    model = TwoTower()
    model.items = nn.Embedding(500, 8)  # dense gradient, optimised by Adam: rows drift
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(UnsoundOptimizerError, match="items"):
        IncrementalCheckpointer(
            model, [opt], store=f"file://{tmp_path}", model_name="m", interval_samples=10
        )
    full = IncrementalCheckpointer(
        model,
        [opt],
        store=f"file://{tmp_path}",
        model_name="m",
        policy="full",
        interval_samples=10,
    )
    full.close()


def test_misuse_is_reported(tmp_path: Path) -> None:
    model, opts = make(0)
    with pytest.raises(CheckpointError, match=r"no nn\.Embedding"):
        IncrementalCheckpointer(
            nn.Linear(2, 2), [], store=f"file://{tmp_path}", model_name="m", interval_samples=1
        )
    with pytest.raises(CheckpointError, match="codec"):
        IncrementalCheckpointer(
            model,
            opts,
            store=f"file://{tmp_path}",
            model_name="m",
            codec="int5",
            interval_samples=1,
        )
    with pytest.raises(CheckpointError, match="interval_samples"):
        IncrementalCheckpointer(
            model, opts, store=f"file://{tmp_path}", model_name="m", interval_samples=0
        )
    ckpt = IncrementalCheckpointer(
        model,
        opts,
        store=f"file://{tmp_path}",
        model_name="m",
        codec={"users.id": "int8", "items": "fp16"},
        interval_seconds=3600,
    )
    assert not ckpt.due()
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.checkpoint_now()
