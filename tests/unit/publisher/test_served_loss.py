"""The served loss each version records (docs/FORMAT.md 3.2) and `--codec auto`'s use of it."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from publisher.codecs import decode_rows, encode_rows
from publisher.dlrm import DLRM, DLRMConfig, SparseFeature, table_weight_names
from publisher.paired_quality import delong_auc_diff
from publisher.read.catalog import Catalog
from publisher.served_loss import (
    DLRMBatches,
    MeterOrderError,
    ScoredBatch,
    ServedLossMeter,
    roc_auc,
    rows_carried,
)
from publisher.store import FileStore
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.policies import ServedLossCodecRule
from publisher.write.snapshot import Snapshot
from schemas.manifest import ServedLoss
from tests.support import snapshot_of

CONFIG = DLRMConfig(
    sparse=(SparseFeature("user", 60), SparseFeature("item", 40)),
    dense=("x",),
    embedding_dim=8,
    bottom_mlp=(8,),
    top_mlp=(8,),
)


def _model() -> DLRM:
    torch.manual_seed(0)
    model = DLRM(CONFIG)
    with torch.no_grad():  # rows spread wider than the initial ones: quantization shows
        for emb in model.embeddings.values():
            assert isinstance(emb, torch.nn.EmbeddingBag)
            emb.weight.normal_(0, 1.0)
    return model


def _samples(n: int = 2000, batch: int = 500, seed: int = 1) -> tuple[ScoredBatch, ...]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n // batch):
        sparse = {
            f.name: (rng.integers(0, f.rows, batch), np.arange(batch, dtype=np.int64))
            for f in CONFIG.sparse
        }
        out.append(
            ScoredBatch(
                dense=rng.normal(size=(batch, 1)).astype(np.float32),
                sparse=sparse,
                labels=(rng.random(batch) < 0.4).astype(np.float32),
            )
        )
    return tuple(out)


def _snapshot(
    model: DLRM,
    codec: str,
    rows: dict[str, np.ndarray] | None = None,
    scored: tuple[ScoredBatch, ...] = (),
) -> Snapshot:
    """A full snapshot of `model` (every row) or a delta of `rows`."""
    return snapshot_of(model, codec, CONFIG.to_json(), rows, scored)


def _score(model: DLRM, samples: tuple[ScoredBatch, ...]) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([model(*b.inputs()) for b in samples]).numpy()


def _measure(meter: ServedLossMeter, snap: Snapshot) -> ServedLoss | None:
    """One version through the meter, as `CheckpointPublisher.publish` drives it."""
    fp32 = meter.score_fp32(snap.tables, snap.dense, snap.scored)
    for t in snap.tables:
        meter.apply_table(t.name, t.row_ids, decode_rows(encode_rows(t.codec, t.values)))
    return meter.measure(fp32)


def _samples_of(rows: dict[str, np.ndarray], n: int, seed: int) -> ScoredBatch:
    """One batch of `n` samples looking up only `rows` (feature name -> row ids)."""
    rng = np.random.default_rng(seed)
    return ScoredBatch(
        dense=rng.normal(size=(n, 1)).astype(np.float32),
        sparse={
            f.name: (rng.choice(rows[f"embeddings.{f.name}"], n), np.arange(n, dtype=np.int64))
            for f in CONFIG.sparse
        },
        labels=(rng.random(n) < 0.4).astype(np.float32),
    )


def _fp32_loss(model: DLRM, samples: tuple[ScoredBatch, ...]) -> tuple[float | None, float]:
    """AUC and log loss of a real fp32 model on `samples`."""
    logits = _score(model, samples)
    labels = np.concatenate([b.labels for b in samples])
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.from_numpy(logits), torch.from_numpy(labels)
    )
    return roc_auc(logits, labels), float(loss)


def _train_rows(model: DLRM, rows: dict[str, np.ndarray]) -> None:
    """What an interval of training does: the looked-up rows and the dense layers move."""
    with torch.no_grad():
        for name, emb in model.embeddings.items():
            assert isinstance(emb, torch.nn.EmbeddingBag)
            ids = torch.from_numpy(rows[f"embeddings.{name}"])
            emb.weight[ids] = emb.weight[ids] * 1.05 + 0.01
        for p in model.top.parameters():
            p.mul_(1.02)


def test_roc_auc_counts_every_pair_and_ties_one_half() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 60).astype(np.float64)  # many ties
    labels = (rng.random(60) < 0.5).astype(np.float32)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = [1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)]
    assert roc_auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    assert roc_auc(scores, np.zeros(60, dtype=np.float32)) is None


def test_fp32_is_served_exactly_and_a_codec_loss_is_the_decoded_models() -> None:
    model, samples = _model(), _samples()
    labels = np.concatenate([b.labels for b in samples])
    meter = ServedLossMeter(CONFIG.to_json())
    for codec in ("fp32", "int2"):
        loss = _measure(meter, _snapshot(model, codec, scored=samples))
        assert loss is not None and loss.samples == 2000
        assert loss.positives == int(labels.sum())  # what the AUCs rest on
        assert loss.auc_fp32 == pytest.approx(roc_auc(_score(model, samples), labels))
        # the paired DeLong interval of the loss, on the same samples
        paired = delong_auc_diff(labels, _score(model, samples), _served_scores(codec, samples))
        assert paired is not None
        assert loss.auc_loss_low == pytest.approx(paired[2].low, abs=1e-9)
        assert loss.auc_loss_high == pytest.approx(paired[2].high, abs=1e-9)
        if codec == "fp32":
            assert loss.auc_served == loss.auc_fp32 and loss.logloss_served == loss.logloss_fp32
            assert loss.auc_loss_low == loss.auc_loss_high == 0.0
            continue
        # The served copy is the model with every row as int2 decodes it.
        quantized = _model()
        with torch.no_grad():
            for emb in quantized.embeddings.values():
                assert isinstance(emb, torch.nn.EmbeddingBag)
                w = emb.weight.numpy()
                w[:] = decode_rows(encode_rows("int2", w))
        assert loss.auc_served == pytest.approx(roc_auc(_score(quantized, samples), labels))
        assert loss.logloss_served != loss.logloss_fp32


def _served_scores(codec: str, samples: tuple[ScoredBatch, ...]) -> np.ndarray:
    """What the model with every row as `codec` decodes it scores on `samples`."""
    quantized = _model()
    with torch.no_grad():
        for emb in quantized.embeddings.values():
            assert isinstance(emb, torch.nn.EmbeddingBag)
            w = emb.weight.numpy()
            w[:] = decode_rows(encode_rows(codec, w))
    return _score(quantized, samples)


def test_nothing_is_measured_before_a_full_version_or_without_samples() -> None:
    model, samples = _model(), _samples()
    meter = ServedLossMeter(CONFIG.to_json())
    some = {"embeddings.user": np.arange(5), "embeddings.item": np.arange(3)}
    # Rows of the tables never written yet, then a full version without samples.
    assert _measure(meter, _snapshot(model, "int8", some, scored=samples)) is None
    assert _measure(meter, _snapshot(model, "int8")) is None
    assert _measure(meter, _snapshot(model, "int8", some, scored=samples)) is not None
    assert ServedLossMeter.for_config({"architecture": "custom"}) is None


def test_each_manifest_records_the_chain_as_served(tmp_path: Path) -> None:
    """A delta's rows carry its codec; the rows it did not carry keep the full's."""
    model, samples = _model(), _samples()
    store = FileStore(tmp_path)
    publisher = CheckpointPublisher(store, "m", measure_served_loss=True)
    publisher.publish(_snapshot(model, "int2", scored=samples))
    touched = {"embeddings.user": np.arange(0, 60, 2), "embeddings.item": np.arange(10)}
    with torch.no_grad():
        for emb in model.embeddings.values():
            assert isinstance(emb, torch.nn.EmbeddingBag)
            emb.weight.mul_(1.01)  # every row moves; only `touched` are written
    publisher.publish(_snapshot(model, "fp32", touched, scored=samples))
    meter = publisher.served._meter
    assert meter is not None
    for table, key in table_weight_names(model).items():
        served = meter.served.state_dict()[key].numpy()
        now = model.state_dict()[key].numpy()
        rows = touched[table]
        others = np.setdiff1d(np.arange(len(now)), rows)
        assert np.array_equal(served[rows], now[rows])
        before = now[others] / np.float32(1.01)
        expected = decode_rows(encode_rows("int2", before))
        assert np.allclose(served[others], expected, atol=1e-5)
    versions = [ref.manifest for ref in Catalog(store, "m").versions()]
    assert [m.served_loss is not None for m in versions] == [True, True]
    # The full scores every sample; the delta those whose rows it carries.
    carried = sum(
        int(
            (
                np.isin(b.sparse["user"][0], touched["embeddings.user"])
                & np.isin(b.sparse["item"][0], touched["embeddings.item"])
            ).sum()
        )
        for b in samples
    )
    assert [m.served_loss.samples for m in versions if m.served_loss is not None] == [
        2000,
        carried,
    ]


def test_a_publisher_without_measurement_writes_none(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    CheckpointPublisher(store, "m").publish(_snapshot(_model(), "int8", scored=_samples()))
    (ref,) = Catalog(store, "m").versions()
    assert ref.manifest.served_loss is None


def test_the_codec_rule_picks_each_versions_codec_from_the_last_measurement(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path)
    rule = ServedLossCodecRule("int4", budget=1.0, patience=1)
    publisher = CheckpointPublisher(store, "m", measure_served_loss=True, codec_rule=rule)
    model, samples = _model(), _samples()
    publisher.publish(_snapshot(model, "int2", scored=samples))  # the snapshot's codec yields
    (first,) = Catalog(store, "m").versions()
    assert {t.codec for t in first.manifest.tables} == {"int4"}
    rule.observe(2.0)  # over budget: the next version gets more bits
    assert rule.codec == "int8"
    some = {"embeddings.user": np.arange(10), "embeddings.item": np.arange(10)}
    publisher.publish(_snapshot(model, "int2", some, scored=samples))
    second = Catalog(store, "m").versions()[-1]
    assert {t.codec for t in second.manifest.tables} == {"int8"}
    # |loss| is far within half of a budget of 1.0: one calm version steps back down.
    assert second.manifest.served_loss is not None
    assert rule.codec == "int4"
    publisher.publish(_snapshot(model, "int2", some, scored=samples))
    third = Catalog(store, "m").versions()[-1]
    assert {t.codec for t in third.manifest.tables} == {"int4"}


def test_a_full_version_starts_from_the_floor_and_climbs_only_while_over_budget(
    tmp_path: Path,
) -> None:
    """A baseline gets the fewest bits that measure within the budget, not the rule's codec."""
    model, samples = _model(), _samples(seed=3)  # int4 and int8 over 0.01% here, fp16 within
    rule = ServedLossCodecRule("int4", judge="estimate")
    publisher = CheckpointPublisher(
        FileStore(tmp_path), "m", measure_served_loss=True, codec_rule=rule
    )
    for _ in range(3):
        rule.observe(1.0)  # noisy deltas left the rule at the top
    assert rule.codec == "fp32"
    result = publisher.publish(_snapshot(model, "int4", scored=samples))
    assert [codec for codec, _ in result.reencoded] == ["int4", "int8"]
    assert {t.codec for t in result.manifest.tables} == {"fp16"}
    # Tried below the rule's codec, the failures did not move it; the calm commit counts.
    assert rule.codec == "fp32"
    calm = _model()
    with torch.no_grad():
        for emb in calm.embeddings.values():
            assert isinstance(emb, torch.nn.EmbeddingBag)
            emb.weight.mul_(0.01)  # rows so narrow int4 loses nothing measurable
    result = publisher.publish(_snapshot(calm, "fp32", scored=samples))
    assert result.reencoded == ()
    assert {t.codec for t in result.manifest.tables} == {"int4"}


