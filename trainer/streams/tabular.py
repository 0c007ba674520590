"""Any interaction log in CSV, TSV or Parquet, given a column mapping, replayed in time order.

    mapping = ColumnMapping(user="uid", item="sku", timestamp="ts", rating="stars",
                            rating_threshold=4, categorical=("country",), bags=("tags",))
    stream = load_table("log.parquet", mapping)

Sparse features: user, item, each extra categorical column, and each bag column (ids separated by
`bag_separator`). Dense features: hour-of-day and day-of-week (sin/cos) when there is a
timestamp, and log1p of the user's and the item's earlier interactions. Label: a 0/1 (or
boolean) column, or a numeric rating compared with a threshold (label = rating >= threshold).
Timestamps may be numbers (unix seconds), timestamps or ISO 8601 text; rows are replayed in
timestamp order (file order for ties, or throughout when no timestamp column is given).

Everything that is wrong with a file raises `DataError` naming the file and the column, and the
row where there is one: as a "file row", the file's data rows counted from 1 (the header is not
one) in the file's order, not in the replay order.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import csv

from publisher.dlrm import SparseFeature
from publisher.live_features import DenseFeature, time_features
from trainer.streams.base import (
    ColumnarStream,
    DataError,
    IdColumn,
    bag_column,
    id_column,
    prior_count_log,
)

CSV_SUFFIXES = (".csv", ".tsv")
PARQUET_SUFFIXES = (".parquet", ".pq")
_NAME_RE = re.compile(r"[^A-Za-z0-9_]")


@dataclass(frozen=True)
class ColumnMapping:
    """Which column of the file plays which role."""

    user: str = "user"
    item: str = "item"
    #: None: no timestamp, the file's order is the replay order.
    timestamp: str | None = "timestamp"
    #: a 0/1 or boolean column; used when `rating` is None.
    label: str = "label"
    #: a numeric column turned into label = (rating >= rating_threshold).
    rating: str | None = None
    rating_threshold: float = 4.0
    categorical: tuple[str, ...] = ()
    #: columns holding several ids per row, separated by `bag_separator`.
    bags: tuple[str, ...] = ()
    bag_separator: str = "|"
    #: numeric columns, a value missing where null or empty: each becomes the model's two dense
    #: inputs `<col>_log1p` and `<col>_missing` (publisher/live_features.py `DenseFeature`), and
    #: `checknrun replay` sends it as the event's field of that name (docs/FORMAT.md 8.4).
    #: Out of the repr, which a file stream's fingerprint hashes: a mapping without dense
    #: columns keeps the fingerprint it had (its dense inputs, also hashed, tell them apart).
    dense: tuple[str, ...] = field(default=(), repr=False)

    def required(self) -> dict[str, str]:
        """Column -> the role it plays, for every column this mapping reads."""
        roles: dict[str, str] = {self.user: "user", self.item: "item"}
        if self.timestamp is not None:
            roles[self.timestamp] = "timestamp"
        if self.rating is not None:
            roles[self.rating] = "rating"
        else:
            roles[self.label] = "label"
        for name in self.categorical:
            roles[name] = "categorical"
        for name in self.bags:
            roles[name] = "bag"
        for name in self.dense:
            roles[name] = "dense"
        return roles


def read_table(path: Path) -> pa.Table:
    """The file as an Arrow table, by suffix; DataError for anything unreadable."""
    suffix = path.suffix.lower()
    if suffix not in CSV_SUFFIXES + PARQUET_SUFFIXES:
        raise DataError(
            f"{path}: unknown file type {suffix or '(no suffix)'!r}; expected one of "
            f"{', '.join(CSV_SUFFIXES + PARQUET_SUFFIXES)}"
        )
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    try:
        if suffix in PARQUET_SUFFIXES:
            return pq.read_table(path)
        delimiter = "\t" if suffix == ".tsv" else ","
        return csv.read_csv(path, parse_options=csv.ParseOptions(delimiter=delimiter))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: cannot read it as {suffix[1:]}: {exc}") from exc


def load_table(path: str | os.PathLike[str], mapping: ColumnMapping) -> ColumnarStream:
    """The interaction stream a CSV/TSV/Parquet file holds, under `mapping`."""
    path = Path(path)
    table = read_table(path)
    roles = mapping.required()
    for column, role in roles.items():
        if column not in table.column_names:
            raise DataError(
                f"{path}: the {role} column {column!r} is missing; the file has columns "
                f"{table.column_names}"
            )
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows (only a header)")

    # Checked in file order, so an error names the row as the file has it.
    seconds: np.ndarray | None = None
    if mapping.timestamp is not None:
        seconds = _seconds(path, mapping.timestamp, table.column(mapping.timestamp))
    if mapping.rating is not None:
        rating = _numeric(path, mapping.rating, table.column(mapping.rating))
        labels = (rating >= mapping.rating_threshold).astype(np.float32)
    else:
        labels = _binary(path, mapping.label, table.column(mapping.label))
    numbers = {name: _numbers(path, name, table.column(name)) for name in mapping.dense}
    if seconds is not None:
        order = np.argsort(seconds, kind="stable")  # ties keep file order: deterministic
        table = table.take(pa.array(order))
        seconds, labels = seconds[order], labels[order]
        numbers = {name: values[order] for name, values in numbers.items()}

    names = _feature_names(path, mapping)
    columns: dict[str, IdColumn] = {}
    features: list[SparseFeature] = []
    for column, feature in names.items():
        values = table.column(column)
        if column in mapping.bags:
            ids, rows = _bag(path, column, values, mapping.bag_separator)
        else:
            ids, rows = id_column(values)
        columns[feature] = ids
        features.append(SparseFeature(feature, rows, bag=column in mapping.bags))

    dense_cols: dict[str, np.ndarray] = {}
    if seconds is not None:
        dense_cols.update(time_features(seconds))
    dense_cols["user_prior_log"] = prior_count_log(columns["user"].values) / 5.0
    dense_cols["item_prior_log"] = prior_count_log(columns["item"].values) / 5.0
    for name, values in numbers.items():
        numeric = DenseFeature(name)
        dense_cols.update(zip(numeric.input_names, numeric.inputs(values), strict=True))
    dense_names = tuple(dense_cols)
    dense = np.stack([dense_cols[n] for n in dense_names], axis=1).astype(np.float32)
    return ColumnarStream(
        source="file",
        features=tuple(features),
        columns=columns,
        dense_names=dense_names,
        dense=dense,
        labels=labels,
        fingerprint_parts=(path.name, path.stat().st_size, mapping),
        timestamps=seconds,
        numbers=numbers,
    )


def _feature_names(path: Path, mapping: ColumnMapping) -> dict[str, str]:
    """Column -> sparse feature name (a valid module name: letters, digits, underscores)."""
    names = {mapping.user: "user", mapping.item: "item"}
    for column in (*mapping.categorical, *mapping.bags):
        feature = _NAME_RE.sub("_", column) or "_"
        if feature in names.values() or column in names:
            raise DataError(
                f"{path}: column {column!r} is used twice or its feature name {feature!r} "
                "clashes with another feature"
            )
        names[column] = feature
    return names


def _numeric(path: Path, name: str, values: pa.ChunkedArray) -> np.ndarray:
    """float64 values of a column that must be numeric and complete."""
    _no_nulls(path, name, values)
    if pa.types.is_boolean(values.type):
        return np.asarray(pc.cast(values, pa.float64()).to_numpy(), dtype=np.float64)
    try:
        out = np.asarray(pc.cast(values, pa.float64()).to_numpy(), dtype=np.float64)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataError(f"{path}: column {name!r} must be numeric ({exc})") from exc
    if not np.isfinite(out).all():
        row = int(np.flatnonzero(~np.isfinite(out))[0])
        raise DataError(f"{path}: column {name!r} has a non-finite value at {_file_row(row)}")
    return out


def _numbers(path: Path, name: str, values: pa.ChunkedArray) -> np.ndarray:
    """float64 values of a numeric column, NaN where a value is missing (null, or an empty
    CSV cell); DataError for a non-numeric column or an infinite value."""
    try:
        out = np.asarray(
            pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataError(f"{path}: dense column {name!r} must be numeric ({exc})") from exc
    if np.isinf(out).any():
        row = int(np.flatnonzero(np.isinf(out))[0])
        raise DataError(f"{path}: dense column {name!r} has an infinite value at {_file_row(row)}")
    return out


def _binary(path: Path, name: str, values: pa.ChunkedArray) -> np.ndarray:
    """0/1 labels from a boolean or numeric column holding only 0 and 1."""
    labels = _numeric(path, name, values)
    bad = (labels != 0) & (labels != 1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{path}: label column {name!r} must hold 0/1, found {float(labels[row]):g} at "
            f"{_file_row(row)} (for ratings give the rating column and a threshold instead)"
        )
    return labels.astype(np.float32)


def _seconds(path: Path, name: str, values: pa.ChunkedArray) -> np.ndarray:
    """Unix seconds (float64) from a numeric, timestamp or ISO 8601 text column."""
    _no_nulls(path, name, values)
    kind = values.type
    if pa.types.is_timestamp(kind) or pa.types.is_date(kind):
        as_ts = pc.cast(values, pa.timestamp("us")) if pa.types.is_date(kind) else values
        micros = pc.cast(as_ts, pa.timestamp("us")).cast(pa.int64()).to_numpy()
        return np.asarray(micros, dtype=np.float64) / 1e6
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        try:
            parsed = pc.cast(values, pa.timestamp("us"))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise DataError(
                f"{path}: timestamp column {name!r} is neither numeric nor ISO 8601 ({exc})"
            ) from exc
        return np.asarray(parsed.cast(pa.int64()).to_numpy(), dtype=np.float64) / 1e6
    return _numeric(path, name, values)


def _no_nulls(path: Path, name: str, values: pa.ChunkedArray) -> None:
    if values.null_count:
        row = int(np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))[0])
        raise DataError(
            f"{path}: column {name!r} has {values.null_count} missing value(s), first at "
            f"{_file_row(row)}"
        )


def _file_row(index: int) -> str:
    """Row `index` (0-based, in file order) as messages name it."""
    return f"file row {index + 1}"


def _bag(path: Path, name: str, values: pa.ChunkedArray, sep: str) -> tuple[IdColumn, int]:
    """A text column of `sep`-separated ids as a bag column (missing or empty = empty bag)."""
    try:
        text = pc.fill_null(pc.cast(values.combine_chunks(), pa.string()), "")
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataError(f"{path}: bag column {name!r} cannot be read as text ({exc})") from exc
    return bag_column(text, sep)
