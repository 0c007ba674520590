"""`checknrun bench shardckpt` runs both arms and reports what it measured (shapes, not speeds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main

pytest.importorskip("torchrec")


def test_the_shardckpt_part_reports_one_and_two_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shardckpt.json"
    argv = ["shardckpt", "--rows", "2000", "--steps", "9", "--every", "3", "--batch", "64"]
    assert main([*argv, "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["part"] == "shardckpt" and doc["machine"]["nproc"] >= 1
    assert doc["tables"] == {"user": 2000, "item": 1000, "ad": 500}
    one, two = doc["arms"]["1"], doc["arms"]["2"]
    assert set(one["ranks"]) == {"0"} and set(two["ranks"]) == {"0", "1"}
    for arm in (one, two):
        assert arm["versions"] >= 1
        assert all(v["stall_ms_median"] > 0 for v in arm["ranks"].values())
    # Each rank of the job writes its own blobs under its rank's directory.
    assert set(two["bytes_per_rank_median"]["full"]) == {"r0000", "r0001"}
    assert set(one["bytes_per_rank_median"]["full"]) == {"r0000"}
    assert "2 ranks / 1 rank" in capsys.readouterr().out
