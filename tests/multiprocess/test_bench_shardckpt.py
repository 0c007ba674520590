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


def test_a_full_copied_in_chunks_reports_every_stop(tmp_path: Path) -> None:
    out = tmp_path / "shardckpt.json"
    # 20,000 user rows of 32 floats and an accumulator (132 B): 2.5 MiB, 4.4 MiB with the
    # other two tables; in 1 MiB chunks, 5 on 1 rank, fewer on each of 2.
    argv = ["shardckpt", "--rows", "20000", "--steps", "9", "--every", "3", "--batch", "64"]
    assert main([*argv, "--full-chunk-mib", "1", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["options"]["full_chunk_mib"] == 1
    one, two = doc["arms"]["1"], doc["arms"]["2"]
    # The full's stops: one per chunk, then the last one.
    assert one["ranks"]["0"]["full_stops"] == 5 + 1
    stops = {v["full_stops"] for v in two["ranks"].values()}
    assert len(stops) == 1 and 2 < stops.pop() < 6  # every rank stops as often
    for arm in (one, two):
        for figures in arm["ranks"].values():
            assert 0 < figures["full_stop_ms_median"] <= figures["full_stop_ms_max"]
