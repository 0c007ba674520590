"""A rank's rows sent to rank 0 read back as they were, a job's shards merge into whole tables,
and bytes that are not such rows are refused with a typed error (never unpickled)."""

from __future__ import annotations

import io
import pickle
import threading

import numpy as np
import pytest

from publisher.write.collective import ThreadCollective
from publisher.write.row_transfer import (
    RowTransferError,
    largest_magnitudes,
    merge_rank_rows,
    rows_from_bytes,
    rows_to_bytes,
)
from publisher.write.snapshot import TableRows


def _rows(name: str, ids: list[int], *, row_range: tuple[int, int] | None = None) -> TableRows:
    values = np.arange(len(ids) * 3, dtype=np.float32).reshape(len(ids), 3) - 4
    return TableRows(
        name=name,
        table_rows=10,
        codec="int4",
        row_ids=np.array(ids, dtype=np.int64),
        values=values,
        aux=np.ones((len(ids), 1), dtype=np.float32),
        row_range=row_range,
    )


def test_rows_read_back_as_sent() -> None:
    sent = [_rows("user", [1, 4], row_range=(0, 5)), _rows("item", [])]
    got = rows_from_bytes(rows_to_bytes(sent))
    assert [(t.name, t.table_rows, t.codec, t.row_range) for t in got] == [
        ("user", 10, "int4", (0, 5)),
        ("item", 10, "int4", None),
    ]
    for a, b in zip(sent, got, strict=True):
        np.testing.assert_array_equal(a.row_ids, b.row_ids)
        np.testing.assert_array_equal(a.values, b.values)
        assert b.aux.shape == (a.n_rows, 0)  # optimizer columns stay on their rank


def test_row_wise_shards_merge_into_one_table_in_row_order() -> None:
    rank0 = [_rows("user", [1, 4], row_range=(0, 5)), _rows("item", [2])]
    rank1 = [_rows("user", [5, 9], row_range=(5, 10))]
    (user, item) = merge_rank_rows([rank1, rank0])
    assert user.name == "user" and user.row_range is None
    assert user.row_ids.tolist() == [1, 4, 5, 9]
    np.testing.assert_array_equal(user.values[2:], rank1[0].values)
    assert item.row_ids.tolist() == [2]
    assert largest_magnitudes([user])["user"] == pytest.approx(4.0)


def test_two_ranks_sending_one_row_is_refused() -> None:
    with pytest.raises(RowTransferError, match="same row"):
        merge_rank_rows([[_rows("user", [1])], [_rows("user", [1])]])


@pytest.mark.parametrize(
    "data",
    [b"", b"not an archive", pickle.dumps({"meta": 1})],
    ids=["empty", "garbage", "a pickle"],
)
def test_bytes_that_are_not_rows_are_refused(data: bytes) -> None:
    with pytest.raises(RowTransferError):
        rows_from_bytes(data)


def test_an_archive_holding_a_pickled_object_is_refused() -> None:
    out = io.BytesIO()
    np.savez(out, meta=np.array([{"evil": 1}], dtype=object))
    with pytest.raises(RowTransferError):
        rows_from_bytes(out.getvalue())


def test_thread_collective_gathers_bytes_on_rank_0() -> None:
    ranks = ThreadCollective.group(3, timeout_s=10)
    got: dict[int, list[bytes] | None] = {}

    def run(c: ThreadCollective) -> None:
        got[c.rank] = c.gather_bytes(bytes([c.rank]) * (c.rank + 1))

    threads = [threading.Thread(target=run, args=(c,)) for c in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {0: [b"\x00", b"\x01\x01", b"\x02\x02\x02"], 1: None, 2: None}
