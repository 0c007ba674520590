"""The prepared GPU check (bench/gpu_check.py) runs end to end on CPU at its `--small` sizes: a
2-rank job trains and publishes, its last version restores whole and finite, and every figure
the README takes from a GPU run is there and positive. (The figures here measure nothing.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gpu_check

pytestmark = pytest.mark.slow

FIGURES = (
    "samples_per_s",
    "stall_ms_median",
    "full_stall_ms",
    "publish_s_median",
    "restore_s",
    "torch_save_s",
    "torch_save_bytes",
    "stall_over_torch_save",
)


def test_the_check_trains_restores_and_times_torch_save_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--small"]) == 0
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    sizes = gpu_check.SMALL
    assert doc["device"] == "cpu" and doc["nproc"] == 2
    assert doc["samples"] == sizes.max_samples
    for key in FIGURES:
        assert doc[key] > 0, key
    # one version per interval, the first a full baseline, each with its checkpoint's stall
    versions = doc["versions"]
    assert [v["version"] for v in versions] == list(range(1, 6))
    assert versions[0]["kind"] == "full"
    assert all(v["stall_ms"] > 0 and v["publish_s"] > 0 and v["bytes"] > 0 for v in versions)
    assert len(doc["stall_ms"]) >= len(versions)
    restored = doc["restore"]
    assert restored == {**restored, "version": 5, "tables": 26, "finite": True, "passed": True}
    # the state torch.save wrote: every table's fp32 weights and accumulator, at least
    rows = versions[0]["rows_in_checkpoint"]  # a full holds every row
    assert doc["torch_save_bytes"] >= rows * (sizes.embedding_dim + 1) * 4
    assert doc["machine"]["cpu_model"] and doc["machine"]["gpu"] is None
    # only the JSON is left: the store and the torch.save files went with the work directory
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_check.json"]
    printed = capsys.readouterr().out
    assert "stall / torch.save" in printed and doc["machine"]["cpu_model"] in printed


def test_cuda_without_a_gpu_is_refused_before_anything_runs(tmp_path: Path) -> None:
    if torch.cuda.device_count() > 0:
        pytest.skip("this machine has a GPU")
    assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path)]) != 0
    assert not any(tmp_path.iterdir())
