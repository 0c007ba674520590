"""The data sources: MovieLens-1M (the real file), the synthetic stream, CSV/Parquet logs, and
the errors bad input gives."""

from __future__ import annotations

import csv as pycsv
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainer.streams.base import DataError, bag_column, encode_categories, prior_count_log
from trainer.streams.movielens import default_directory, load_movielens
from trainer.streams.synthetic import (
    SyntheticConfig,
    SyntheticStream,
    criteo_like_cardinalities,
)
from trainer.streams.tabular import ColumnMapping, load_table

# --- shared building blocks ----------------------------------------------------------------------


def test_encode_categories_first_appearance_and_nulls() -> None:
    ids, k = encode_categories(pa.array(["b", "a", None, "b", "c", None]))
    assert ids.tolist() == [0, 1, 2, 0, 3, 2] and k == 4


def test_prior_count_log_counts_earlier_occurrences() -> None:
    out = prior_count_log(np.array([5, 3, 5, 5, 3, 9]))
    assert np.allclose(np.expm1(out), [0, 0, 1, 2, 1, 0])


def test_bag_column_splits_and_empty_bags() -> None:
    column, k = bag_column(pa.array(["a|b", "", "b", "c|a|b"]), "|")
    assert k == 3
    assert column.splits is not None and column.splits.tolist() == [0, 2, 2, 3, 6]
    assert column.values.tolist() == [0, 1, 1, 2, 0, 1]
    batch = column.take(1, 4)
    assert batch.offsets.tolist() == [0, 0, 1] and batch.values.tolist() == [1, 2, 0, 1]


# --- MovieLens-1M --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def movielens() -> object:
    return load_movielens()


def test_movielens_shapes_and_features(movielens: object) -> None:
    from trainer.streams.base import ColumnarStream

    assert isinstance(movielens, ColumnarStream)
    s = movielens
    assert s.num_samples == 1_000_209
    rows = {f.name: f.rows for f in s.features}
    assert rows["user"] == 6040 and rows["item"] == 3706 and rows["gender"] == 2
    assert rows["age"] == 7 and rows["occupation"] == 21 and rows["genres"] == 18
    assert [f.name for f in s.features if f.bag] == ["genres"]
    assert 0.55 < float(s.labels.mean()) < 0.6  # rating >= 4 is ~57.5% of MovieLens-1M
    assert len(s.dense_names) == 7
    n = 5000
    batches = list(s.batches(1000, stop=n))
    assert [b.offset for b in batches] == [0, 1000, 2000, 3000, 4000]
    for b in batches:
        assert b.dense.shape == (1000, 7) and torch.isfinite(b.dense).all()
        genres = b.sparse["genres"]
        assert genres.offsets.shape == (1000,) and int(genres.values.max()) < 18


def test_movielens_is_in_timestamp_order_with_rating_labels(movielens: object) -> None:
    """The first samples are the earliest ratings of the raw file, labelled rating >= 4."""
    path = default_directory() / "ml-1m.inter"
    with path.open() as f:
        reader = pycsv.reader(f, delimiter="\t", quoting=pycsv.QUOTE_NONE)
        next(reader)
        rows = [(int(r[3]), i, float(r[2])) for i, r in enumerate(reader)]
    rows.sort()  # by timestamp, then file order: the replay order
    expected = np.array([rating >= 4 for _, _, rating in rows[:2000]], dtype=np.float32)
    labels = torch.cat([b.labels for b in movielens.batches(500, stop=2000)])  # type: ignore[attr-defined]
    assert np.array_equal(labels.numpy(), expected)


def test_movielens_missing_directory_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"ml-1m\.inter"):
        load_movielens(tmp_path)


# --- synthetic -----------------------------------------------------------------------------------


def small_config(**overrides: object) -> SyntheticConfig:
    base: dict[str, object] = {"cardinalities": (10, 3000, 20000, 4), "seed": 7, "chunk": 1000}
    base.update(overrides)
    return SyntheticConfig(**base)  # type: ignore[arg-type]


def concat_ids(batches: list, feature: str) -> np.ndarray:  # type: ignore[type-arg]
    return torch.cat([b.sparse[feature].values for b in batches]).numpy()


