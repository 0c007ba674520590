"""`checknrun replay`'s events, without a broker: raw ids as the source names them, time order,
the user id as the record key, a clock for a source without time; bad options refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.events import EventFields, parse_event
from trainer.replay import SYNTHETIC_EPOCH, SYNTHETIC_STEP_S, event_chunks, main
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
