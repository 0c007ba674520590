"""`checknrun bench dense` end to end: every arm trains the live path on the same events, and a
model that reads the events' numbers ranks clicks the ids alone cannot (figures, not speeds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_dense_part_trains_every_arm_and_the_numbers_help(tmp_path: Path) -> None:
    out = tmp_path / "dense.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli", "dense", "--events", "40000", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    arms = doc["arms"]
    assert set(arms) == {"ids only", "bucket ids", "dense features", "dense, lr 0.01"}
    assert arms["ids only"]["dense_inputs"] + 4 == arms["dense features"]["dense_inputs"]
    best = doc["best_auc_second_half"]
    assert all(a["auc_second_half"] < best for a in arms.values())
    assert arms["dense, lr 0.01"]["auc_second_half"] > arms["ids only"]["auc_second_half"] + 0.05
    assert "Dense features" in proc.stdout
