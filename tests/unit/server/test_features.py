"""build_batch: request examples to model tensors, and every problem reported with its place."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench.synthetic_run import small_config
from server.feature_batch import build_batch
from server.feature_problems import MAX_REPORTED_ERRORS, FeatureProblem, FeatureValidationError

CONFIG = small_config(rows=(10, 5), bag_rows=4)


def ex(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"d0": 1.0, "d1": 2, "f0": 1, "f1": 2, "tags": [0, 3]}
    base.update(kw)
    return base


def test_tensors_and_bag_offsets() -> None:
    batch = build_batch([ex(), ex(tags=[]), ex(f0=9, tags=[1, 1, 2])], CONFIG)
    assert batch.size == 3
    assert batch.dense.dtype == torch.float32 and batch.dense.tolist()[1] == [1.0, 2.0]
    assert batch.sparse["f0"].values.tolist() == [1, 1, 9]
    assert batch.sparse["f0"].offsets.tolist() == [0, 1, 2]
    assert batch.sparse["tags"].values.tolist() == [0, 3, 1, 1, 2]
    assert batch.sparse["tags"].offsets.tolist() == [0, 2, 2]  # the empty bag embeds to zeros


def test_every_problem_is_reported_with_its_location() -> None:
    with pytest.raises(FeatureValidationError) as info:
        build_batch([ex(), ex(f0=10, colour=1), ex(tags="x", d0=float("inf"))], CONFIG)
    found = {(tuple(p.as_detail()["loc"]), p.type) for p in info.value.problems}
    assert found == {
        (("body", "examples", 1, "colour"), "unknown_feature"),
        (("body", "examples", 1, "f0"), "id_out_of_range"),
        (("body", "examples", 2, "tags"), "wrong_type"),
        (("body", "examples", 2, "d0"), "not_finite"),
    }


def test_reported_problems_are_capped() -> None:
    with pytest.raises(FeatureValidationError) as info:
        build_batch([ex(f0=-1)] * (MAX_REPORTED_ERRORS + 10), CONFIG)
    problems = info.value.problems
    assert len(problems) == MAX_REPORTED_ERRORS + 1
    assert problems[-1].type == "too_many" and "10 more" in problems[-1].message


def test_bag_size_cap() -> None:
    with pytest.raises(FeatureValidationError) as info:
        build_batch([ex(tags=[0] * 5)], CONFIG, max_ids_per_bag=4)
    assert info.value.problems[0].type == "too_many_ids"


def test_hashing_folds_any_int64() -> None:
    hashed = small_config(rows=(10, 5), bag_rows=4, hashing=True)
    batch = build_batch([ex(f0=-1, f1=2**62, tags=[7])], hashed)
    assert batch.sparse["f0"].values.tolist() == [9]
    assert batch.sparse["f1"].values.tolist() == [2**62 % 5]
    assert batch.sparse["tags"].values.tolist() == [3]
    with pytest.raises(FeatureValidationError):
        build_batch([ex(f0=2**63)], hashed)


def test_nulls_are_wrong_types_not_zeros() -> None:
    # null was read as 0 (dense) or an empty bag (sparse) and scored without a word.
    with pytest.raises(FeatureValidationError) as info:
        build_batch([ex(d0=None, f0=None, tags=None)], CONFIG)
    found = {(p.feature, p.type) for p in info.value.problems}
    assert found == {("d0", "wrong_type"), ("f0", "wrong_type"), ("tags", "wrong_type")}


def test_bools_are_not_numbers_or_ids() -> None:
    with pytest.raises(FeatureValidationError) as info:
        build_batch([ex(d0=True, f0=False, tags=[True])], CONFIG)
    assert {p.feature for p in info.value.problems} == {"d0", "f0", "tags"}


def test_unknown_names_are_counted_and_shown_short() -> None:
    # 90k unknown names, some 8 KB long or holding a lone surrogate: one capped report.
    example = {**ex(), **{f"k{i:x}": 1 for i in range(90_000)}, "x" * 8000: 1, "\ud800": 1}
    with pytest.raises(FeatureValidationError) as info:
        build_batch([example], CONFIG)
    problems = info.value.problems
    assert len(problems) == MAX_REPORTED_ERRORS + 1
    assert problems[-1].type == "too_many"
    assert f"{90_002 - MAX_REPORTED_ERRORS} more" in problems[-1].message
    for p in problems:
        detail = p.as_detail()
        assert all(len(str(part)) <= 80 for part in detail["loc"])
        assert len(detail["msg"]) < 200
        detail["msg"].encode("utf-8")  # showable: no lone surrogate left
    long_one = build_problems([{**ex(), "x" * 8000: 1}])[0]
    assert long_one.feature is not None and long_one.feature.endswith("...")
    surrogate = build_problems([{**ex(), "\ud800": 1}])[0]
    assert surrogate.feature == "\\ud800"


def build_problems(examples: list[object]) -> list[FeatureProblem]:
    with pytest.raises(FeatureValidationError) as info:
        build_batch(examples, CONFIG)
    return info.value.problems


def test_an_example_that_is_not_an_object_is_a_problem() -> None:
    problems = build_problems([ex(), 3, [1], None])
    assert [(p.example, p.type) for p in problems] == [(i, "wrong_type") for i in (1, 2, 3)]
