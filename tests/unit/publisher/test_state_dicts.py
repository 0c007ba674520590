"""The optimizer-state layout: per-row optimizer tensors as aux columns, the rest as the dense
optimizer blob, and both put back into state_dicts that load into fresh optimizers exactly."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from publisher.state_dicts import OptimizerStateLayout, RowState, optimizer_state_dicts


def model_and_optimizers(seed: int) -> tuple[nn.ModuleDict, list[torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    model = nn.ModuleDict({"emb": nn.Embedding(20, 3, sparse=True), "head": nn.Linear(3, 1)})
    sparse = torch.optim.SparseAdam([model["emb"].weight], lr=0.1)
    dense = torch.optim.Adam(model["head"].parameters(), lr=0.1)
    return model, [sparse, dense]


def train(model: nn.ModuleDict, optimizers: list[torch.optim.Optimizer]) -> None:
    ids = torch.tensor([1, 5, 5, 17])
    loss = model["head"](model["emb"](ids)).sum()
    loss.backward()
    for o in optimizers:
        o.step()


def test_row_state_layout_and_round_trip() -> None:
    model, optimizers = model_and_optimizers(0)
    weight = model["emb"].weight
    layout = OptimizerStateLayout(optimizers, {"emb": weight})
    assert layout.row_state("emb") == []  # SparseAdam has no state before its first step
    train(model, optimizers)
    rows = layout.row_state("emb")
    assert rows == [RowState(0, 0, "exp_avg", (3,)), RowState(0, 0, "exp_avg_sq", (3,))]
    assert [r.width for r in rows] == [3, 3]
    assert [RowState.from_json(r.to_json()) for r in rows] == rows

    aux = np.empty((20, 6), dtype=np.float32)
    layout.copy_row_state("emb", rows, None, aux)
    state = optimizers[0].state[weight]
    np.testing.assert_array_equal(aux[:, :3], state["exp_avg"].numpy())
    np.testing.assert_array_equal(aux[:, 3:], state["exp_avg_sq"].numpy())
    some = np.empty((2, 6), dtype=np.float32)
    layout.copy_row_state("emb", rows, torch.tensor([5, 17]), some)
    np.testing.assert_array_equal(some, aux[[5, 17]])

    tensors, meta = layout.dense_state({"emb": rows})
    # The per-row tensors travel only as aux columns; Adam's moments and steps are dense.
    assert not any(k.startswith("optimizers.0.") and "exp_avg" in k for k in tensors)
    assert {"optimizers.1.state.0.exp_avg", "optimizers.1.state.1.step"} <= set(tensors)
    assert meta["row_state"] == {"emb": [r.to_json() for r in rows]}

    dicts = optimizer_state_dicts(tensors, meta, {"emb": aux})
    fresh, fresh_optimizers = model_and_optimizers(1)
    fresh.load_state_dict(model.state_dict())
    for optimizer, sd in zip(fresh_optimizers, dicts, strict=True):
        optimizer.load_state_dict(sd)
    for a, b in zip(optimizers, fresh_optimizers, strict=True):
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for j in sa:
            assert sa[j].keys() == sb[j].keys()
            for name in sa[j]:
                x, y = torch.as_tensor(sa[j][name]), torch.as_tensor(sb[j][name])
                assert x.shape == y.shape and torch.equal(x, y), (j, name)
