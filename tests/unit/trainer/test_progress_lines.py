"""Without a terminal the trainer writes a progress line every PROGRESS_EVERY_S seconds, also
while it waits for events; with one, its bar moves and no line is written. The clock is driven
by the test: nothing sleeps."""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from tqdm import tqdm

from publisher.store import FileStore
from schemas.events import BadEventCounts
from trainer.checkpointer import IncrementalCheckpointer
from trainer.online import build_dlrm, build_optimizers, train_online
from trainer.progress import PROGRESS_EVERY_S, TrainingProgress
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.streams.base import Batch
from trainer.streams.kafka_events import KafkaEventStream
from trainer.streams.synthetic import SyntheticConfig, SyntheticStream


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Checkpoints:
    """The figures progress reads from the checkpointer."""

    def __init__(self) -> None:
        self.versions_committed = 0
        self.last_version: int | None = None
        self.bytes_written = 0


class Live:
    """The figures a progress line reads from a live stream."""

    def __init__(self) -> None:
        self.lag = 0
        self.bad = BadEventCounts()
        self.id_maps: dict[str, Any] = {}


class Sized:
    def __init__(self, size: int) -> None:
        self.size = size


def progress(clock: Clock, lines: list[str], *, live: Live | None = None, **kw: Any) -> Any:
    return TrainingProgress(
        "events",
        cast(IncrementalCheckpointer, Checkpoints()),
        cast(KafkaEventStream, live),
        clock=clock,
        write=lines.append,
        **kw,
    )


def scored() -> ProgressiveMetrics:
    metrics = ProgressiveMetrics()
    metrics.update(torch.tensor([2.0, -2.0, 1.0, -1.0]), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    return metrics


def test_a_line_every_interval_with_the_rate_of_that_interval() -> None:
    clock, lines = Clock(), []
    p = progress(clock, lines)
    metrics = scored()
    for _ in range(4):
        clock.now += 2.0
        p.on_batch(cast(Batch, Sized(512)), metrics)
    assert lines == []  # 8 s: not yet
    p.ckpt.versions_committed, p.ckpt.last_version = 2, 7
    clock.now += 2.0
    p.on_batch(cast(Batch, Sized(512)), metrics)  # 10 s, 2,560 samples
    assert lines == [
        "events: 2,560 samples (256 samples/s), 2 versions (last v7), AUC 1.0000 since start"
    ]
    clock.now += 5.0
    p.on_batch(cast(Batch, Sized(1000)), metrics)
    assert len(lines) == 1  # the next one is due 10 s after the last
    clock.now += 5.0
    p.on_batch(cast(Batch, Sized(1000)), metrics)
    assert lines[1].startswith("events: 4,560 samples (200 samples/s)")


def test_a_waiting_trainer_says_so_every_interval() -> None:
    clock, lines, live = Clock(), [], Live()
    p = progress(clock, lines, live=live)
    live.lag, live.bad = 0, BadEventCounts({"not_json": 3})
    for _ in range(int(PROGRESS_EVERY_S / 0.25) * 3):  # 30 s of polls of 0.25 s, no event
        clock.now += 0.25
        p.on_wait()
    assert len(lines) == 3
    assert lines[0] == (
        "events: waiting for events (10 s); 0 samples (0 samples/s), 0 versions, lag 0, "
        "bad events 3"
    )
    assert lines[2].startswith("events: waiting for events (30 s); ")
    clock.now += PROGRESS_EVERY_S
    p.on_batch(cast(Batch, Sized(64)), scored())  # events again: no longer waiting
    assert "waiting" not in lines[3] and lines[3].startswith("events: 64 samples")


def test_on_a_terminal_the_bar_moves_and_no_line_is_written() -> None:
    clock, lines = Clock(), []
    with tqdm(file=io.StringIO()) as bar:
        p = progress(clock, lines, bar=bar)
        for _ in range(3):
            clock.now += PROGRESS_EVERY_S
            p.on_batch(cast(Batch, Sized(100)), scored())
            clock.now += 7.0
            p.on_wait()
        assert bar.n == 300 and bar.postfix == "waiting for events (7 s)"
        clock.now += 1.0
        p.on_batch(cast(Batch, Sized(100)), scored())
        assert bar.postfix is not None and bar.postfix.startswith("auc=")
    assert lines == []


class PausingStream(SyntheticStream):
    """Yields `n` batches, then polls `polls` times in vain (calling `on_idle`, as a live stream
    does every POLL_S), the test's clock moving `poll_s` each time."""

    def __init__(self, n: int, polls: int, clock: Clock, poll_s: float) -> None:
        super().__init__(SyntheticConfig(cardinalities=(30, 200, 5), seed=1, chunk=256))
        self.n, self.polls, self.clock, self.poll_s = n, polls, clock, poll_s

    def batches(self, batch_size: int, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        for i, batch in enumerate(super().batches(batch_size, start, stop)):
            if i == self.n:
                break
            yield batch
        for _ in range(self.polls):
            self.clock.now += self.poll_s
            if self.on_idle is not None:
                self.on_idle()


def test_the_training_loop_reports_its_waits(tmp_path: Path) -> None:
    clock, lines = Clock(), []
    stream = PausingStream(n=2, polls=60, clock=clock, poll_s=0.25)
    model = build_dlrm(stream.features, stream.dense_names, seed=0)
    optimizers = build_optimizers(model)
    with IncrementalCheckpointer(
        model, optimizers, store=FileStore(tmp_path), model_name="m", codec="fp32"
    ) as ckpt:
        p = TrainingProgress("m", ckpt, clock=clock, write=lines.append)
        train_online(
            model,
            optimizers,
            stream,
            batch_size=64,
            checkpointer=ckpt,
            on_batch=p.on_batch,
            on_wait=p.on_wait,
        )
    # 15 s of waiting after the 2 batches: one line, which says so.
    assert len(lines) == 1 and lines[0].startswith("m: waiting for events (10 s); 128 samples")
