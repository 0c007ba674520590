"""`checknrun bench shards` runs and reports what it measured (sizes and shapes, not speeds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main


def test_the_shards_part_reports_both_arms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shards.json"
    argv = ["shards", "--ranks", "3", "--tables", "2", "--rows", "900", "--dim", "8"]
    assert main([*argv, "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["part"] == "shards" and doc["machine"]["nproc"] >= 1
    assert (doc["ranks"], doc["tables"], doc["rows"], doc["repeats"]) == (3, 2, 900, 1)
    for kind in ("full", "delta"):
        assert set(doc["publish_median_s"]) == {"one_writer", "job"}
        assert doc["job_over_one_writer"][kind] > 0
        written = doc["bytes_per_rank"][kind]
        assert len(written) == 3 and all(b > 0 for b in written)
    # Rank 0 also writes the dense state: more than the others' shards alone.
    assert doc["bytes_per_rank"]["full"][0] > doc["bytes_per_rank"]["full"][1]
    assert doc["restore_sharded_over_whole"] > 0
    assert "job of 3 ranks" in capsys.readouterr().out
