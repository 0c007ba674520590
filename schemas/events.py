"""One training event per Kafka record (docs/FORMAT.md section 8): parse, validate, count.

    fields = EventFields(singles=("user", "item"), bags=("genres",))
    event = parse_event(record_value, fields)      # EventError(reason) for a bad one
    encode_event(ts=..., rating=4, ids={"user": "42", ...})   # what a producer sends

An event is a UTF-8 JSON object of at most MAX_EVENT_BYTES, parsed by the JSON rule of every
document (schemas/strict_json.py): `ts` (event time, unix seconds), `label` in [0, 1] or else a
`rating` (label = rating >= the threshold), one raw id per single-valued feature and a list of
at most MAX_BAG_IDS raw ids per bag feature (section 7's key rule: schemas/id_map_blob.id_key),
and a JSON number (or nothing: missing) per dense feature (section 8.4). Everything else is
ignored. A bad event is skipped and counted under one reason of
BAD_REASONS; the checks run in that order, so an event has exactly one reason.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from schemas.errors import FormatError
from schemas.id_map_blob import MAX_KEY_BYTES, IdKeyError, id_key
from schemas.strict_json import StrictDecoder

MAX_EVENT_BYTES = 64 * 1024
MAX_BAG_IDS = 256
#: how far ahead of the reader's and the stream's clocks a trainer lets an event's `ts` run by
#: default (section 8.1: `--max-event-lead-s`); producers' clocks drift by seconds, not minutes.
MAX_EVENT_LEAD_S = 300.0
#: section 8.2's reasons, in the order the checks run.
BAD_REASONS = (
    "oversized",
    "not_json",
    "not_object",
    "missing_ts",
    "bad_ts",
    "missing_label",
    "bad_label",
    "bad_id",
    "too_many_ids",
    "bad_dense",
)
#: the fields an event names itself by; no feature may take them.
EVENT_FIELDS = ("ts", "label", "rating", "event_id")


class EventError(FormatError):
    """A record that is not a good event; `reason` is one of BAD_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class _NotJson(FormatError):
    """What the strict decoder raises; turned into EventError("not_json")."""


_DECODER = StrictDecoder(_NotJson, "event")
#: an int id below this in magnitude has at most MAX_KEY_BYTES - 1 digits.
_INT_LIMIT = 10 ** (MAX_KEY_BYTES - 1)


@dataclass(frozen=True)
class EventFields:
    """What the parser reads from an event: the trainer's features (distinct names, none of
    EVENT_FIELDS: publisher.live_features.LiveSpec checks them) and the rating rule."""

    singles: tuple[str, ...] = ()
    bags: tuple[str, ...] = ()
    rating_threshold: float = 4.0
    dense: tuple[str, ...] = ()


class Event(NamedTuple):
    """A good event: its time, its label, one key (or None) per single feature, a tuple of
    keys per bag feature and a value (or None: missing) per dense feature, each in the order of
    `EventFields`. (A tuple: one is built per record, and a frozen dataclass costs several times
    more to build.)"""

    ts: float
    label: float
    ids: tuple[str | None, ...]
    bags: tuple[tuple[str, ...], ...]
    dense: tuple[float | None, ...] = ()


def parse_event(value: bytes | None, fields: EventFields) -> Event:
    """The event a record's value holds; EventError naming the first rule it breaks."""
    obj, ts, label = event_object(value, fields)
    get = obj.get
    # A plain ASCII string of a valid length is the common case, checked inline.
    limit = MAX_KEY_BYTES
    ids = tuple(
        [
            v if type(v) is str and v.isascii() and 0 < len(v) <= limit else event_key(v, name)
            for name, v in zip(fields.singles, map(get, fields.singles), strict=True)
        ]
    )
    bags = tuple(event_bag(get(name), name) for name in fields.bags) if fields.bags else ()
    dense = tuple(event_number(get(name), name) for name in fields.dense)
    return Event(ts, label, ids, bags, dense)


def event_object(value: bytes | None, fields: EventFields) -> tuple[dict[str, Any], float, float]:
    """The first checks of `parse_event` (size, JSON, object, `ts`, label): the event's JSON
    object, its time and its label. A caller that maps ids itself then takes each feature's
    value through `event_key` / `event_bag`, in the order of `fields`."""
    if value is None:
        raise EventError("not_json", "the record has no value (a tombstone)")
    if len(value) > MAX_EVENT_BYTES:
        raise EventError("oversized", f"{len(value)} bytes, at most {MAX_EVENT_BYTES}")
    try:
        obj = _DECODER.loads(value)
    except _NotJson as exc:
        raise EventError("not_json", str(exc)) from exc
    if type(obj) is not dict:
        raise EventError("not_object", f"the value is a JSON {type(obj).__name__}, not an object")
    ts = obj.get("ts")
    if type(ts) is not float or not 0.0 <= ts < math.inf:  # the common case, checked inline
        ts = _time(ts)
    label = obj.get("label")
    if type(label) is not float or not 0.0 <= label <= 1.0:
        label = _label(obj, fields.rating_threshold)
    return obj, ts, label


