"""v2 tensors straight into the DLRM's batch (server/feature_columns.py): the batch the
per-example form builds from the same values, every rule of it refused per column, and a v2
infer on a model of encoded ids scoring as /v1/predict does."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from bench.synthetic_run import random_examples, small_config
from server.column_request import column_arrays
from server.feature_batch import build_batch
from server.feature_columns import build_columnar_batch, examples_as_columns
from server.feature_problems import FeatureValidationError
from server.v2_tensors import BatchTooLargeError, V2RequestError
from tests.unit.server.test_api import Served, examples, factory, served

__all__ = ["factory", "served"]  # the fixtures, shared with the /v1 tests

CONFIG = small_config()


def _columns(config: Any, batch: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in config.sparse:
        if f.bag:
            out[f.name] = np.asarray([v for ex in batch for v in ex[f.name]], dtype=np.int64)
            out[f.name + "_lengths"] = np.asarray([len(ex[f.name]) for ex in batch], np.int32)
        else:
            out[f.name] = np.asarray([[ex[f.name]] for ex in batch], dtype=np.int64)
    for d in config.dense:
        out[d] = np.asarray([ex[d] for ex in batch], dtype=np.float64)
    return out


@pytest.mark.parametrize("hashing", [False, True])
def test_columns_build_the_batch_the_examples_build(hashing: bool) -> None:
    config = replace(CONFIG, hashing=hashing)
    batch = random_examples(config, 9, seed=4)
    if hashing:  # any int64 folds in
        batch[0] = {**batch[0], config.sparse[0].name: 10**12}
    want = build_batch(batch, config)
    got = build_columnar_batch(_columns(config, batch), config)
    assert torch.equal(got.dense, want.dense)
    for name, sparse in want.sparse.items():
        assert torch.equal(got.sparse[name].values, sparse.values), name
        assert torch.equal(got.sparse[name].offsets, sparse.offsets), name


def _broken(change: dict[str, Any]) -> dict[str, np.ndarray]:
    """Valid tensors of 3 examples with `change` made (None: the input left out)."""
    tensors = _columns(CONFIG, random_examples(CONFIG, 3, seed=1)) | change
    return {name: array for name, array in tensors.items() if array is not None}


SINGLE = next(f for f in CONFIG.sparse if not f.bag)
BAG = next(f for f in CONFIG.sparse if f.bag)
DENSE = CONFIG.dense[0]
_EX = random_examples(CONFIG, 1, seed=2)[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({SINGLE.name: None}, "is missing"),
        ({"stray": np.zeros(3)}, "unknown input 'stray'"),
        ({SINGLE.name: np.asarray([0, SINGLE.rows, 1])}, f"outside its table [0, {SINGLE.rows})"),
        ({SINGLE.name: np.asarray([0.5, 1.0, 2.0])}, "must be integers"),
        ({SINGLE.name: np.zeros((3, 2), np.int64)}, "one value per example"),
        ({DENSE: np.asarray([1.0, np.nan, 2.0])}, "must be finite"),
        ({DENSE: np.asarray([1.0, 1e39, 2.0])}, "within float32"),
        ({DENSE: np.asarray([b"x", b"y", b"z"], dtype=object)}, "needs numbers"),
        ({BAG.name + "_lengths": np.asarray([1, 1, 99])}, "add up to"),
        ({BAG.name + "_lengths": np.asarray([0, -1, 0])}, "0 to 4096"),
    ],
)
def test_every_rule_is_checked_per_column(change: dict[str, Any], message: str) -> None:
    with pytest.raises(FeatureValidationError) as info:
        build_columnar_batch(_broken(change), CONFIG)
    assert any(message in p.message for p in info.value.problems), info.value.problems


def test_v2_infer_on_encoded_ids_scores_as_v1(served: Served) -> None:
    batch = examples(served, 5, seed=3)
    want = served.client.post("/v1/predict", json={"examples": batch}).json()
    inputs = [
        {
            "name": name,
            "datatype": "INT64" if array.dtype.kind in "iu" else "FP64",
            "shape": list(array.shape),
            "data": array.reshape(-1).tolist(),
        }
        for name, array in _columns(served.run.config, batch).items()
    ]
    r = served.client.post("/v2/models/m/infer", json={"inputs": inputs})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["model_version"] == str(want["version"])
    np.testing.assert_allclose(doc["outputs"][0]["data"], want["scores"], atol=1e-6)
    bad = [
        i | {"data": [10**6] * len(i["data"])} if i["name"] == SINGLE.name else i for i in inputs
    ]
    r = served.client.post("/v2/models/m/infer", json={"inputs": bad})
    assert r.status_code == 400 and "outside its table" in r.json()["error"]
    too_many = [
        i | {"shape": [17], "data": i["data"][:1] * 17}
        if not i["name"].endswith("_lengths") and i["name"] != BAG.name
        else i
        for i in inputs
    ]
    lengths = BAG.name + "_lengths"
    for i in too_many:
        if i["name"] == lengths:
            i.update(shape=[17], data=[0] * 17)
        elif i["name"] == BAG.name:
            i.update(shape=[0], data=[])
    r = served.client.post("/v2/models/m/infer", json={"inputs": too_many})
    assert r.status_code == 413, r.text


def test_v1_columns_score_as_the_same_examples(served: Served) -> None:
    batch = examples(served, 6, seed=5)
    want = served.client.post("/v1/predict", json={"examples": batch}).json()
    columns = {n: a.reshape(-1).tolist() for n, a in _columns(served.run.config, batch).items()}
    r = served.client.post("/v1/predict", json={"columns": columns})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["version"] == want["version"] and got["model"] == want["model"]
    np.testing.assert_allclose(got["scores"], want["scores"], atol=1e-6)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({}, 422, "exactly one of"),
        ({"examples": [{}], "columns": {"a": [1]}}, 422, "exactly one of"),
        ({"columns": {}}, 422, "names no input"),
        ({"columns": {DENSE: 1.5}}, 422, "is a list of values"),
        ({"columns": {DENSE: [{"x": 1}]}}, 422, "values are numbers, or raw ids"),
        ({"columns": {SINGLE.name: [2**70]}}, 422, "int64"),
        ({"columns": {SINGLE.name: [10**6]}}, 422, "outside its table"),
        ({"columns": {DENSE: ["a", 1]}}, 422, "needs numbers"),
    ],
    ids=["neither", "both", "empty", "not-a-list", "object", "int70", "outside", "text"],
)
def test_bad_v1_columns_are_refused_with_a_reason(
    served: Served, body: dict[str, Any], status: int, message: str
) -> None:
    if set(body) == {"columns"} and body["columns"]:
        good = {n: a.reshape(-1).tolist() for n, a in _columns(CONFIG, [_EX]).items()}
        body = {"columns": good | body["columns"]}
    r = served.client.post("/v1/predict", json=body)
    assert r.status_code == status, r.text
    assert message in r.text, r.text


def test_the_value_cap_is_checked_before_a_column_is_converted() -> None:
    with pytest.raises(BatchTooLargeError, match="11 values in all exceed the cap of 10"):
        column_arrays({"a": [0] * 6, "b": ["x"] * 5}, 10)
    got = column_arrays({"a": [1, 2], "b": [0.5, 1], "c": ["u", 7, None]}, 10)
    assert got["a"].dtype == np.int64 and got["b"].dtype == np.float64
    assert got["c"].tolist() == [b"u", b"7", b""]
    with pytest.raises(V2RequestError, match="not UTF-8"):
        column_arrays({"c": ["\ud800"]}, 10)


@pytest.mark.parametrize("hashing", [False, True])
def test_well_formed_examples_are_checked_as_columns(hashing: bool) -> None:
    config = replace(CONFIG, hashing=hashing)
    batch = random_examples(config, 11, seed=7)
    batch[0] = {**batch[0], BAG.name: []}  # an empty bag
    columns = examples_as_columns(batch, config)
    assert columns is not None
    got, want = build_columnar_batch(columns, config), build_batch(batch, config)
    assert torch.equal(got.dense, want.dense)
    for name, sparse in want.sparse.items():
        assert torch.equal(got.sparse[name].values, sparse.values), name
        assert torch.equal(got.sparse[name].offsets, sparse.offsets), name


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {DENSE: None},
        {DENSE: "1.5"},
        {DENSE: True},
        {DENSE: 10**400},
        {SINGLE.name: 1.0},
        {SINGLE.name: True},
        {SINGLE.name: 2**70},
        {BAG.name: 3},
        {BAG.name: [1, "2"]},
    ],
    ids=[
        "extra",
        "null",
        "text",
        "bool",
        "int400",
        "float-id",
        "bool-id",
        "int70",
        "bag-int",
        "bag-text",
    ],
)
def test_any_malformed_example_goes_the_per_example_way(change: dict[str, Any]) -> None:
    batch = random_examples(CONFIG, 3, seed=1)
    batch[1] = {**batch[1], **change}
    assert examples_as_columns(batch, CONFIG) is None
    missing = [dict(batch[0]), *batch[1:]]
    del missing[0][DENSE]
    assert examples_as_columns(missing, CONFIG) is None
    assert examples_as_columns([*batch[:1], [1, 2]], CONFIG) is None  # type: ignore[list-item]
