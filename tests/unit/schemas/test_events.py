"""Events (docs/FORMAT.md section 8): a good event parses to its fields; every bad one is refused
with exactly one reason of section 8.2, built here from hand-made bytes."""

from __future__ import annotations

import json

import pytest

from schemas.events import (
    BAD_REASONS,
    MAX_BAG_IDS,
    MAX_EVENT_BYTES,
    BadEventCounts,
    Event,
    EventError,
    EventFields,
    encode_event,
    parse_event,
)
from schemas.id_map_blob import MAX_KEY_BYTES, IdKeyError, id_key

FIELDS = EventFields(singles=("user", "item"), bags=("genres",), rating_threshold=4.0)


def reason_of(value: bytes | None) -> str:
    with pytest.raises(EventError) as caught:
        parse_event(value, FIELDS)
    return caught.value.reason


def doc(**fields: object) -> bytes:
    return json.dumps({"ts": 1_000, "label": 1, "user": "u1", **fields}).encode()


def test_a_good_event_names_its_time_label_and_ids() -> None:
    value = b'{"ts": 978300760.5, "label": 0, "user": "u1", "item": 42, "genres": ["Drama", 7]}'
    assert parse_event(value, FIELDS) == Event(978300760.5, 0.0, ("u1", "42"), (("Drama", "7"),))


def test_absent_or_null_ids_are_no_id_and_other_fields_are_ignored() -> None:
    value = b'{"ts": 0, "label": 0.25, "item": null, "genres": null, "extra": {"a": [1]}}'
    assert parse_event(value, FIELDS) == Event(0.0, 0.25, (None, None), ((),))


def test_a_rating_gives_the_label_by_threshold_and_a_label_wins() -> None:
    assert parse_event(doc(label=None, rating=4), FIELDS).label == 1.0
    assert parse_event(doc(label=None, rating=3.5), FIELDS).label == 0.0
    assert parse_event(doc(label=0, rating=5), FIELDS).label == 0.0
    strict = EventFields(singles=("user",), rating_threshold=4.5)
    assert parse_event(doc(label=None, rating=4), strict).label == 0.0


def test_encode_event_round_trips() -> None:
    value = encode_event(ts=12.5, label=1, ids={"user": "é", "item": 3, "genres": ["a", "b"]})
    assert parse_event(value, FIELDS) == Event(12.5, 1.0, ("é", "3"), (("a", "b"),))
    assert b" " not in value  # compact
    assert parse_event(encode_event(ts=1, rating=2, ids={"user": None}), FIELDS).ids == (
        None,
        None,
    )


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"{" + b" " * MAX_EVENT_BYTES + b"}", "oversized"),
        (None, "not_json"),
        (b"\xff\xfe", "not_json"),
        (b"{not json", "not_json"),
        (b'{"ts": 1, "ts": 2, "label": 1}', "not_json"),
        (b'{"ts": NaN, "label": 1}', "not_json"),
        (b'{"ts": 1, "label": 1, "user": "\\ud800"}', "not_json"),
        (b"\xef\xbb\xbf{}", "not_json"),
        (b"[1, 2]", "not_object"),
        (b'"event"', "not_object"),
        (b'{"label": 1}', "missing_ts"),
        (b'{"ts": null, "label": 1}', "missing_ts"),
        (b'{"ts": -1, "label": 1}', "bad_ts"),
        (b'{"ts": "1", "label": 1}', "bad_ts"),
        (b'{"ts": true, "label": 1}', "bad_ts"),
        (b'{"ts": 1e400, "label": 1}', "bad_ts"),
        (b'{"ts": 1' + b"0" * 400 + b', "label": 1}', "bad_ts"),
        (b'{"ts": 1}', "missing_label"),
        (b'{"ts": 1, "label": null, "rating": null}', "missing_label"),
        (b'{"ts": 1, "label": 2}', "bad_label"),
        (b'{"ts": 1, "label": -0.5}', "bad_label"),
        (b'{"ts": 1, "label": "1"}', "bad_label"),
        (b'{"ts": 1, "label": true}', "bad_label"),
        (b'{"ts": 1, "rating": "5"}', "bad_label"),
        (b'{"ts": 1, "rating": 1e999}', "bad_label"),
        (b'{"ts": 1, "label": 1, "user": 1.5}', "bad_id"),
        (b'{"ts": 1, "label": 1, "user": true}', "bad_id"),
        (b'{"ts": 1, "label": 1, "user": ""}', "bad_id"),
        (b'{"ts": 1, "label": 1, "user": ["a"]}', "bad_id"),
        (b'{"ts": 1, "label": 1, "item": {"id": 1}}', "bad_id"),
        (b'{"ts": 1, "label": 1, "genres": "Drama"}', "bad_id"),
        (b'{"ts": 1, "label": 1, "genres": ["a", null]}', "bad_id"),
        (b'{"ts": 1, "label": 1, "genres": [[1]]}', "bad_id"),
    ],
)
def test_each_bad_event_has_its_reason(value: bytes | None, reason: str) -> None:
    assert reason_of(value) == reason


def test_id_length_limits() -> None:
    assert parse_event(doc(user="x" * MAX_KEY_BYTES), FIELDS).ids[0] == "x" * MAX_KEY_BYTES
    assert reason_of(doc(user="x" * (MAX_KEY_BYTES + 1))) == "bad_id"
    assert reason_of(doc(user="é" * (MAX_KEY_BYTES // 2 + 1))) == "bad_id"  # 2 bytes each
    assert reason_of(doc(user=10**MAX_KEY_BYTES)) == "bad_id"


def test_bag_size_limit() -> None:
    assert len(parse_event(doc(genres=["g"] * MAX_BAG_IDS), FIELDS).bags[0]) == MAX_BAG_IDS
    assert reason_of(doc(genres=["g"] * (MAX_BAG_IDS + 1))) == "too_many_ids"


def test_checks_run_in_the_documented_order() -> None:
    assert reason_of(b'{"user": 1.5}') == "missing_ts"
    assert reason_of(b'{"ts": 1, "user": 1.5}') == "missing_label"
    assert reason_of(b'{"ts": 1, "label": 7, "user": 1.5}') == "bad_label"
    assert list(BAD_REASONS)[:3] == ["oversized", "not_json", "not_object"]


def test_id_key_rule() -> None:
    assert id_key("a") == "a"
    assert id_key(42) == "42" and id_key(-7) == "-7"
    assert id_key("é" * 128) == "é" * 128
    for bad in ("", True, 1.0, None, [1], "\ud800", "é" * 129, "x" * 257, 10**300):
        with pytest.raises(IdKeyError):
            id_key(bad)


def test_bad_event_counts_round_trip_through_metrics() -> None:
    counts = BadEventCounts()
    counts.add("bad_id")
    counts.update({"not_json": 2})
    metrics = counts.metrics()
    assert metrics["bad_events"] == 3.0
    assert metrics["bad_events_not_json"] == 2.0 and metrics["bad_events_oversized"] == 0.0
    assert BadEventCounts.from_metrics(metrics).counts == counts.counts
    assert BadEventCounts.from_metrics({}).total == 0
    with pytest.raises(ValueError, match="unknown bad-event reason"):
        counts.add("nope")
