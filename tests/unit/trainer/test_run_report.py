"""What a person reads about a run: a resume says where it goes on (the version and the reader's
offsets), and the summary of a run that trained nothing reads as such, with no "None ms" in it;
the progressive metrics say they are this process's."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.manifest import Position, RankPosition
from trainer.checkpointer import IncrementalCheckpointer
from trainer.cli import main
from trainer.online import TrainingReport, build_dlrm, build_optimizers, train_online
from trainer.report_text import summary_lines
from trainer.resume import resumed_text
from trainer.streams.synthetic import SyntheticConfig, SyntheticStream

SYNTHETIC = [
    *("--data", "synthetic", "--table-cap", "400", "--embedding-dim", "8"),
    *("--batch-size", "256", "--interval-samples", "2000", "--codec", "int8"),
    "--no-progress",
]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


def test_the_resume_line_names_the_version_and_where_the_reader_goes_on() -> None:
    kafka = {"source": "kafka", "topic": "events", "offsets": {"0": 1204, "1": 99812}}
    assert resumed_text(7, Position(step=40, samples_seen=20480, reader=kafka)) == (
        "resumed from v7 at offsets 0:1,204 1:99,812 of topic 'events' (step 40, 20,480 samples)"
    )
    replay = {"source": "synthetic", "offset": 5120, "fingerprint": "f"}
    assert resumed_text(3, Position(step=20, samples_seen=5120, reader=replay)) == (
        "resumed from v3 at sample 5,120 of 'synthetic' (step 20, 5,120 samples)"
    )
    ranks = (
        RankPosition(rank=0, samples_seen=10, reader={"offsets": {"0": 10}, "topic": "t"}),
        RankPosition(rank=1, samples_seen=12, reader={"offsets": {"1": 12}, "topic": "t"}),
    )
    job = resumed_text(2, Position(step=1, samples_seen=22, ranks=ranks))
    assert "rank 0 at offsets 0:10 of topic 't'; rank 1 at offsets 1:12 of topic 't'" in job


def test_train_resume_logs_where_it_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = ["--store", f"file://{tmp_path}"]
    assert main(["train", *SYNTHETIC, *store, "--max-samples", "4096", "--json"]) == 0
    caplog.set_level(logging.INFO, logger="trainer.resume")
    caplog.clear()
    assert main(["train", *SYNTHETIC, *store, "--max-samples", "6144", "--resume", "--json"]) == 0
    resumed = [r.getMessage() for r in caplog.records if r.name == "trainer.resume"]
    assert len(resumed) == 1
    assert resumed[0].startswith("resumed from v2 at sample 4,096 of 'synthetic' (step 16, ")


def test_a_resume_through_the_library_logs_it_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def run(resume: bool) -> None:
        stream = SyntheticStream(SyntheticConfig(cardinalities=(30, 200, 5), seed=1, chunk=256))
        model = build_dlrm(stream.features, stream.dense_names, seed=0)
        optimizers = build_optimizers(model)
        with IncrementalCheckpointer(
            model, optimizers, store=str(tmp_path), model_name="m", codec="fp32"
        ) as ckpt:
            start = stream.resume_offset(ckpt.resume().reader) if resume else 0
            stop = start + 640
            train_online(
                model, optimizers, stream, batch_size=64, start=start, stop=stop, checkpointer=ckpt
            )

    run(resume=False)
    caplog.set_level(logging.INFO, logger="trainer.resume")
    run(resume=True)
    assert [r.getMessage() for r in caplog.records if r.name == "trainer.resume"] == [
        "resumed from v1 at sample 640 of 'synthetic' (step 10, 640 samples)"
    ]


def doc_of(report: TrainingReport) -> dict[str, Any]:
    """The parts of `train --json`'s document the summary reads (trainer/cli.py)."""
    return {
        "samples": report.samples,
        "start_offset": report.start_offset,
        "end_offset": report.end_offset,
        "seconds": report.seconds,
        "samples_per_s": report.samples_per_s,
        "metrics": report.metrics,
        "summary": {**report.summary(), "non_finite_skipped": 0},
    }


def test_the_summary_of_a_run_that_trained_nothing() -> None:
    nothing = TrainingReport(
        start_offset=0, end_offset=0, samples=0, steps=0, seconds=107.2, cpu_seconds=0.4, metrics={}
    )
    lines = summary_lines(doc_of(nothing))
    assert lines == ["trained no samples in 107.2 s", "no version published"]
    assert not any("None" in line for line in lines)


def test_the_summary_of_a_run_labels_its_metrics_as_this_process(tmp_path: Path) -> None:
    stream = SyntheticStream(SyntheticConfig(cardinalities=(30, 200, 5), seed=1, chunk=256))
    model = build_dlrm(stream.features, stream.dense_names, seed=0)
    optimizers = build_optimizers(model)
    with IncrementalCheckpointer(
        model, optimizers, store=str(tmp_path), model_name="m", codec="fp32", interval_samples=256
    ) as ckpt:
        report = train_online(
            model, optimizers, stream, batch_size=128, stop=512, checkpointer=ckpt
        )
        ckpt.flush()
    first, metrics, versions = summary_lines(doc_of(report))
    assert first.startswith("trained 512 samples (0 -> 512) in ")
    assert metrics.endswith("over the 512 samples of this process (since it started)")
    assert versions.startswith("2 version(s) published (last v2), 0 merged; stall median ")
    assert "x smaller than full fp32" in versions and "None" not in versions
