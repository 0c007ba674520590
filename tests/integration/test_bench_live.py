"""`checknrun bench live` on the real broker: both arms run, and the report has its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main

from .conftest import Services


def test_the_live_part_reports_both_arms(
    services: Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHECKNRUN_KAFKA_BOOTSTRAP", services.kafka_bootstrap)
    out = tmp_path / "live.json"
    assert main(["live", "--samples", "3000", "--rounds", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["part"] == "live" and doc["samples"] == 3000
    (file_run,) = doc["runs"]["file"]
    (kafka_run,) = doc["runs"]["kafka"]
    assert kafka_run["samples"] == 3000 and kafka_run["samples_per_s"] > 0
    assert 3000 <= file_run["samples"] < 3000 + 512  # whole batches
    assert file_run["samples_per_s"] > 0
    assert kafka_run["bad_events"] == 0
    assert doc["ratio_kafka_to_file"] > 0
