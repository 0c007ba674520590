"""A restored version loaded into any module of its model (publisher/read/module_state.py),
without a lease: bit for bit at fp32 for both example models, refused whole when the module
does not fit; and `checknrun restore` writing a version's id maps beside the weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from examples import two_tower
from publisher.cli import main
from publisher.id_map import IdMap
from publisher.read.module_state import ModuleStateError, load_module_state
from publisher.read.restore import RestoredState, restore
from publisher.state_dicts import weight_key
from publisher.store import FileStore
from tests.example_training import BATCH, EXAMPLES, ExampleTrainer
from tests.support import unwritten_like

INTERVAL = 6 * BATCH


def _published(tmp_path: Path, example: str, codec: str = "fp32") -> ExampleTrainer:
    """Three intervals of `example` published (a full, then deltas), ending at a checkpoint."""
    trainer = ExampleTrainer(example)
    ckpt = trainer.checkpointer(
        f"file://{tmp_path}", codec=codec, policy="consecutive", interval_samples=INTERVAL
    )
    with ckpt:
        trainer.train(3 * 6, ckpt)
    return trainer


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("example", EXAMPLES)
def test_an_fp32_version_loads_bit_for_bit_into_a_fresh_module(
    tmp_path: Path, example: str
) -> None:
    trainer = _published(tmp_path, example)
    state = restore(FileStore(tmp_path), example)
    assert state.version == 3 and state.manifest.kind == "delta"
    fresh = trainer.build(state.manifest.model_config_)
    id_maps = load_module_state(fresh, state)
    # What the version holds, bit for bit; the rows no version carried (a full of a dynamic
    # table leaves its free rows out, docs/FORMAT.md 7.1) are zero, as a server holds them.
    assert _same(unwritten_like(fresh, trainer.model, state), _state(trainer.model))
    loaded = fresh.state_dict()
    for name, table in state.tables.items():
        assert not loaded[weight_key(name)][torch.from_numpy(table.unwritten)].any()
    if trainer.id_maps:  # two_tower's full left free rows out
        assert sum(len(t.unwritten) for t in state.tables.values()) > 0
    with torch.no_grad():  # as a module built with the trainer's seed would hold them
        fresh.load_state_dict(unwritten_like(fresh, trainer.model, state))
    assert set(id_maps) == set(trainer.id_maps)  # two_tower's maps; none for deepfm
    for name, id_map in id_maps.items():
        ours, theirs = id_map.entries(), trainer.id_maps[name].entries()
        assert ours.keys == theirs.keys and np.array_equal(ours.counts, theirs.counts)
        assert len(id_map) == len(trainer.id_maps[name]) > 0
    inputs, _ = trainer.next_batch()  # (maps the next batch's new ids: after the check)
    with torch.no_grad():
        assert torch.equal(trainer.score(fresh, inputs), trainer.score(trainer.model, inputs))


def test_a_module_that_does_not_fit_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    trainer = _published(tmp_path, "two_tower")
    state = restore(FileStore(tmp_path), "two_tower")
    config = two_tower.TwoTowerConfig(users=400, items=200, categories=12)

    def refused(module: nn.Module, match: str) -> None:
        before = _state(module)
        with pytest.raises(ModuleStateError, match=match):
            load_module_state(module, state)
        assert _same(_state(module), before)  # nothing written

    more_users = two_tower.TwoTowerConfig(users=401, items=200, categories=12)
    refused(two_tower.TwoTower(more_users), r"table 'user' is \(401, 16\) here but \(400, 16\)")
    wider = two_tower.TwoTowerConfig(users=400, items=200, categories=12, hidden=33)
    refused(two_tower.TwoTower(wider), r"user_tower\.0\.weight is \(33, 32\) here")
    refused(nn.Sequential(nn.Embedding(400, 16)), r"holds tables \['category', .*has \['0'\]")

    class WithAnExtraTable(two_tower.TwoTower):
        def __init__(self) -> None:
            super().__init__(config)
            self.region = nn.Embedding(5, 2)

    extra = WithAnExtraTable()
    refused(extra, r"\(missing: \['region'\]\)")
    region = extra.region.weight.detach().clone()
    # Not strict: what the version holds is loaded, the rest left alone.
    assert set(load_module_state(extra, state, strict=False)) == {"user", "item"}
    assert torch.equal(extra.region.weight, region)
    assert torch.equal(
        unwritten_like(extra, trainer.model, state)["user.weight"], trainer.model.user.weight
    )
    # A version restored over a row range is not a module's state.
    ranged = RestoredState(state.manifest, dict(state.tables), dense=state.dense)
    user = ranged.tables["user"]
    ranged.tables["user"] = type(user)(user.name, user.weights, user.aux, row_start=1)
    with pytest.raises(ModuleStateError, match=r"from row 1"):
        load_module_state(two_tower.TwoTower(config), ranged)


def test_restore_writes_the_id_maps_and_model_only_puts_them_beside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = _published(tmp_path / "store", "two_tower", codec="int8")
    url = f"file://{tmp_path / 'store'}"
    expected = restore(FileStore(tmp_path / "store"), "two_tower").id_maps

    def same_maps(got: dict[str, IdMap]) -> None:
        assert set(got) == set(expected) == {"user", "item"}
        for name, id_map in got.items():
            ours, theirs = id_map.entries(), expected[name].entries()
            assert ours.keys == theirs.keys and np.array_equal(ours.counts, theirs.counts)
            assert np.array_equal(ours.last_seen, theirs.last_seen)
            assert id_map.row_of(next(k for k in theirs.keys if k)) is not None

    out = tmp_path / "full.pt"
    assert main(["restore", "--store", url, "--model", "two_tower", "--out", str(out)]) == 0
    payload = torch.load(out, weights_only=True)
    same_maps({name: IdMap.from_state(s) for name, s in payload["id_maps"].items()})
    assert payload["id_maps"]["user"]["hashed"] is False
    assert len(payload["id_maps"]["user"]["keys"]) == 400
    assert not (tmp_path / "full.id_maps.pt").exists()

    out = tmp_path / "model.pt"
    argv = ["restore", "--store", url, "--model", "two_tower", "--out", str(out), "--model-only"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    beside = tmp_path / "model.id_maps.pt"
    assert f"the id maps of tables ['item', 'user'] are in {beside}" in err
    model = two_tower.build(payload["manifest"]["model_config"])
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: the weights alone
    same_maps({n: IdMap.from_state(s) for n, s in torch.load(beside, weights_only=True).items()})
    assert main([*argv, "--json"]) == 0
    assert '"id_maps_out": "' + str(beside) + '"' in capsys.readouterr().out
    del trainer


def test_restore_of_a_version_without_id_maps_writes_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _published(tmp_path / "store", "deepfm", codec="int8")
    url = f"file://{tmp_path / 'store'}"
    out = tmp_path / "model.pt"
    argv = ["restore", "--store", url, "--model", "deepfm", "--out", str(out)]
    assert main([*argv, "--model-only"]) == 0
    assert "id maps" not in capsys.readouterr().err
    assert not (tmp_path / "model.id_maps.pt").exists()
    assert main(argv) == 0
    assert "id_maps" not in torch.load(out, weights_only=True)
