"""A batch of records parsed column by column (`RawEventsBuilder.add_records`, msgspec's decoder
where it reads a record as the strict rule does) gives what the rule gives record by record
(`schemas.events.parse_event`): the same good events, ids, times, labels and dense values, and
the same reason for each bad record. Property-tested on records of every shape the rule sees:
canonical and not (spaces, escapes, exponents, duplicate keys), ids of every type, bad values."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from schemas.events import (
    EventError,
    EventFields,
    event_json,
    event_objects,
    parse_event,
)
from trainer.streams.event_columns import RawEventsBuilder

FIELDS = EventFields(singles=("user", "item"), bags=("genres",), dense=("price",))

_ids = st.one_of(
    st.sampled_from(["a", "b", "c", "1", "Toy Story (1995)", "é", "", "x" * 300]),
    st.integers(-3, 3),
    st.integers(0, 2),  # the same few ids again (a second occurrence looks up the first's number)
    st.sampled_from([1, True, 1.0, "1"]),  # equal as dict keys, not as ids
    st.integers(-(10**40), 10**40),
    st.sampled_from([True, 1.0, 2.5, [], {}]),
    st.none(),
)
_numbers = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(10**20), 10**20),
    st.sampled_from([None, True, "1", -1.0, 2.0, 0.5, [1.0]]),
)


@st.composite
def _event(draw: st.DrawFn) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    good_ts = st.one_of(st.floats(0, 2e9), st.integers(0, 2 * 10**9))
    for name, values in (
        ("ts", st.one_of(good_ts, good_ts, good_ts, _numbers)),  # mostly good: later checks run
        ("label", st.one_of(st.sampled_from([0.0, 1.0, 0.25, 0, 1]), _numbers)),
        ("rating", _numbers),
        ("user", _ids),
        ("item", _ids),
        ("genres", st.one_of(st.lists(_ids, max_size=4), _ids)),
        ("price", _numbers),
        ("extra", st.sampled_from([{"a": [1, {"b": 2}]}, "x", 1])),
    ):
        if draw(st.booleans()) or name in ("ts", "label"):
            obj[name] = draw(values)
    return obj


@st.composite
def _record(draw: st.DrawFn) -> bytes | None:
    """An event's bytes, as a writer might put them on the topic."""
    kind = draw(st.sampled_from(["canonical"] * 6 + ["json", "ascii", "garbage", "none"]))
    if kind == "none":
        return None
    if kind == "garbage":
        return draw(
            st.sampled_from(
                [
                    b"not json",
                    b"[1, 2]",
                    b'"e"',
                    b"\xff",
                    b'{"ts": 1, "ts": 2, "label": 1}',
                    b'{"ts": NaN, "label": 1}',
                    b'{"ts": 1e+16, "label": 1}',
                    b"\xef\xbb\xbf{}",
                    b'{"ts": 1, "label": 1, "user": "\\ud800"}',
                    b'{"a": [[[[[1]]]]], "ts": 1}',
                ]
            )
        )
    obj = draw(_event())
    if kind == "canonical":
        return msgspec.json.encode(obj)
    if kind == "json":
        return json.dumps(obj).encode()  # spaces after separators
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode()  # \u escapes


def _by_the_rule(records: list[bytes | None]) -> tuple[list[tuple[Any, ...]], list[str]]:
    """Each good event's (ts, label, ids, bags, dense) and each bad record's reason, record by
    record."""
    good, bad = [], []
    for value in records:
        try:
            e = parse_event(value, FIELDS)
        except EventError as exc:
            bad.append(exc.reason)
            continue
        dense = tuple(math.nan if v is None else v for v in e.dense)
        good.append((e.ts, np.float32(e.label), e.ids, e.bags, dense))
    return good, bad


def _in_batches(records: list[bytes | None], size: int) -> tuple[list[tuple[Any, ...]], list[str]]:
    """The same, through RawEventsBuilder.add_records `size` records at a time."""
    builder = RawEventsBuilder(FIELDS)
    offsets = list(range(len(records)))
    for start in range(0, len(records), size):
        chunk = slice(start, start + size)
        builder.add_records(records[chunk], [0] * len(offsets[chunk]), offsets[chunk])
    raw = builder.take()
    keys = [list(keys) for keys, _ in raw.singles]
    ids = list(
        zip(
            *(
                [k[n] if n >= 0 else None for n in inverse.tolist()]
                for k, (_, inverse) in zip(keys, raw.singles, strict=True)
            ),
            strict=True,
        )
    )
    bag_keys, inverse, splits = raw.bags[0]
    bags = [
        (tuple(bag_keys[n] for n in inverse[splits[i] : splits[i + 1]].tolist()),)
        for i in range(raw.n)
    ]
    good = [
        (float(raw.ts[i]), raw.labels[i], ids[i], bags[i], tuple(raw.dense[i].tolist()))
        for i in range(raw.n)
    ]
    assert raw.offsets.tolist() == sorted(raw.offsets.tolist())
    assert raw.ends == {0: len(records)} if records else raw.ends == {}
    return good, [reason for reason, _, _ in raw.bad_records]


def _same(
    a: tuple[list[tuple[Any, ...]], list[str]], b: tuple[list[tuple[Any, ...]], list[str]]
) -> bool:
    # NaN (a missing dense value) equals itself here: compare the reprs.
    return repr(a) == repr(b)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_record(), max_size=40), st.integers(1, 17))
@example([b'{"ts":1.0,"label":1,"item":1}', b'{"ts":1.0,"label":1,"item":true}'], 1)
def test_a_batch_parses_as_its_records_one_by_one(records: list[bytes | None], size: int) -> None:
    expected = _by_the_rule(records)
    assert _same(_in_batches(records, len(records) or 1), expected)
    assert _same(_in_batches(records, size), expected)


@settings(max_examples=300, deadline=None)
@given(st.lists(_record(), max_size=20))
def test_msgspec_reads_a_record_only_as_the_strict_rule_reads_it(
    records: list[bytes | None],
) -> None:
    for value, obj in zip(records, event_objects(records), strict=True):
        if obj is None:
            continue  # left to the strict rule
        strict = event_json(value)
        # value for value and type for type (1 and 1.0, True and 1 are different here)
        assert repr(obj) == repr(strict) and _types(obj) == _types(strict)


def _types(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _types(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_types(v) for v in value]
    return type(value).__name__


def test_canonical_records_take_the_fast_path_and_others_do_not() -> None:
    canonical = b'{"ts":1.5,"label":1,"user":"a","genres":["x",2]}'
    assert event_objects([canonical]) == [{"ts": 1.5, "label": 1, "user": "a", "genres": ["x", 2]}]
    for value in (
        b'{"ts": 1.5, "label": 1}',  # spaces
        b'{"ts":1.5,"label":1,"user":"\\u00e9"}',  # an escape msgspec would not write
        b'{"ts":1e+16,"label":1}',  # not the shortest form
        b'{"ts":1,"ts":2,"label":1}',  # a duplicate key
        b'{"a":{"b":{"c":[1]}},"ts":1}',  # deeper than an event nests
        None,
    ):
        assert event_objects([canonical, value]) == [event_objects([canonical])[0], None]
