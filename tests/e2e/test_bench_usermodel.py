"""`checknrun bench usermodel --quick` end to end: a user model served by `--model-factory` next to
the built-in DLRM, every figure present and sane (not speeds)."""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any

import pytest

from bench import usermodel
from bench.machine import write_json

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "usermodel.json"
    write_json(usermodel.run(True), out)
    doc: dict[str, Any] = json.loads(out.read_text())  # what --json writes
    return doc


def test_options_are_run_keywords() -> None:
    parser = argparse.ArgumentParser()
    usermodel.add_arguments(parser)
    options = vars(parser.parse_args([]))
    assert set(options) <= set(inspect.signature(usermodel.run).parameters) - {"quick"}


def test_machine_and_sizes(quick_doc: dict[str, Any]) -> None:
    assert quick_doc["part"] == "usermodel" and quick_doc["quick"] is True
    assert quick_doc["machine"]["nproc"] >= 1 and quick_doc["machine"]["cpu_model"]
    config = quick_doc["config"]
    assert config["two_tower"]["items"] == config["items"] == config["dlrm"]["sparse"][1]["rows"]
    assert set(quick_doc["codecs"]) == {"int4"}


def test_apply_every_series_and_size(quick_doc: dict[str, Any]) -> None:
    config = quick_doc["config"]
    sizes = sorted(int(s) for s in config["delta_sizes"].split(","))
    result = quick_doc["codecs"]["int4"]["apply"]
    got = {(r["series"], r["delta_rows"]): r for r in result["results"]}
    assert set(got) == {(s.name, n) for s in usermodel.SERIES for n in sizes}
    for row in got.values():
        assert row["n"] == config["repeats"]
        assert 0 < row["apply_ms_min"] <= row["apply_ms_median"] <= row["apply_ms_max"]
        assert row["pause_us_median"] > 0 and row["bytes_fetched_median"] > 0
        assert 0 < row["fetch_ms_median"] < row["apply_ms_max"]
    ratios = result["user_over_dlrm"]
    assert [r["delta_rows"] for r in ratios] == sizes
    assert all(r[s.name]["apply"] > 0 for r in ratios for s in usermodel.SERIES[:-1])
    # the id maps travel with the user model, not the DLRM
    assert result["two_tower_id_maps_mib_per_copy"] > 0


def test_predict_over_http_and_in_process(quick_doc: dict[str, Any]) -> None:
    doc = quick_doc["codecs"]["int4"]
    config = quick_doc["config"]
    assert set(doc["http"]) == set(doc["forward"]) == {str(b) for b in config["batches"]}
    for batch in doc["http"]:
        for arm in (usermodel.USER, usermodel.DLRM):
            http, forward = doc["http"][batch][arm], doc["forward"][batch][arm]
            assert http["failed"] == 0, http["first_error"]
            assert http["n"] >= config["requests"] - config["rounds"]
            assert 0 < http["p50_ms"] <= http["p99_ms"]
            assert 0 < forward["p50_ms"] <= forward["p99_ms"]
    assert all(r["http_p50"] > 0 and r["forward_p50"] > 0 for r in doc["predict_user_over_dlrm"])
    servers = doc["servers"]
    assert servers[usermodel.USER]["architecture"] == "two_tower"
    assert servers[usermodel.DLRM]["architecture"] == "dlrm"
