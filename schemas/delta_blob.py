"""The delta blob: one embedding table's rows at one version (docs/FORMAT.md §4).

A blob holds either every row of a table (a full checkpoint) or the modified rows (a delta), as
**absolute** values, so codec error never accumulates along a chain. All integers little-endian::

    offset      size        field
    0           8           magic  b"CNRDELTA"
    8           2           format_version u16 = 1; 2 for a bfloat16 aux; 3 for fp32 fields
    10          2           flags u16 = 0 (reserved, MUST be 0)
    12          4           header_len u32 (1 .. 65536)
    16          header_len  header: UTF-8 JSON object, exactly the fields below
    16+H        ...         sections rows, codes, scale_bias, aux: back to back, in that order
    end-4       4           crc32 (zlib) u32 of every byte before it

    header: table (str, 1..256 chars), codec (schemas.codec_names.CODECS), dim (1..65536),
            table_rows (1..2^31), n_rows (0..table_rows), aux_dim (0..65536),
            row_encoding ("all" | "bitmap" | "varint"; "all" only if n_rows == table_rows),
            sections: exactly 4 x {name, compression ("none" | "zstd"), stored_len, raw_len},
            in versions 2 and 3: aux_encoding ("float32" | "bfloat16"),
            in version 3 only: scale_bias_encoding ("float16" | "float32"; "float32" only for
            a codec whose layout stores fp32 fields, schemas.codec_names)

    section      raw bytes                       contents
    rows         0 | ceil(table_rows/8) | varint  see schemas.row_index
    codes        n_rows * row_bytes(codec, dim)   row-major; int codes packed LSB first
    scale_bias   4|8 * n_rows (int codecs) | 0    n_rows scales, then n_rows biases: fp16, or
                                                 fp32 with scale_bias_encoding "float32"
    aux          4|2 * n_rows * aux_dim           optimizer state, row-major: float32, or
                                                 bfloat16 (a float32's upper 16 bits)

Rules (MUST):

- Every raw_len equals the length above; stored_len == raw_len when compression is "none". The
  writer applies zstd to a section only when it shrinks it.
- The total length is exactly 16 + header_len + sum(stored_len) + 4.
- A reader treats the bytes as hostile and checks, in this order: total length cap and minimum
  length, magic, version and flags, header length, strict header parse, every size against the
  caps (nothing is allocated before this), exact total length, crc32, zstd with an output limit of
  raw_len, then the rows. Each failure raises its own `schemas.errors.FormatError` subclass.

Where FORMAT.md leaves a choice, this reader: takes 20 bytes (prefix + crc32) as the minimum
length; raises `BadHeaderError` for header_len 0 and `BlobTooLargeError` past the header cap;
checks the section-length rules (`SectionLengthError`) with the size arithmetic, before the exact
length; accepts a varint `rows` raw_len in n_rows..5*n_rows and leaves exact consumption to the
row check; parses the header by the JSON rule of every document (schemas/strict_json.py:
duplicate keys, NaN/Infinity and lone surrogates are a `BadHeaderError`); and
wants a zstd section to be exactly one frame whose declared content size, if any, is raw_len.
Padding bits of int codes are not checked (no error type exists for them).

Decoding is zero-copy for uncompressed sections: the arrays of the returned `DeltaBlob` are
read-only numpy views into the input buffer. The caps live in `BlobLimits`: a reader that knows
the blob's table passes `BlobLimits.for_table` (its manifest entry's shape), tests lower them.
"""

from __future__ import annotations

import json
import struct
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
import zstandard

from schemas import strict_json
from schemas.codec_names import (
    CODEC_BITS,
    CODECS,
    FIELD_BYTES,
    LAYOUTS,
    SCALE_BIAS_ENCODINGS,
    ScaleBiasEncoding,
    is_integer_codec,
    row_bytes,
    scale_bias_bytes,
)
from schemas.errors import (
    BadHeaderError,
    BadMagicError,
    BlobTooLargeError,
    ChecksumMismatchError,
    DecompressionError,
    SectionLengthError,
    TrailingBytesError,
    TruncatedBlobError,
    UnsupportedVersionError,
)
from schemas.row_index import (
    MAX_VARINT_BYTES,
    ROW_ENCODINGS,
    RowEncoding,
    bitmap_size,
    choose_encoding,
    decode_row_ids,
    encode_row_ids,
)

MAGIC: Final[bytes] = b"CNRDELTA"
#: the version of a blob whose aux is float32 (what every writer produced before version 2).
FORMAT_VERSION: Final[int] = 1
#: the version that adds the header field `aux_encoding` (docs/FORMAT.md section 4).
AUX_ENCODING_VERSION: Final[int] = 2
#: the version that adds `scale_bias_encoding` (fp32 fields: int8, whose codes are the byte
#: kernel's).
SCALE_BIAS_ENCODING_VERSION: Final[int] = 3
FORMAT_VERSIONS: Final[tuple[int, ...]] = (
    FORMAT_VERSION,
    AUX_ENCODING_VERSION,
    SCALE_BIAS_ENCODING_VERSION,
)
_PREFIX: Final[struct.Struct] = struct.Struct("<8sHHI")
_CRC: Final[struct.Struct] = struct.Struct("<I")
PREFIX_BYTES: Final[int] = _PREFIX.size
CRC_BYTES: Final[int] = _CRC.size
#: The shortest byte string that can be a blob: fixed prefix plus trailer.
MIN_BLOB_BYTES: Final[int] = PREFIX_BYTES + CRC_BYTES

