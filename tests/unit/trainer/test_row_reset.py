"""An evicted row starts over: weights redrawn from the table's initial distribution, per-row
optimizer state back to its initial value, marked dirty; other rows untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from publisher.state_dicts import OptimizerStateLayout
from publisher.write.tracker import DirtyRowTracker
from trainer.row_reset import RowReset
from trainer.rowwise_adagrad import RowWiseAdagrad


@pytest.mark.parametrize("kind", ["rowwise", "adagrad"])
def test_reset_rows_and_their_optimizer_state(kind: str) -> None:
    torch.manual_seed(0)
    table = nn.EmbeddingBag(6, 4, mode="sum", sparse=True)
    optimizer: torch.optim.Optimizer
    if kind == "rowwise":
        optimizer = RowWiseAdagrad([table.weight], lr=0.5)
    else:
        optimizer = torch.optim.Adagrad([table.weight], lr=0.5, initial_accumulator_value=0.1)
    ids = torch.tensor([0, 1, 2, 3, 4, 5])
    for _ in range(3):
        optimizer.zero_grad()
        table(ids, torch.arange(6)).pow(2).sum().mul(10).backward()
        optimizer.step()
    before = table.weight.detach().clone()
    state = optimizer.state[table.weight]["sum"]
    state_before = state.clone()
    tracker = DirtyRowTracker({"emb": 6})
    layout = OptimizerStateLayout([optimizer], {"emb": table.weight})
    RowReset("emb", table.weight, layout, tracker)(np.array([1, 4]))

    after = table.weight.detach()
    bound = 1 / 4**0.5
    assert torch.equal(after[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
    assert not torch.equal(after[[1, 4]], before[[1, 4]])
    assert bool((after[[1, 4]].abs() <= bound).all())
    initial = 0.0 if kind == "rowwise" else 0.1
    assert bool((state[[1, 4]] == initial).all())
    assert torch.equal(state[[0, 2, 3, 5]], state_before[[0, 2, 3, 5]])
    assert tracker.peek("emb").tolist() == [1, 4]
