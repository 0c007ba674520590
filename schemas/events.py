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

The JSON is read by msgspec's C decoder where that provably gives what the strict rule gives
(`event_objects`: a record written canonically, ~1.1 us an event where `json.loads` under the
rule takes ~2.7), and by the strict rule itself everywhere else, so what is accepted, refused
and why is the rule's alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import msgspec

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

# The C decoder (msgspec, not orjson: orjson reads an integer past 64 bits as a float, so an id
# of 30 digits would turn into a bad_id; msgspec reads it as Python's int, as json does, and is
# as fast: 0.63 vs 0.69 us a MovieLens event here), typed to what an event may nest: a record
# nested deeper is read by the strict rule, so none is near the recursion limit, where the two
# decoders' limits differ by the frames between them. What it raises for bytes it does not read:
# ValueError for invalid UTF-8, RecursionError.
_Scalar = str | int | float | bool | None
_Flat = _Scalar | list[_Scalar]
_FAST = msgspec.json.Decoder(dict[str, _Flat | dict[str, _Flat]])
_CANONICAL = msgspec.json.Encoder().encode
_FAST_REFUSES = (msgspec.MsgspecError, ValueError, RecursionError)


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
    obj = _fast_object(value)
    if obj is None:
        obj = event_json(value)
    return obj, event_time(obj.get("ts")), event_label(obj, fields.rating_threshold)


def event_json(value: bytes | None) -> dict[str, Any]:
    """The first three checks (size, JSON, object) by the strict rule itself: the event's JSON
    object, or EventError("oversized" | "not_json" | "not_object")."""
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
    return obj


def event_objects(values: Sequence[bytes | None]) -> list[dict[str, Any] | None]:
    """Each record's JSON object as the strict rule reads it, decoded by msgspec; None for a
    record the C decoder does not read or that is not written canonically: the caller takes
    those through `event_json`, which gives the object or the reason.

    A record is read here only when it is byte for byte what msgspec writes for the object it
    decoded (compact, keys in their order, shortest round-trip floats, escapes only where JSON
    needs them: what `encode_event`, JSON.stringify, Jackson or Go write), and then the strict
    rule reads the same object, value for value and type for type: text msgspec wrote is UTF-8
    with no BOM, NaN, Infinity or lone surrogate, and an object it wrote names each key once;
    floats are read back to the same double by both (each rounds correctly), integers as
    Python ints by both (msgspec refuses past the 4,300 digits json does); the depth is at most
    3 (`_FAST`). Any other record (whitespace between tokens, `\\u00e9` for é, `1e+16`, a
    duplicate key, anything bad) takes the strict rule: no faster than before, and no different.

    Measured on MovieLens events: 0.36 us an event for the check, on 0.7 us for the decode,
    where `json.loads` under the rule takes 2.7 us.
    """
    if None in values:
        return list(map(_fast_object, values))
    present = cast("Sequence[bytes]", values)
    if max(map(len, present), default=0) > MAX_EVENT_BYTES:
        return list(map(_fast_object, values))
    try:
        objs: list[dict[str, Any] | None] = list(map(_FAST.decode, present))
        written = list(map(_CANONICAL, objs))
    except _FAST_REFUSES:
        return list(map(_fast_object, values))
    if written == list(values):
        return objs
    return [
        obj if w == value else None for obj, w, value in zip(objs, written, values, strict=True)
    ]


def _fast_object(value: bytes | None) -> dict[str, Any] | None:
    """One record's `event_objects`."""
    if value is None or len(value) > MAX_EVENT_BYTES:
        return None
    try:
        obj: dict[str, Any] = _FAST.decode(value)
        return obj if _CANONICAL(obj) == value else None
    except _FAST_REFUSES:
        return None


def event_time(value: object) -> float:
    """An event's `ts` field's value as its time; EventError("missing_ts" | "bad_ts")."""
    if type(value) is float and 0.0 <= value < math.inf:  # the common case, checked inline
        return value
    return _time(value)


def event_label(obj: Mapping[str, Any], threshold: float) -> float:
    """An event's label, from `label` or else `rating` (by `threshold`);
    EventError("missing_label" | "bad_label")."""
    label = obj.get("label")
    if type(label) is float and 0.0 <= label <= 1.0:  # the common case, checked inline
        return label
    return _label(obj, threshold)


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