def finite_number(value: object) -> float | None:
    """A JSON number as a finite float, None for anything else (a bool is not a number)."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None  # type: ignore[arg-type,return-value]
    if kind is int:
        try:
            return float(value)  # type: ignore[arg-type]
        except OverflowError:
            return None
    return None


def _time(value: object) -> float:
    if value is None:
        raise EventError("missing_ts", "no `ts`")
    ts = finite_number(value)
    if ts is None or ts < 0:
        raise EventError("bad_ts", f"`ts` must be a finite number >= 0, got {_shown(value)}")
    return ts


def _label(obj: Mapping[str, Any], threshold: float) -> float:
    label, rating = obj.get("label"), obj.get("rating")
    if label is not None:
        number = finite_number(label)
        if number is None or not 0.0 <= number <= 1.0:
            raise EventError("bad_label", f"`label` must be in [0, 1], got {_shown(label)}")
        return number
    if rating is not None:
        number = finite_number(rating)
        if number is None:
            raise EventError("bad_label", f"`rating` must be a finite number, got {_shown(rating)}")
        return 1.0 if number >= threshold else 0.0
    raise EventError("missing_label", "neither `label` nor `rating`")


def event_key(value: object, name: str) -> str | None:
    """The key of feature `name`'s value (None: absent or null); EventError("bad_id")."""
    if value is None:
        return None
    if type(value) is str and value.isascii() and 0 < len(value) <= MAX_KEY_BYTES:  # hot path
        return value
    if type(value) is int and -_INT_LIMIT < value < _INT_LIMIT:
        return str(value)
    try:
        return id_key(value)
    except IdKeyError as exc:
        raise EventError("bad_id", f"feature {name!r}: {exc}") from exc


def event_bag(value: object, name: str) -> tuple[str, ...]:
    """The keys of bag feature `name`'s value (absent or null: none); EventError otherwise."""
    if value is None:
        return ()
    if type(value) is not list:
        raise EventError("bad_id", f"bag feature {name!r} must be a list, got {_shown(value)}")
    if len(value) > MAX_BAG_IDS:
        raise EventError(
            "too_many_ids", f"bag feature {name!r} holds {len(value)} ids, at most {MAX_BAG_IDS}"
        )
    limit = MAX_KEY_BYTES
    keys = tuple(
        [
            v if type(v) is str and v.isascii() and 0 < len(v) <= limit else event_key(v, name)
            for v in value
        ]
    )
    if None in keys:
        raise EventError("bad_id", f"bag feature {name!r} holds a null")
    return keys  # type: ignore[return-value]


def event_number(value: object, name: str) -> float | None:
    """Dense feature `name`'s value as a float (None: absent or null, missing);
    EventError("bad_dense") for anything but a JSON number within float64's range."""
    if value is None:
        return None
    number = finite_number(value)
    if number is None:
        raise EventError(
            "bad_dense", f"dense feature {name!r} must be a finite number, got {_shown(value)}"
        )
    return number


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class BadEventCounts:
    """Bad events counted by reason (cumulative; `metrics` names them as manifests do)."""

    def __init__(self, counts: Mapping[str, int] | None = None) -> None:
        self.counts = dict.fromkeys(BAD_REASONS, 0)
        for reason, n in (counts or {}).items():
            self.add(reason, n)

    def add(self, reason: str, n: int = 1) -> None:
        if reason not in self.counts:
            raise ValueError(f"unknown bad-event reason {reason!r}; one of {BAD_REASONS}")
        self.counts[reason] += n

    def update(self, other: Mapping[str, int]) -> None:
        for reason, n in other.items():
            self.add(reason, n)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def metrics(self) -> dict[str, float]:
        """`bad_events_<reason>` for every reason, and `bad_events` (their sum)."""
        out = {f"bad_events_{r}": float(n) for r, n in self.counts.items()}
        out["bad_events"] = float(self.total)
        return out

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> BadEventCounts:
        """The counts a manifest's `metrics` carries (absent reasons count 0)."""
        return cls({r: int(metrics.get(f"bad_events_{r}", 0.0)) for r in BAD_REASONS})


def encode_event(
    *,
    ts: float,
    ids: Mapping[str, str | int | Sequence[str | int] | None],
    label: float | None = None,
    rating: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """The record value of one event (what `checknrun replay` produces): compact UTF-8 JSON.

    `ids` maps a feature to its raw id, or to a list of raw ids for a bag; None is left out.
    """
    doc: dict[str, Any] = {"ts": ts}
    if label is not None:
        doc["label"] = label
    if rating is not None:
        doc["rating"] = rating
    for name, value in ids.items():
        if value is None:
            continue
        doc[name] = list(value) if isinstance(value, list | tuple) else value
    if extra:
        doc.update(extra)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
