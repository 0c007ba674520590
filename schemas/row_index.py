"""The `rows` section of a delta blob: which rows of a table a blob holds (docs/FORMAT.md §4).

A blob lists its row ids in one of three encodings:

- ``all``: every row of the table, 0 bytes.
- ``bitmap``: ceil(table_rows / 8) bytes; bit i (LSB first in byte i // 8) is set iff row i is
  present. The popcount MUST equal n_rows; bits at or past table_rows MUST be 0.
- ``varint``: n_rows unsigned LEB128 varints: the first row id, then the gap to the previous id.
  Gaps MUST be >= 1, ids MUST be < table_rows, no varint may exceed 5 bytes, and every byte MUST
  be consumed.

The writer picks the smaller of bitmap and varint (varint on a tie) and ``all`` when every row is
present. Decoders treat the bytes as hostile and raise `RowIndexError` naming the bad value and
what was expected; encoders take sorted unique ids and raise `ValueError` on anything else.
Everything is vectorised: no Python loop runs over rows, only over the at most 5 byte positions of
a varint.
"""

from __future__ import annotations

from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from schemas.errors import RowIndexError

RowEncoding = Literal["all", "bitmap", "varint"]
ROW_ENCODINGS: Final[tuple[RowEncoding, ...]] = ("all", "bitmap", "varint")

#: The longest varint the format allows: 5 x 7 payload bits hold any id below 2^31 with room.
MAX_VARINT_BYTES: Final[int] = 5
_MAX_VARINT_VALUE: Final[int] = (1 << (7 * MAX_VARINT_BYTES)) - 1

# Population count of every byte value: np.bitwise_count needs numpy >= 2, the project allows 1.26.
_POPCOUNT: Final[npt.NDArray[np.uint8]] = np.array(
    [bin(i).count("1") for i in range(256)], dtype=np.uint8
)

RowIds = npt.NDArray[np.int64]


def _as_row_ids(row_ids: npt.ArrayLike) -> RowIds:
    """The ids as a 1-D int64 array, refusing anything not sorted strictly increasing and >= 0."""
    ids = np.asarray(row_ids)
    if ids.ndim != 1:
        raise ValueError(f"row ids must be 1-D, got shape {ids.shape}")
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"row ids must be integers, got dtype {ids.dtype}")
    if (
        ids.dtype.kind == "u"
        and ids.dtype.itemsize >= 8
        and int(ids.max()) > np.iinfo(np.int64).max
    ):
        raise ValueError(f"row id {int(ids.max())} does not fit in int64")
    ids = ids.astype(np.int64, copy=False)
    if int(ids[0]) < 0:
        raise ValueError(f"row ids must be >= 0, got {int(ids[0])} first")
    bad = np.flatnonzero(ids[1:] <= ids[:-1])
    if bad.size:
        i = int(bad[0]) + 1
        raise ValueError(
            f"row ids must be strictly increasing, got {int(ids[i])} after {int(ids[i - 1])} "
            f"at index {i}"
        )
    return ids


def _check_table_rows(table_rows: int) -> None:
    if table_rows < 1:
        raise ValueError(f"table_rows must be >= 1, got {table_rows}")


def bitmap_size(table_rows: int) -> int:
    """Bytes of the bitmap encoding of a table of `table_rows` rows."""
    return (table_rows + 7) // 8


