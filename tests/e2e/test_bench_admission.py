"""`checknrun bench admission --quick` end to end: cold start measured on both streams and both
arms, the flood arms keeping real ids under frequency admission, the memory bound (figures, not
speeds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_admission_part_measures_cold_start_floods_and_memory(tmp_path: Path) -> None:
    out = tmp_path / "admission.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli", "admission", "--quick", "--events", "3000",
         "--flood-events", "20000", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    for stream in ("movielens", "click_log"):
        arms = doc["cold_start"][stream]
        for arm in ("unknown-row", "off"):
            for feature in arms["watched"]:
                assert arms[arm][feature]["events"] > 0
    frequency = [a for a in doc["flood"]["arms"] if a["admission"] == "frequency"]
    assert len(frequency) == 3 and all(a["real_ids_kept"] == 1.0 for a in frequency)
    memory = doc["memory"]
    assert memory["sketch_bytes_per_table"] == 3 * 2**20
    assert memory["bound_mib_per_feature"] < memory["bound_mib_per_feature_before"]
    assert "Flood:" in proc.stdout