# The ranges FORMAT.md fixes; `BlobLimits` may only tighten them.
MAX_HEADER_BYTES: Final[int] = 65536
MAX_TABLE_NAME_CHARS: Final[int] = 256
MAX_DIM: Final[int] = 65536
MAX_AUX_DIM: Final[int] = 65536
MAX_TABLE_ROWS: Final[int] = 2**31

SectionName = Literal["rows", "codes", "scale_bias", "aux"]
SECTION_NAMES: Final[tuple[SectionName, ...]] = ("rows", "codes", "scale_bias", "aux")
Compression = Literal["none", "zstd"]
COMPRESSIONS: Final[tuple[Compression, ...]] = ("none", "zstd")
AuxEncoding = Literal["float32", "bfloat16"]
AUX_ENCODINGS: Final[tuple[AuxEncoding, ...]] = ("float32", "bfloat16")
#: bytes per stored aux value.
_AUX_ITEMSIZE: Final[dict[AuxEncoding, int]] = {"float32": 4, "bfloat16": 2}

_HEADER_FIELDS: Final[tuple[str, ...]] = (
    "table",
    "codec",
    "dim",
    "table_rows",
    "n_rows",
    "aux_dim",
    "row_encoding",
    "sections",
)
_V2_HEADER_FIELDS: Final[tuple[str, ...]] = (*_HEADER_FIELDS, "aux_encoding")
_V3_HEADER_FIELDS: Final[tuple[str, ...]] = (*_V2_HEADER_FIELDS, "scale_bias_encoding")
_FIELDS_OF_VERSION: Final[dict[int, tuple[str, ...]]] = {
    FORMAT_VERSION: _HEADER_FIELDS,
    AUX_ENCODING_VERSION: _V2_HEADER_FIELDS,
    SCALE_BIAS_ENCODING_VERSION: _V3_HEADER_FIELDS,
}
#: numpy dtype of a stored scale or bias, by encoding (little-endian, as the format stores it).
_FIELD_DTYPE: Final[dict[ScaleBiasEncoding, str]] = {"float16": "<f2", "float32": "<f4"}
_SECTION_FIELDS: Final[tuple[str, ...]] = ("name", "compression", "stored_len", "raw_len")
# Bytes per decoded row id (int64): part of what a blob costs to decode, so it counts to the cap.
_ROW_ID_BYTES: Final[int] = 8

_GIB: Final[int] = 2**30

BytesLike = bytes | bytearray | memoryview


@dataclass(frozen=True)
class BlobLimits:
    """Caps a reader enforces before it allocates anything; defaults suit production.

    `max_total_bytes` caps the encoded blob, `max_decoded_bytes` the sum of the raw section
    lengths plus 8 bytes per decoded row id. The other caps default to the format's own ranges
    and can only be lowered: a value past the format's range is a `BadHeaderError`, a value within
    it but past a lowered cap a `BlobTooLargeError`.
    """

    max_total_bytes: int = 8 * _GIB
    max_decoded_bytes: int = 8 * _GIB
    max_header_bytes: int = MAX_HEADER_BYTES
    max_dim: int = MAX_DIM
    max_aux_dim: int = MAX_AUX_DIM
    max_table_rows: int = MAX_TABLE_ROWS

    @classmethod
    def for_table(
        cls, *, codec: str, dim: int, table_rows: int, n_rows: int, aux_dim: int, size: int
    ) -> BlobLimits:
        """Caps that admit a blob of exactly this shape and `size` bytes and nothing larger:
        what a reader that knows the blob's table (its manifest entry) passes, so a blob
        declaring more rows, wider rows or bigger sections than that table is refused from its
        header, before anything is inflated. Any row encoding fits: the row index may take
        up to a bitmap's or n_rows varints' length, whichever is larger, and the aux and the
        scale and bias any encoding the format has."""
        rows_len = max(bitmap_size(table_rows), MAX_VARINT_BYTES * n_rows)
        return cls(
            max_total_bytes=max(size, MIN_BLOB_BYTES),
            max_decoded_bytes=max(
                _decoded_bytes(codec, dim, n_rows, aux_dim, rows_len, encoding, fields)
                for encoding in AUX_ENCODINGS
                for fields in SCALE_BIAS_ENCODINGS
            ),
            max_dim=dim,
            max_aux_dim=aux_dim,
            max_table_rows=table_rows,
        )

    def __post_init__(self) -> None:
        bounds = {
            "max_total_bytes": (MIN_BLOB_BYTES, None),
            "max_decoded_bytes": (0, None),
            "max_header_bytes": (1, MAX_HEADER_BYTES),
            "max_dim": (1, MAX_DIM),
            "max_aux_dim": (0, MAX_AUX_DIM),
            "max_table_rows": (1, MAX_TABLE_ROWS),
        }
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if type(value) is not int or value < low or (high is not None and value > high):
                raise ValueError(f"BlobLimits.{name} = {value!r}, expected an int in {low}..{high}")


