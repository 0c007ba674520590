"""`checknrun bench --quick` end to end: every part runs and reports sane values (not speeds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.cli import DEFAULT_PARTS, main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    assert main(["--quick", "--json", str(out)]) == 0
    doc: dict = json.loads(out.read_text())
    return doc


def test_every_part_with_machine(quick_doc: dict) -> None:
    assert quick_doc["quick"] is True
    assert set(quick_doc["parts"]) == set(DEFAULT_PARTS)
    for part in quick_doc["parts"].values():
        machine = part["machine"]
        assert machine["nproc"] >= 1
        assert machine["cpu_model"]
        assert len(machine["load_average"]) == 3


def test_paper_bytes(quick_doc: dict) -> None:
    paper = quick_doc["parts"]["paper"]
    assert "synthetic" in paper["workloads"]
    for wl in paper["workloads"].values():
        n = wl["workload"]["intervals"]
        assert len(wl["dirty_fraction"]) == n
        assert all(0 < f <= 1 for f in wl["dirty_fraction"])
        by = {(r["policy"], r["codec"]): r for r in wl["results"]}
        assert {p for p, _ in by} == {"full", "one-shot", "consecutive", "intermittent"}
        for r in wl["results"]:
            assert len(r["bytes_per_interval"]) == n
            assert r["kinds"][0] == "full"
            assert r["bandwidth_reduction_mean"] > 0
            assert r["capacity_reduction_latest"] > 0
        # fewer bits never write more; a delta never writes more than a full of its codec
        assert by[("full", "int2")]["bytes_mean"] < by[("full", "int4")]["bytes_mean"]
        assert by[("full", "int4")]["bytes_mean"] < by[("full", "fp32")]["bytes_mean"]
        assert by[("consecutive", "int4")]["bytes_max"] <= by[("full", "int4")]["bytes_max"]
        # full fp32 (plus manifest) is the reference itself
        assert 0.99 < by[("full", "fp32")]["bandwidth_reduction_mean"] < 1.2
        # the real publisher's bytes match the replayed ones (same encoder)
        published = wl["published_default"]["versions"]
        replayed = by[("intermittent", "int4")]["bytes_per_interval"]
        assert len(published) == n
        for pub, rep in zip(published, replayed, strict=True):
            assert pub["bytes_written"] == pytest.approx(rep, rel=0.2)
            assert pub["full_fp32_bytes"] == wl["full_fp32_bytes"]  # one definition
        assert wl["restore"]["restore_s_median"] > 0
        assert wl["restore"]["torch_load_s_median"] > 0
        served = wl["served_default_codec"]
        assert 0.3 < served["auc_fp32"] < 1 and 0.3 < served["auc_served"] < 1
        # each published setting's manifests record their served loss, version by version
        first = wl["published"][0]
        assert (first["policy"], first["codec"]) == ("intermittent", "int4")
        for arm in wl["published"]:
            assert len(arm["versions"]) == n
            assert all(0.3 < v["served_loss"]["auc_fp32"] < 1 for v in arm["versions"])
            assert arm["served_loss"]["versions_measured"] == n


def test_accuracy_and_rule(quick_doc: dict) -> None:
    acc = quick_doc["parts"]["accuracy"]
    for wl in acc["workloads"].values():
        assert wl["fp32_restores_check"]["equals_reference"]
        assert 0.3 < wl["reference_fp32"]["auc"] < 1
        for r in wl["restores"]:
            assert r["failures"] >= 1
            assert math.isfinite(r["auc_rel_degradation"])
            assert r["samples"] == wl["workload"]["samples"]
        assert {r["codec"] for r in wl["served"]["codecs"]} >= {"int8", "int2"}
    rule = acc["bit_rule"]
    assert "thresholds" in rule and rule["beyond"]
    ks = [t["max_expected_restores"] for t in rule["thresholds"]]
    assert ks == sorted(ks)


def test_stall_codec_freshness(quick_doc: dict) -> None:
    stall = quick_doc["parts"]["stall"]
    for w in stall["workloads"].values():
        s = w["summary"]
        assert s["checkpoints"] >= 2 and s["stall_ms_median"] > 0
        assert s["torch_save_ms_median"] > 0
        assert w["dcp"]["stall_ms_median"] > 0
        assert w["restore"]["restore_over_torch_load"] > 0
    codec = quick_doc["parts"]["codec"]
    assert {r["codec"] for r in codec["results"]} >= {"fp32", "int4", "int2-adaptive"}
    assert all(r["encode_mb_s"] > 0 and r["decode_mb_s"] > 0 for r in codec["results"])
    fresh = quick_doc["parts"]["freshness"]
    assert fresh["freshness"]["versions"] >= 1
    assert fresh["freshness"]["train_step_to_served"]["p50_ms"] > 0
    assert fresh["apply"]["results"]
    assert fresh["http"]["idle"]["n"] > 0


def test_report_from_quick_results(quick_doc: dict, tmp_path: Path) -> None:
    for part, doc in quick_doc["parts"].items():
        (tmp_path / f"{part}.json").write_text(json.dumps(doc))
    assert main(["report", "--dir", str(tmp_path)]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "Headline" in text and "paper" in text
    for png in ("bytes_per_interval.png", "auc_vs_bits.png", "stall.png"):
        assert (tmp_path / png).stat().st_size > 1000