def test_a_version_over_the_budget_is_encoded_again_with_more_bits_before_its_commit(
    tmp_path: Path,
) -> None:
    """--codec auto commits no version over its budget while more bits can help."""
    model, samples = _model(), _samples(seed=3)
    # What each codec loses on these samples, each measured alone: int4 and int8 over the
    # default budget (0.01%), fp16 within it.
    alone = {
        codec: _measure(ServedLossMeter(CONFIG.to_json()), _snapshot(model, codec, scored=samples))
        for codec in ("int4", "int8", "fp16")
    }
    losses = {codec: loss.auc_rel_loss for codec, loss in alone.items() if loss is not None}
    # Judged by the point estimate: on these random samples no loss is beyond their noise
    # (the default, "sure", would keep int4: docs/SERVED_LOSS.md).
    rule = ServedLossCodecRule("int4", judge="estimate")
    assert losses["int4"] > rule.budget and losses["int8"] > rule.budget >= losses["fp16"]
    store = FileStore(tmp_path)
    publisher = CheckpointPublisher(store, "m", measure_served_loss=True, codec_rule=rule)
    result = publisher.publish(_snapshot(model, "int4", scored=samples))
    assert result.reencoded == (("int4", losses["int4"]), ("int8", losses["int8"]))
    (only,) = Catalog(store, "m").versions()  # the rejected encodings wrote nothing
    assert {t.codec for t in only.manifest.tables} == {"fp16"}
    assert only.manifest.served_loss is not None
    assert only.manifest.served_loss.auc_rel_loss == losses["fp16"]
    assert rule.codec == "fp16"  # the next version starts where this one ended
    # A delta: its few scored samples move by a whole pair at a time, so it may take more
    # bits still; whatever it took, it commits within the budget.
    touched = {"embeddings.user": np.arange(0, 60, 3), "embeddings.item": np.arange(0, 40, 3)}
    delta = publisher.publish(_snapshot(model, "int4", touched, scored=samples))
    assert all(loss > rule.budget for _, loss in delta.reencoded)
    assert delta.manifest.served_loss is not None
    assert delta.manifest.served_loss.auc_rel_loss <= rule.budget