DEFAULT_LIMITS: Final[BlobLimits] = BlobLimits()


@dataclass(frozen=True)
class SectionHeader:
    """One entry of the header's `sections` list."""

    name: SectionName
    compression: Compression
    stored_len: int
    raw_len: int


@dataclass(frozen=True)
class BlobHeader:
    """The parsed JSON header of a blob, plus `header_len` (the JSON's byte length)."""

    table: str
    codec: str
    dim: int
    table_rows: int
    n_rows: int
    aux_dim: int
    row_encoding: RowEncoding
    sections: tuple[SectionHeader, SectionHeader, SectionHeader, SectionHeader]
    header_len: int
    #: "float32" for a version 1 blob, which has no such field.
    aux_encoding: AuxEncoding = "float32"
    #: "float16" for a version 1 or 2 blob, which has no such field.
    scale_bias_encoding: ScaleBiasEncoding = "float16"

    @property
    def data_offset(self) -> int:
        """Offset of the first section (the `rows` section)."""
        return PREFIX_BYTES + self.header_len

    @property
    def total_len(self) -> int:
        """The exact byte length of the blob this header describes."""
        return self.data_offset + sum(s.stored_len for s in self.sections) + CRC_BYTES


@dataclass(frozen=True, eq=False)
class DeltaBlob:
    """The decoded content of a delta blob: the encoded rows `row_ids` of one table.

    Row `row_ids[i]` is `codes[i]` (bytes of the codec), with `scale[i]`/`bias[i]` for integer
    codecs (both empty for fp32/fp16; both fp16 or, for a codec whose layout stores fp32 fields,
    both fp32: their dtype is the blob's `scale_bias_encoding`, and fp32 makes a version 3 blob)
    and optimizer state `aux[i]`, float32 in memory whatever
    `aux_encoding` stores: with "bfloat16" every aux value must be a bfloat16 value (its low 16
    bits zero; `round_to_bfloat16` makes one). A decoded blob's arrays are read-only and may be
    views into the decoded bytes. Equality compares every array bit for bit (so NaN payloads
    count); blobs are unhashable.
    """

    table: str
    codec: str
    dim: int
    table_rows: int
    row_ids: npt.NDArray[np.int64]
    codes: npt.NDArray[np.uint8]
    scale: npt.NDArray[np.float16] | npt.NDArray[np.float32]
    bias: npt.NDArray[np.float16] | npt.NDArray[np.float32]
    aux: npt.NDArray[np.float32]
    aux_encoding: AuxEncoding = "float32"

    @property
    def scale_bias_encoding(self) -> ScaleBiasEncoding:
        """How the blob stores its scale and bias: as `scale`'s dtype holds them."""
        itemsize = getattr(getattr(self.scale, "dtype", None), "itemsize", 2)
        return "float32" if itemsize == FIELD_BYTES["float32"] else "float16"

    @property
    def n_rows(self) -> int:
        """How many rows the blob holds."""
        return int(self.row_ids.shape[0])

    @property
    def aux_dim(self) -> int:
        """Optimizer-state float32 columns per row."""
        return int(self.aux.shape[1])

    @property
    def row_bytes(self) -> int:
        """Bytes of one row in `codes`."""
        return row_bytes(self.codec, self.dim)

    def validate(self) -> None:
        """Raise `ValueError` unless every field is within the format and the shapes agree.

        The encoder calls this; the decoder builds blobs that satisfy it by construction.
        """
        _check_table_name(self.table, ValueError)
        if not isinstance(self.codec, str) or self.codec not in CODEC_BITS:
            raise ValueError(f"codec {self.codec!r} unknown, expected one of {CODECS}")
        if not LAYOUTS[self.codec].reads_fields(self.scale_bias_encoding):
            raise ValueError(
                f"scale is {self.scale_bias_encoding}, expected float16 for codec {self.codec}"
            )
        _check_int("dim", self.dim, 1, MAX_DIM, ValueError)
        _check_int("table_rows", self.table_rows, 1, MAX_TABLE_ROWS, ValueError)
        ids = _check_array("row_ids", self.row_ids, "i", 8, 1)
        n = ids.shape[0]
        if n > self.table_rows:
            raise ValueError(f"{n} row ids, expected at most table_rows {self.table_rows}")
        if n:
            if int(ids[0]) < 0 or int(ids[-1]) >= self.table_rows:
                raise ValueError(
                    f"row ids span {int(ids[0])}..{int(ids[-1])}, expected 0..{self.table_rows - 1}"
                )
            steps = np.diff(ids)
            if steps.size and int(steps.min()) < 1:
                i = int(np.argmax(steps < 1)) + 1
                raise ValueError(
                    f"row ids must be strictly increasing: {int(ids[i])} follows "
                    f"{int(ids[i - 1])} at index {i}"
                )
        codes = _check_array("codes", self.codes, "u", 1, 2)
        if codes.shape != (n, self.row_bytes):
            raise ValueError(
                f"codes shape {codes.shape}, expected (n_rows, row_bytes) = {(n, self.row_bytes)}"
            )
        per_row = (n,) if is_integer_codec(self.codec) else (0,)
        encoding = self.scale_bias_encoding
        for name, arr in (("scale", self.scale), ("bias", self.bias)):
            if _check_array(name, arr, "f", FIELD_BYTES[encoding], 1).shape != per_row:
                raise ValueError(
                    f"{name} shape {arr.shape}, expected {per_row} for codec {self.codec}"
                )
        aux = _check_array("aux", self.aux, "f", 4, 2)
        if aux.shape[0] != n:
            raise ValueError(f"aux shape {aux.shape}, expected {n} rows")
        _check_int("aux_dim", aux.shape[1], 0, MAX_AUX_DIM, ValueError)
        if self.aux_encoding not in AUX_ENCODINGS:
            raise ValueError(f"aux_encoding {self.aux_encoding!r}, expected one of {AUX_ENCODINGS}")
        if self.aux_encoding == "bfloat16" and aux.size:
            low = _little_endian(aux).view("<u4") & 0xFFFF
            if low.any():
                row = int(np.flatnonzero(low.any(axis=1))[0])
                raise ValueError(
                    f"aux row {row} holds values that are not bfloat16 (low 16 bits set): "
                    "round them with round_to_bfloat16 first"
                )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeltaBlob):
            return NotImplemented
        scalars = ("table", "codec", "dim", "table_rows", "aux_encoding")
        arrays = ("row_ids", "codes", "scale", "bias", "aux")
        return all(getattr(self, f) == getattr(other, f) for f in scalars) and all(
            _same_bits(getattr(self, f), getattr(other, f)) for f in arrays
        )

    __hash__ = None  # type: ignore[assignment]


