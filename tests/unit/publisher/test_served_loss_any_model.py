"""The served loss of any model (publisher/served_loss.py `ModelBatches`): kept batches of the
forward's own arguments, scored by the user's `score`, filtered per batch by the rows the
served copy's lookups read."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from examples import deepfm, two_tower
from publisher.codecs import decode_rows, encode_rows
from publisher.served_loss import (
    KeptBatch,
    ModelBatches,
    ScoredBatch,
    ServedLossError,
    ServedLossMeter,
    ServedModel,
    roc_auc,
)
from publisher.store import FileStore
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.snapshot import Snapshot
from publisher.write.tracker import LookupRecorder, find_embedding_tables
from schemas.manifest import ServedLoss
from tests.support import snapshot_of

CONFIG = two_tower.TwoTowerConfig(users=60, items=40, categories=10, dim=8, hidden=8)


def _model() -> two_tower.TwoTower:
    torch.manual_seed(0)
    model = two_tower.TwoTower(CONFIG)
    with torch.no_grad():  # rows spread wider than the initial ones: quantization shows
        for table in find_embedding_tables(model).values():
            table.weight.normal_(0, 1.0)
    return model


def _batch(rows: dict[str, np.ndarray], n: int, seed: int) -> KeptBatch:
    """A batch of `n` samples looking up only `rows` (table -> row ids), one id per bag."""
    rng = np.random.default_rng(seed)

    def ids(table: str) -> torch.Tensor:
        return torch.from_numpy(rng.choice(rows[table], n).astype(np.int64))

    offsets = torch.arange(n)
    inputs = (ids("user"), ids("history"), offsets, ids("item"), ids("category"), offsets)
    labels = torch.from_numpy((rng.random(n) < 0.4).astype(np.float32))
    return KeptBatch.of(inputs, labels)


EVERY_ROW = {
    "user": np.arange(CONFIG.users),
    "history": np.arange(CONFIG.items),
    "item": np.arange(CONFIG.items),
    "category": np.arange(CONFIG.categories),
}


def _snapshot(
    model: nn.Module,
    codec: str,
    rows: dict[str, np.ndarray] | None = None,
    scored: tuple[KeptBatch, ...] = (),
) -> Snapshot:
    """A full snapshot of `model` (every row) or a delta of `rows`."""
    return snapshot_of(model, codec, CONFIG.to_json(), rows, scored)


def _publisher(tmp_path: Path, score: Any = two_tower.score) -> CheckpointPublisher:
    served = ServedModel(score, factory=two_tower.build)
    return CheckpointPublisher(
        FileStore(tmp_path), "m", measure_served_loss=True, served_model=served
    )


def _fp32_loss(model: nn.Module, batches: tuple[KeptBatch, ...]) -> tuple[float | None, float]:
    """AUC and log loss of a real fp32 model on `batches`."""
    with torch.no_grad():
        logits = torch.cat([two_tower.score(model, b.inputs) for b in batches])
    labels = torch.from_numpy(np.concatenate([b.labels for b in batches]))
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
    return roc_auc(logits.numpy(), labels.numpy()), float(loss)


def _train_rows(model: nn.Module, rows: dict[str, np.ndarray]) -> None:
    """What an interval of training does: the looked-up rows and the dense layers move."""
    with torch.no_grad():
        for name, table in find_embedding_tables(model).items():
            ids = torch.from_numpy(rows[name])
            table.weight[ids] = table.weight[ids] * 1.05 + 0.01
        for p in model.user_tower.parameters():
            p.mul_(1.02)


def test_a_batch_looking_up_a_row_the_delta_does_not_carry_is_not_scored(
    tmp_path: Path,
) -> None:
    """A kept batch reading one row the delta left out would score that row's served (int2)
    value as fp32: it is left out whole, and the fp32 side is the real fp32 model's."""
    model = _model()
    publisher = _publisher(tmp_path)
    first = publisher.publish(_snapshot(model, "int2", scored=(_batch(EVERY_ROW, 300, 1),)))
    assert first.manifest.served_loss is not None and first.manifest.served_loss.samples == 300
    rng = np.random.default_rng(3)
    touched = {
        name: np.sort(rng.choice(rows, len(rows) // 2, replace=False))
        for name, rows in EVERY_ROW.items()
    }
    _train_rows(model, touched)
    carried = _batch(touched, 400, seed=4)
    # The same samples but one: its user row was not touched, so the delta does not carry it.
    outside = int(np.setdiff1d(EVERY_ROW["user"], touched["user"])[0])
    users = carried.inputs[0].clone()
    users[7] = outside
    left_out = KeptBatch.of((users, *carried.inputs[1:]), torch.from_numpy(carried.labels))
    result = publisher.publish(_snapshot(model, "int2", touched, scored=(left_out, carried)))
    loss = result.manifest.served_loss
    assert loss is not None and loss.samples == carried.size
    auc, logloss = _fp32_loss(model, (carried,))
    assert loss.auc_fp32 == pytest.approx(auc, abs=1e-12)
    assert loss.logloss_fp32 == pytest.approx(logloss, rel=1e-6)
    assert loss.logloss_served != loss.logloss_fp32  # int2 on the served side


def test_a_full_version_scores_every_batch_and_fp32_is_served_exactly(tmp_path: Path) -> None:
    model = _model()
    publisher = _publisher(tmp_path)
    batches = (_batch(EVERY_ROW, 200, 1), _batch(EVERY_ROW, 300, 2))
    loss = publisher.publish(_snapshot(model, "fp32", scored=batches)).manifest.served_loss
    assert loss is not None and loss.samples == 500
    assert loss.auc_served == loss.auc_fp32 and loss.logloss_served == loss.logloss_fp32
    assert loss.auc_fp32 == pytest.approx(_fp32_loss(model, batches)[0], abs=1e-12)
    # int2: the served copy is the model with every row as int2 decodes it.
    loss = publisher.publish(_snapshot(model, "int2", scored=batches)).manifest.served_loss
    quantized = _model()
    with torch.no_grad():
        for table in find_embedding_tables(quantized).values():
            w = table.weight.numpy()
            w[:] = decode_rows(encode_rows("int2", w))
    assert loss is not None
    assert loss.auc_served == pytest.approx(_fp32_loss(quantized, batches)[0], abs=1e-12)


def test_a_batchs_rows_are_recorded_once_and_a_batch_not_carried_is_not_scored_again(
    tmp_path: Path,
) -> None:
    calls: list[int] = []

    def counted(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        calls.append(len(inputs[0]))
        return two_tower.score(module, inputs)

    model = _model()
    publisher = _publisher(tmp_path, counted)
    touched = {name: rows[: len(rows) // 2] for name, rows in EVERY_ROW.items()}
    inside, everywhere = _batch(touched, 100, 1), _batch(EVERY_ROW, 200, 2)
    publisher.publish(_snapshot(model, "int4", scored=(inside, everywhere)))
    # Full: each batch once for fp32 (its rows recorded meanwhile), once as served.
    assert calls == [100, 200, 100, 200]
    calls.clear()
    result = publisher.publish(_snapshot(model, "int4", touched, scored=(inside, everywhere)))
    # Delta: the batch reading rows it does not carry is known not to be carried (cached).
    assert calls == [100, 100]
    assert result.manifest.served_loss is not None
    assert result.manifest.served_loss.samples == 100


def _measure(meter: ServedLossMeter, snap: Snapshot) -> ServedLoss | None:
    fp32 = meter.score_fp32(snap.tables, snap.dense, snap.scored)
    for t in snap.tables:
        meter.apply_table(t.name, t.row_ids, decode_rows(encode_rows(t.codec, t.values)))
    return meter.measure(fp32)


def test_what_a_meter_cannot_score_is_an_error_naming_it(tmp_path: Path) -> None:
    model = _model()
    batches = (_batch(EVERY_ROW, 100, 1),)

    def pooled(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return module(*inputs).unsqueeze(1)  # (B, 1)

    meter = ServedModel(pooled, factory=two_tower.build).meter(CONFIG.to_json())
    with pytest.raises(ServedLossError, match=r"returned \(100, 1\) for a batch of 100 labels"):
        _measure(meter, _snapshot(model, "int4", scored=batches))
    # A factory building another architecture.
    other = two_tower.TwoTowerConfig(users=61, items=40, categories=10, dim=8, hidden=8)
    meter = ServedModel(two_tower.score, copy=two_tower.TwoTower(other)).meter(CONFIG.to_json())
    with pytest.raises(
        ServedLossError, match=r"table 'user' is 60x8 in the version but 61x8 in the served copy"
    ):
        _measure(meter, _snapshot(model, "int4", scored=batches))
    meter = ServedModel(two_tower.score, copy=deepfm.DeepFM(deepfm.DeepFMConfig())).meter({})
    with pytest.raises(ServedLossError, match="must build the trained architecture"):
        _measure(meter, _snapshot(model, "int4", scored=batches))
    with pytest.raises(ServedLossError, match=r"the model factory cannot build model_config"):
        ServedModel(two_tower.score, factory=two_tower.build).meter({"architecture": "dlrm"})
    # Kept batches of the other rule's kind.
    meter = ServedModel(two_tower.score, factory=two_tower.build).meter(CONFIG.to_json())
    dlrm_batch = ScoredBatch(np.zeros((2, 1), np.float32), {}, np.zeros(2, np.float32))
    with pytest.raises(ServedLossError, match="scores KeptBatches, got a ScoredBatch"):
        _measure(meter, _snapshot(model, "int4", scored=(dlrm_batch,)))


def test_without_a_served_model_a_user_model_is_not_measured_and_it_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = CheckpointPublisher(FileStore(tmp_path), "m", measure_served_loss=True)
    model, batches = _model(), (_batch(EVERY_ROW, 100, 1),)
    with caplog.at_level(logging.WARNING, logger="publisher.write.publishing"):
        for _ in range(2):
            result = publisher.publish(_snapshot(model, "int4", scored=batches))
            assert result.manifest.served_loss is None
    (warning,) = caplog.records
    assert "served loss not measured" in warning.getMessage()
    assert "score=" in warning.getMessage()


def test_a_kept_batch_owns_copies_of_any_inputs_a_kjt_included() -> None:
    config = deepfm.DeepFMConfig()
    model = deepfm.DeepFM(config).eval()
    batch = deepfm.Stream(config, batch=32).next()
    kept = KeptBatch.of(batch.inputs, batch.labels)
    features, dense = kept.inputs
    assert type(features) is type(batch.features) and features is not batch.features
    assert features.keys() == batch.features.keys()
    assert features.values().data_ptr() != batch.features.values().data_ptr()
    assert dense.data_ptr() != batch.dense.data_ptr()
    with torch.no_grad():
        expected = deepfm.score(model, batch.inputs)
        assert torch.equal(deepfm.score(model, kept.inputs), expected)
        # What crosses to a publisher process: the same inputs, the same number.
        again = pickle.loads(pickle.dumps(kept, protocol=5))
        assert again.number == kept.number
        assert torch.equal(deepfm.score(model, again.inputs), expected)
    batch.dense.add_(1.0)  # the user's buffers may change: the kept batch does not
    assert not torch.equal(dense, batch.dense)
    assert kept.labels.dtype == np.float32 and kept.size == 32


def test_the_lookup_recorder_reads_rows_in_any_grad_mode_and_any_call_form() -> None:
    config = deepfm.DeepFMConfig(users=10, items=10, tags=5)
    model = deepfm.DeepFM(config)
    bag = nn.EmbeddingBag(8, 2, mode="sum")
    features = deepfm.features(config, [3, 3, 7], [1, 2, 2], [[4], [], [0, 4]])
    recorder = LookupRecorder({**find_embedding_tables(model), "bag": bag})
    with torch.no_grad(), recorder:
        model(features, torch.zeros(3, config.dense))  # TorchRec passes `input=`
        bag(torch.tensor([[5, 1], [1, 1]]))  # 2D form
        bag(torch.tensor([6, 0]), torch.tensor([0, 1]))  # 1D with offsets
    rows = recorder.rows()
    assert rows["bags.embedding_bags.user"].tolist() == [3, 7]
    assert rows["bags.embedding_bags.item"].tolist() == [1, 2]
    assert rows["bags.embedding_bags.tags"].tolist() == [0, 4]
    assert rows["bag"].tolist() == [0, 1, 5, 6]
    # The first-order table reads every feature's ids, offset into it.
    assert rows["bags.embedding_bags.linear"].tolist() == [3, 7, 11, 12, 20, 24]
    bag(torch.tensor([[2]]))  # after the block: no hook left
    assert recorder.rows()["bag"].tolist() == [0, 1, 5, 6]
    assert not bag._forward_pre_hooks
    meter = ServedLossMeter({}, model, ModelBatches(deepfm.score))
    assert sorted(meter._weights) == sorted(find_embedding_tables(model))
