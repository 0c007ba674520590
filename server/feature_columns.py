"""A v2 request's tensors straight into the built-in DLRM's input batch, checked column by column
with numpy: no per-example step (server/feature_batch.py is the per-example form of /v1).

The rules are the per-example form's (a dense value a finite number within float32, an id in its
table `[0, rows)` unless the config hashes, a bag at most `max_ids_per_bag` ids); a column
breaking one is reported once, naming the feature and the first example that breaks it. The
tensors: a dense feature `[B]` or `[B, 1]` of a float or integer type, a single-valued sparse
feature `[B]` or `[B, 1]` of an integer type, a bag its ids flat and `<bag>_lengths` `[B]`.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from publisher.dlrm import DLRMConfig, SparseBatch
from server.feature_batch import FeatureBatch
from server.feature_problems import Problems

LENGTHS = "_lengths"
_FLOAT32_MAX = 3.0e38


def build_columnar_batch(
    tensors: Mapping[str, np.ndarray], config: DLRMConfig, *, max_ids_per_bag: int = 4096
) -> FeatureBatch:
    """The model's input batch of `tensors`; FeatureValidationError listing what is wrong."""
    problems = Problems()
    expected = {*config.dense}
    for f in config.sparse:
        expected.add(f.name)
        if f.bag:
            expected.add(f.name + LENGTHS)
    for name in sorted(set(tensors) - expected)[: problems.room()]:
        problems.add(
            None, name, f"unknown input {name!r}; the model takes {sorted(expected)}", "unknown"
        )
    for name in sorted(expected - set(tensors))[: problems.room()]:
        problems.add(None, name, f"input {name!r} is missing", "missing")
    problems.raise_if_any()
    batch = _batch_size(tensors, config)
    dense = np.zeros((batch, len(config.dense)), dtype=np.float32)
    for j, name in enumerate(config.dense):
        column = _single(tensors[name], name, batch, problems)
        if column is None:
            continue
        if column.dtype.kind not in "fiu":
            problems.add(None, name, f"dense feature {name!r} needs numbers", "wrong_type")
            continue
        values = column.astype(np.float64)
        at = _first(~np.isfinite(values) | (np.abs(values) > _FLOAT32_MAX))
        if at is not None:
            message = f"dense feature {name!r} must be finite and within float32, got {values[at]}"
            problems.add(at, name, message, "not_finite")
            continue
        dense[:, j] = values
    sparse: dict[str, SparseBatch] = {}
    for feature in config.sparse:
        name = feature.name
        if feature.bag:
            got = _bag(tensors, name, batch, max_ids_per_bag, problems)
        else:
            column = _single(tensors[name], name, batch, problems)
            got = None if column is None else (column, np.ones(batch, dtype=np.int64))
        if got is None:
            continue
        ids, lengths = got
        if ids.dtype.kind not in "iu":
            problems.add(None, name, f"ids of {name!r} must be integers", "wrong_type")
            continue
        rows = _ids(ids, name, feature.rows, config.hashing, problems)
        if rows is None:
            continue
        offsets = np.zeros(batch, dtype=np.int64)
        if batch > 1:
            np.cumsum(lengths[:-1], out=offsets[1:])
        sparse[name] = SparseBatch(torch.from_numpy(rows), torch.from_numpy(offsets))
    problems.raise_if_any()
    return FeatureBatch(dense=torch.from_numpy(dense), sparse=sparse)


def _first(bad: np.ndarray) -> int | None:
    """The first example `bad` marks (a column is reported once), None if none."""
    where = np.flatnonzero(bad)
    return int(where[0]) if len(where) else None


def _batch_size(tensors: Mapping[str, np.ndarray], config: DLRMConfig) -> int:
    first = config.dense[0] if config.dense else None
    for f in config.sparse:
        if first is None:
            first = f.name + LENGTHS if f.bag else f.name
    assert first is not None
    return int(tensors[first].shape[0]) if tensors[first].ndim else 0


def _single(array: np.ndarray, name: str, batch: int, problems: Problems) -> np.ndarray | None:
    if not (array.ndim == 1 or (array.ndim == 2 and array.shape[1] == 1)) or len(array) != batch:
        problems.add(
            None,
            name,
            f"input {name!r} is one value per example ([{batch}] or [{batch}, 1]), got shape "
            f"{list(array.shape)}",
            "wrong_shape",
        )
        return None
    return array.reshape(-1)


