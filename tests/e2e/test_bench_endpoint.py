"""`checknrun bench endpoint --quick` end to end: every arm (the forward, a naive endpoint, /v1,
v2 REST and gRPC with Triton's clients) answers every batch, wrk loads the HTTP arms where it is
installed, and the figures are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_endpoint_part_measures_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "endpoint.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli", "endpoint", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["arms"]) == {"forward", "naive", "v1", "v1 columns", "v2 http", "v2 grpc"}
    for arm in doc["arms"].values():
        assert set(arm) == {"1", "64"} and all(0 < b["p50_ms"] <= b["p99_ms"] for b in arm.values())
    assert doc["vs_forward_p50"]["forward"] == {"1": 1.0, "64": 1.0}
    assert "v2 grpc" in proc.stdout
    load = doc["load"]
    if "skipped" in load:  # wrk is a Debian package CI need not install
        assert "throughput: skipped" in proc.stdout
    else:
        for arm in ("naive", "v1", "v1 columns", "v2 http"):
            assert load[arm]["requests"] > 0 and load[arm]["failed"] == 0, (arm, load[arm])
            assert 0 < load[arm]["p50_ms"] <= load[arm]["p99_ms"]
        workers = doc["workers"]
        for n in ("1", "2"):
            got = workers[n]
            assert got["idle"]["failed"] == got["applying"]["failed"] == 0, got
            assert got["deltas_committed"] > 0 and got["pss_bytes"] > 0
            assert got["served_after"] > 1  # the deltas reached the server under load
        assert workers["throughput_2_vs_1"] > 0 and "2 workers vs 1" in proc.stdout
