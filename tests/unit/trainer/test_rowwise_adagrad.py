"""Row-wise Adagrad and dirty-row tracking on the real DLRM: untouched rows stay bitwise equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from publisher.write.tracker import attach, check_optimizers
from trainer.online import build_dlrm, build_optimizers, train_step
from trainer.rowwise_adagrad import RowWiseAdagrad
from trainer.streams.synthetic import SyntheticConfig, SyntheticStream


def reference_step(
    weight: np.ndarray, acc: np.ndarray, grad_rows: dict[int, np.ndarray], lr: float, eps: float
) -> None:
    """The update written out per row (slow, obviously right)."""
    for row, g in grad_rows.items():
        acc[row] += np.float32(np.mean(g.astype(np.float32) ** 2))
        weight[row] -= lr * g / (np.sqrt(acc[row]) + eps)


def test_matches_per_row_reference_with_duplicate_ids() -> None:
    torch.manual_seed(0)
    emb = torch.nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
    opt = RowWiseAdagrad(emb.parameters(), lr=0.1)
    weight = emb.weight.detach().numpy().copy()
    acc = np.zeros(20, dtype=np.float32)
    for ids in ([1, 3, 3, 7], [3, 19, 0, 0]):
        values = torch.tensor(ids)
        out = emb(values, torch.tensor([0, 2]))
        (out * torch.arange(8.0).reshape(2, 4)).sum().backward()
        assert emb.weight.grad is not None
        grad = emb.weight.grad.to_dense().numpy()
        rows = {r: grad[r].copy() for r in sorted(set(ids))}
        opt.step()
        opt.zero_grad()
        reference_step(weight, acc, rows, 0.1, 1e-8)
    np.testing.assert_allclose(emb.weight.detach().numpy(), weight, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(opt.state[emb.weight]["sum"].numpy(), acc, rtol=1e-6)


def test_dense_gradient_leaves_zero_rows_bitwise_unchanged() -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3)  # dense gradient
    opt = RowWiseAdagrad(emb.parameters(), lr=0.1)
    before = emb.weight.detach().clone()
    emb(torch.tensor([2, 5])).sum().backward()
    opt.step()
    changed = (emb.weight.detach() != before).any(dim=1).nonzero().reshape(-1).tolist()
    assert changed == [2, 5]
    assert opt.state[emb.weight]["sum"].nonzero().reshape(-1).tolist() == [2, 5]


def test_rejects_bad_hyperparameters_and_shapes() -> None:
    with pytest.raises(ValueError, match="lr"):
        RowWiseAdagrad([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.0)
    with pytest.raises(ValueError, match="2-D"):
        RowWiseAdagrad([torch.nn.Parameter(torch.zeros(2))])


def test_tracker_is_sound_on_the_real_dlrm() -> None:
    """Rows not looked up are bitwise unchanged (weight and accumulator) after a step, and
    every row that changed was marked dirty."""
    stream = SyntheticStream(
        SyntheticConfig(cardinalities=(50, 400, 3000, 7, 1200), seed=3, chunk=256)
    )
    model = build_dlrm(stream.features, stream.dense_names, seed=1)
    optimizers = build_optimizers(model)
    check_optimizers(model, optimizers)  # row-wise Adagrad is trusted, Adam is dense-only
    tracked = attach(model)
    sparse_opt = optimizers[0]
    for batch in stream.batches(64, stop=64 * 6):
        weights = {n: t.weight.detach().clone() for n, t in tracked.tables.items()}
        accs = {n: sparse_opt.state[t.weight]["sum"].clone() for n, t in tracked.tables.items()}
        train_step(model, optimizers, batch)
        dirty = tracked.tracker.snapshot_and_reset()
        for name, table in tracked.tables.items():
            looked_up = np.unique(batch.sparse[name.split(".", 1)[1]].values.numpy())
            assert np.array_equal(dirty[name], looked_up), name
            changed_w = (table.weight.detach() != weights[name]).any(dim=1)
            changed_a = sparse_opt.state[table.weight]["sum"] != accs[name]
            changed = torch.nonzero(changed_w | changed_a).reshape(-1).numpy()
            assert np.isin(changed, dirty[name]).all(), f"{name}: unmarked rows changed"
            untouched = np.setdiff1d(np.arange(table.num_embeddings), dirty[name])
            idx = torch.from_numpy(untouched)
            assert torch.equal(
                table.weight.detach()[idx].view(torch.int32), weights[name][idx].view(torch.int32)
            )
            assert torch.equal(sparse_opt.state[table.weight]["sum"][idx], accs[name][idx])
            assert changed.size > 0  # the step did move the looked-up rows
    tracked.detach()