def test_synthetic_is_a_function_of_seed_and_offset() -> None:
    a = list(SyntheticStream(small_config()).batches(700, start=1300, stop=5000))
    b = list(SyntheticStream(small_config()).batches(333, start=300, stop=5000))
    for feature in ("c1", "c2", "c3", "c4"):
        assert np.array_equal(concat_ids(a, feature), concat_ids(b, feature)[1000:])
    la = torch.cat([x.labels for x in a])
    lb = torch.cat([x.labels for x in b])[1000:]
    assert torch.equal(la, lb)
    assert torch.equal(torch.cat([x.dense for x in a]), torch.cat([x.dense for x in b])[1000:])
    other = list(SyntheticStream(small_config(seed=8)).batches(700, start=1300, stop=5000))
    assert not np.array_equal(concat_ids(a, "c3"), concat_ids(other, "c3"))


def test_synthetic_ids_are_zipf_skewed_and_drift() -> None:
    s = SyntheticStream(small_config(drift=0.5))
    early = concat_ids(list(s.batches(1000, stop=20_000)), "c3")
    assert early.min() >= 0 and early.max() < 20_000
    counts = np.bincount(early, minlength=20_000)
    top = np.sort(counts)[::-1]
    assert top[:200].sum() > 0.3 * len(early)  # 1% of the ids take a large share
    late = concat_ids(list(s.batches(1000, start=1_000_000, stop=1_020_000)), "c3")
    hot_early = set(np.argsort(-counts)[:50].tolist())
    hot_late = set(np.argsort(-np.bincount(late, minlength=20_000))[:50].tolist())
    assert len(hot_early & hot_late) < 25  # popularity moved


def test_synthetic_labels_mix_and_stream_limits() -> None:
    s = SyntheticStream(small_config(num_samples=2500))
    batches = list(s.batches(1000))
    assert [b.size for b in batches] == [1000, 1000, 500]
    labels = torch.cat([b.labels for b in batches])
    assert 0.1 < float(labels.mean()) < 0.6
    assert s.reader_state(2500)["offset"] == 2500
    assert s.resume_offset(s.reader_state(1000)) == 1000
    with pytest.raises(DataError, match="past"):
        s.resume_offset({**s.reader_state(0), "offset": 3000})


def test_synthetic_default_tables_exceed_a_gigabyte_at_dim_64() -> None:
    rows = sum(criteo_like_cardinalities(730_000))
    assert rows * 64 * 4 > 1e9 and max(criteo_like_cardinalities(730_000)) == 730_000


def test_synthetic_rejects_bad_config() -> None:
    with pytest.raises(DataError, match="cardinalities"):
        SyntheticStream(SyntheticConfig(cardinalities=(0, 5)))
    with pytest.raises(DataError, match="cap"):
        criteo_like_cardinalities(0)


# --- CSV / Parquet -------------------------------------------------------------------------------

LOG = {
    "uid": ["u1", "u2", "u1", "u3", "u2", "u1"],
    "sku": [10, 11, 12, 10, 10, 13],
    "ts": [50, 10, 40, 30, 20, 40],
    "stars": [5.0, 2.0, 4.0, 3.0, 4.5, 1.0],
    "country": ["fr", "de", "fr", None, "de", "fr"],
    "tags": ["a|b", "", "b", "c", "a", "a|c"],
}
MAPPING = ColumnMapping(
    user="uid",
    item="sku",
    timestamp="ts",
    rating="stars",
    rating_threshold=4.0,
    categorical=("country",),
    bags=("tags",),
)


def write(tmp_path: Path, name: str, data: Mapping[str, Any]) -> Path:
    path = tmp_path / name
    table = pa.table(data)
    if name.endswith(".parquet"):
        pq.write_table(table, path)
    else:
        from pyarrow import csv

        csv.write_csv(table, path)
    return path


@pytest.mark.parametrize("name", ["log.csv", "log.parquet"])
def test_table_stream_from_csv_and_parquet(tmp_path: Path, name: str) -> None:
    s = load_table(write(tmp_path, name, LOG), MAPPING)
    assert s.source == "file" and s.num_samples == 6
    rows = {f.name: (f.rows, f.bag) for f in s.features}
    assert rows == {
        "user": (3, False),
        "item": (4, False),
        "country": (3, False),
        "tags": (3, True),
    }
    (batch,) = list(s.batches(10))
    # timestamp order 10, 20, 30, 40, 40, 50 (the two 40s keep file order): stars 2, 4.5, 3,
    # 4, 1, 5
    assert batch.labels.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert batch.sparse["tags"].offsets.tolist() == [0, 0, 1, 2, 3, 5]
    assert "hour_sin" in s.dense_names and batch.dense.shape == (6, len(s.dense_names))


def test_table_with_label_column_and_no_timestamp(tmp_path: Path) -> None:
    data = {"user": ["a", "b", "a"], "item": ["x", "x", "y"], "label": [1, 0, 1]}
    s = load_table(write(tmp_path, "l.csv", data), ColumnMapping(timestamp=None))
    (batch,) = list(s.batches(8))
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]
    assert s.dense_names == ("user_prior_log", "item_prior_log")


