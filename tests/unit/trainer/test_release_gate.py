"""The release gate through the checkpointer API, on a user's own model (the two-tower example)
and a real file store: every version judged on the events after it, RELEASED moved only for
versions that pass, a poisoned stretch of the stream (labels flipped) held, release resuming
once it heals, and a bad version a person released rolled back at its probation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from publisher.read.catalog import Catalog
from publisher.release import GateConfig, ReleaseLog
from publisher.store import FileStore
from schemas.release import Evaluation
from tests.example_training import BATCH, ExampleTrainer
from trainer.checkpointer import IncrementalCheckpointer

#: 16 batches of 64 per version: each window holds 1,024 examples.
INTERVAL = 16 * BATCH
#: Tighter than the defaults (measured on MovieLens, docs/RELEASE.md): the example's model is
#: weak (AUC ~0.55), so a flip moves it less; its events are independent (small blocks).
RULES = GateConfig(
    min_examples=256,
    block_examples=16,
    auc_tolerance=0.002,
    logloss_tolerance=0.005,
    drift_tolerance=0.05,
    drift_auc_tolerance=0.01,
)


class PoisonedTrainer(ExampleTrainer):
    """The example's stream with its labels flipped while `flipped` says so."""

    def __init__(self) -> None:
        super().__init__("two_tower")
        self.flipped = False
        clean = self.next_batch

        def next_batch() -> tuple[Any, torch.Tensor]:
            inputs, labels = clean()
            return inputs, 1.0 - labels if self.flipped else labels

        self.next_batch = next_batch


def _checkpointer(trainer: ExampleTrainer, store: Path, **options: Any) -> IncrementalCheckpointer:
    return trainer.checkpointer(
        f"file://{store}",
        interval_samples=INTERVAL,
        served_loss_samples=4096,
        score=trainer.score,
        codec="int8",
        gate=RULES,
        **options,
    )


def _evaluations(store: Path) -> dict[int, Evaluation]:
    log = ReleaseLog(FileStore(store), "two_tower")
    found = {}
    for version in log.evaluated_versions():
        evaluation = log.evaluation(version)
        assert evaluation is not None
        found[version] = evaluation
    return found


def _released_versions(store: Path) -> list[tuple[int, str, str]]:
    """(version, action, by) of every move of RELEASED, oldest first."""
    log = ReleaseLog(FileStore(store), "two_tower")
    return [(r.version, r.action, r.by) for r in reversed(list(log.records()))]


def test_every_version_is_judged_on_the_events_after_it(tmp_path: Path) -> None:
    trainer = PoisonedTrainer()
    with _checkpointer(trainer, tmp_path) as ckpt:
        trainer.train(8 * 16, ckpt)
    versions = Catalog(FileStore(tmp_path), "two_tower").versions()
    assert [v.version for v in versions] == list(range(1, 9))
    evaluations = _evaluations(tmp_path)
    # Each judged when the next version's snapshot brought the events after it; the last one
    # has no events after it yet.
    assert sorted(evaluations) == list(range(1, 8))
    for ref in versions[:-1]:
        e = evaluations[ref.version]
        assert e.manifest == ref.key
        assert e.window.after_samples == ref.manifest.position.samples_seen
        assert e.window.examples == INTERVAL
    assert evaluations[1].baseline is None and evaluations[1].decision == "release"
    released = _released_versions(tmp_path)
    assert released[0] == (1, "release", "gate")
    # Each release moved RELEASED to a version judged "release" against the one before.
    for version, _, _ in released:
        assert evaluations[version].decision == "release"
    for version, e in evaluations.items():
        if version > 1:
            assert e.baseline is not None and e.baseline < version
            assert e.drift is not None  # the released version's reference is known
    log = ReleaseLog(FileStore(tmp_path), "two_tower")
    current = log.released()
    assert current is not None and current.version == released[-1][0]


def test_flipped_labels_are_held_and_release_resumes_when_they_heal(tmp_path: Path) -> None:
    trainer = PoisonedTrainer()
    with _checkpointer(trainer, tmp_path) as ckpt:
        trainer.train(5 * 16, ckpt)  # v1..v5 clean
        trainer.flipped = True
        trainer.train(3 * 16, ckpt)  # v6..v8 trained on flipped labels
        trainer.flipped = False
        trainer.train(8 * 16, ckpt)  # v9.. on the healed stream
    evaluations = _evaluations(tmp_path)
    # v5's window is the first flipped interval: the released version's log loss jumps.
    for version in (5, 6, 7):
        e = evaluations[version]
        assert e.decision == "hold" and "moved away" in e.reason, (version, e.reason)
    released = [v for v, action, _ in _released_versions(tmp_path) if action == "release"]
    poisoned = {6, 7, 8}  # trained on flipped events
    assert not poisoned & set(released), released
    assert max(released) > 8, (released, {v: e.reason for v, e in evaluations.items()})


def test_a_bad_version_a_person_released_is_rolled_back_at_its_probation(
    tmp_path: Path,
) -> None:
    trainer = PoisonedTrainer()
    store = FileStore(tmp_path)
    with _checkpointer(trainer, tmp_path) as ckpt:
        trainer.train(4 * 16, ckpt)
        trainer.flipped = True
        trainer.train(2 * 16, ckpt)  # v5, v6 trained on flipped labels: held
        trainer.flipped = False
        ckpt.flush()
        log = ReleaseLog(store, "two_tower")
        good = log.released()
        assert good is not None and good.version <= 5
        bad = Catalog(store, "two_tower").find(6)
        # A person releases the poisoned v6 by hand; the gate meets it at the next version.
        log.move(bad, action="release", by="person", reason="tried by hand")
        trainer.train(3 * 16, ckpt)
    moves = _released_versions(tmp_path)
    assert (6, "release", "person") in moves
    rollback = [m for m in moves if m[1] == "rollback"]
    assert rollback and rollback[0] == (good.version, "rollback", "gate"), moves
    judged = [e for e in _evaluations(tmp_path).values() if e.probation is not None]
    assert any(e.probation is not None and e.probation.released == 6 for e in judged)
    current = ReleaseLog(store, "two_tower").released()
    assert current is not None and current.version != 6


@pytest.mark.multiprocess  # the publisher runs in a child process
def test_the_gate_judges_in_a_publisher_process_too(tmp_path: Path) -> None:
    trainer = PoisonedTrainer()
    with _checkpointer(
        trainer, tmp_path, publish_in="process", model_factory=trainer.build
    ) as ckpt:
        trainer.train(4 * 16, ckpt)
    evaluations = _evaluations(tmp_path)
    assert sorted(evaluations) == [1, 2, 3]
    assert _released_versions(tmp_path)[0] == (1, "release", "gate")


def test_the_gate_needs_the_kept_samples(tmp_path: Path) -> None:
    trainer = ExampleTrainer("two_tower")
    with pytest.raises(Exception, match="served_loss_samples > 0"):
        trainer.checkpointer(
            f"file://{tmp_path}", gate=RULES, served_loss_samples=0, score=trainer.score
        )
