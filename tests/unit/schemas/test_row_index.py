"""The rows section of a delta blob: bitmap and varint encodings, the writer's choice, and every
rejection a hostile section can trigger (docs/FORMAT.md §4, `rows`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.errors import RowIndexError
from schemas.row_index import (
    MAX_VARINT_BYTES,
    bitmap_size,
    choose_encoding,
    decode_bitmap,
    decode_row_ids,
    decode_varint,
    encode_bitmap,
    encode_row_ids,
    encode_varint,
    varint_size,
)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# --- golden bytes -----------------------------------------------------------------------------


def test_varint_golden_bytes() -> None:
    # first id 0, then gaps 1, 128, 171 (LEB128: 7 payload bits per byte, low bits first)
    assert encode_varint(ids(0, 1, 129, 300)) == bytes.fromhex("00 01 80 01 ab 01")
    assert decode_varint(bytes.fromhex("00 01 80 01 ab 01"), 301, 4).tolist() == [0, 1, 129, 300]


def test_varint_five_bytes_hold_the_largest_id() -> None:
    largest = 2**31 - 1
    encoded = encode_varint(ids(largest))
    assert encoded == bytes.fromhex("ff ff ff ff 07")
    assert decode_varint(encoded, 2**31, 1).tolist() == [largest]


def test_bitmap_golden_bytes_lsb_first() -> None:
    assert encode_bitmap(ids(0, 9), 10) == b"\x01\x02"
    assert encode_bitmap(ids(0, 2, 3, 5, 6, 8, 9), 10) == b"\x6d\x03"
    assert decode_bitmap(b"\x6d\x03", 10, 7).tolist() == [0, 2, 3, 5, 6, 8, 9]


def test_empty_encodings() -> None:
    assert encode_varint(ids()) == b""
    assert decode_varint(b"", 10, 0).tolist() == []
    assert encode_bitmap(ids(), 10) == b"\x00\x00"
    assert decode_bitmap(b"\x00\x00", 10, 0).tolist() == []
    assert decode_row_ids(b"", "varint", 10, 0).dtype == np.int64


def test_all_encoding() -> None:
    assert encode_row_ids(np.arange(5, dtype=np.int64), 5, "all") == b""
    assert decode_row_ids(b"", "all", 5, 5).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="every row"):
        encode_row_ids(ids(0, 1), 5, "all")


# --- the writer's choice ----------------------------------------------------------------------


def test_choose_encoding() -> None:
    assert choose_encoding(np.arange(10, dtype=np.int64), 10) == "all"
    assert choose_encoding(ids(0, 2, 3, 5, 6, 8, 9), 10) == "bitmap"
    assert choose_encoding(ids(3), 1000) == "varint"
    assert choose_encoding(ids(), 10) == "varint"
    # 2 bytes either way: varint wins the tie (cheaper to decode)
    assert choose_encoding(ids(1, 7), 10) == "varint"


@settings(max_examples=200, deadline=None)
@given(
    table_rows=st.integers(1, 5000),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.2, 0.5, 0.95, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_and_choice_property(table_rows: int, density: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    row_ids = np.flatnonzero(rng.random(table_rows) < density).astype(np.int64)
    n = row_ids.size
    bitmap = encode_bitmap(row_ids, table_rows)
    varint = encode_varint(row_ids)
    assert len(bitmap) == bitmap_size(table_rows)
    assert len(varint) == varint_size(row_ids)
    np.testing.assert_array_equal(decode_bitmap(bitmap, table_rows, n), row_ids)
    np.testing.assert_array_equal(decode_varint(varint, table_rows, n), row_ids)
    choice = choose_encoding(row_ids, table_rows)
    if n == table_rows:
        assert choice == "all"
    else:
        assert choice == ("bitmap" if len(bitmap) < len(varint) else "varint")
    encoded = encode_row_ids(row_ids, table_rows, choice)
    np.testing.assert_array_equal(decode_row_ids(encoded, choice, table_rows, n), row_ids)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 2**31 // 64), min_size=1, max_size=60))
def test_varint_round_trip_with_large_gaps(gaps: list[int]) -> None:
    row_ids = np.cumsum(np.array(gaps, dtype=np.int64)) - 1
    encoded = encode_varint(row_ids)
    assert len(encoded) <= MAX_VARINT_BYTES * len(gaps)
    np.testing.assert_array_equal(decode_varint(encoded, 2**31, len(gaps)), row_ids)


def test_large_inputs_are_vectorised() -> None:
    # A million rows would take seconds with a Python loop per row.
    row_ids = np.arange(0, 3_000_000, 3, dtype=np.int64)
    assert decode_varint(encode_varint(row_ids), 3_000_000, row_ids.size).size == row_ids.size
    assert decode_bitmap(encode_bitmap(row_ids, 3_000_000), 3_000_000, row_ids.size).size == (
        row_ids.size
    )


# --- encoder input errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row_ids", "match"),
    [
        (ids(3, 2), "strictly increasing"),
        (ids(2, 2), "strictly increasing"),
        (ids(-1, 2), ">= 0"),
        (np.array([0.0, 1.0]), "integers"),
        (np.zeros((2, 2), dtype=np.int64), "1-D"),
    ],
)
def test_encoders_refuse_bad_ids(row_ids: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_varint(row_ids)
    with pytest.raises(ValueError, match=match):
        encode_bitmap(row_ids, 10)


def test_encoders_refuse_ids_out_of_range() -> None:
    with pytest.raises(ValueError, match="out of range"):
        encode_bitmap(ids(10), 10)
    with pytest.raises(ValueError, match="out of range"):
        encode_row_ids(ids(10), 10, "varint")
    with pytest.raises(ValueError, match="varint bytes"):
        encode_varint(ids(2**35))


# --- decoder rejections -----------------------------------------------------------------------


def test_bitmap_wrong_length() -> None:
    with pytest.raises(RowIndexError, match="bitmap is 1 bytes, expected ceil"):
        decode_bitmap(b"\x01", 10, 1)


def test_bitmap_popcount_mismatch() -> None:
    with pytest.raises(RowIndexError, match="popcount is 3, expected n_rows 2"):
        decode_bitmap(b"\x07\x00", 10, 2)


def test_bitmap_padding_bits_set() -> None:
    # table_rows 10: bits 10..15 (bits 2..7 of the last byte) are padding
    with pytest.raises(RowIndexError, match="padding bits set: last byte 0x04"):
        decode_bitmap(b"\x01\x04", 10, 2)


def test_varint_truncated() -> None:
    with pytest.raises(RowIndexError, match="truncated varint: the last byte 0x86"):
        decode_varint(b"\x01\x86", 10, 2)


def test_varint_leftover_bytes() -> None:
    with pytest.raises(RowIndexError, match=r"leftover bytes: .* 3 varints, expected n_rows 2"):
        decode_varint(b"\x01\x06\x01", 10, 2)


def test_varint_too_few() -> None:
    with pytest.raises(RowIndexError, match=r"only 1 varints .* expected n_rows 2"):
        decode_varint(b"\x81\x06", 1000, 2)


def test_varint_longer_than_five_bytes() -> None:
    with pytest.raises(RowIndexError, match="varint 0 is 6 bytes long, expected at most 5"):
        decode_varint(b"\x81\x80\x80\x80\x80\x00\x01", 10, 2)


def test_varint_gap_zero_is_non_increasing() -> None:
    with pytest.raises(RowIndexError, match=r"gap 0 at index 1: .* expected a gap >= 1"):
        decode_varint(b"\x01\x00", 10, 2)


@pytest.mark.parametrize(
    ("data", "bad_id", "index"),
    [
        (b"\x0a\x01", 10, 0),  # the first id itself
        (b"\x01\x09", 10, 1),  # a single gap past the end
        (b"\x05\x04\x01", 10, 2),  # only the running sum reaches table_rows
    ],
)
def test_varint_id_out_of_range(data: bytes, bad_id: int, index: int) -> None:
    n = len(data)
    with pytest.raises(RowIndexError, match=f"row id {bad_id} at index {index} out of range"):
        decode_varint(data, 10, n)


def test_varint_huge_gaps_do_not_wrap_around() -> None:
    # 2^35 - 1 per gap: a naive int64 cumulative sum would wrap after 2^28 of them; the decoder
    # refuses the first gap >= table_rows, so it never sums such values.
    one_gap = bytes.fromhex("ff ff ff ff 7f")
    with pytest.raises(RowIndexError, match=r"row id 34359738368 at index 1 out of range"):
        decode_varint(b"\x01" + one_gap * 3, 2**31, 4)


def test_all_with_bytes_or_wrong_count() -> None:
    with pytest.raises(RowIndexError, match="'all' takes 0 bytes, got 1"):
        decode_row_ids(b"\x00", "all", 5, 5)
    with pytest.raises(RowIndexError, match="n_rows == table_rows"):
        decode_row_ids(b"", "all", 5, 4)


def test_unknown_encoding() -> None:
    with pytest.raises(RowIndexError, match="unknown row encoding"):
        decode_row_ids(b"", "runs", 5, 0)  # type: ignore[arg-type]
