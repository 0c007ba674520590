"""`checknrun bench accuracy --data FILE`: the accuracy part on a ratings file of your own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from tests.support import write_ratings


def test_the_accuracy_part_measures_a_ratings_file(tmp_path: Path) -> None:
    data, out = tmp_path / "my-ratings.csv", tmp_path / "accuracy.json"
    write_ratings(data)
    argv = ["accuracy", "--quick", "--data", str(data), "--interval-samples", "1000"]
    argv += ["--user-col", "uid", "--item-col", "movie", "--rating-col", "stars"]
    argv += ["--time-col", "ts", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    (name,) = doc["workloads"]
    assert name == "my-ratings"  # the file, and only the file
    entry = doc["workloads"][name]
    assert entry["workload"]["interval_samples"] == 1000 and entry["workload"]["samples"] == 3000
    served = {r["codec"]: r for r in entry["served"]["codecs"]}
    assert set(served) == {"int8", "int2"} and all(r["samples"] > 0 for r in served.values())
    assert entry["fp32_restores_check"]["equals_reference"] is True
    assert doc["bit_rule"]["workloads"] == ["my-ratings"]


def test_a_bad_column_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "r.csv"
    write_ratings(data, 100)
    assert main(["accuracy", "--quick", "--data", str(data), "--rating-col", "stars"]) == 1
    assert "the user column 'user' is missing" in capsys.readouterr().err
