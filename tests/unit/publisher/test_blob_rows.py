"""write_blob / decode_blob: a blob of every row decodes in place, some rows are scattered."""

from __future__ import annotations

import numpy as np
import pytest

from publisher.codecs import QuantizedRows, decode_rows
from publisher.read.blob_rows import decode_blob, rows_between, write_blob
from schemas.delta_blob import DeltaBlob
from tests.support import delta_blob_of

ROWS, DIM, AUX = 50, 6, 2


def blob_of(ids: np.ndarray, codec: str = "int8", seed: int = 0) -> DeltaBlob:
    """A blob of rows `ids` of this file's table shape, as the store returns it."""
    return delta_blob_of(ids, codec, table_rows=ROWS, dim=DIM, aux_dim=AUX, seed=seed)


def decoded(blob: DeltaBlob) -> np.ndarray:
    """The blob's rows decoded by the codec directly."""
    q = QuantizedRows(
        codec=blob.codec, dim=blob.dim, codes=blob.codes, scale=blob.scale, bias=blob.bias
    )
    return decode_rows(q)


def test_a_blob_of_every_row_decodes_in_place() -> None:
    blob = blob_of(np.arange(ROWS))
    weights = np.full((ROWS, DIM), np.nan, dtype=np.float32)
    aux = np.full((ROWS, AUX), np.nan, dtype=np.float32)
    assert write_blob(blob, weights, aux) is None  # nothing to replay: the table is the write
    np.testing.assert_array_equal(weights, decoded(blob))
    np.testing.assert_array_equal(aux, blob.aux)


def test_some_rows_are_scattered_and_returned_for_replay() -> None:
    ids = np.array([0, 7, 8, 49])
    blob = blob_of(ids, codec="int4")
    weights = np.zeros((ROWS, DIM), dtype=np.float32)
    aux = np.zeros((ROWS, AUX), dtype=np.float32)
    rows = write_blob(blob, weights, aux)
    assert rows is not None
    np.testing.assert_array_equal(rows.ids, ids)
    np.testing.assert_array_equal(weights[ids], decoded(blob))
    np.testing.assert_array_equal(aux[ids], blob.aux)
    others = np.setdiff1d(np.arange(ROWS), ids)
    assert not weights[others].any() and not aux[others].any()
    # Replaying the returned rows on a second copy makes it bitwise equal (no aux on a server).
    second = np.zeros((ROWS, DIM), dtype=np.float32)
    rows.scatter(second)
    np.testing.assert_array_equal(second, weights)
    # The kept ids are an own copy: they do not pin the fetched bytes.
    assert not np.shares_memory(rows.ids, blob.row_ids) and rows.ids.flags.writeable


def test_without_aux_only_weights_are_written() -> None:
    blob = blob_of(np.array([3, 4]), codec="fp32")
    weights = np.zeros((ROWS, DIM), dtype=np.float32)
    write_blob(blob, weights)
    np.testing.assert_array_equal(weights[[3, 4]], decoded(blob))


def test_decode_blob_touches_no_table() -> None:
    blob = blob_of(np.array([1, 5]), codec="fp16")
    rows = decode_blob(blob)
    np.testing.assert_array_equal(rows.ids, [1, 5])
    np.testing.assert_array_equal(rows.values, decoded(blob))


def test_a_blob_without_rows_writes_nothing() -> None:
    blob = blob_of(np.array([], dtype=np.int64))
    weights = np.ones((ROWS, DIM), dtype=np.float32)
    rows = write_blob(blob, weights)
    assert rows is not None and rows.ids.size == 0 and (weights == 1).all()


@pytest.mark.parametrize(
    ("weights_shape", "aux_shape"),
    [((ROWS + 1, DIM), None), ((ROWS, DIM + 1), None), ((ROWS, DIM), (ROWS, AUX + 1))],
)
def test_a_table_of_another_shape_is_refused(
    weights_shape: tuple[int, int], aux_shape: tuple[int, int] | None
) -> None:
    weights = np.zeros(weights_shape, dtype=np.float32)
    aux = None if aux_shape is None else np.zeros(aux_shape, dtype=np.float32)
    with pytest.raises(ValueError, match="the table is"):
        write_blob(blob_of(np.arange(ROWS)), weights, aux)


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_rows_between_is_the_rows_in_range_with_ids_from_its_start(codec: str) -> None:
    ids = np.array([0, 7, 8, 20, 31, 49])
    blob = blob_of(ids, codec=codec)
    part = rows_between(blob, 8, 31)
    assert part.table_rows == 23 and part.codec == codec
    np.testing.assert_array_equal(part.row_ids, [0, 12])  # rows 8 and 20
    np.testing.assert_array_equal(decoded(part), decoded(blob)[2:4])
    np.testing.assert_array_equal(part.aux, blob.aux[2:4])
    assert np.shares_memory(part.codes, blob.codes)  # still encoded, not copied
    assert rows_between(blob, 21, 31).n_rows == 0  # no row of the blob in range
    assert rows_between(blob, 0, ROWS) is blob
    every = rows_between(blob_of(np.arange(ROWS), codec=codec), 10, 20)
    np.testing.assert_array_equal(every.row_ids, np.arange(10))  # every row in range: positions