def test_a_loss_within_the_samples_noise_adds_no_bits(tmp_path: Path) -> None:
    """By default the rule judges the loss's sure part (its interval's low end): int4's loss on
    these random samples is over the budget as a point estimate but its interval holds 0."""
    model, samples = _model(), _samples(seed=3)
    alone = _measure(ServedLossMeter(CONFIG.to_json()), _snapshot(model, "int4", scored=samples))
    assert alone is not None and alone.auc_rel_loss > 1e-4 and alone.sure_auc_rel_loss <= 0
    rule = ServedLossCodecRule("int4")
    publisher = CheckpointPublisher(
        FileStore(tmp_path), "m", measure_served_loss=True, codec_rule=rule
    )
    result = publisher.publish(_snapshot(model, "int4", scored=samples))
    assert result.reencoded == () and {t.codec for t in result.manifest.tables} == {"int4"}
    assert rule.codec == "int4"


def test_at_the_top_of_the_ladder_a_version_commits_as_measured(tmp_path: Path) -> None:
    rule = ServedLossCodecRule("fp32", budget=1e-9)
    assert rule.step_up_now(1.0) is None  # no more bits to give
    store = FileStore(tmp_path)
    publisher = CheckpointPublisher(store, "m", measure_served_loss=True, codec_rule=rule)
    result = publisher.publish(_snapshot(_model(), "int4", scored=_samples(seed=3)))
    assert result.reencoded == ()
    assert result.manifest.served_loss is not None
    assert result.manifest.served_loss.auc_rel_loss == 0.0  # fp32 is served exactly


