"""`checknrun demo` end to end: in-process trainer, a real `serve` process, both sides printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_demo_runs_both_sides(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.demo", "--dir", str(tmp_path / "demo"),
         "--max-samples", "40000", "--interval-samples", "10000", "--rate", "20000",
         "--eval-samples", "1024"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"(v|merged->v)\d+ ", line)]
    assert len(rows) >= 3
    assert all("trainer AUC" in r and "served AUC" in r for r in rows)
    last = int(re.search(r"published (\d+) versions", proc.stdout).group(1))  # type: ignore[union-attr]
    assert f"server: serving v{last} " in proc.stdout
    assert (tmp_path / "demo" / "store" / "movielens" / "HEAD").exists()
