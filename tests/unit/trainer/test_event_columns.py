"""Records parsed into columns: distinct keys and per-occurrence indices, bag splits, where the
batch ends in each partition (bad records included), and a batch cut after n good events."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.events import EventFields, encode_event
from trainer.streams import event_columns
from trainer.streams.event_columns import RawEventsBuilder

FIELDS = EventFields(singles=("user", "item"), bags=("genres",))


def event(user: str | None, item: int, genres: list[str], ts: float = 1.0) -> bytes:
    return encode_event(ts=ts, label=1, ids={"user": user, "item": item, "genres": genres})


def build() -> RawEventsBuilder:
    builder = RawEventsBuilder(FIELDS)
    builder.add(event("a", 1, ["x", "y"], 1.0), partition=0, offset=10)
    builder.add(b"not json", partition=1, offset=5)
    builder.add(event(None, 1, [], 2.0), partition=1, offset=6)
    builder.add(event("a", 2, ["y"], 3.0), partition=0, offset=11)
    builder.add(b'{"ts": 1}', partition=0, offset=12)
    return builder


def test_columns_hold_distinct_keys_and_occurrences() -> None:
    builder = build()
    assert (builder.n, builder.records) == (3, 5)
    raw = builder.take({0: 20, 1: 7})
    assert builder.n == 0 and builder.records == 0
    assert raw.ts.tolist() == [1.0, 2.0, 3.0] and raw.labels.tolist() == [1.0, 1.0, 1.0]
    (users, user_inv), (items, item_inv) = raw.singles
    assert users == ["a"] and user_inv.tolist() == [0, -1, 0]
    assert items == ["1", "2"] and item_inv.tolist() == [0, 0, 1]
    genres, genre_inv, splits = raw.bags[0]
    assert genres == ["x", "y"] and genre_inv.tolist() == [0, 1, 1]
    assert splits.tolist() == [0, 2, 2, 3]
    assert raw.ends == {0: 13, 1: 7}
    assert raw.bad == {"not_json": 1, "missing_label": 1}
    assert raw.highwater == {0: 20, 1: 7}


def test_head_cuts_before_the_first_good_event_left_out() -> None:
    raw = build().take()
    head = raw.head(2)
    assert head.n == 2
    # partition 0 stops before offset 11 (the third good event); partition 1 is read through.
    assert head.ends == {0: 11, 1: 7}
    assert head.bad == {"not_json": 1}  # offset 12 of partition 0 is after the cut
    assert head.bags[0][2].tolist() == [0, 2, 2]
    assert np.array_equal(head.singles[1][1], np.array([0, 0], dtype=np.int32))
    assert raw.head(3) is raw


def test_a_key_travels_once_and_the_numbering_starts_over_at_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    builder = build()
    builder.take()
    builder.add(event("b", 1, ["y", "z"]), partition=0, offset=13)
    builder.add(event("a", 3, []), partition=0, offset=14)
    raw = builder.take()
    (users, user_numbers), (items, item_numbers) = raw.singles
    assert users == ["b"] and user_numbers.tolist() == [1, 0]
    assert items == ["3"] and item_numbers.tolist() == [0, 2]
    assert raw.bags[0][0] == ["z"] and raw.bags[0][1].tolist() == [1, 2]
    assert raw.epoch == 0
    monkeypatch.setattr(event_columns, "MAX_KEYS", 3)
    builder.add(event("a", 1, []), partition=0, offset=15)
    assert builder.take().epoch == 0  # items reached 3 keys: the next batch renumbers
    builder.add(event("a", 1, []), partition=0, offset=16)
    raw = builder.take()
    assert raw.epoch == 1 and raw.singles[0][0] == ["a"] and raw.singles[0][1].tolist() == [0]
