"""The release gate's documents (docs/FORMAT.md section 9), refused from hand-made bytes: each
rule of the format gives its typed error, and a good document round-trips."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.release import Evaluation, Released, ReleaseFormatError, ReleaseRecord

MANIFEST = "m/manifests/000000000007-abc.json"
RECORD = "m/releases/000000000002-abc.json"
INTERVAL = {"estimate": 0.01, "low": -0.01, "high": 0.03}
QUALITY = {"auc": 0.75, "auc_se": 0.004, "logloss": 0.55, "logloss_se": 0.01, "calibration": None}
RULES = {
    "level": 0.95,
    "auc_tolerance": 0.005,
    "logloss_tolerance": 0.05,
    "calibration": [0.5, 2.0],
    "drift_tolerance": 0.15,
    "drift_auc_tolerance": 0.05,
    "probation_windows": 3,
    "block_examples": 128,
}


def evaluation(**change: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema_version": 1,
        "model": "m",
        "version": 7,
        "manifest": MANIFEST,
        "window": {"after_samples": 1000, "examples": 16384, "positives": 9000},
        "baseline": 6,
        "candidate": QUALITY,
        "released": QUALITY,
        "auc_diff": INTERVAL,
        "logloss_diff": INTERVAL,
        "drift": INTERVAL,
        "auc_drift": INTERVAL,
        "drifting": False,
        "probation": None,
        "decision": "release",
        "reason": "not worse than v6",
        "gate": RULES,
        "created_at": "2026-12-06T10:00:00+00:00",
    }
    doc.update(change)
    return doc


def record(**change: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema_version": 1,
        "model": "m",
        "sequence": 3,
        "version": 7,
        "manifest": MANIFEST,
        "action": "release",
        "by": "gate",
        "reason": "passed",
        "previous": RECORD,
        "previous_version": 5,
        "created_at": "2026-12-06T10:00:00Z",
    }
    doc.update(change)
    return doc


def test_good_documents_round_trip() -> None:
    e = Evaluation.from_json(json.dumps(evaluation()).encode())
    assert Evaluation.from_json(e.to_json()) == e
    r = ReleaseRecord.from_json(json.dumps(record()).encode())
    assert ReleaseRecord.from_json(r.to_json()) == r
    p = Released(model="m", version=7, manifest=MANIFEST, sequence=3, record=RECORD)
    assert Released.from_json(p.to_json()) == p


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        (evaluation(extra=1), "Extra inputs"),
        (evaluation(auc_diff={"estimate": 0.0, "low": 0.1, "high": 0.2}), "not ordered"),
        (evaluation(baseline=None), "`released` is given iff `baseline` is"),
        (evaluation(baseline=None, released=None), "paired difference without"),
        (evaluation(manifest="m/blobs/x.json"), "not a manifest key"),
        (evaluation(manifest="other/manifests/000000000007-abc.json"), "not a safe key"),
        (evaluation(window={"after_samples": 0, "examples": 10, "positives": 11}), "positives"),
        (evaluation(decision="maybe"), "decision"),
        (evaluation(reason=""), "reason"),
        (evaluation(reason="x" * 1025), "reason"),
        (evaluation(created_at="2026-12-06T10:00:00"), "UTC offset"),
        (evaluation(gate={**RULES, "calibration": [1.5, 2.0]}), "must hold 1.0"),
        (record(previous=None), "only the first has none"),
        (record(sequence=1), "only the first has none"),
        (record(action="promote"), "action"),
        (record(previous="m/HEAD"), "not a release record key"),
    ],
)
def test_a_document_breaking_a_rule_is_refused(doc: dict[str, Any], match: str) -> None:
    kind = ReleaseRecord if "sequence" in doc else Evaluation
    with pytest.raises(ReleaseFormatError, match=match):
        kind.from_json(json.dumps(doc).encode())


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b'{"model": "m", "model": "m"}', "duplicate"),
        (b'{"estimate": NaN}', "JSON"),
        (b"\xff\xfe", "UTF-8"),
        (b"[]", "invalid"),
    ],
)
def test_bytes_that_are_not_strict_json_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(ReleaseFormatError, match=match):
        Evaluation.from_json(data)
