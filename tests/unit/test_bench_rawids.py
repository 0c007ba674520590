"""`checknrun bench rawids` runs and reports what it measured (shapes, not speeds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main


def test_the_rawids_part_reports_both_arms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rawids.json"
    argv = ["rawids", "--rows", "2000", "--delta-sizes", "50,200", "--batches", "1,8"]
    assert main([*argv, "--repeats", "2", "--dim", "8", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["part"] == "rawids" and doc["machine"]["nproc"] >= 1
    assert doc["config"] == {"rows": 2000, "dim": 8, "codec": "int8", "repeats": 2}
    assert [r["batch"] for r in doc["predict"]] == [1, 8]
    for r in doc["predict"]:
        assert min(r["raw_ms"], r["encoded_ms"], r["map_full_ms"], r["map_small_ms"]) > 0
    for scheme in ("double-buffer", "rwlock"):
        assert [r["delta_rows"] for r in doc["apply"][scheme]] == [50, 200]
        assert all(r["raw_apply_ms"] > 0 < r["encoded_apply_ms"] for r in doc["apply"][scheme])
        memory = doc["model_memory_bytes"][scheme]
        assert memory["raw"] > memory["encoded"]  # the id maps
    assert "apply, rwlock" in capsys.readouterr().out