def _same_bits(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    return (
        a.shape == b.shape
        and a.dtype.kind == b.dtype.kind
        and a.dtype.itemsize == b.dtype.itemsize
        and _little_endian(a).tobytes() == _little_endian(b).tobytes()
    )


def _little_endian(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    return a.astype(a.dtype.newbyteorder("<"), copy=False)


def _check_array(name: str, arr: object, kind: str, itemsize: int, ndim: int) -> npt.NDArray[Any]:
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype.kind != kind or arr.dtype.itemsize != itemsize or arr.ndim != ndim:
        raise ValueError(
            f"{name} is {arr.dtype} with {arr.ndim} dims, expected kind {kind!r}, "
            f"{itemsize}-byte items, {ndim} dims"
        )
    return arr


def _check_int(name: str, value: object, low: int, high: int, error: type[ValueError]) -> int:
    # JSON true/false parse as bool, a subclass of int: the format wants real integers.
    if type(value) is not int:
        raise error(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise error(f"{name} {value} out of range, expected {low}..{high}")
    return value


def _check_table_name(value: object, error: type[ValueError]) -> str:
    if not isinstance(value, str):
        raise error(f"table must be a string, got {type(value).__name__} {value!r}")
    if not 1 <= len(value) <= MAX_TABLE_NAME_CHARS:
        raise error(f"table name of {len(value)} chars, expected 1..{MAX_TABLE_NAME_CHARS}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        # JSON can escape a lone surrogate; no UTF-8 writer could have produced it.
        raise error(f"table name {value!r} is not valid Unicode: {exc}") from exc
    return value


# --- encoding ---------------------------------------------------------------------------------


def round_to_bfloat16(values: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """float32 `values` rounded to the nearest bfloat16 (ties to even), as float32: what a
    bfloat16 aux section holds. Overflow rounds to inf, as IEEE rounding does; a NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    # Adding 0x7FFF plus the kept part's lowest bit and truncating rounds to nearest, ties to
    # even; in uint64 so the carry out of the top cannot wrap.
    wide = bits.astype(np.uint64)
    rounded = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16 << 16).astype("<u4")
    # A NaN whose payload sits only in the low bits would round to inf: keep it a (quiet) NaN.
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = (bits[nan] & 0xFFFF0000) | 0x00400000
    return rounded.view("<f4").astype(np.float32, copy=False)


def encode_delta_blob(blob: DeltaBlob, *, compress: bool = True, zstd_level: int = 3) -> bytes:
    """The bytes of `blob` in the delta blob format.

    Each non-empty section is zstd-compressed (at `zstd_level`) when `compress` is set and only
    if that makes it smaller. Raises `ValueError` if `blob.validate()` does.
    """
    blob.validate()
    encoding = choose_encoding(blob.row_ids, blob.table_rows)
    fields = blob.scale_bias_encoding
    scale_bias = b""
    if is_integer_codec(blob.codec):
        dtype = _FIELD_DTYPE[fields]
        scale_bias = (
            blob.scale.astype(dtype, copy=False).tobytes()
            + blob.bias.astype(dtype, copy=False).tobytes()
        )
    raws: tuple[bytes, ...] = (
        encode_row_ids(blob.row_ids, blob.table_rows, encoding),
        blob.codes.tobytes(),
        scale_bias,
        _aux_bytes(blob.aux, blob.aux_encoding),
    )
    compressor = zstandard.ZstdCompressor(level=zstd_level) if compress else None
    stored: list[bytes] = []
    sections: list[dict[str, object]] = []
    for name, raw in zip(SECTION_NAMES, raws, strict=True):
        payload, compression = raw, "none"
        if compressor is not None and raw:
            # The frame records its content size, which lets a reader check it before inflating.
            packed = compressor.compress(raw)
            if len(packed) < len(raw):
                payload, compression = packed, "zstd"
        stored.append(payload)
        sections.append(
            {
                "name": name,
                "compression": compression,
                "stored_len": len(payload),
                "raw_len": len(raw),
            }
        )
    header: dict[str, object] = {
        "table": blob.table,
        "codec": blob.codec,
        "dim": blob.dim,
        "table_rows": blob.table_rows,
        "n_rows": blob.n_rows,
        "aux_dim": blob.aux_dim,
        "row_encoding": encoding,
        "sections": sections,
    }
    # A float32 aux with fp16 fields stays version 1, byte for byte what readers before version
    # 2 read; fp32 fields make a version 3 blob, which names both encodings.
    version = FORMAT_VERSION
    if fields != "float16":
        header["aux_encoding"] = blob.aux_encoding
        header["scale_bias_encoding"] = fields
        version = SCALE_BIAS_ENCODING_VERSION
    elif blob.aux_encoding != "float32":
        header["aux_encoding"] = blob.aux_encoding
        version = AUX_ENCODING_VERSION
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(header_bytes) > MAX_HEADER_BYTES:  # pragma: no cover - a 256-char name stays far below
        raise ValueError(f"header of {len(header_bytes)} bytes exceeds {MAX_HEADER_BYTES}")
    parts = [_PREFIX.pack(MAGIC, version, 0, len(header_bytes)), header_bytes, *stored]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    parts.append(_CRC.pack(crc))
    return b"".join(parts)


def _aux_bytes(aux: npt.NDArray[np.float32], encoding: AuxEncoding) -> bytes:
    little = aux.astype("<f4", copy=False)
    if encoding == "float32":
        return little.tobytes()
    # validate() checked the low halves are zero: the upper halves are the bfloat16 values.
    return (np.ascontiguousarray(little).view("<u4") >> 16).astype("<u2").tobytes()


# --- decoding ---------------------------------------------------------------------------------


def peek_header(data: BytesLike, *, limits: BlobLimits = DEFAULT_LIMITS) -> BlobHeader:
    """Parse and check the prefix and header of a blob without touching its sections.

    `data` may be the whole blob or just its first 16 + header_len bytes. Runs the reader's checks
    up to and including the size arithmetic, but not the exact length or the crc32: the header is
    therefore unauthenticated, fine for inspection, not for trusting the sections.
    """
    return _read_header(_byte_view(data), limits, whole_blob=False)


def decode_delta_blob(data: BytesLike, *, limits: BlobLimits = DEFAULT_LIMITS) -> DeltaBlob:
    """Decode and fully check a blob; raise the documented `FormatError` subclass on any flaw.

    Uncompressed sections become read-only numpy views into `data` (no copy): if `data` is a
    mutable buffer, do not change it while the blob is in use.
    """
    buf = _byte_view(data)
    header = _read_header(buf, limits, whole_blob=True)
    total = header.total_len
    if len(buf) < total:
        raise TruncatedBlobError(
            f"blob is {len(buf)} bytes, expected {total} (16 + header_len {header.header_len} + "
            f"sections {total - header.data_offset - CRC_BYTES} + 4)"
        )
    if len(buf) > total:
        raise TrailingBytesError(
            f"blob is {len(buf)} bytes, the header accounts for {total}: "
            f"{len(buf) - total} trailing bytes"
        )
    (stored_crc,) = _CRC.unpack_from(buf, total - CRC_BYTES)
    actual_crc = zlib.crc32(buf[: total - CRC_BYTES])
    if actual_crc != stored_crc:
        raise ChecksumMismatchError(
            f"crc32 of the blob is 0x{actual_crc:08x}, expected the stored 0x{stored_crc:08x}"
        )

    payloads: list[BytesLike] = []
    offset = header.data_offset
    for section in header.sections:
        stored = buf[offset : offset + section.stored_len]
        offset += section.stored_len
        if section.compression == "zstd":
            payloads.append(_inflate(stored, section))
        else:
            payloads.append(stored)
    rows, codes, scale_bias, aux = payloads

    n = header.n_rows
    row_ids = decode_row_ids(rows, header.row_encoding, header.table_rows, n)
    codes_arr = np.frombuffer(codes, dtype=np.uint8).reshape(n, row_bytes(header.codec, header.dim))
    # For fp codecs the section is empty, so both are the (0,) arrays the blob wants.
    sb = np.frombuffer(scale_bias, dtype=_FIELD_DTYPE[header.scale_bias_encoding])
    scale, bias = sb[:n], sb[n:]
    if header.aux_encoding == "float32":
        aux_arr = np.frombuffer(aux, dtype="<f4").reshape(n, header.aux_dim)
    else:
        halves = np.frombuffer(aux, dtype="<u2").reshape(n, header.aux_dim)
        aux_arr = (halves.astype("<u4") << 16).view("<f4")
    for arr in (row_ids, codes_arr, scale, bias, aux_arr):
        arr.flags.writeable = False
    return DeltaBlob(
        table=header.table,
        codec=header.codec,
        dim=header.dim,
        table_rows=header.table_rows,
        row_ids=row_ids,
        codes=codes_arr,
        scale=scale,
        bias=bias,
        aux=aux_arr,
        aux_encoding=header.aux_encoding,
    )


def _byte_view(data: BytesLike) -> memoryview:
    """A flat byte memoryview of `data`, so slicing below never copies."""
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise TypeError("a blob must be a contiguous buffer")
        view = view.cast("B")
    return view


def _read_header(buf: memoryview, limits: BlobLimits, *, whole_blob: bool) -> BlobHeader:
    """The reader's steps up to the size arithmetic (everything that needs only the header)."""
    if len(buf) > limits.max_total_bytes:
        raise BlobTooLargeError(
            f"blob is {len(buf)} bytes, exceeds the cap of {limits.max_total_bytes}"
        )
    minimum = MIN_BLOB_BYTES if whole_blob else PREFIX_BYTES
    if len(buf) < minimum:
        raise TruncatedBlobError(f"blob is {len(buf)} bytes, expected at least {minimum}")
    magic, version, flags, header_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BadMagicError(f"magic is {bytes(magic)!r}, expected {MAGIC!r}")
    if version not in FORMAT_VERSIONS:
        raise UnsupportedVersionError(
            f"format_version is {version}, expected one of {FORMAT_VERSIONS}"
        )
    if flags != 0:
        raise UnsupportedVersionError(f"flags are 0x{flags:04x}, expected 0 (reserved)")
    if header_len == 0:
        raise BadHeaderError(f"header_len is 0, expected 1..{MAX_HEADER_BYTES}")
    if header_len > limits.max_header_bytes:
        raise BlobTooLargeError(
            f"header_len {header_len} exceeds the cap of {limits.max_header_bytes}"
        )
    needed = PREFIX_BYTES + header_len + (CRC_BYTES if whole_blob else 0)
    if len(buf) < needed:
        raise TruncatedBlobError(
            f"blob is {len(buf)} bytes, header_len {header_len} needs at least {needed}"
        )
    header = _parse_header(bytes(buf[PREFIX_BYTES : PREFIX_BYTES + header_len]), version)
    _check_sizes(header, limits)
    return header


def _parse_header(raw: bytes, version: int) -> BlobHeader:
    """The header from its JSON bytes, with every field's type and range checked (the fields of
    format `version`)."""
    obj = strict_json.loads(raw, BadHeaderError, "header")
    fields = _exact_fields(obj, _FIELDS_OF_VERSION[version], f"a version {version} header")
    aux_encoding = fields.get("aux_encoding", "float32")
    if not isinstance(aux_encoding, str) or aux_encoding not in AUX_ENCODINGS:
        raise BadHeaderError(
            f"aux_encoding {aux_encoding!r} unknown, expected one of {AUX_ENCODINGS}"
        )
    scale_bias_encoding = fields.get("scale_bias_encoding", "float16")
    if not isinstance(scale_bias_encoding, str) or scale_bias_encoding not in SCALE_BIAS_ENCODINGS:
        raise BadHeaderError(
            f"scale_bias_encoding {scale_bias_encoding!r} unknown, expected one of "
            f"{SCALE_BIAS_ENCODINGS}"
        )

    table = _check_table_name(fields["table"], BadHeaderError)
    codec = fields["codec"]
    if not isinstance(codec, str) or codec not in CODEC_BITS:
        raise BadHeaderError(f"codec {codec!r} unknown, expected one of {CODECS}")
    if not LAYOUTS[codec].reads_fields(scale_bias_encoding):
        raise BadHeaderError(
            f"scale_bias_encoding {scale_bias_encoding!r} for codec {codec}, whose scale and "
            "bias are float16"
        )
    dim = _check_int("dim", fields["dim"], 1, MAX_DIM, BadHeaderError)
    table_rows = _check_int("table_rows", fields["table_rows"], 1, MAX_TABLE_ROWS, BadHeaderError)
    n_rows = _check_int("n_rows", fields["n_rows"], 0, table_rows, BadHeaderError)
    aux_dim = _check_int("aux_dim", fields["aux_dim"], 0, MAX_AUX_DIM, BadHeaderError)
    row_encoding = fields["row_encoding"]
    if not isinstance(row_encoding, str) or row_encoding not in ROW_ENCODINGS:
        raise BadHeaderError(
            f"row_encoding {row_encoding!r} unknown, expected one of {ROW_ENCODINGS}"
        )
    if row_encoding == "all" and n_rows != table_rows:
        raise BadHeaderError(
            f"row_encoding 'all' with n_rows {n_rows}, expected n_rows == table_rows {table_rows}"
        )
    sections = _parse_sections(fields["sections"])
    return BlobHeader(
        table=table,
        codec=codec,
        dim=dim,
        table_rows=table_rows,
        n_rows=n_rows,
        aux_dim=aux_dim,
        row_encoding=row_encoding,
        sections=sections,
        header_len=len(raw),
        aux_encoding=aux_encoding,
        scale_bias_encoding=scale_bias_encoding,
    )


def _parse_sections(
    value: object,
) -> tuple[SectionHeader, SectionHeader, SectionHeader, SectionHeader]:
    if not isinstance(value, list) or len(value) != len(SECTION_NAMES):
        got = f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__
        raise BadHeaderError(f"sections is {got}, expected a list of {len(SECTION_NAMES)} objects")
    parsed: list[SectionHeader] = []
    for i, (entry, expected_name) in enumerate(zip(value, SECTION_NAMES, strict=True)):
        where = f"sections[{i}]"
        fields = _exact_fields(entry, _SECTION_FIELDS, where)
        name = fields["name"]
        if name != expected_name:
            raise BadHeaderError(
                f"{where}.name is {name!r}, expected {expected_name!r} "
                f"(order {', '.join(SECTION_NAMES)})"
            )
        compression = fields["compression"]
        if not isinstance(compression, str) or compression not in COMPRESSIONS:
            raise BadHeaderError(
                f"{where}.compression {compression!r} unknown, expected one of {COMPRESSIONS}"
            )
        # No upper bound here: the caps are checked against sizes in _check_sizes, and Python
        # ints cannot overflow.
        stored_len = _check_nonnegative(f"{where}.stored_len", fields["stored_len"])
        raw_len = _check_nonnegative(f"{where}.raw_len", fields["raw_len"])
        parsed.append(
            SectionHeader(
                name=expected_name,
                compression=compression,
                stored_len=stored_len,
                raw_len=raw_len,
            )
        )
    return parsed[0], parsed[1], parsed[2], parsed[3]


def _check_nonnegative(name: str, value: object) -> int:
    if type(value) is not int:
        raise BadHeaderError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < 0:
        raise BadHeaderError(f"{name} is {value}, expected >= 0")
    return value


def _exact_fields(obj: object, names: tuple[str, ...], where: str) -> Mapping[str, object]:
    if not isinstance(obj, dict):
        raise BadHeaderError(f"{where} must be a JSON object, got {type(obj).__name__}")
    missing = [n for n in names if n not in obj]
    if missing:
        raise BadHeaderError(f"{where} lacks field(s) {missing}, expected all of {list(names)}")
    extra = sorted(k for k in obj if k not in names)
    if extra:
        raise BadHeaderError(f"{where} has unknown field(s) {extra}, expected only {list(names)}")
    return obj


def _expected_raw_len(header: BlobHeader, name: SectionName) -> int:
    if name == "rows":
        if header.row_encoding == "bitmap":
            return bitmap_size(header.table_rows)
        return 0  # "all"; varint lengths are a range, handled by the caller
    return _row_sections(
        header.codec,
        header.dim,
        header.n_rows,
        header.aux_dim,
        header.aux_encoding,
        header.scale_bias_encoding,
    )[name]


def _row_sections(
    codec: str,
    dim: int,
    n_rows: int,
    aux_dim: int,
    aux_encoding: AuxEncoding,
    scale_bias_encoding: ScaleBiasEncoding,
) -> dict[SectionName, int]:
    """The raw lengths of the sections that hold `n_rows` rows: codes, scale_bias and aux."""
    return {
        "codes": n_rows * row_bytes(codec, dim),
        "scale_bias": scale_bias_bytes(codec, n_rows, scale_bias_encoding),
        "aux": _AUX_ITEMSIZE[aux_encoding] * n_rows * aux_dim,
    }


def _decoded_bytes(
    codec: str,
    dim: int,
    n_rows: int,
    aux_dim: int,
    rows_len: int,
    aux_encoding: AuxEncoding,
    scale_bias_encoding: ScaleBiasEncoding,
) -> int:
    """What decoding costs (`BlobLimits.max_decoded_bytes` caps it): every raw section, the
    `rows_len` bytes of the row index included, plus 8 bytes per decoded row id and, for a
    bfloat16 aux, the float32 values it widens to."""
    sections = sum(
        _row_sections(codec, dim, n_rows, aux_dim, aux_encoding, scale_bias_encoding).values()
    )
    widened = 0 if aux_encoding == "float32" else 4 * n_rows * aux_dim
    return _ROW_ID_BYTES * n_rows + rows_len + sections + widened


def _check_sizes(header: BlobHeader, limits: BlobLimits) -> None:
    """Check every declared and implied size against the caps, then against the format's rules.

    Runs before the exact-length check and before anything is allocated: a header claiming
    gigabytes fails here whatever the buffer holds.
    """
    for name, value, cap in (
        ("dim", header.dim, limits.max_dim),
        ("aux_dim", header.aux_dim, limits.max_aux_dim),
        ("table_rows", header.table_rows, limits.max_table_rows),
    ):
        if value > cap:
            raise BlobTooLargeError(f"{name} {value} exceeds the cap of {cap}")
    for s in header.sections:
        if s.stored_len > limits.max_total_bytes:
            raise BlobTooLargeError(
                f"section {s.name} declares stored_len {s.stored_len}, exceeds the cap of "
                f"{limits.max_total_bytes}"
            )
        if s.raw_len > limits.max_decoded_bytes:
            raise BlobTooLargeError(
                f"section {s.name} declares raw_len {s.raw_len}, exceeds the cap of "
                f"{limits.max_decoded_bytes}"
            )
    expected = {name: _expected_raw_len(header, name) for name in SECTION_NAMES}
    if header.row_encoding == "varint":
        expected["rows"] = header.sections[0].raw_len
    decoded = _decoded_bytes(
        header.codec,
        header.dim,
        header.n_rows,
        header.aux_dim,
        expected["rows"],
        header.aux_encoding,
        header.scale_bias_encoding,
    )
    if decoded > limits.max_decoded_bytes:
        raise BlobTooLargeError(
            f"decoding needs {decoded} bytes ({header.n_rows} rows of codec {header.codec}, dim "
            f"{header.dim}, aux_dim {header.aux_dim}), exceeds the cap of "
            f"{limits.max_decoded_bytes}"
        )
    for s in header.sections:
        if s.name == "rows" and header.row_encoding == "varint":
            low, high = header.n_rows, MAX_VARINT_BYTES * header.n_rows
            if not low <= s.raw_len <= high:
                raise SectionLengthError(
                    f"section rows has raw_len {s.raw_len}, expected {low}..{high} for "
                    f"{header.n_rows} varints of 1..{MAX_VARINT_BYTES} bytes"
                )
        elif s.raw_len != expected[s.name]:
            raise SectionLengthError(
                f"section {s.name} has raw_len {s.raw_len}, expected {expected[s.name]}"
            )
        if s.compression == "none" and s.stored_len != s.raw_len:
            raise SectionLengthError(
                f"section {s.name} is uncompressed with stored_len {s.stored_len}, expected "
                f"raw_len {s.raw_len}"
            )
    if header.total_len > limits.max_total_bytes:
        raise BlobTooLargeError(
            f"header declares a {header.total_len}-byte blob, exceeds the cap of "
            f"{limits.max_total_bytes}"
        )


def _inflate(stored: memoryview, section: SectionHeader) -> bytes:
    """Decompress one zstd section to exactly `raw_len` bytes, never allocating more than that.

    zstandard's one-shot `decompress` allocates whatever size the frame header declares and
    ignores `max_output_size` then, so the declared size is checked first. It also returns b""
    for a frame declaring 0 bytes without reading on, and treats `max_output_size=0` as
    unlimited, so an empty section takes a streaming path.
    """
    raw_len = section.raw_len
    where = f"section {section.name}"
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise DecompressionError(f"{where} is not a zstd frame: {exc}") from exc
    if declared not in (-1, raw_len):
        raise DecompressionError(
            f"{where}: the zstd frame declares {declared} bytes, expected raw_len {raw_len}"
        )
    decompressor = _decompressor()
    try:
        if raw_len > 0:
            out = decompressor.decompress(stored, max_output_size=raw_len, allow_extra_data=False)
        elif declared == 0:
            # zstd itself refuses output past a declared content size, so this stays bounded.
            stream = decompressor.decompressobj()
            out = stream.decompress(stored)
            if not stream.eof or stream.unused_data:
                raise DecompressionError(
                    f"{where}: the zstd frame is incomplete or followed by "
                    f"{len(stream.unused_data)} extra bytes, expected exactly one frame"
                )
        else:
            out = decompressor.decompress(stored, max_output_size=1, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise DecompressionError(f"{where}: invalid zstd data: {exc}") from exc
    if len(out) != raw_len:
        raise DecompressionError(
            f"{where} decompressed to {len(out)} bytes, expected raw_len {raw_len}"
        )
    return out


#: One zstd decompressor per thread: a new one allocates its context on first use, ~30 us (a
#: quiet core) against 5 us to inflate a small section, and a 20-version restore of 26 tables
#: inflates 2,000 sections. Each call resets it; it is not thread-safe, hence one per thread.
_THREAD_DECOMPRESSOR = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    decompressor: zstandard.ZstdDecompressor | None = getattr(
        _THREAD_DECOMPRESSOR, "decompressor", None
    )
    if decompressor is None:
        decompressor = _THREAD_DECOMPRESSOR.decompressor = zstandard.ZstdDecompressor()
    return decompressor
