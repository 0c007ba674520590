"""Predict inputs of a model trained from raw events: raw ids mapped with the served version's
id maps, and the dense inputs derived from the request time and the maps' counts.

A model whose config carries `extra["live"]` (publisher/live_features.py) takes what a client
knows, never an encoded index or a derived feature:

    {"user": "u1", "item": 42, "genres": ["Drama", "Comedy"], "price": 12.5, "ts": 1700000000}

- a single-valued feature: one raw id, a JSON string or integer as in the events (`42` and
  `"42"` are one id, docs/FORMAT.md section 7); null or absent: no id, which the model reads as
  row 0 (in a dynamic id space, the unknown row), as the trainer does for an event without it,
  and which is counted in `unknown_ids` like an id the served version does not know;
- a bag feature: a list of raw ids (null or absent: an empty bag, which embeds to zeros);
- a dense feature (the spec's `dense_features`): a JSON number; null or absent: missing, as in
  the events (docs/FORMAT.md section 8.4: the model reads a missing flag);
- `ts`: optional unix seconds (UTC), finite and >= 0; null or absent: the request time.

Any other name is a 422, like a typo in a model of encoded ids.

It is done in two steps so that the served version is borrowed only for the second:
`parse_raw_examples` checks every value against the spec and makes ids canonical (one pass over
the body, a capped report, server/feature_problems.py); `RawExamples.to_batch` looks every id up
in the borrowed buffer's id maps (one dict lookup per id, one blake2b in a hashed space), so
the rows and the maps read come from one version; an id that version does not know takes row 0
and is counted in `unknown_ids`; the dense inputs are `LiveSpec.dense` of the times and of the
maps' counts (the trainer's rule: the prior count of an id without a row is 0) and of the dense
values. All of it costs
O(ids in the request), whatever the size of the maps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from publisher.dlrm import TABLE_PREFIX, SparseBatch
from publisher.id_map import UNKNOWN_ROW, IdMap, canonical_key
from publisher.live_features import LiveSpec
from schemas.events import finite_number
from server.feature_batch import FeatureBatch
from server.feature_problems import Problems

#: the request field holding an example's time.
TS_FIELD = "ts"


@dataclass(frozen=True)
class RawFeature:
    """The canonical ids one feature got in a batch: flat, and how many per example."""

    name: str
    bag: bool
    keys: list[str]
    lengths: npt.NDArray[np.int64]  # (n,); 0 or 1 for a single-valued feature


@dataclass(frozen=True)
class MappedExamples:
    """Model input for a batch of raw examples, and what mapping their ids found."""

    batch: FeatureBatch
    #: ids sent per feature; those the served version does not know (row 0), with the
    #: examples that sent none of a single-valued feature (row 0 too).
    ids: dict[str, int]
    unknown_ids: dict[str, int]


@dataclass(frozen=True)
class RawExamples:
    """A batch of raw examples, checked against a live spec, not yet mapped to rows."""

    spec: LiveSpec
    ts: npt.NDArray[np.float64]  # (n,)
    features: tuple[RawFeature, ...]
    #: (n, dense features): the dense features' values, NaN where missing.
    dense: npt.NDArray[np.float64] | None = None

    def to_batch(self, id_maps: Mapping[str, IdMap]) -> MappedExamples:
        """Rows and dense inputs from `id_maps` (table name -> map, one version's)."""
        n = int(self.ts.shape[0])
        sparse: dict[str, SparseBatch] = {}
        prior: dict[str, npt.NDArray[np.int64]] = {}
        ids: dict[str, int] = {}
        unknown: dict[str, int] = {}
        for feature in self.features:
            id_map = id_maps[TABLE_PREFIX + feature.name]
            rows = id_map.lookup(feature.keys)
            ids[feature.name] = len(feature.keys)
            known = np.ones(len(rows), dtype=np.bool_) if id_map.hashed else rows != UNKNOWN_ROW
            unknown[feature.name] = len(rows) - int(np.count_nonzero(known))
            if feature.bag:
                offsets = np.zeros(n, dtype=np.int64)
                if n > 1:
                    np.cumsum(feature.lengths[:-1], out=offsets[1:])
                sparse[feature.name] = SparseBatch(
                    torch.from_numpy(rows), torch.from_numpy(offsets)
                )
                continue
            # One row per example: no id (absent or null) reads row 0, as in training, and is
            # counted with the unknown ids.
            present = feature.lengths == 1
            unknown[feature.name] += n - len(rows)
            values = np.full(n, UNKNOWN_ROW, dtype=np.int64)
            values[present] = rows
            sparse[feature.name] = SparseBatch(
                torch.from_numpy(values), torch.arange(n, dtype=torch.int64)
            )
            if feature.name in self.spec.count_features:
                counts = np.zeros(n, dtype=np.int64)
                counts[present] = np.where(known, id_map.counts[rows], 0)
                prior[feature.name] = counts
        dense = torch.from_numpy(self.spec.dense(self.ts, prior, self.dense))
        return MappedExamples(FeatureBatch(dense=dense, sparse=sparse), ids, unknown)


def _dense_value(value: object, name: str) -> float | str:
    """`value` as dense feature `name`'s number, or why it is not one (the events' rule)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"dense feature {name!r} needs a number, got {type(value).__name__}"
    number = finite_number(value)
    if number is None:
        return f"dense feature {name!r} must be a finite number"
    return number


def _ts_value(value: object) -> float | str:
    """`value` as a request time, or why it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"`ts` needs a number of unix seconds, got {type(value).__name__}"
    seconds = finite_number(value)  # None: an integer past float's range
    if seconds is None or seconds < 0:
        return "`ts` must be finite unix seconds >= 0 (the events' rule)"
    return seconds


def parse_raw_examples(
    examples: Sequence[object], spec: LiveSpec, *, now: float, max_ids_per_bag: int = 4096
) -> RawExamples:
    """Check `examples` (as the client sent them) against `spec` and make their ids canonical;
    a missing `ts` is `now`. FeatureValidationError lists every invalid value or unknown name."""
    problems = Problems()
    known = {*spec.names, *spec.dense_feature_names, TS_FIELD}
    n = len(examples)
    ts = np.full(n, now, dtype=np.float64)
    dense = np.full((n, len(spec.dense_features)), np.nan)
    keys: dict[str, list[str]] = {f.name: [] for f in spec.features}
    lengths = {f.name: np.zeros(n, dtype=np.int64) for f in spec.features}
    for i, example in enumerate(examples):
        if not isinstance(example, Mapping):
            problems.add(
                i,
                None,
                f"an example is an object of raw ids, got {type(example).__name__}",
                "wrong_type",
            )
            continue
        problems.check_names(i, example, known, required=())
        when = example.get(TS_FIELD)
        if when is not None:
            seconds = _ts_value(when)
            if isinstance(seconds, str):
                problems.add(i, TS_FIELD, seconds, "bad_ts")
            else:
                ts[i] = seconds
        for feature in spec.features:
            value = example.get(feature.name)
            if value is None:
                continue
            got = keys_of(value, feature.name, feature.bag, max_ids_per_bag)
            if isinstance(got, tuple):
                problems.add(i, feature.name, *got)
                continue
            keys[feature.name].extend(got)
            lengths[feature.name][i] = len(got)
        for j, name in enumerate(spec.dense_feature_names):
            value = example.get(name)
            if value is None:
                continue
            number = _dense_value(value, name)
            if isinstance(number, str):
                problems.add(i, name, number, "bad_dense")
            else:
                dense[i, j] = number
    problems.raise_if_any()
    features = tuple(
        RawFeature(f.name, f.bag, keys[f.name], lengths[f.name]) for f in spec.features
    )
    return RawExamples(spec, ts, features, dense)


def keys_of(
    value: object, name: str, bag: bool, max_ids_per_bag: int
) -> list[str] | tuple[str, str]:
    """The canonical keys of one feature value (a bag: a list of raw ids; else one raw id), or
    (message, type) of what is wrong with it. A user's request adapter's raw ids are checked
    by the same rule (server/predictors.py)."""
    if bag:
        if not isinstance(value, list):
            return (
                f"bag feature {name!r} needs a list of ids (strings or integers), "
                f"got {type(value).__name__}",
                "wrong_type",
            )
        if len(value) > max_ids_per_bag:
            return (
                f"bag feature {name!r} has {len(value)} ids; at most {max_ids_per_bag}",
                "too_many_ids",
            )
        items = value
    else:
        items = [value]
    try:
        return [canonical_key(v) for v in items]
    except ValueError as exc:  # IdMapError, or an int too long for str()
        # The message names the rule broken, never the id itself (hostile text stays out).
        return f"an id of {name!r} is not valid: {exc}", "bad_id"
