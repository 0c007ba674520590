"""trainer/sharded/optimizer_state.py: the dense optimizer's state is checked to fit before a
rank writes anything (torch's load_state_dict hands state over by position)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from publisher.read.restore import RestoredState
from trainer.errors import CheckpointError
from trainer.sharded.optimizer_state import dense_optimizer_state, job_optimizer_state


def _version_of(optimizer: torch.optim.Optimizer) -> RestoredState:
    tensors, meta = job_optimizer_state(optimizer, [], {"lr": 0.1, "eps": 1e-8})
    manifest = cast(Any, SimpleNamespace(version=3))
    return RestoredState(manifest=manifest, tables={}, optimizer=tensors, optimizer_meta=meta)


def _trained_adam(layers: torch.nn.Sequential) -> torch.optim.Optimizer:
    adam = torch.optim.Adam(layers.parameters(), lr=0.1)
    layers(torch.ones(2, 3)).sum().backward()
    adam.step()
    return adam


def test_the_same_optimizer_gets_its_state_back() -> None:
    layers = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = _version_of(_trained_adam(layers))
    fresh = torch.optim.Adam(layers.parameters(), lr=0.1)
    fresh.load_state_dict(dense_optimizer_state(state, fresh))
    assert set(fresh.state_dict()["state"]) == {0, 1, 2, 3}


def test_another_class_or_parameters_of_other_shapes_are_refused() -> None:
    layers = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = _version_of(_trained_adam(layers))
    with pytest.raises(CheckpointError, match=r"Adam, this optimizer a torch\.optim\.sgd\.SGD"):
        dense_optimizer_state(state, torch.optim.SGD(layers.parameters(), lr=0.1))
    swapped = [*layers[1].parameters(), *layers[0].parameters()]
    with pytest.raises(CheckpointError, match=r"parameter 0 is \(2, 4\) here"):
        dense_optimizer_state(state, torch.optim.Adam(swapped, lr=0.1))
