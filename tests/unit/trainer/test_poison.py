"""A stream broken on purpose for a stretch (trainer/streams/poison.py): each kind changes only
its samples, the original stays as it was, and a bad spec is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.support import write_ratings
from trainer.streams.base import DataError
from trainer.streams.poison import Poison, poisoned
from trainer.streams.tabular import ColumnMapping, load_table


@pytest.fixture()
def stream(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "ratings.csv"
    write_ratings(path, 600)
    text = path.read_text().splitlines()
    # a numeric column, as replay sends it (`--dense-cols price`)
    lines = [text[0] + ",price"] + [f"{line},{i % 7 + 1}" for i, line in enumerate(text[1:])]
    path.write_text("\n".join(lines) + "\n")
    mapping = ColumnMapping(user="uid", item="movie", timestamp="ts", rating="stars")
    return load_table(path, replace(mapping, dense=("price",)))


def test_each_poison_changes_its_stretch_only(stream) -> None:  # type: ignore[no-untyped-def]
    labels = stream.labels.copy()
    items = stream.column("item").values.copy()
    price = np.array(stream.numbers["price"])
    out = poisoned(
        stream,
        [
            Poison.parse("labels:100:200"),
            Poison.parse("ids:item:300:400"),
            Poison.parse("dense:price*1000:450:500"),
        ],
    )
    assert np.array_equal(out.labels[100:200], 1 - labels[100:200])
    assert np.array_equal(out.labels[:100], labels[:100])
    assert np.array_equal(out.labels[200:], labels[200:])
    scrambled = out.column("item").values
    assert (scrambled[300:400] != items[300:400]).mean() > 0.8
    assert np.array_equal(scrambled[:300], items[:300])
    assert np.array_equal(scrambled[400:], items[400:])
    assert np.array_equal(out.numbers["price"][450:500], price[450:500] * 1000)
    assert np.array_equal(out.numbers["price"][:450], price[:450])
    # the original is untouched, and the permutation is the same every time
    assert np.array_equal(stream.labels, labels)
    assert np.array_equal(stream.column("item").values, items)
    again = poisoned(stream, [Poison.parse("ids:item:300:400")])
    assert np.array_equal(again.column("item").values, scrambled)


@pytest.mark.parametrize(
    "text",
    ["labels:5:5", "labels:item:1:2", "ids:1:2", "dense:price:1:2", "flip:1:2", "labels:-1:4"],
)
def test_a_bad_spec_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="poison"):
        Poison.parse(text)


def test_an_unknown_target_is_refused(stream) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DataError, match="no feature 'colour'"):
        poisoned(stream, [Poison.parse("ids:colour:1:2")])
    with pytest.raises(DataError, match="no numeric column 'weight'"):
        poisoned(stream, [Poison.parse("dense:weight*2:1:2")])
