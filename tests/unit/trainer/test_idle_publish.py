"""A live stream that goes quiet: what was trained is published once the interval passes,
without waiting for the next event (or a new id would not be served until traffic resumes)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from publisher.read.catalog import Catalog
from publisher.store import FileStore
from trainer.checkpointer import IncrementalCheckpointer
from trainer.online import build_dlrm, build_optimizers, train_online
from trainer.streams.base import Batch
from trainer.streams.synthetic import SyntheticConfig, SyntheticStream


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


class QuietAfter(SyntheticStream):
    """Yields `n` batches, then waits (calling `on_idle` as a live stream does) for `idle_s`."""

    def __init__(self, n: int, idle_s: float) -> None:
        super().__init__(SyntheticConfig(cardinalities=(30, 200, 5), seed=1, chunk=256))
        self.n, self.idle_s = n, idle_s
        self.idle_calls = 0

    def batches(self, batch_size: int, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        for i, batch in enumerate(super().batches(batch_size, start, stop)):
            if i == self.n:
                break
            yield batch
        deadline = time.monotonic() + self.idle_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if self.on_idle is not None:
                self.idle_calls += 1
                self.on_idle()


def test_a_quiet_stream_publishes_what_was_trained_when_the_interval_passes(
    tmp_path: Path,
) -> None:
    stream = QuietAfter(n=3, idle_s=1.5)
    model = build_dlrm(stream.features, stream.dense_names, seed=0)
    optimizers = build_optimizers(model)
    store = FileStore(tmp_path)
    with IncrementalCheckpointer(
        model, optimizers, store=store, model_name="quiet", interval_seconds=0.5, codec="fp32"
    ) as ckpt:
        report = train_online(
            model, optimizers, stream, batch_size=64, checkpointer=ckpt, final_checkpoint=False
        )
    assert stream.idle_calls > 0 and stream.on_idle is None  # the loop unhooks itself
    versions = Catalog(store, "quiet").versions()
    # The 3 batches (192 samples) were published while the stream was quiet, once: idling
    # on with nothing new trained publishes nothing more.
    assert [v.manifest.position.samples_seen for v in versions] == [report.samples] == [192]


def test_idle_publishes_nothing_before_anything_is_trained(tmp_path: Path) -> None:
    stream = QuietAfter(n=0, idle_s=1.0)
    model = build_dlrm(stream.features, stream.dense_names, seed=0)
    optimizers = build_optimizers(model)
    store = FileStore(tmp_path)
    with IncrementalCheckpointer(
        model, optimizers, store=store, model_name="quiet", interval_seconds=0.2, codec="fp32"
    ) as ckpt:
        train_online(model, optimizers, stream, batch_size=64, checkpointer=ckpt)
    assert stream.idle_calls > 0
    assert Catalog(store, "quiet").versions() == []