def varint_sizes(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Bytes each non-negative value takes as an unsigned LEB128 varint (no cap applied)."""
    sizes = np.ones(values.shape, dtype=np.int64)
    # Every further 7 payload bits cost one byte; values here stay below 2^63, so 8 steps suffice.
    for k in range(1, 9):
        sizes += values >= (1 << (7 * k))
    return sizes


def _gaps(ids: RowIds) -> RowIds:
    """The first id, then the differences to the previous id: what the varint encoding stores."""
    return np.diff(ids, prepend=np.int64(0))


def varint_size(row_ids: npt.ArrayLike) -> int:
    """Bytes of the varint encoding of sorted unique `row_ids`."""
    ids = _as_row_ids(row_ids)
    return int(varint_sizes(_gaps(ids)).sum())


def choose_encoding(row_ids: npt.ArrayLike, table_rows: int) -> RowEncoding:
    """The encoding a writer uses: ``all`` for every row, else the smaller of bitmap and varint.

    On a tie varint wins: it costs O(n_rows) to decode, the bitmap O(table_rows).
    """
    _check_table_rows(table_rows)
    ids = _as_row_ids(row_ids)
    if ids.size and int(ids[-1]) >= table_rows:
        raise ValueError(f"row id {int(ids[-1])} out of range for table_rows {table_rows}")
    if ids.size == table_rows:
        return "all"
    return "bitmap" if bitmap_size(table_rows) < varint_size(ids) else "varint"


# --- bitmap -----------------------------------------------------------------------------------


def encode_bitmap(row_ids: npt.ArrayLike, table_rows: int) -> bytes:
    """The bitmap of sorted unique `row_ids` < `table_rows`: bit i, LSB first, set iff i present."""
    _check_table_rows(table_rows)
    ids = _as_row_ids(row_ids)
    if ids.size and int(ids[-1]) >= table_rows:
        raise ValueError(f"row id {int(ids[-1])} out of range for table_rows {table_rows}")
    out = np.zeros(bitmap_size(table_rows), dtype=np.uint8)
    # Ids are unique, so no bit is set twice: the byte-wise OR can run unbuffered via ufunc.at
    # without a table_rows-sized bool temporary.
    np.bitwise_or.at(out, ids >> 3, np.left_shift(1, ids & 7).astype(np.uint8))
    return out.tobytes()


def decode_bitmap(data: npt.ArrayLike | bytes, table_rows: int, n_rows: int) -> RowIds:
    """The sorted row ids a bitmap holds, checking its length, popcount and padding bits.

    Raises `RowIndexError` if the bitmap is not ceil(table_rows / 8) bytes, its popcount is not
    `n_rows`, or a bit at or past `table_rows` is set.
    """
    bits = _as_bytes_array(data)
    expected_len = bitmap_size(table_rows)
    if bits.size != expected_len:
        raise RowIndexError(
            f"bitmap is {bits.size} bytes, expected ceil(table_rows / 8) = {expected_len} "
            f"for table_rows {table_rows}"
        )
    tail = table_rows % 8
    if tail and int(bits[-1]) >> tail:
        raise RowIndexError(
            f"bitmap padding bits set: last byte 0x{int(bits[-1]):02x}, expected bits {tail}..7 "
            f"to be 0 for table_rows {table_rows}"
        )
    popcount = int(_POPCOUNT[bits].sum(dtype=np.int64))
    if popcount != n_rows:
        raise RowIndexError(f"bitmap popcount is {popcount}, expected n_rows {n_rows}")
    # Only the non-zero bytes are unpacked, so the temporaries are bounded by 8 * n_rows rather
    # than by table_rows (a sparse bitmap of a 2^31-row table stays cheap).
    nonzero = np.flatnonzero(bits)
    present = np.unpackbits(bits[nonzero][:, None], axis=1, bitorder="little").astype(bool)
    candidates = (nonzero[:, None] << 3) + np.arange(8, dtype=np.int64)
    return np.ascontiguousarray(candidates[present], dtype=np.int64)


# --- varint -----------------------------------------------------------------------------------


def encode_varint(row_ids: npt.ArrayLike) -> bytes:
    """LEB128 varints of sorted unique `row_ids`: the first id, then the gaps to the previous id.

    Raises `ValueError` if a value would need more than 5 bytes (ids of the format stay < 2^31).
    """
    ids = _as_row_ids(row_ids)
    values = _gaps(ids)
    if values.size and int(values.max()) > _MAX_VARINT_VALUE:
        raise ValueError(
            f"row id gap {int(values.max())} needs more than {MAX_VARINT_BYTES} varint bytes"
        )
    sizes = varint_sizes(values)
    starts = np.cumsum(sizes) - sizes
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    for k in range(MAX_VARINT_BYTES):
        has = sizes > k
        payload = (values[has] >> (7 * k)) & 0x7F
        more = (sizes[has] > k + 1).astype(np.int64) << 7
        out[starts[has] + k] = (payload | more).astype(np.uint8)
    return out.tobytes()


def decode_varint(data: npt.ArrayLike | bytes, table_rows: int, n_rows: int) -> RowIds:
    """The row ids of a varint section, checking every rule of the format.

    Raises `RowIndexError` for a truncated varint (last byte has its continuation bit set), a
    count of varints other than `n_rows` (too few, or leftover bytes), a varint longer than 5
    bytes, a gap < 1 (ids not strictly increasing) and an id >= `table_rows`.
    """
    raw = _as_bytes_array(data)
    if raw.size and int(raw[-1]) & 0x80:
        raise RowIndexError(
            f"truncated varint: the last byte 0x{int(raw[-1]):02x} has its continuation bit set, "
            f"expected a terminating byte < 0x80"
        )
    is_end = raw < 0x80
    # Counting terminators first bounds every later temporary by n_rows, which the caller capped.
    count = int(np.count_nonzero(is_end))
    if count > n_rows:
        raise RowIndexError(
            f"leftover bytes: the varint section holds {count} varints, expected n_rows {n_rows}"
        )
    if count < n_rows:
        raise RowIndexError(
            f"the varint section holds only {count} varints ({raw.size} bytes), "
            f"expected n_rows {n_rows}"
        )
    ends = np.flatnonzero(is_end)
    lengths = np.diff(ends, prepend=np.int64(-1))
    if lengths.size and int(lengths.max()) > MAX_VARINT_BYTES:
        i = int(np.argmax(lengths > MAX_VARINT_BYTES))
        raise RowIndexError(
            f"varint {i} is {int(lengths[i])} bytes long, expected at most {MAX_VARINT_BYTES}"
        )
    # Horner's rule from each varint's last byte (its top 7 bits) back to its first, on the
    # varints still that long only: most gaps fit one byte, so the loop touches few.
    values = raw[ends].astype(np.int64)
    longer = np.flatnonzero(lengths > 1)
    back = 1
    while longer.size:
        values[longer] = (values[longer] << 7) | (raw[ends[longer] - back] & 0x7F)
        back += 1
        longer = longer[lengths[longer] > back]
    return _ids_from_gaps(values, table_rows)


def _ids_from_gaps(values: RowIds, table_rows: int) -> RowIds:
    """Turn (first id, gaps...) into ids, refusing gaps < 1 and ids >= table_rows.

    A varint holds up to 2^35 - 1, so a cumulative sum over hostile gaps could overflow int64 and
    wrap to a plausible id. Every gap >= table_rows already makes its id out of range, so those
    are rejected before the sum, which then stays below n_rows * 2^31 <= 2^62.
    """
    if values.size == 0:
        return values
    if values.size > 1:
        small = values[1:] < 1
        if small.any():
            i = int(np.argmax(small)) + 1
            raise RowIndexError(
                f"row id gap {int(values[i])} at index {i}: ids must be strictly increasing, "
                f"expected a gap >= 1"
            )
    big = values >= table_rows
    if big.any():
        i = int(np.argmax(big))
        # Gaps before i are < table_rows <= 2^31, so this Python-int sum is the true id.
        row_id = int(values[:i].sum()) + int(values[i])
        raise RowIndexError(
            f"row id {row_id} at index {i} out of range, expected < table_rows {table_rows}"
        )
    ids = np.cumsum(values)
    last = int(ids[-1])
    if last >= table_rows:
        i = int(np.argmax(ids >= table_rows))
        raise RowIndexError(
            f"row id {int(ids[i])} at index {i} out of range, expected < table_rows {table_rows}"
        )
    return ids


# --- all three --------------------------------------------------------------------------------


def encode_row_ids(row_ids: npt.ArrayLike, table_rows: int, encoding: RowEncoding) -> bytes:
    """The `rows` section for `row_ids` in `encoding` (see `choose_encoding`)."""
    if encoding == "all":
        ids = _as_row_ids(row_ids)
        if ids.size != table_rows or (ids.size and int(ids[-1]) != table_rows - 1):
            raise ValueError(
                f"encoding 'all' needs every row 0..{table_rows - 1}, got {ids.size} ids"
            )
        return b""
    if encoding == "bitmap":
        return encode_bitmap(row_ids, table_rows)
    if encoding == "varint":
        ids = _as_row_ids(row_ids)
        if ids.size and int(ids[-1]) >= table_rows:
            raise ValueError(f"row id {int(ids[-1])} out of range for table_rows {table_rows}")
        return encode_varint(ids)
    raise ValueError(f"unknown row encoding {encoding!r}, expected one of {ROW_ENCODINGS}")


def decode_row_ids(
    data: npt.ArrayLike | bytes, encoding: RowEncoding, table_rows: int, n_rows: int
) -> RowIds:
    """The row ids of a `rows` section in `encoding`; raises `RowIndexError` on any violation."""
    if encoding == "all":
        raw = _as_bytes_array(data)
        if raw.size:
            raise RowIndexError(f"encoding 'all' takes 0 bytes, got {raw.size}")
        if n_rows != table_rows:
            raise RowIndexError(
                f"encoding 'all' needs n_rows == table_rows, got {n_rows} and {table_rows}"
            )
        return np.arange(table_rows, dtype=np.int64)
    if encoding == "bitmap":
        return decode_bitmap(data, table_rows, n_rows)
    if encoding == "varint":
        return decode_varint(data, table_rows, n_rows)
    raise RowIndexError(f"unknown row encoding {encoding!r}, expected one of {ROW_ENCODINGS}")


def _as_bytes_array(data: npt.ArrayLike | bytes) -> npt.NDArray[np.uint8]:
    """A 1-D uint8 view of `data` (no copy for bytes, bytearray, memoryview or uint8 arrays)."""
    if isinstance(data, bytes | bytearray | memoryview):
        return np.frombuffer(data, dtype=np.uint8)
    arr = np.asarray(data)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise TypeError(f"expected bytes or a 1-D uint8 array, got {arr.dtype} {arr.shape}")
    return arr
