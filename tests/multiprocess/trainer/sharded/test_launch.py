"""The job's processes: a failing or dying rank stops the job with its error, and a whole
`checknrun train --nproc 2` (spawned, or under torchrun) exits cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from publisher.cli import exit_status
from tests.multiprocess.trainer.sharded.ranks import die_on_rank_one, fail_on_rank_one
from trainer.cli import main
from trainer.errors import RankFailedError
from trainer.sharded.launch import spawn_ranks

ROOT = Path(__file__).resolve().parents[4]
pytestmark = pytest.mark.slow


def test_a_rank_that_raises_stops_the_job_with_its_error() -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 failed: ValueError: rank one broke") as got:
        spawn_ranks(fail_on_rank_one, 2, timeout_s=60)
    assert exit_status(got.value) != 0


def test_a_rank_that_dies_stops_the_job() -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 died: killed by SIGKILL"):
        spawn_ranks(die_on_rank_one, 2, timeout_s=60)


def _ratings(path: Path, rows: int = 600) -> Path:
    lines = ["user,item,timestamp,label"]
    lines += [f"{i % 17},{i % 29},{i},{(i * 7) % 3 == 0:d}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_batch_the_ranks_cannot_split_is_refused_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = str(_ratings(tmp_path / "r.csv"))
    assert main(["train", "--nproc", "2", "--data", data, "--batch-size", "63"]) == 1
    assert "multiple of 2" in capsys.readouterr().err


def _train(command: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    data = str(_ratings(tmp_path / "r.csv"))
    options = ["--data", data, "--batch-size", "64", "--sharding", "row_wise", "--json"]
    options += ["--store", f"file://{tmp_path / 'store'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [*command, *options], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )


def test_train_nproc_2_trains_the_whole_file_and_exits_cleanly(tmp_path: Path) -> None:
    done = _train([sys.executable, "-m", "trainer.cli", "train", "--nproc", "2"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr
    report = json.loads(done.stdout)  # rank 0's, and only rank 0's
    assert (report["nproc"], report["samples"], report["steps"]) == (2, 600, 10)


def test_the_same_entry_runs_under_torchrun(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", "2", "-m", "trainer.sharded.launch"]
    done = _train(command, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr
    assert json.loads(done.stdout)["samples"] == 600
