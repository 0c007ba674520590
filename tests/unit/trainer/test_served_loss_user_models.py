"""Served loss and `codec="auto"` for a user's own model through the checkpointer API: the
example two-tower model (plain tables, raw ids) and DeepFM (TorchRec, a KeyedJaggedTensor),
publishing in a thread and in a process; what is refused and why; what `close()` leaves out."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from examples import two_tower
from publisher.read.catalog import Catalog
from publisher.served_loss import ServedLossError
from publisher.store import FileStore
from publisher.write.policies import ServedLossCodecRule
from tests.example_training import BATCH, EXAMPLES, ExampleTrainer
from trainer.checkpointer import CheckpointError, IncrementalCheckpointer

#: 4 intervals of 8 batches: each version's own interval is 512 samples.
STEPS, INTERVAL = 32, 8 * BATCH


def _measured_run(
    tmp_path: Path, example: str, publish_in: str, **options: Any
) -> tuple[ExampleTrainer, IncrementalCheckpointer]:
    trainer = ExampleTrainer(example)
    process = publish_in == "process"
    ckpt = trainer.checkpointer(
        f"file://{tmp_path}",
        interval_samples=INTERVAL,
        served_loss_samples=2048,
        score=trainer.score,
        # In a process the copy is built there, from the module-level factory.
        model_factory=trainer.build if process else None,
        publish_in=publish_in,
        **options,
    )
    with ckpt:
        trainer.train(STEPS, ckpt)
    return trainer, ckpt


@pytest.mark.parametrize("publish_in", ["thread", "process"])
@pytest.mark.parametrize("example", EXAMPLES)
def test_every_version_of_a_user_model_records_its_served_loss(
    tmp_path: Path, example: str, publish_in: str
) -> None:
    _, ckpt = _measured_run(tmp_path, example, publish_in, codec="int4")
    versions = Catalog(FileStore(tmp_path), example).versions()
    assert len(versions) == STEPS * BATCH // INTERVAL
    for ref in versions:
        loss = ref.manifest.served_loss
        assert loss is not None and {t.codec for t in ref.manifest.tables} == {"int4"}
        # A version scores at least its own interval's batches (every row they look up was
        # trained, so carried) and at most the window.
        assert INTERVAL <= loss.samples <= 2048
        assert abs(loss.auc_rel_loss) < 0.05
    assert [r.served_loss for r in ckpt.records] == [ref.manifest.served_loss for ref in versions]


@pytest.mark.parametrize("publish_in", ["thread", "process"])
@pytest.mark.parametrize("example", EXAMPLES)
def test_auto_commits_no_version_of_a_user_model_over_its_budget(
    tmp_path: Path, example: str, publish_in: str
) -> None:
    budget = 1e-9  # int4 and int8 lose more than this on most versions
    # The point estimate judged: these small windows cannot tell a codec's loss from noise,
    # which the default rule ("sure") would rightly take as no loss.
    rule = ServedLossCodecRule("int4", budget=budget, judge="estimate")
    _, ckpt = _measured_run(tmp_path, example, publish_in, codec="int4", codec_rule=rule)
    versions = Catalog(FileStore(tmp_path), example).versions()
    assert len(versions) == len(ckpt.records) == STEPS * BATCH // INTERVAL
    assert any(r.reencoded for r in ckpt.records)
    for record, ref in zip(ckpt.records, versions, strict=True):
        loss = ref.manifest.served_loss
        assert loss is not None and record.served_loss == loss
        codecs = {t.codec for t in ref.manifest.tables}
        assert len(codecs) == 1 and record.codec in codecs
        # Within the budget, or at the top of the ladder (fp32 is served exactly).
        assert loss.auc_rel_loss <= budget or record.codec == "fp32"
        assert all(first > budget for _, first in record.reencoded)
        assert record.codec not in {codec for codec, _ in record.reencoded}


def test_auto_measures_by_default_and_starts_from_the_bit_rules_floor(tmp_path: Path) -> None:
    trainer = ExampleTrainer("two_tower")
    ckpt = trainer.checkpointer(
        f"file://{tmp_path}", codec="auto", score=two_tower.score, expected_restores=5
    )
    with ckpt:
        assert ckpt.recent_samples.capacity == 16_384  # DEFAULT_SCORED_SAMPLES
        assert ckpt.codec_rule is not None and ckpt.codec_rule.codec == "int8"  # 5 restores
        assert set(ckpt.codecs.values()) == {"int8"}
        trainer.train(4, ckpt)
        ckpt.checkpoint_now()
        ckpt.flush()
    (ref,) = Catalog(FileStore(tmp_path), "two_tower").versions()
    assert ref.manifest.served_loss is not None and ref.manifest.served_loss.samples == 4 * BATCH


def test_the_served_copy_is_taken_before_the_tracking_hooks(tmp_path: Path) -> None:
    """DeepFM's TorchRec tables (dense gradients) are marked at each lookup: a copy of the
    model with those hooks would mark the trainer's rows whenever the publisher scores it."""
    trainer = ExampleTrainer("deepfm")
    ckpt = trainer.checkpointer(
        f"file://{tmp_path}", codec="int4", served_loss_samples=256, score=trainer.score
    )
    with ckpt:
        assert ckpt.tracked.attached
        served = ckpt._served_model
        assert served is not None and served.copy is not None
        assert served.copy is not trainer.model
        inputs, _ = trainer.next_batch()
        served.copy(*inputs)  # grad on, weights trainable: what a hooked copy would mark
        assert set(ckpt.tracked.tracker.dirty_counts().values()) == {0}
        trainer.model(*inputs)  # the trainer's own model is tracked
        assert max(ckpt.tracked.tracker.dirty_counts().values()) > 0


