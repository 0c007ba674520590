"""Dense features (docs/FORMAT.md section 8.4): the events' numbers become model inputs by one
rule, the trainer's and every server's: a transformed, clipped value and a missing flag."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from publisher.cli import CommandError
from publisher.dlrm import DLRMConfig, SparseFeature
from publisher.live_features import (
    DENSE_CLIP,
    DenseFeature,
    LiveFeature,
    LiveSpec,
    LiveSpecError,
    live_spec_of,
)
from schemas.events import EventError, EventFields, encode_event, parse_event
from server.feature_problems import FeatureValidationError
from server.raw_ids import parse_raw_examples
from trainer.live_options import live_spec
from trainer.options import add_live_args
from trainer.streams.event_columns import RawEventsBuilder
from trainer.streams.kafka_events import KafkaEventStream
from trainer.streams.kafka_reader import EventSource

SPEC = LiveSpec(
    features=(LiveFeature("user"),),
    time_features=False,
    dense_features=(DenseFeature("price"), DenseFeature("affinity", "raw")),
)


def test_each_dense_feature_is_a_transformed_value_and_a_missing_flag() -> None:
    assert SPEC.dense_names == ("price_log1p", "price_missing", "affinity_raw", "affinity_missing")
    values = np.array([[0.0, 0.5], [math.e - 1, -2.0], [-(math.e - 1), np.nan], [np.nan, 1e300]])
    dense = SPEC.dense(np.zeros(4), {}, values)
    assert dense.dtype == np.float32 and dense.shape == (4, 4)
    np.testing.assert_allclose(dense[:, 0], [0.0, 1.0, -1.0, 0.0], atol=1e-6)  # log1p, mirrored
    assert dense[:, 1].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert dense[:, 2].tolist() == [0.5, -2.0, 0.0, DENSE_CLIP]  # raw, a missing one is 0, clip
    assert dense[:, 3].tolist() == [0.0, 0.0, 1.0, 0.0]
    # no values at all: every one missing
    assert SPEC.dense(np.zeros(2), {}).tolist() == [[0.0, 1.0, 0.0, 1.0]] * 2


def test_the_spec_round_trips_and_leaves_older_specs_as_they_were() -> None:
    assert LiveSpec.from_json(json.loads(json.dumps(SPEC.to_json()))) == SPEC
    plain = LiveSpec(features=SPEC.features)
    assert "dense_features" not in plain.to_json()  # fingerprints of older jobs unchanged
    config = DLRMConfig(
        sparse=(SparseFeature("user", 4),),
        dense=SPEC.dense_names,
        extra={"live": SPEC.to_json()},
    )
    assert live_spec_of(config) == SPEC
    with pytest.raises(LiveSpecError, match="dense inputs"):
        live_spec_of(DLRMConfig(**{**vars(config), "dense": SPEC.dense_names[:2]}))


@pytest.mark.parametrize(
    ("dense", "match"),
    [
        ((DenseFeature("user"),), "differ from the features"),
        ((DenseFeature("price"), DenseFeature("price", "raw")), "unique"),
        ((DenseFeature("ts"),), "identifier other than"),
        ((DenseFeature("price", "sqrt"),), "transform"),
    ],
)
def test_bad_dense_specs_are_refused(dense: tuple[DenseFeature, ...], match: str) -> None:
    with pytest.raises(LiveSpecError, match=match):
        LiveSpec(features=SPEC.features, dense_features=dense)


def test_the_option_names_fields_and_transforms() -> None:
    parser = argparse.ArgumentParser()
    add_live_args(parser)
    parser.add_argument("--rating-threshold", type=float, default=4.0)
    args = parser.parse_args(["--features", "user", "--dense-features", "price, affinity:raw"])
    assert live_spec(args).dense_features == SPEC.dense_features
    assert live_spec(parser.parse_args(["--features", "user"])).dense_features == ()
    with pytest.raises(CommandError, match="--dense-features"):
        live_spec(parser.parse_args(["--features", "user", "--dense-features", "price:cube"]))


FIELDS = EventFields(singles=("user",), dense=("price", "affinity"))


def test_an_event_carries_a_number_or_nothing_per_dense_feature() -> None:
    value = encode_event(ts=1.0, label=1, ids={"user": "u"}, extra={"price": 3, "affinity": None})
    assert parse_event(value, FIELDS).dense == (3.0, None)
    for bad in ("3.5", True, [1], {"x": 1}, 10**400):
        event = json.dumps({"ts": 1, "label": 1, "price": bad}).encode()
        with pytest.raises(EventError) as caught:
            parse_event(event, FIELDS)
        assert caught.value.reason == "bad_dense"


def test_the_reader_hands_the_values_over_with_nan_for_missing_and_skips_bad_ones() -> None:
    builder = RawEventsBuilder(FIELDS)
    for i, extra in enumerate([{"price": 2.5}, {"affinity": -1}, {"price": "x"}, {}]):
        builder.add(encode_event(ts=1.0, label=0, ids={"user": "u"}, extra=extra), 0, i)
    raw = builder.take()
    assert raw.n == 3 and raw.bad == {"bad_dense": 1}
    np.testing.assert_array_equal(raw.dense, [[2.5, np.nan], [np.nan, -1.0], [np.nan, np.nan]])
    np.testing.assert_array_equal(raw.head(1).dense, [[2.5, np.nan]])


def test_training_and_serving_compute_the_same_dense_inputs() -> None:
    """A batch of events and the same examples sent to a server give one model input."""
    stream = KafkaEventStream(EventSource.parse("kafka://127.0.0.1:9/events"), SPEC, {"user": 8})
    builder = RawEventsBuilder(stream.fields)
    examples: list[dict[str, object]] = [
        {"user": "a", "price": 120.0, "affinity": 0.25},
        {"user": "b", "affinity": None},
        {"user": "a", "price": -3, "affinity": 7},
    ]
    for i, example in enumerate(examples):
        ids = {"user": example["user"]}
        extra = {k: v for k, v in example.items() if k != "user"}
        builder.add(encode_event(ts=5.0, label=1, ids=ids, extra=extra), 0, i)  # type: ignore[arg-type]
    trained = stream._batch(builder.take(), offset=0).dense.numpy()
    served = parse_raw_examples(examples, SPEC, now=5.0).to_batch(stream.id_maps).batch.dense
    np.testing.assert_array_equal(served.numpy(), trained)
    assert trained[:, 1].tolist() == [0.0, 1.0, 0.0]


def test_a_request_with_a_value_that_is_not_a_number_is_refused_where_it_is() -> None:
    with pytest.raises(FeatureValidationError) as info:
        parse_raw_examples([{"user": "a", "price": "12"}, {"price": True}], SPEC, now=0.0)
    problems = {(tuple(p.as_detail()["loc"]), p.type) for p in info.value.problems}
    assert problems == {
        (("body", "examples", 0, "price"), "bad_dense"),
        (("body", "examples", 1, "price"), "bad_dense"),
    }