def test_iso_timestamps_are_parsed(tmp_path: Path) -> None:
    data = {
        "user": ["a", "b"],
        "item": ["x", "y"],
        "label": [1, 0],
        "timestamp": ["2024-01-02T00:00:00", "2024-01-01T12:00:00"],
    }
    s = load_table(write(tmp_path, "iso.csv", data), ColumnMapping())
    (batch,) = list(s.batches(8))
    assert batch.labels.tolist() == [0.0, 1.0]  # sorted by time


def test_missing_column_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "log.csv", LOG)
    with pytest.raises(DataError, match=r"rating column 'rating'.*missing"):
        load_table(path, ColumnMapping(user="uid", item="sku", timestamp="ts", rating="rating"))
    with pytest.raises(DataError, match="'label'"):
        load_table(path, ColumnMapping(user="uid", item="sku", timestamp="ts"))


def test_non_numeric_and_non_binary_labels(tmp_path: Path) -> None:
    data: dict[str, list[object]] = {
        "user": ["a", "b"],
        "item": ["x", "y"],
        "timestamp": [1, 2],
        "label": ["yes", "no"],
    }
    with pytest.raises(DataError, match="column 'label' must be numeric"):
        load_table(write(tmp_path, "a.csv", data), ColumnMapping())
    data["label"] = [1, 3]
    with pytest.raises(DataError, match=r"'label' must hold 0/1, found 3 at file row 2"):
        load_table(write(tmp_path, "b.csv", data), ColumnMapping())
    data["label"] = [1, None]
    with pytest.raises(DataError, match="'label' has 1 missing"):
        load_table(write(tmp_path, "c.csv", data), ColumnMapping())


@pytest.mark.parametrize("name", ["late.csv", "late.parquet"])
def test_errors_name_the_file_row_not_the_replay_row(tmp_path: Path, name: str) -> None:
    # The bad value is on the first data row, whose timestamp replays it last.
    data: dict[str, list[object]] = {
        "user": ["a", "b", "c"],
        "item": ["x", "y", "z"],
        "timestamp": [30, 10, 20],
        "label": [7, 0, 1],
    }
    with pytest.raises(DataError, match=r"found 7 at file row 1 "):
        load_table(write(tmp_path, name, data), ColumnMapping())
    data["label"] = [1, 0, None]
    with pytest.raises(DataError, match=r"1 missing value\(s\), first at file row 3$"):
        load_table(write(tmp_path, name, data), ColumnMapping())
    data["label"], data["stars"] = [1, 0, 1], [float("inf"), 4.0, 5.0]
    with pytest.raises(DataError, match=r"'stars' has a non-finite value at file row 1$"):
        load_table(write(tmp_path, name, data), ColumnMapping(rating="stars"))


def test_bad_timestamp_rating_and_names(tmp_path: Path) -> None:
    data: dict[str, list[object]]
    data = {"user": ["a"], "item": ["x"], "timestamp": ["yesterday"], "label": [1]}
    with pytest.raises(DataError, match="timestamp column 'timestamp'"):
        load_table(write(tmp_path, "t.csv", data), ColumnMapping())
    data = {"user": ["a"], "item": ["x"], "timestamp": [1], "r": ["five"]}
    with pytest.raises(DataError, match="column 'r' must be numeric"):
        load_table(write(tmp_path, "r.csv", data), ColumnMapping(rating="r"))
    data = {"user": ["a"], "item": ["x"], "timestamp": [1], "label": [1]}
    with pytest.raises(DataError, match="clashes"):
        load_table(write(tmp_path, "n.csv", data), ColumnMapping(categorical=("user",)))


def test_unknown_type_empty_and_header_only_files(tmp_path: Path) -> None:
    (tmp_path / "log.json").write_text("{}")
    with pytest.raises(DataError, match=r"unknown file type '.json'"):
        load_table(tmp_path / "log.json", ColumnMapping())
    (tmp_path / "empty.csv").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        load_table(tmp_path / "empty.csv", ColumnMapping())
    (tmp_path / "header.csv").write_text("user,item,timestamp,label\n")
    with pytest.raises(DataError, match="no rows"):
        load_table(tmp_path / "header.csv", ColumnMapping())
    with pytest.raises(DataError, match="not found"):
        load_table(tmp_path / "absent.parquet", ColumnMapping())
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="cannot read"):
        load_table(tmp_path / "broken.parquet", ColumnMapping())