def test_what_cannot_be_measured_is_refused_with_what_to_do(tmp_path: Path) -> None:
    trainer = ExampleTrainer("two_tower")
    url = f"file://{tmp_path}"

    def refused(match: str, **options: Any) -> None:
        with pytest.raises(CheckpointError, match=match):
            trainer.checkpointer(url, **options)

    refused(r"needs score=fn\(module, inputs\)", served_loss_samples=64)
    refused(r"needs score=", codec="auto")
    refused(
        r"give served_loss_samples > 0", codec="auto", score=trainer.score, served_loss_samples=0
    )
    refused(r"choose codec='auto''s codecs", codec="int4", served_loss_budget=1e-3)
    refused(r"choose codec='auto''s codecs", codec="int8", expected_restores=4)
    refused(r"served_loss_samples must be >= 0", served_loss_samples=-1)

    def local_score(module: nn.Module, inputs: Any) -> torch.Tensor:
        out: torch.Tensor = module(*inputs)
        return out

    process = {"publish_in": "process", "served_loss_samples": 64}
    refused(r"give model_factory=", score=two_tower.score, **process)
    refused(
        r"score <function .*<lambda> at .* is a lambda; give a module-level function",
        score=lambda m, x: m(*x),
        model_factory=two_tower.build,
        **process,
    )
    refused(
        r"score .*local_score.* is defined inside another function",
        score=local_score,
        model_factory=two_tower.build,
        **process,
    )

    smaller = two_tower.TwoTowerConfig(users=10, items=200, categories=12)
    refused(
        r"model_factory built tables .* must build the trained architecture",
        score=two_tower.score,
        served_loss_samples=64,
        model_factory=lambda _: two_tower.TwoTower(smaller),
    )
    refused(
        r"sharing parameters with the trained model",
        score=two_tower.score,
        served_loss_samples=64,
        model_factory=lambda _: trainer.model,
    )
    # Not measuring, nothing is asked of the model.
    trainer.checkpointer(url, codec="int4").close()


def test_a_score_that_returns_no_logits_stops_publishing_with_its_shape(tmp_path: Path) -> None:
    trainer = ExampleTrainer("two_tower")

    def pooled(module: nn.Module, inputs: Any) -> torch.Tensor:
        return module(*inputs).unsqueeze(1).expand(-1, 2)  # (B, 2): not logits

    ckpt = trainer.checkpointer(
        f"file://{tmp_path}", codec="int4", served_loss_samples=256, score=pooled
    )
    trainer.train(2, ckpt)
    ckpt.checkpoint_now()
    with pytest.raises(ServedLossError, match=r"returned \(64, 2\) for a batch of 64 labels"):
        ckpt.flush()
    ckpt.close(flush=False)


def test_a_dlrm_kept_batch_is_its_forwards_arguments(tmp_path: Path) -> None:
    from publisher.dlrm import DLRM, DLRMConfig, SparseBatch, SparseFeature

    model = DLRM(DLRMConfig(sparse=(SparseFeature("user", 20),), dense=("x",), embedding_dim=4))
    ckpt = IncrementalCheckpointer(
        model,
        [torch.optim.SGD(model.parameters(), lr=0.1)],
        store=f"file://{tmp_path}",
        model_name="dlrm",
        served_loss_samples=64,
    )
    with ckpt:
        ids = SparseBatch(torch.arange(8), torch.arange(8))
        ckpt.keep_scored((torch.zeros(8, 1), {"user": ids}), torch.zeros(8))
        assert len(ckpt.recent_samples) == 8
        with pytest.raises(CheckpointError, match=r"\(dense, sparse\)"):
            ckpt.keep_scored(torch.zeros(8, 1), torch.zeros(8))


def test_close_says_what_it_does_not_publish(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = ExampleTrainer("deepfm")
    ckpt = trainer.checkpointer(f"file://{tmp_path}", codec="int4", interval_samples=INTERVAL)
    trainer.train(8 + 3, ckpt)  # one interval, then 3 steps
    with caplog.at_level(logging.WARNING, logger="trainer.checkpointer"):
        ckpt.close()
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = warning.getMessage()
    assert "3 step(s) (192 samples) trained since the last checkpoint" in text
    assert "not published" in text and "checkpoint_now(reader) before close()" in text
    assert [
        v.manifest.position.samples_seen for v in Catalog(FileStore(tmp_path), "deepfm").versions()
    ] == [INTERVAL]

    # checkpoint_now before close publishes them, and close has nothing to say.
    caplog.clear()
    trainer = ExampleTrainer("deepfm")
    ckpt = trainer.checkpointer(f"file://{tmp_path}/b", codec="int4", interval_samples=INTERVAL)
    trainer.train(8 + 3, ckpt)
    ckpt.checkpoint_now(reader={"offset": ckpt.samples_seen})
    with caplog.at_level(logging.WARNING, logger="trainer.checkpointer"):
        ckpt.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    latest = Catalog(FileStore(tmp_path / "b"), "deepfm").versions()[-1]
    assert latest.manifest.position.samples_seen == (8 + 3) * BATCH
