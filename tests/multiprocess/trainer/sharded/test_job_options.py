"""`train` options a sharded job honours as one process does: `--interval-seconds` (each rank's
clock votes, every rank checkpoints at the same step), SIGTERM on a file (one final version,
exit 0), the training metrics of the job's samples in every version's manifest, and `--codec
auto` (rank 0 measures each version as served on every rank's rows and picks its codec), and
`--gate` (rank 0 judges each version and moves RELEASED)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from publisher.read.catalog import Catalog
from publisher.release import ReleaseLog
from publisher.store import FileStore

ROOT = Path(__file__).resolve().parents[4]
pytestmark = pytest.mark.slow
TRAINING_METRICS = {"auc", "logloss", "ctr", "samples", "auc_cumulative", "samples_cumulative"}


def _ratings(path: Path, rows: int) -> Path:
    lines = ["user,item,timestamp,label"]
    lines += [f"{i % 17},{i % 29},{i},{(i * 7) % 3 == 0:d}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _command(tmp_path: Path, rows: int, *options: str) -> list[str]:
    data = str(_ratings(tmp_path / "r.csv", rows))
    command = [sys.executable, "-m", "trainer.cli", "train", "--nproc", "2", "--data", data]
    command += ["--store", f"file://{tmp_path / 'store'}", "--model", "m", "--codec", "fp32"]
    return [*command, "--batch-size", "64", "--json", *options]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _versions(tmp_path: Path) -> list[int]:
    if not (tmp_path / "store").exists():
        return []
    return [ref.version for ref in Catalog(FileStore(tmp_path / "store"), "m").versions()]


def test_interval_seconds_checkpoints_every_rank_at_the_same_step(tmp_path: Path) -> None:
    command = _command(tmp_path, 32_000, "--interval-seconds", "0.5")
    done = subprocess.run(
        command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["samples"] == 32_000
    catalog = Catalog(FileStore(tmp_path / "store"), "m")
    refs = catalog.versions()
    # by time, not by samples (the default interval is 50,000 samples: one version at the end)
    assert len(refs) >= 2, report
    for ref in refs:
        manifest = catalog.find(ref.version).manifest
        ranks = manifest.position.ranks
        assert ranks is not None and len(ranks) == 2
        # one step for both ranks: the same job step, each rank's share of its samples
        assert sum(r.samples_seen for r in ranks) == manifest.position.samples_seen
        assert set(manifest.metrics) >= TRAINING_METRICS, manifest.metrics
    last = catalog.find(refs[-1].version).manifest
    assert last.metrics["samples_cumulative"] == 32_000.0  # both ranks' samples, no padding
    # each version's window is its samples since the version before, unless it folds several
    # snapshots (the publisher was busy): then it is the newest one's window
    previous = 0.0
    for ref in refs:
        metrics = catalog.find(ref.version).manifest.metrics
        since = metrics["samples_cumulative"] - previous
        previous = metrics["samples_cumulative"]
        if "snapshots" in metrics:
            assert metrics["snapshots"] >= 2 and metrics["samples"] < since, metrics
        else:
            assert metrics["samples"] == since, metrics


def test_sigterm_to_a_job_on_a_file_publishes_a_final_version_and_exits_0(tmp_path: Path) -> None:
    command = _command(tmp_path, 400_000, "--interval-samples", "1280")
    job = subprocess.Popen(
        command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not _versions(tmp_path) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # polling for the job's first version, not a timed assertion
        assert job.poll() is None, "the job ended before it was stopped"
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    assert "killed by SIGTERM" not in err and "terminate called" not in err
    report = json.loads(out)
    assert report["stopped"] == "stop"
    assert 0 < report["samples"] < 400_000
    latest = Catalog(FileStore(tmp_path / "store"), "m").latest()
    assert latest is not None
    # the final version holds every step the job trained, and --resume continues after it
    assert latest.version == report["last_version"]
    assert latest.manifest.position.samples_seen == report["samples"]
    assert latest.manifest.position.reader["offset"] == report["end_offset"]


def test_codec_auto_measures_every_version_as_served_and_steps_up_over_budget(
    tmp_path: Path,
) -> None:
    # a budget no codec but fp32 meets: the rule must step up on the rows of both ranks
    command = _command(tmp_path, 6_400, "--interval-samples", "1280")
    command = [c for c in command if c not in ("--codec", "fp32")]  # the default: auto
    # judged on the point estimate: this small window cannot tell int4's loss from noise
    command += ["--served-loss-budget", "1e-9", "--served-loss-judge", "estimate"]
    done = subprocess.run(
        command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    catalog = Catalog(FileStore(tmp_path / "store"), "m")
    manifests = [catalog.find(ref.version).manifest for ref in catalog.versions()]
    assert len(manifests) == 5
    for manifest in manifests:
        loss = manifest.served_loss
        assert loss is not None, manifest.version  # every version, measured on rank 0
        assert loss.samples > 0
        # one codec for every table of the version, whichever rank wrote it
        assert len({t.codec for t in manifest.tables}) == 1
    codecs = {manifest.tables[0].codec for manifest in manifests}
    assert codecs - {"int4"}, codecs  # stepped up from the floor at least once


def test_the_release_gate_judges_a_jobs_versions_on_rank_0(tmp_path: Path) -> None:
    # 2 ranks, a version every 1,280 job samples: rank 0 judges each on its slice's samples
    # after it (640 a window) next to the released version, and moves RELEASED
    command = _command(tmp_path, 6_400, "--interval-samples", "1280", "--gate")
    command += ["--served-loss-samples", "2048"]
    done = subprocess.run(
        command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    fs = FileStore(tmp_path / "store")
    refs = Catalog(fs, "m").versions()
    assert len(refs) == 5 and all(r.manifest.metrics["release_gate"] == 1.0 for r in refs)
    log = ReleaseLog(fs, "m")
    judged = log.evaluated_versions()
    assert judged == [1, 2, 3, 4]  # the last one's window is still open
    for version in judged:
        evaluation = log.evaluation(version)
        assert evaluation is not None
        ref = next(r for r in refs if r.version == version)
        assert evaluation.manifest == ref.key
        # rank 0's own samples after the version: its half of the job's
        assert 0 < evaluation.window.examples <= 640
    current = log.released()
    assert current is not None and current.record.by == "gate"
    assert log.evaluation(current.version).decision == "release"  # type: ignore[union-attr]