def test_the_fp32_side_is_the_trainers_model_on_the_current_intervals_samples(
    tmp_path: Path,
) -> None:
    """One served copy: the delta's fp32 rows overlaid on it score as the real fp32 model."""
    model = _model()
    publisher = CheckpointPublisher(FileStore(tmp_path), "m", measure_served_loss=True)
    publisher.publish(_snapshot(model, "int2", scored=_samples()))
    rng = np.random.default_rng(3)
    touched = {
        "embeddings.user": np.sort(rng.choice(60, 20, replace=False)),
        "embeddings.item": np.sort(rng.choice(40, 15, replace=False)),
    }
    current = tuple(_samples_of(touched, 400, seed) for seed in (4, 5))
    _train_rows(model, touched)
    result = publisher.publish(_snapshot(model, "int2", touched, scored=current))
    loss = result.manifest.served_loss
    assert loss is not None and loss.samples == 800  # every sample of the interval counts
    auc, logloss = _fp32_loss(model, current)
    assert loss.auc_fp32 == pytest.approx(auc, abs=1e-12)
    assert loss.logloss_fp32 == pytest.approx(logloss, rel=1e-6)
    assert loss.logloss_served != loss.logloss_fp32  # int2 on the served side


def test_samples_looking_up_rows_the_version_does_not_carry_are_not_scored() -> None:
    """Older samples whose rows the delta left out would score their served (int2) values as
    fp32: they are left out, and the fp32 side stays the real fp32 model's."""
    model = _model()
    meter = ServedLossMeter(CONFIG.to_json())
    assert _measure(meter, _snapshot(model, "int2", scored=_samples())) is not None
    touched = {"embeddings.user": np.arange(0, 60, 2), "embeddings.item": np.arange(0, 40, 2)}
    older = _samples(seed=6)  # rows of every kind: about a quarter are carried
    _train_rows(model, touched)
    current = (_samples_of(touched, 300, seed=7),)
    loss = _measure(meter, _snapshot(model, "int2", touched, scored=older + current))
    kept = rows_carried(
        older + current,
        {
            "user": np.arange(60) % 2 == 0,
            "item": np.arange(40) % 2 == 0,
        },
    )
    even = [
        (b.sparse["user"][0] % 2 == 0) & (b.sparse["item"][0] % 2 == 0) for b in older + current
    ]
    assert loss is not None and loss.samples == sum(int(e.sum()) for e in even)
    assert 300 < loss.samples < 2300
    labels = np.concatenate([b.labels[e] for b, e in zip(older + current, even, strict=True)])
    assert np.array_equal(np.concatenate([b.labels for b in kept]), labels)
    # Every row moved since the int2 full (rows 2k moved again), so a sample scored on served
    # values of rows outside the delta could not match the real fp32 model.
    auc, logloss = _fp32_loss(model, kept)
    assert loss.auc_fp32 == pytest.approx(auc, abs=1e-12)
    assert loss.logloss_fp32 == pytest.approx(logloss, rel=1e-6)