def _bag(
    tensors: Mapping[str, np.ndarray],
    name: str,
    batch: int,
    max_ids: int,
    problems: Problems,
) -> tuple[np.ndarray, np.ndarray] | None:
    lengths = _single(tensors[name + LENGTHS], name + LENGTHS, batch, problems)
    if lengths is None:
        return None
    if lengths.dtype.kind not in "iu":
        problems.add(None, name, f"{name + LENGTHS!r} must be integers", "wrong_type")
        return None
    counts = lengths.astype(np.int64)
    at = _first((counts < 0) | (counts > max_ids))
    if at is not None:
        message = f"bag feature {name!r} has {int(counts[at])} ids; 0 to {max_ids}"
        problems.add(at, name, message, "too_many_ids")
        return None
    ids = tensors[name].reshape(-1)
    if int(counts.sum()) != len(ids):
        problems.add(
            None,
            name,
            f"{name + LENGTHS!r} add up to {int(counts.sum())}, {name!r} holds {len(ids)} ids",
            "wrong_shape",
        )
        return None
    return ids, counts


def _ids(
    ids: np.ndarray, name: str, rows: int, hashing: bool, problems: Problems
) -> np.ndarray | None:
    """int64 rows of `ids`: in range, or folded by modulo when the config hashes."""
    if ids.dtype == np.uint64 and len(ids) and int(ids.max()) > np.iinfo(np.int64).max:
        problems.add(None, name, f"ids of {name!r} must fit in int64", "out_of_range")
        return None
    values = ids.astype(np.int64)
    if hashing:
        return np.remainder(values, rows)
    bad = np.flatnonzero((values < 0) | (values >= rows))
    if len(bad):
        problems.add(
            None,
            name,
            f"id {int(values[bad[0]])} of {name!r} is outside its table [0, {rows})",
            "id_out_of_range",
        )
        return None
    return values


#: the Python types a JSON number arrives as (bool, an int subclass, is not one).
NUMBER_TYPES = frozenset({int, float})


def examples_as_columns(
    examples: Sequence[object], config: DLRMConfig
) -> dict[str, np.ndarray] | None:
    """The columns of well-formed `examples` (every one a dict of exactly the model's features,
    each value of its kind's Python type), or None when any is not: the caller then checks them
    one by one (`server.feature_batch.build_batch`) for the report of what is wrong.

    One list comprehension per feature and a C-level type check per column (`set(map(type,
    ...))`), so /v1's per-example JSON costs about what the naive endpoint's loop does; the
    values' rules (ranges, finiteness, bag lengths) are then the columnar checks'."""
    names = {*config.dense, *(f.name for f in config.sparse)}
    if not examples or set(map(type, examples)) != {dict}:
        return None
    keys: Iterable[object] = map(dict.keys, examples)  # type: ignore[arg-type]
    if not all(map(operator.eq, itertools.repeat(names), keys)):  # set == keys: C-level
        return None
    rows: Sequence[dict[str, object]] = examples  # type: ignore[assignment]
    columns: dict[str, np.ndarray] = {}
    for name in config.dense:
        column = [ex[name] for ex in rows]
        if not set(map(type, column)) <= NUMBER_TYPES:
            return None
        try:
            columns[name] = np.asarray(column, dtype=np.float64)
        except OverflowError:
            return None
    for feature in config.sparse:
        column = [ex[feature.name] for ex in rows]
        if feature.bag:
            if set(map(type, column)) != {list}:
                return None
            flat: list[object] = list(itertools.chain.from_iterable(column))  # type: ignore[arg-type]
            if flat and set(map(type, flat)) != {int}:
                return None
            lengths = map(len, column)  # type: ignore[arg-type]
            columns[feature.name + LENGTHS] = np.fromiter(lengths, np.int64, len(column))
            column = flat
        elif set(map(type, column)) != {int}:
            return None
        try:
            columns[feature.name] = np.asarray(column, dtype=np.int64)
        except OverflowError:  # beyond int64: the per-example form says so
            return None
    return columns
