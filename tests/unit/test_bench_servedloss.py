"""`checknrun bench servedloss` runs every arm and reports the cost and the recorded losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from tests.support import write_ratings


def test_the_servedloss_part_reports_cost_and_losses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, out = tmp_path / "r.csv", tmp_path / "servedloss.json"
    write_ratings(data)
    argv = ["servedloss", "--quick", "--data", str(data), "--interval-samples", "1000"]
    argv += ["--user-col", "uid", "--item-col", "movie", "--rating-col", "stars"]
    assert main([*argv, "--time-col", "ts", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["arms"]) == {"unmeasured", "int4", "int8", "auto"}
    assert doc["arms"]["unmeasured"]["measured_versions"] == 0
    for arm in ("int4", "int8", "auto"):
        a = doc["arms"][arm]
        # A checkpoint per 1000 of 3000 samples; one taken while the previous one is still
        # being published merges into the next version.
        assert 1 <= a["measured_versions"] == a["versions"] <= 3
    assert set(doc["arms"]["int8"]["codecs"]) == {"int8"}
    assert doc["cost"]["train_s_ratio"] > 0 and doc["cost"]["measure_ms_median"] > 0
    assert "measured/unmeasured training time" in capsys.readouterr().out
