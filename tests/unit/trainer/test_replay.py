"""`checknrun replay`'s events, without a broker: raw ids as the source names them, time order,
the user id as the record key, a clock for a source without time; bad options refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from schemas.events import EventFields, parse_event
from trainer.replay import SYNTHETIC_EPOCH, SYNTHETIC_STEP_S, event_chunks, main
from trainer.streams.base import DataError
from trainer.streams.synthetic import SyntheticConfig, SyntheticStream
from trainer.streams.tabular import ColumnMapping, load_table


def test_a_file_replays_its_raw_ids_in_time_order(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text("user,item,timestamp,label,tags,price\n7,a,100,1,x|y,1.5\n8,b,99,0,,2\n")
    stream = load_table(path, ColumnMapping(bags=("tags",), categorical=("price",)))
    (chunk,) = list(event_chunks(stream, 0, None))
    assert chunk.keys == [b"8", b"7"]
    docs = [json.loads(v) for v in chunk.values]
    assert docs[0] == {"ts": 99.0, "label": 0.0, "user": 8, "item": "b", "tags": [], "price": 2}
    assert docs[1]["tags"] == ["x", "y"] and docs[1]["price"] == "1.5"
    fields = EventFields(singles=("user", "item", "price"), bags=("tags",))
    assert parse_event(chunk.values[1], fields).ids == ("7", "a", "1.5")


def test_a_files_dense_columns_are_model_inputs_and_replay_as_event_fields(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.csv"
    path.write_text("user,item,timestamp,label,price,dwell\n7,a,100,1,,3\n8,b,99,0,2.5,-1\n")
    stream = load_table(path, ColumnMapping(dense=("price", "dwell")))
    names = stream.dense_names
    assert names[-4:] == ("price_log1p", "price_missing", "dwell_log1p", "dwell_missing")
    (batch,) = list(stream.batches(10))
    dense = batch.dense.numpy()  # in time order: user 8 first
    column = {n: dense[:, i].tolist() for i, n in enumerate(names)}
    assert column["price_missing"] == [0.0, 1.0] and column["price_log1p"][1] == 0.0
    assert column["price_log1p"][0] == pytest.approx(math.log1p(2.5))
    assert column["dwell_log1p"] == pytest.approx([-math.log1p(1), math.log1p(3)])
    (chunk,) = list(event_chunks(stream, 0, None))
    docs = [json.loads(v) for v in chunk.values]
    assert docs[0]["price"] == 2.5 and docs[0]["dwell"] == -1.0
    assert "price" not in docs[1] and docs[1]["dwell"] == 3.0  # missing: left out
    fields = EventFields(singles=("user", "item"), dense=("price", "dwell"))
    assert parse_event(chunk.values[0], fields).dense == (2.5, -1.0)
    # the fingerprint of a mapping without dense columns is the one it had before they existed
    assert "dense" not in repr(ColumnMapping())


@pytest.mark.parametrize(
    ("cell", "message"), [("abc", "must be numeric"), ("inf", "infinite value at file row 2")]
)
def test_a_dense_column_that_is_not_a_number_is_refused(
    tmp_path: Path, cell: str, message: str
) -> None:
    path = tmp_path / "log.csv"
    path.write_text(f"user,item,timestamp,label,price\n7,a,100,1,1\n8,b,101,0,{cell}\n")
    with pytest.raises(DataError, match=message):
        load_table(path, ColumnMapping(dense=("price",)))
    path.write_text("user,item,timestamp,label\n7,a,100,1\n")
    with pytest.raises(DataError, match="the dense column 'price' is missing"):
        load_table(path, ColumnMapping(dense=("price",)))


def test_a_stream_without_time_gets_a_clock_and_chunks_resume() -> None:
    stream = SyntheticStream(SyntheticConfig(cardinalities=(5, 7), num_samples=10, chunk=4))
    chunks = list(event_chunks(stream, 2, 9, chunk=4))
    assert [len(c.values) for c in chunks] == [4, 3]
    first = json.loads(chunks[0].values[0])
    assert first["ts"] == SYNTHETIC_EPOCH + 2 * SYNTHETIC_STEP_S
    assert set(first) == {"ts", "label", "c1", "c2"} and isinstance(first["c1"], int)
    assert chunks[0].keys[0] == str(first["c1"]).encode()


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--to", "http://x/t"],
        ["replay", "--to", "kafka://h:1/t", "--rate", "0"],
        ["replay", "--to", "kafka://h:1/t", "--start", "-1"],
    ],
)
def test_bad_options_exit_1(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    assert "checknrun replay" in capsys.readouterr().err  # one line, no traceback
