"""Raw-id predict inputs (server/raw_ids.py): the check of a live model's examples, the mapping
of their ids with one version's id maps (unknown ids -> row 0, counted), and the derived dense
inputs, computed by the trainer's own rule (LiveSpec.dense)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from publisher.dlrm import TABLE_PREFIX, DLRMConfig, SparseFeature
from publisher.id_map import UNKNOWN_ROW, IdMap, hashed_rows
from publisher.live_features import LiveFeature, LiveSpec, LiveSpecError, live_spec_of, new_id_maps
from server.feature_problems import MAX_REPORTED_ERRORS, FeatureValidationError
from server.raw_ids import parse_raw_examples

SPEC = LiveSpec(
    features=(LiveFeature("user"), LiveFeature("item"), LiveFeature("genres", bag=True)),
    count_features=("user", "item"),
)
NOW = 1_700_000_000.0


def live_config(spec: LiveSpec = SPEC, rows: int = 16, **extra: Any) -> DLRMConfig:
    return DLRMConfig(
        sparse=tuple(SparseFeature(f.name, rows, f.bag) for f in spec.features),
        dense=spec.dense_names,
        embedding_dim=4,
        extra={"live": spec.to_json(), **extra},
    )


def maps_with(spec: LiveSpec = SPEC, **held: dict[str, tuple[int, int]]) -> dict[str, IdMap]:
    """Id maps of `live_config(spec)`; `held[feature] = {key: (row, count)}`."""
    maps = new_id_maps(live_config(spec), spec)
    for feature, ids in held.items():
        id_map = maps[TABLE_PREFIX + feature]
        for key, (row, count) in ids.items():
            id_map.assign(key, row)
            id_map.counts[row] = count
    return maps


def problems_of(examples: list[Any], **kw: Any) -> set[tuple[object, ...]]:
    with pytest.raises(FeatureValidationError) as info:
        parse_raw_examples(examples, SPEC, now=NOW, **kw)
    return {(tuple(p.as_detail()["loc"]), p.type) for p in info.value.problems}


def test_spec_must_describe_the_model() -> None:
    assert live_spec_of(live_config()) == SPEC
    encoded = DLRMConfig(sparse=(SparseFeature("user", 4),), dense=())
    assert live_spec_of(encoded) is None
    other = LiveSpec(features=(LiveFeature("user"), LiveFeature("item")))
    with pytest.raises(LiveSpecError, match="sparse features"):
        live_spec_of(DLRMConfig(**{**vars(live_config()), "extra": {"live": other.to_json()}}))
    with pytest.raises(LiveSpecError, match="dense inputs"):
        live_spec_of(DLRMConfig(**{**vars(live_config()), "dense": ("hour_sin",)}))
    with pytest.raises(LiveSpecError, match="2 rows"):
        live_spec_of(live_config(rows=1))
    hashed = LiveSpec(features=SPEC.features, id_space="hash")
    assert live_spec_of(live_config(hashed, rows=1)) == hashed


def test_ids_map_through_the_version_maps_and_unknown_ids_take_row_0() -> None:
    maps = maps_with(
        user={"u1": (3, 7), "42": (5, 0)}, item={"7": (2, 149)}, genres={"Drama": (1, 0)}
    )
    raw = parse_raw_examples(
        [
            {"user": "u1", "item": 7, "genres": ["Drama", "Noir", "Drama"], "ts": 86_400.0},
            {"user": 42, "item": "nope"},  # 42 and "42" are one id
            {"genres": None, "user": None},  # no ids at all: row 0, an empty bag
        ],
        SPEC,
        now=NOW,
    )
    mapped = raw.to_batch(maps)
    sparse = mapped.batch.sparse
    assert sparse["user"].values.tolist() == [3, 5, UNKNOWN_ROW]
    assert sparse["user"].offsets.tolist() == [0, 1, 2]
    assert sparse["item"].values.tolist() == [2, UNKNOWN_ROW, UNKNOWN_ROW]
    assert sparse["genres"].values.tolist() == [1, UNKNOWN_ROW, 1]
    assert sparse["genres"].offsets.tolist() == [0, 3, 3]
    # Absent ids are not ids sent, but a missing single id reads the unknown row, so it is
    # counted with the ids the version does not know (an empty bag reads nothing).
    assert mapped.ids == {"user": 2, "item": 2, "genres": 3}
    assert mapped.unknown_ids == {"user": 1, "item": 2, "genres": 1}
    # The dense inputs are the trainer's rule on the request's times and the maps' counts.
    expected = SPEC.dense(
        np.array([86_400.0, NOW, NOW]),
        {"user": np.array([7, 0, 0]), "item": np.array([149, 0, 0])},
    )
    np.testing.assert_array_equal(mapped.batch.dense.numpy(), expected)
    assert mapped.batch.dense.shape == (3, len(SPEC.dense_names))


def test_an_unknown_id_has_prior_count_0_whatever_row_0_counted() -> None:
    maps = maps_with()
    maps[TABLE_PREFIX + "user"].counts[UNKNOWN_ROW] = 1000  # events of ids without a row
    mapped = parse_raw_examples([{"user": "new"}], SPEC, now=NOW).to_batch(maps)
    zero = np.zeros(1, dtype=np.int64)
    expected = SPEC.dense(np.array([NOW]), {"user": zero, "item": zero})
    np.testing.assert_array_equal(mapped.batch.dense.numpy(), expected)


def test_a_hashed_space_maps_every_id_and_counts_per_row() -> None:
    spec = LiveSpec(features=SPEC.features, id_space="hash", count_features=("user",))
    maps = new_id_maps(live_config(spec), spec)
    row = int(hashed_rows(["u1"], 16)[0])
    maps[TABLE_PREFIX + "user"].counts[row] = 20
    mapped = parse_raw_examples(
        [{"user": "u1", "genres": ["a", "b"], "ts": 0}], spec, now=NOW
    ).to_batch(maps)
    assert mapped.batch.sparse["user"].values.tolist() == [row]
    assert mapped.batch.sparse["genres"].values.tolist() == hashed_rows(["a", "b"], 16).tolist()
    assert mapped.unknown_ids == {"user": 0, "item": 1, "genres": 0}  # no item: row 0
    expected = spec.dense(np.zeros(1), {"user": np.array([20])})
    np.testing.assert_array_equal(mapped.batch.dense.numpy(), expected)


def test_every_bad_value_is_reported_with_its_place() -> None:
    found = problems_of(
        [
            {"user": True, "item": 1.5, "colour": "red"},
            {"user": "", "genres": "Drama", "ts": -1},
            {"user": "x" * 257, "genres": ["ok", None], "ts": "noon"},
            {"user": "\ud800", "ts": float("nan")},
            ["not", "an", "object"],
            {"item": [1], "ts": 10**400},
        ]
    )
    assert found == {
        (("body", "examples", 0, "user"), "bad_id"),
        (("body", "examples", 0, "item"), "bad_id"),
        (("body", "examples", 0, "colour"), "unknown_feature"),
        (("body", "examples", 1, "user"), "bad_id"),
        (("body", "examples", 1, "genres"), "wrong_type"),
        (("body", "examples", 1, "ts"), "bad_ts"),
        (("body", "examples", 2, "user"), "bad_id"),
        (("body", "examples", 2, "genres"), "bad_id"),
        (("body", "examples", 2, "ts"), "bad_ts"),
        (("body", "examples", 3, "user"), "bad_id"),
        (("body", "examples", 3, "ts"), "bad_ts"),
        (("body", "examples", 4), "wrong_type"),
        (("body", "examples", 5, "item"), "bad_id"),
        (("body", "examples", 5, "ts"), "bad_ts"),
    }


def test_no_id_is_echoed_and_reports_are_capped() -> None:
    with pytest.raises(FeatureValidationError) as info:
        parse_raw_examples(
            [{"user": "secret-" + "x" * 300}] * (MAX_REPORTED_ERRORS + 5), SPEC, now=NOW
        )
    problems = info.value.problems
    assert len(problems) == MAX_REPORTED_ERRORS + 1
    assert problems[-1].type == "too_many" and "5 more" in problems[-1].message
    assert not any("secret" in p.message for p in problems)


def test_bag_size_cap() -> None:
    found = problems_of([{"genres": ["a"] * 5}], max_ids_per_bag=4)
    assert found == {(("body", "examples", 0, "genres"), "too_many_ids")}
    raw = parse_raw_examples([{"genres": ["a"] * 4}], SPEC, now=NOW, max_ids_per_bag=4)
    assert raw.features[2].keys == ["a"] * 4
