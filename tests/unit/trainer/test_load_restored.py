"""`trainer.resume.load_restored` for any model without private helpers: the tables and their
state_dict keys default to the model's own, and a model that does not fit is refused with the
checks `publisher.read.module_state` makes, before anything is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples import two_tower
from publisher.id_map import IdMap
from publisher.read.restore import restore
from publisher.store import FileStore
from tests.example_training import BATCH, ExampleTrainer
from tests.support import unwritten_like
from trainer.errors import CheckpointError
from trainer.resume import load_restored


def test_a_user_model_resumes_with_the_default_tables_and_keys(tmp_path: Path) -> None:
    trainer = ExampleTrainer("two_tower")
    ckpt = trainer.checkpointer(
        f"file://{tmp_path}", codec="fp32", policy="consecutive", interval_samples=4 * BATCH
    )
    with ckpt:
        trainer.train(8, ckpt)
    state = restore(FileStore(tmp_path), "two_tower")
    config = state.manifest.model_config_
    model = two_tower.build(config)
    optimizers = two_tower.optimizers(model)
    id_maps = {name: IdMap(m.rows) for name, m in trainer.id_maps.items()}
    load_restored(state, model, optimizers, model_config=config, id_maps=id_maps)
    # the rows no version carried (docs/FORMAT.md 7.1) keep the new model's own values
    ours, theirs = unwritten_like(model, trainer.model, state), trainer.model.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    for loaded, trained in zip(optimizers, trainer.optimizers, strict=True):
        a, b = loaded.state_dict()["state"], trained.state_dict()["state"]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[i][k], b[i][k]) for i in b for k in b[i])
    assert all(id_maps[n].entries().keys == m.entries().keys for n, m in trainer.id_maps.items())

    wider = two_tower.TwoTowerConfig(users=400, items=200, categories=12, hidden=33)
    other = two_tower.TwoTower(wider)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"user_tower\.0\.weight is \(33, 32\) here"):
        load_restored(state, other, two_tower.optimizers(other), model_config={}, id_maps=id_maps)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
