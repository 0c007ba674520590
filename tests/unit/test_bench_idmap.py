"""`checknrun bench idmap` runs and reports what it measured (sizes and shapes, not speeds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main


def test_the_idmap_part_reports_its_arms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "idmap.json"
    argv = ["idmap", "--rows", "3000", "--dirty", "200", "--repeats", "2", "--dim", "8"]
    assert main([*argv, "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["part"] == "idmap" and doc["machine"]["nproc"] >= 1
    assert doc["config"] == {
        "rows": 3000,
        "dirty": 200,
        "dim": 8,
        "codec": "int4",
        "repeats": 2,
        "full_repeats": 2,
        "optimizer": "row-wise Adagrad (1 column per row)",
    }
    for kind in ("delta", "full"):
        stall = doc["stall"][kind]
        assert stall["stalls"] == 2
        assert stall["stall_ms_median_with_id_map"] > 0 and stall["stall_ms_median_without"] > 0
        assert stall["id_maps_share_ms_median"] > 0
    part = doc["id_map_part_of_a_delta_stall"]
    assert part["capture_ms_median"] > 0 and part["entries_ms_median"] > 0
    sizes = doc["bytes"]
    # assigned 1 + counts 8 + last_seen 8 + key_ends 8 + a 12-byte key, plus the header.
    assert 37 < sizes["id_map_bytes_per_row"] < 37 + 1000 / 200
    assert sizes["id_map_blob_bytes"] == round(sizes["id_map_bytes_per_row"] * 200)
    assert 0 < sizes["id_map_zstd3_bytes"] < sizes["id_map_blob_bytes"]
    assert doc["times"]["rebuild_whole_map_s_median"] > 0
    assert "id-map part of a 200-row stall" in capsys.readouterr().out