def test_a_selection_keeps_whole_bags_of_any_length() -> None:
    batch = ScoredBatch(
        dense=np.arange(4, dtype=np.float32).reshape(4, 1),
        sparse={"f": (np.array([1, 2, 3, 4, 5], dtype=np.int64), np.array([0, 2, 2, 3]))},
        labels=np.array([0, 1, 0, 1], dtype=np.float32),
    )
    # bags: [1, 2], [], [3], [4, 5]; row 2 and row 4 not carried
    (kept,) = rows_carried([batch], {"f": np.array([1, 1, 0, 1, 0, 1], dtype=bool)})
    assert kept.dense[:, 0].tolist() == [1.0, 2.0]
    assert kept.sparse["f"][0].tolist() == [3] and kept.sparse["f"][1].tolist() == [0, 0]
    (empty_bag,) = rows_carried([batch], {"f": np.zeros(6, dtype=bool)})
    assert empty_bag.dense[:, 0].tolist() == [1.0] and empty_bag.sparse["f"][0].size == 0
    assert rows_carried([batch], {"f": np.ones(6, dtype=bool)}) == (batch,)  # no copy


def test_a_version_left_half_applied_is_never_measured_on_fp32_rows() -> None:
    """Between `score_fp32` and the last `apply_table` the served copy holds fp32 rows: measuring
    then is refused, and a version that failed there leaves its tables unknown until the next
    full one."""
    model, samples = _model(), _samples()
    meter = ServedLossMeter(CONFIG.to_json())
    full = _snapshot(model, "int2", scored=samples)
    some = {"embeddings.user": np.arange(0, 60, 2), "embeddings.item": np.arange(0, 40, 2)}
    delta = _snapshot(model, "int2", some, scored=samples)
    assert _measure(meter, full) is not None and _measure(meter, delta) is not None
    fp32 = meter.score_fp32(delta.tables, delta.dense, delta.scored)
    with pytest.raises(MeterOrderError, match=r"embeddings\.user"):
        meter.measure(fp32)
    assert _measure(meter, delta) is None
    assert _measure(meter, full) is not None and _measure(meter, delta) is not None


def test_batches_scored_in_chunks_score_as_one_by_one() -> None:
    model, samples = _model(), _samples(n=2000, batch=300, seed=4)
    with torch.no_grad():
        alone = torch.cat([model(*b.inputs()) for b in samples])
        chunked = DLRMBatches().score(model, samples)
    torch.testing.assert_close(chunked, alone)
    one = ScoredBatch.concat(samples)
    assert one.size == 1800 and np.array_equal(
        one.labels, np.concatenate([b.labels for b in samples])
    )
