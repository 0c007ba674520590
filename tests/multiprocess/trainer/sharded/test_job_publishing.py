"""`checknrun train --nproc N` publishes: one version per interval for the whole job, the
job's samples in `samples_seen` and each rank's in `position.ranks`, a version servers rebuild,
and `--resume` at another world size (2 -> 1) and in the one-process trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from publisher.dlrm import build_model
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.state_dicts import weight_key
from publisher.store import FileStore

ROOT = Path(__file__).resolve().parents[4]
SAMPLES, BATCH = 600, 64
pytestmark = pytest.mark.slow


def _ratings(path: Path) -> Path:
    lines = ["user,item,timestamp,label"]
    lines += [f"{i % 17},{i % 29},{i},{(i * 7) % 3 == 0:d}" for i in range(SAMPLES)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(tmp_path: Path, *options: str) -> dict[str, object]:
    command = [sys.executable, "-m", "trainer.cli", "train", "--data", str(tmp_path / "r.csv")]
    command += ["--store", f"file://{tmp_path / 'store'}", "--model", "m", "--codec", "fp32"]
    command += ["--batch-size", str(BATCH), "--interval-samples", "128", "--json", *options]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr
    report: dict[str, object] = json.loads(done.stdout)
    return report


def test_a_two_rank_job_publishes_versions_servers_load_and_resumes_on_one_rank(
    tmp_path: Path,
) -> None:
    _ratings(tmp_path / "r.csv")
    first = _train(tmp_path, "--nproc", "2", "--sharding", "row_wise", "--max-samples", "384")
    store = FileStore(str(tmp_path / "store"))
    catalog = Catalog(store, "m")
    latest = catalog.latest()
    assert latest is not None and first["last_version"] == latest.version
    position = latest.manifest.position
    # The run ends with a version: the job's samples, each rank's half of them.
    assert position.samples_seen == 384 and position.ranks is not None
    assert [r.samples_seen for r in position.ranks] == [192, 192]
    assert any(t.shards for t in latest.manifest.tables)  # row-wise: shard blobs
    # A server's rebuild: the DLRM the manifest describes, loaded strictly.
    state = restore(store, "m")
    weights = {weight_key(name): torch.from_numpy(t.weights) for name, t in state.tables.items()}
    weights.update({name: torch.from_numpy(value) for name, value in state.dense.items()})
    build_model(latest.manifest.model_config_).load_state_dict(weights)  # strict

    second = _train(tmp_path, "--nproc", "1", "--resume", "latest")
    assert second["resumed_from"] == latest.version
    after = catalog.latest()
    assert after is not None and after.version > latest.version
    assert after.manifest.position.samples_seen == SAMPLES
    assert second["samples"] == SAMPLES - 384


def test_the_one_process_trainer_resumes_a_sharded_jobs_version(tmp_path: Path) -> None:
    _ratings(tmp_path / "r.csv")
    _train(tmp_path, "--nproc", "2", "--max-samples", "256")
    resumed = _train(tmp_path, "--resume", "latest", "--sparse-lr", "0.05")
    latest = Catalog(FileStore(str(tmp_path / "store")), "m").latest()
    assert latest is not None and latest.manifest.position.samples_seen == SAMPLES
    assert latest.manifest.position.ranks is None
    assert resumed["samples"] == SAMPLES - 256


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")
def test_a_job_on_the_gpu_publishes_what_the_same_job_on_the_cpu_publishes(
    tmp_path: Path,
) -> None:
    """Tables on the GPU: dirty rows from the device tracker, rows copied into pinned host
    buffers; the versions hold the CPU job's model within float tolerance."""
    _ratings(tmp_path / "r.csv")
    states = {}
    for device in ("cpu", "cuda"):
        run = tmp_path / device
        run.mkdir()
        (run / "r.csv").write_bytes((tmp_path / "r.csv").read_bytes())
        report = _train(run, "--nproc", "1", "--device", device, "--max-samples", "384")
        catalog = Catalog(FileStore(str(run / "store")), "m")
        assert [v.manifest.kind for v in catalog.versions()][:2] == ["full", "delta"]
        assert report["last_version"] == catalog.latest().version  # type: ignore[union-attr]
        states[device] = restore(FileStore(str(run / "store")), "m")
    cpu, gpu = states["cpu"], states["cuda"]
    assert sorted(gpu.tables) == sorted(cpu.tables)
    for name, table in cpu.tables.items():
        torch.testing.assert_close(
            torch.from_numpy(gpu.tables[name].weights),
            torch.from_numpy(table.weights),
            rtol=1e-4,
            atol=1e-5,
        )
