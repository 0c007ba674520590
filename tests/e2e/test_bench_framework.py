"""`checknrun bench framework --quick` end to end: Ray Serve kept live by a Subscriber, every arm
measured with no failed request, the applying arm applying versions (figures, not speeds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def test_the_framework_part_measures_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "framework.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli", "framework", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["part"] == "framework" and doc["quick"] is True and doc["machine"]["nproc"] >= 1
    for arms in doc["batches"].values():
        assert set(arms) == {"idle", "trainer", "applying"}
        assert all(arm["n"] > 0 and arm["failed"] == 0 for arm in arms.values())
        assert arms["applying"]["versions_applied"] > 0
    assert doc["served"]["following"] is True and doc["served"]["rejected"] == 0
    assert "applying/idle" in proc.stdout
