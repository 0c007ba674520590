"""The delta blob format (docs/FORMAT.md §4): golden bytes, round trips, and one test per rejection.

Rejections are built from hand-made bytes (`assemble`, `tiny_blob`), not from the encoder, so
the tests check the reader against the spec rather than against the writer. The crc32 is fixed
up wherever a test means to reach a check that comes after it.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec_names import CODECS, is_integer_codec, row_bytes
from schemas.delta_blob import (
    BlobLimits,
    DeltaBlob,
    decode_delta_blob,
    encode_delta_blob,
    peek_header,
    round_to_bfloat16,
)
from schemas.errors import (
    BadHeaderError,
    BadMagicError,
    BlobTooLargeError,
    ChecksumMismatchError,
    DecompressionError,
    FormatError,
    RowIndexError,
    SectionLengthError,
    TrailingBytesError,
    TruncatedBlobError,
    UnsupportedVersionError,
)
from schemas.row_index import choose_encoding

# --- golden bytes -----------------------------------------------------------------------------

GOLDEN_HEADER = (
    b'{"table":"t","codec":"int4","dim":3,"table_rows":10,"n_rows":2,"aux_dim":1,'
    b'"row_encoding":"varint","sections":['
    b'{"name":"rows","compression":"none","stored_len":2,"raw_len":2},'
    b'{"name":"codes","compression":"none","stored_len":4,"raw_len":4},'
    b'{"name":"scale_bias","compression":"none","stored_len":8,"raw_len":8},'
    b'{"name":"aux","compression":"none","stored_len":8,"raw_len":8}]}'
)
GOLDEN_ROWS = b"\x01\x06"  # varint: id 1, gap 6 -> row 7
GOLDEN_CODES = b"\x21\x03\x54\x06"  # int4 LSB first: row 1 = [1, 2, 3], row 7 = [4, 5, 6]
GOLDEN_SCALE_BIAS = b"\x00\x3c\x00\x38" + b"\x00\x00\x00\xbc"  # scales 1.0, 0.5; biases 0.0, -1.0
GOLDEN_AUX = b"\x00\x00\x80\x3e" + b"\x00\x00\x00\x40"  # float32 0.25, 2.0
GOLDEN = (
    b"CNRDELTA"  # magic
    b"\x01\x00"  # format_version 1
    b"\x00\x00"  # flags 0
    b"\x76\x01\x00\x00"  # header_len 374
    + GOLDEN_HEADER
    + GOLDEN_ROWS
    + GOLDEN_CODES
    + GOLDEN_SCALE_BIAS
    + GOLDEN_AUX
    + b"\xed\xb9\xac\xa9"  # crc32 0xa9acb9ed
)

GOLDEN_BITMAP = (
    b"CNRDELTA\x01\x00\x00\x00\x78\x01\x00\x00"  # header_len 376
    b'{"table":"t","codec":"fp16","dim":1,"table_rows":10,"n_rows":7,"aux_dim":0,'
    b'"row_encoding":"bitmap","sections":['
    b'{"name":"rows","compression":"none","stored_len":2,"raw_len":2},'
    b'{"name":"codes","compression":"none","stored_len":14,"raw_len":14},'
    b'{"name":"scale_bias","compression":"none","stored_len":0,"raw_len":0},'
    b'{"name":"aux","compression":"none","stored_len":0,"raw_len":0}]}'
    b"\x6d\x03"  # rows 0, 2, 3, 5, 6 | 8, 9 (bit i of byte i // 8, LSB first)
    b"\x00\x3c\x00\x40\x00\xc0\x00\x38\x00\x00\xff\x7b\x00\x80"  # fp16 1, 2, -2, .5, 0, max, -0
    b"\x3c\x45\xce\xc9"  # crc32
)

# Decode-only: zstd output may differ between library versions, its decoding does not.
GOLDEN_ZSTD = (
    b"CNRDELTA\x01\x00\x00\x00\x78\x01\x00\x00"
    b'{"table":"t","codec":"int8","dim":32,"table_rows":4,"n_rows":4,"aux_dim":0,'
    b'"row_encoding":"all","sections":['
    b'{"name":"rows","compression":"none","stored_len":0,"raw_len":0},'
    b'{"name":"codes","compression":"zstd","stored_len":17,"raw_len":128},'
    b'{"name":"scale_bias","compression":"none","stored_len":16,"raw_len":16},'
    b'{"name":"aux","compression":"none","stored_len":0,"raw_len":0}]}'
    b"\x28\xb5\x2f\xfd\x20\x80\x45\x00\x00\x10\x00\x00\x01\x00\x3b\x05\x58"  # 128 zero bytes
    b"\x00\x3c\x00\x3c\x00\x3c\x00\x3c"  # scales 1.0
    b"\x00\x00\x00\x00\x00\x00\x00\x00"  # biases 0.0
    b"\x66\x9f\xe8\x55"
)


# Version 2: the golden blob with its aux stored as bfloat16 (0.25 and 2.0 are bfloat16 values).
GOLDEN_V2_HEADER = GOLDEN_HEADER.replace(
    b'"stored_len":8,"raw_len":8}]}', b'"stored_len":4,"raw_len":4}],"aux_encoding":"bfloat16"}'
)
GOLDEN_V2_AUX = b"\x80\x3e" + b"\x00\x40"  # bfloat16 0.25, 2.0: float32 0x3e800000, 0x40000000
GOLDEN_V2 = (
    b"CNRDELTA"
    b"\x02\x00"  # format_version 2
    b"\x00\x00"
    b"\x90\x01\x00\x00"  # header_len 400
    + GOLDEN_V2_HEADER
    + GOLDEN_ROWS
    + GOLDEN_CODES
    + GOLDEN_SCALE_BIAS
    + GOLDEN_V2_AUX
    + b"\xf0\xe1\xdc\x3e"  # crc32 0x3edce1f0
)


def golden_blob() -> DeltaBlob:
    return DeltaBlob(
        table="t",
        codec="int4",
        dim=3,
        table_rows=10,
        row_ids=np.array([1, 7], dtype=np.int64),
        codes=np.array([[0x21, 0x03], [0x54, 0x06]], dtype=np.uint8),
        scale=np.array([1.0, 0.5], dtype=np.float16),
        bias=np.array([0.0, -1.0], dtype=np.float16),
        aux=np.array([[0.25], [2.0]], dtype=np.float32),
    )


def test_golden_bytes_pin_the_layout() -> None:
    assert struct.unpack("<I", GOLDEN[12:16]) == (len(GOLDEN_HEADER),)
    assert struct.unpack("<I", GOLDEN[-4:]) == (zlib.crc32(GOLDEN[:-4]),)
    assert encode_delta_blob(golden_blob(), compress=False) == GOLDEN
    assert decode_delta_blob(GOLDEN) == golden_blob()


def golden_v2_blob() -> DeltaBlob:
    return replace(golden_blob(), aux_encoding="bfloat16")


def test_golden_v2_pins_the_bfloat16_aux() -> None:
    assert struct.unpack("<I", GOLDEN_V2[12:16]) == (len(GOLDEN_V2_HEADER),)
    assert struct.unpack("<I", GOLDEN_V2[-4:]) == (zlib.crc32(GOLDEN_V2[:-4]),)
    assert encode_delta_blob(golden_v2_blob(), compress=False) == GOLDEN_V2
    decoded = decode_delta_blob(GOLDEN_V2)
    assert decoded == golden_v2_blob()
    assert decoded.aux.dtype == np.float32 and decoded.aux.tolist() == [[0.25], [2.0]]
    assert not decoded.aux.flags.writeable


def test_a_float32_aux_is_still_written_as_version_1() -> None:
    # Readers older than version 2 keep reading what a float32 writer produces.
    assert encode_delta_blob(golden_blob())[8:10] == b"\x01\x00"
    assert decode_delta_blob(GOLDEN).aux_encoding == "float32"


def test_validate_refuses_an_aux_that_is_not_bfloat16() -> None:
    aux = np.array([[0.25], [1 + 2**-10]], dtype=np.float32)
    with pytest.raises(ValueError, match="aux row 1 holds values that are not bfloat16"):
        encode_delta_blob(replace(golden_v2_blob(), aux=aux))
    with pytest.raises(ValueError, match="aux_encoding 'float16'"):
        encode_delta_blob(replace(golden_blob(), aux_encoding="float16"))  # type: ignore[arg-type]


def test_round_to_bfloat16_is_nearest_ties_to_even() -> None:
    x = np.array(
        [1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-12, -2.5, 0.0, -0.0, np.inf, 3.4e38],
        dtype=np.float32,
    )
    expected = [1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.5, 0.0, -0.0, np.inf, np.inf]
    rounded = round_to_bfloat16(x)
    assert rounded.dtype == np.float32 and rounded.tolist() == expected
    assert np.signbit(rounded[6])
    # A NaN whose payload is only in the low bits must not round to inf.
    nan = np.array([0x7F800001, 0xFF800001], dtype="<u4").view("<f4")
    assert np.isnan(round_to_bfloat16(nan)).all()


@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=50))
@settings(max_examples=100, deadline=None)
def test_round_to_bfloat16_is_within_half_a_bfloat16_step(values: list[float]) -> None:
    x = np.array(values, dtype=np.float32)
    rounded = round_to_bfloat16(x)
    assert not (rounded.view("<u4") & 0xFFFF).any()
    finite = np.isfinite(rounded)
    err = np.abs(rounded[finite].astype(np.float64) - x[finite].astype(np.float64))
    assert (err <= np.abs(x[finite].astype(np.float64)) * 2**-8 + 2**-133).all()


def test_golden_compression_skips_sections_it_cannot_shrink() -> None:
    # Every section of the tiny blob is smaller than a zstd frame, so compress=True is a no-op.
    assert encode_delta_blob(golden_blob(), compress=True) == GOLDEN


def test_golden_bitmap() -> None:
    values = np.array([1, 2, -2, 0.5, 0, 65504, -0.0], dtype="<f2")
    blob = DeltaBlob(
        table="t",
        codec="fp16",
        dim=1,
        table_rows=10,
        row_ids=np.array([0, 2, 3, 5, 6, 8, 9], dtype=np.int64),
        codes=values.view(np.uint8).reshape(7, 2),
        scale=np.zeros(0, dtype=np.float16),
        bias=np.zeros(0, dtype=np.float16),
        aux=np.zeros((7, 0), dtype=np.float32),
    )
    assert encode_delta_blob(blob, compress=False) == GOLDEN_BITMAP
    assert decode_delta_blob(GOLDEN_BITMAP) == blob


def test_golden_zstd_decodes() -> None:
    blob = decode_delta_blob(GOLDEN_ZSTD)
    assert blob.row_ids.tolist() == [0, 1, 2, 3]
    assert blob.codes.shape == (4, 32) and not blob.codes.any()
    assert blob.scale.tolist() == [1.0] * 4 and blob.bias.tolist() == [0.0] * 4
    assert blob.aux.shape == (4, 0)


# --- hand-made bytes --------------------------------------------------------------------------


def assemble(
    header: dict[str, Any] | bytes,
    body: bytes = b"",
    *,
    magic: bytes = b"CNRDELTA",
    version: int = 1,
    flags: int = 0,
    header_len: int | None = None,
    crc: int | None = None,
) -> bytes:
    """Prefix + header + body + crc32, each part overridable; the crc is correct by default."""
    header_bytes = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(header_bytes) if header_len is None else header_len
    data = magic + struct.pack("<HHI", version, flags, length) + header_bytes + body
    return data + struct.pack("<I", zlib.crc32(data) if crc is None else crc)


def tiny_blob(
    *,
    rows: bytes = GOLDEN_ROWS,
    codes: bytes = GOLDEN_CODES,
    scale_bias: bytes = GOLDEN_SCALE_BIAS,
    aux: bytes = GOLDEN_AUX,
    raw_len: dict[str, int] | None = None,
    stored_len: dict[str, int] | None = None,
    compression: dict[str, str] | None = None,
    edit: Callable[[dict[str, Any]], object] | None = None,
    version: int = 1,
    **fields: Any,
) -> bytes:
    """The golden blob rebuilt by hand, with any payload, length or header field replaced."""
    payloads = {"rows": rows, "codes": codes, "scale_bias": scale_bias, "aux": aux}
    sections = [
        {
            "name": name,
            "compression": (compression or {}).get(name, "none"),
            "stored_len": (stored_len or {}).get(name, len(payload)),
            "raw_len": (raw_len or {}).get(name, len(payload)),
        }
        for name, payload in payloads.items()
    ]
    header: dict[str, Any] = {
        "table": "t",
        "codec": "int4",
        "dim": 3,
        "table_rows": 10,
        "n_rows": 2,
        "aux_dim": 1,
        "row_encoding": "varint",
        "sections": sections,
    }
    header.update(fields)
    if edit is not None:
        edit(header)
    return assemble(header, b"".join(payloads.values()), version=version)


def zstd(raw: bytes, *, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(raw)


def test_tiny_blob_is_the_golden_blob() -> None:
    # The helpers are only trustworthy if, left alone, they rebuild the golden blob.
    assert decode_delta_blob(tiny_blob()) == golden_blob()


# --- BlobTooLargeError ------------------------------------------------------------------------


def test_total_length_over_cap() -> None:
    with pytest.raises(BlobTooLargeError, match=f"blob is {len(GOLDEN)} bytes, exceeds the cap"):
        decode_delta_blob(GOLDEN, limits=BlobLimits(max_total_bytes=len(GOLDEN) - 1))


def test_header_len_over_cap() -> None:
    data = GOLDEN[:12] + struct.pack("<I", 2**32 - 1) + GOLDEN[16:]
    with pytest.raises(BlobTooLargeError, match="header_len 4294967295 exceeds the cap of 65536"):
        decode_delta_blob(data)
    with pytest.raises(BlobTooLargeError, match="header_len 374 exceeds the cap of 100"):
        decode_delta_blob(GOLDEN, limits=BlobLimits(max_header_bytes=100))


def _assert_small_peak(call: Callable[[], object], error: type[Exception]) -> None:
    """Run `call`, expect `error`, and check that no big buffer was allocated on the way."""
    tracemalloc.start()
    try:
        with pytest.raises(error):
            call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak allocation {peak} bytes before rejecting"


def test_huge_table_with_tiny_buffer_is_refused_before_allocating() -> None:
    # 2^31 rows of 65536 fp32: the honest raw_len is 2^49 bytes.
    rows, dim = 2**31, 65536
    data = tiny_blob(
        rows=b"",
        codes=b"",
        scale_bias=b"",
        aux=b"",
        raw_len={"codes": rows * 4 * dim},
        codec="fp32",
        dim=dim,
        table_rows=rows,
        n_rows=rows,
        aux_dim=0,
        row_encoding="all",
    )
    _assert_small_peak(lambda: decode_delta_blob(data), BlobTooLargeError)
    with pytest.raises(BlobTooLargeError, match="raw_len 562949953421312, exceeds the cap"):
        decode_delta_blob(data)


def test_implied_decoded_size_over_cap() -> None:
    # Every declared length is small, but 2^31 decoded row ids alone take 16 GiB.
    data = tiny_blob(
        rows=b"",
        codes=b"",
        scale_bias=b"",
        aux=b"",
        codec="int2",
        dim=1,
        table_rows=2**31,
        n_rows=2**31,
        aux_dim=0,
        row_encoding="all",
    )
    _assert_small_peak(lambda: decode_delta_blob(data), BlobTooLargeError)
    with pytest.raises(BlobTooLargeError, match=r"decoding needs \d+ bytes \(2147483648 rows"):
        decode_delta_blob(data)


def test_raw_len_claim_of_many_gigabytes() -> None:
    frame = zstd(GOLDEN_AUX)
    data = tiny_blob(aux=frame, compression={"aux": "zstd"}, raw_len={"aux": 50 * 2**30})
    _assert_small_peak(lambda: decode_delta_blob(data), BlobTooLargeError)
    with pytest.raises(BlobTooLargeError, match="section aux declares raw_len 53687091200"):
        decode_delta_blob(data)


def test_stored_len_claim_over_cap() -> None:
    data = tiny_blob(stored_len={"codes": 2**40}, compression={"codes": "zstd"})
    with pytest.raises(BlobTooLargeError, match="section codes declares stored_len 1099511627776"):
        decode_delta_blob(data)


def test_declared_total_over_cap() -> None:
    # Each stored_len is within the cap, their sum is not.
    limits = BlobLimits(max_total_bytes=1000, max_decoded_bytes=1000)
    data = tiny_blob(
        stored_len={"codes": 600, "aux": 600}, compression={"codes": "zstd", "aux": "zstd"}
    )
    with pytest.raises(
        BlobTooLargeError, match=r"header declares a \d+-byte blob, exceeds the cap of 1000"
    ):
        decode_delta_blob(data, limits=limits)


def test_zstd_frame_declaring_a_huge_size_is_refused_before_inflating() -> None:
    # A frame header claiming 2^40 bytes: zstandard would try to allocate that much if asked to
    # decompress it, so the declared size is checked against raw_len first.
    frame = b"\x28\xb5\x2f\xfd" + b"\xe0" + (2**40).to_bytes(8, "little") + b"\x01\x00\x00"
    assert zstandard.frame_content_size(frame) == 2**40
    data = tiny_blob(codes=frame, compression={"codes": "zstd"}, raw_len={"codes": 4})
    _assert_small_peak(lambda: decode_delta_blob(data), DecompressionError)


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        (BlobLimits(max_dim=2), "dim 3 exceeds the cap of 2"),
        (BlobLimits(max_table_rows=9), "table_rows 10 exceeds the cap of 9"),
        (BlobLimits(max_aux_dim=0), "aux_dim 1 exceeds the cap of 0"),
        (BlobLimits(max_decoded_bytes=7), "section scale_bias declares raw_len 8"),
        (BlobLimits(max_decoded_bytes=37), r"decoding needs 38 bytes"),
    ],
)
def test_lowered_caps(limits: BlobLimits, match: str) -> None:
    with pytest.raises(BlobTooLargeError, match=match):
        decode_delta_blob(GOLDEN, limits=limits)
    assert decode_delta_blob(GOLDEN, limits=BlobLimits(max_decoded_bytes=38)) == golden_blob()


def test_limits_can_only_tighten_the_format() -> None:
    with pytest.raises(ValueError, match="max_dim"):
        BlobLimits(max_dim=65537)
    with pytest.raises(ValueError, match="max_header_bytes"):
        BlobLimits(max_header_bytes=0)


# --- TruncatedBlobError -----------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 8, 15, 16, 19])
def test_shorter_than_prefix_and_crc(length: int) -> None:
    with pytest.raises(TruncatedBlobError, match=f"blob is {length} bytes, expected at least 20"):
        decode_delta_blob(GOLDEN[:length])


def test_header_longer_than_the_blob() -> None:
    data = GOLDEN[:12] + struct.pack("<I", 1000) + GOLDEN[16:]
    with pytest.raises(TruncatedBlobError, match="header_len 1000 needs at least 1020"):
        decode_delta_blob(data)


def test_sections_shorter_than_declared() -> None:
    data = GOLDEN[:-5] + GOLDEN[-4:]  # one aux byte gone
    with pytest.raises(TruncatedBlobError, match=f"blob is {len(GOLDEN) - 1} bytes, expected 416"):
        decode_delta_blob(data)


def test_crc_missing() -> None:
    with pytest.raises(TruncatedBlobError, match="expected 416"):
        decode_delta_blob(GOLDEN[:-4])


# --- TrailingBytesError -----------------------------------------------------------------------


@pytest.mark.parametrize("extra", [b"\x00", b"garbage", GOLDEN])
def test_trailing_bytes(extra: bytes) -> None:
    with pytest.raises(TrailingBytesError, match=f"{len(extra)} trailing bytes"):
        decode_delta_blob(GOLDEN + extra)


# --- BadMagicError ----------------------------------------------------------------------------


@pytest.mark.parametrize("magic", [b"CNRDELTX", b"cnrdelta", b"\x00" * 8, b"PK\x03\x04CNRD"])
def test_bad_magic(magic: bytes) -> None:
    with pytest.raises(BadMagicError, match="expected b'CNRDELTA'"):
        decode_delta_blob(magic + GOLDEN[8:])


# --- UnsupportedVersionError ------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 4, 0xFFFF])
def test_unsupported_version(version: int) -> None:
    match = rf"format_version is {version}, expected one of \(1, 2, 3\)"
    with pytest.raises(UnsupportedVersionError, match=match):
        decode_delta_blob(assemble(GOLDEN_HEADER, GOLDEN[16 + 374 : -4], version=version))


@pytest.mark.parametrize("flags", [1, 0x8000])
def test_reserved_flags_set(flags: int) -> None:
    with pytest.raises(UnsupportedVersionError, match=f"flags are 0x{flags:04x}, expected 0"):
        decode_delta_blob(assemble(GOLDEN_HEADER, GOLDEN[16 + 374 : -4], flags=flags))


# --- BadHeaderError ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"", "header_len is 0"),
        (b"\xff" + GOLDEN_HEADER[1:], "not UTF-8"),
        (GOLDEN_HEADER[:-1], "not JSON"),
        (b"{table: t}", "not JSON"),
        (GOLDEN_HEADER + b" x", "not JSON"),
        (b"\xef\xbb\xbf" + GOLDEN_HEADER, "not JSON"),  # a BOM is not part of the format
        (b"[" * 30_000 + b"]" * 30_000, "not JSON|must be a JSON object"),
        (b"[1, 2]", "header must be a JSON object, got list"),
        (b'"CNRDELTA"', "header must be a JSON object, got str"),
        (b"null", "header must be a JSON object, got NoneType"),
        (GOLDEN_HEADER.replace(b'"dim":3', b'"dim":NaN'), "NaN in header"),
        (GOLDEN_HEADER.replace(b'"dim":3', b'"dim":Infinity'), "Infinity in header"),
        (GOLDEN_HEADER.replace(b'"dim":3', b'"dim":3,"dim":4'), "duplicate key 'dim'"),
        (GOLDEN_HEADER.replace(b'"dim":3', b'"dim":' + b"9" * 5000), "not JSON"),
        (GOLDEN_HEADER.replace(b'"table":"t"', b'"table":"\\ud800"'), "not valid Unicode"),
    ],
)
def test_header_not_a_json_object(header: bytes, match: str) -> None:
    with pytest.raises(BadHeaderError, match=match):
        decode_delta_blob(assemble(header, GOLDEN[16 + 374 : -4]))


@pytest.mark.parametrize(
    "field",
    ["table", "codec", "dim", "table_rows", "n_rows", "aux_dim", "row_encoding", "sections"],
)
def test_header_missing_field(field: str) -> None:
    with pytest.raises(BadHeaderError, match=f"header lacks field\\(s\\) \\['{field}'\\]"):
        decode_delta_blob(tiny_blob(edit=lambda h: h.pop(field)))


def test_header_extra_field() -> None:
    with pytest.raises(BadHeaderError, match=r"unknown field\(s\) \['comment'\]"):
        decode_delta_blob(tiny_blob(comment="hi"))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"table": 5}, "table must be a string, got int"),
        ({"table": ""}, "table name of 0 chars, expected 1..256"),
        ({"table": "x" * 257}, "table name of 257 chars"),
        ({"codec": 4}, "codec 4 unknown"),
        ({"codec": "int5"}, "codec 'int5' unknown"),
        ({"codec": "FP32"}, "codec 'FP32' unknown"),
        ({"dim": "3"}, "dim must be an integer, got str '3'"),
        ({"dim": 3.0}, "dim must be an integer, got float 3.0"),
        ({"dim": True}, "dim must be an integer, got bool True"),
        ({"n_rows": False}, "n_rows must be an integer, got bool False"),
        ({"dim": None}, "dim must be an integer, got NoneType"),
        ({"dim": 0}, r"dim 0 out of range, expected 1..65536"),
        ({"dim": 65537}, r"dim 65537 out of range, expected 1..65536"),
        ({"table_rows": 0}, r"table_rows 0 out of range, expected 1..2147483648"),
        ({"table_rows": 2**31 + 1}, r"table_rows 2147483649 out of range"),
        ({"n_rows": -1}, r"n_rows -1 out of range, expected 0..10"),
        ({"n_rows": 11}, r"n_rows 11 out of range, expected 0..10"),
        ({"aux_dim": -1}, r"aux_dim -1 out of range, expected 0..65536"),
        ({"aux_dim": 65537}, r"aux_dim 65537 out of range"),
        ({"row_encoding": "runs"}, "row_encoding 'runs' unknown"),
        ({"row_encoding": None}, "row_encoding None unknown"),
        ({"row_encoding": "all"}, "'all' with n_rows 2, expected n_rows == table_rows 10"),
        ({"sections": {}}, "sections is dict, expected a list of 4 objects"),
    ],
)
def test_header_field_wrong_type_or_range(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(BadHeaderError, match=match):
        decode_delta_blob(tiny_blob(**fields))


def _swap_rows_and_codes(header: dict[str, Any]) -> None:
    sections = header["sections"]
    sections[0], sections[1] = sections[1], sections[0]


def _set_section(index: int, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        header["sections"][index][key] = value

    return edit


def _drop_section_key(header: dict[str, Any]) -> None:
    del header["sections"][2]["raw_len"]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda h: h["sections"].pop(), "sections is a list of 3, expected a list of 4"),
        (lambda h: h["sections"].append({}), "sections is a list of 5"),
        (_swap_rows_and_codes, r"sections\[0\].name is 'codes', expected 'rows'"),
        (_set_section(3, "name", "optimizer"), r"sections\[3\].name is 'optimizer'"),
        (_set_section(1, "compression", "gzip"), r"sections\[1\].compression 'gzip' unknown"),
        (_set_section(1, "compression", None), r"sections\[1\].compression None unknown"),
        (_set_section(1, "stored_len", -1), r"sections\[1\].stored_len is -1, expected >= 0"),
        (_set_section(1, "raw_len", "4"), r"sections\[1\].raw_len must be an integer, got str"),
        (_set_section(1, "raw_len", True), r"sections\[1\].raw_len must be an integer, got bool"),
        (_set_section(1, "stored_len", 4.0), r"stored_len must be an integer, got float"),
        (_set_section(1, "level", 3), r"sections\[1\] has unknown field\(s\) \['level'\]"),
        (_drop_section_key, r"sections\[2\] lacks field\(s\) \['raw_len'\]"),
        (lambda h: h["sections"].__setitem__(0, ["rows"]), r"sections\[0\] must be a JSON object"),
    ],
)
def test_header_bad_section_list(edit: Callable[[dict[str, Any]], object], match: str) -> None:
    with pytest.raises(BadHeaderError, match=match):
        decode_delta_blob(tiny_blob(edit=edit))


def test_header_accepts_edge_values() -> None:
    # The largest name, a non-ASCII name and whitespace around the JSON are all valid.
    for table in ("x" * 256, "表"):
        assert decode_delta_blob(tiny_blob(table=table)).table == table
    spaced = b" \n" + GOLDEN_HEADER + b"\t "
    assert decode_delta_blob(assemble(spaced, GOLDEN[16 + 374 : -4])) == golden_blob()


# --- ChecksumMismatchError --------------------------------------------------------------------


@pytest.mark.parametrize("position", [0, 8, 9, 15])  # bits of a code byte
def test_bit_flip_in_a_section(position: int) -> None:
    data = bytearray(GOLDEN)
    data[16 + 374 + 2 + position // 8] ^= 1 << (position % 8)
    with pytest.raises(ChecksumMismatchError, match="expected the stored 0xa9acb9ed"):
        decode_delta_blob(bytes(data))


def test_bit_flip_in_the_header_value() -> None:
    data = GOLDEN.replace(b'"table":"t"', b'"table":"u"')
    with pytest.raises(ChecksumMismatchError):
        decode_delta_blob(data)


def test_bit_flip_in_the_crc() -> None:
    data = GOLDEN[:-1] + bytes([GOLDEN[-1] ^ 0x80])
    with pytest.raises(ChecksumMismatchError, match="crc32 of the blob is 0xa9acb9ed"):
        decode_delta_blob(data)


# --- SectionLengthError -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"raw_len": {"codes": 5}, "stored_len": {"codes": 5}}, "codes has raw_len 5, expected 4"),
        ({"stored_len": {"codes": 3}}, "uncompressed with stored_len 3, expected raw_len 4"),
        ({"raw_len": {"aux": 4}}, "aux has raw_len 4, expected 8"),
        ({"raw_len": {"scale_bias": 4}}, "scale_bias has raw_len 4, expected 8"),
        # fp codecs carry no scale/bias: the same 8 bytes are now too many
        ({"codec": "fp16", "codes": b"\x00" * 12}, "scale_bias has raw_len 8, expected 0"),
        ({"row_encoding": "bitmap", "rows": b"\x82"}, "rows has raw_len 1, expected 2"),
        ({"rows": b"\x01"}, r"rows has raw_len 1, expected 2..10 for 2 varints"),
        ({"rows": b"\x01" * 11}, r"rows has raw_len 11, expected 2..10"),
        (
            {"row_encoding": "all", "n_rows": 10, "table_rows": 10, "rows": b"\x00"},
            "rows has raw_len 1, expected 0",
        ),
    ],
)
def test_section_length(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SectionLengthError, match=match):
        decode_delta_blob(tiny_blob(**kwargs))


def test_compressed_raw_len_is_checked_before_decompressing() -> None:
    data = tiny_blob(codes=zstd(GOLDEN_CODES), compression={"codes": "zstd"}, raw_len={"codes": 6})
    with pytest.raises(SectionLengthError, match="codes has raw_len 6, expected 4"):
        decode_delta_blob(data)


# --- DecompressionError -----------------------------------------------------------------------


def _compressed_codes(frame: bytes, raw_len: int = 4) -> bytes:
    return tiny_blob(codes=frame, compression={"codes": "zstd"}, raw_len={"codes": raw_len})


def test_zstd_section_decodes() -> None:
    assert decode_delta_blob(_compressed_codes(zstd(GOLDEN_CODES))) == golden_blob()
    unsized = zstd(GOLDEN_CODES, content_size=False)
    assert decode_delta_blob(_compressed_codes(unsized)) == golden_blob()


def test_corrupt_zstd_with_fixed_up_crc() -> None:
    frame = zstd(GOLDEN_CODES * 8)
    head = zstandard.frame_header_size(frame)
    # A block header of all ones says "reserved block type": invalid whatever follows.
    corrupt = frame[:head] + b"\xff" * (len(frame) - head)
    with pytest.raises(DecompressionError, match="section codes: invalid zstd data"):
        decode_delta_blob(
            tiny_blob(codes=corrupt, compression={"codes": "zstd"}, raw_len={"codes": 32}, dim=32)
        )


def test_not_a_zstd_frame() -> None:
    with pytest.raises(DecompressionError, match="section codes is not a zstd frame"):
        decode_delta_blob(_compressed_codes(b"not zstd at all"))
    with pytest.raises(DecompressionError, match="is not a zstd frame"):
        decode_delta_blob(_compressed_codes(b""))


def test_zstd_declaring_another_length() -> None:
    with pytest.raises(DecompressionError, match="frame declares 5 bytes, expected raw_len 4"):
        decode_delta_blob(_compressed_codes(zstd(GOLDEN_CODES + b"\x00")))


@pytest.mark.parametrize("payload", [GOLDEN_CODES[:3], GOLDEN_CODES + b"\x00"])
def test_unsized_zstd_decompressing_to_another_length(payload: bytes) -> None:
    with pytest.raises(DecompressionError, match="section codes"):
        decode_delta_blob(_compressed_codes(zstd(payload, content_size=False)))


def test_zstd_followed_by_extra_data() -> None:
    frame = zstd(GOLDEN_CODES)
    with pytest.raises(DecompressionError, match="invalid zstd data"):
        decode_delta_blob(_compressed_codes(frame + b"\x00"))
    with pytest.raises(DecompressionError, match="invalid zstd data"):
        decode_delta_blob(_compressed_codes(frame + frame))


def test_a_failed_inflate_leaves_the_next_blob_whole() -> None:
    # Each thread reuses one zstd decompressor: a frame that failed half-way (the streaming
    # path for an empty section, the one-shot path for a corrupt block) must leave nothing
    # behind for the next section it inflates.
    frame = zstd(GOLDEN_CODES * 8)
    head = zstandard.frame_header_size(frame)
    corrupt = tiny_blob(
        codes=frame[:head] + b"\xff" * (len(frame) - head),
        compression={"codes": "zstd"},
        raw_len={"codes": 32},
        dim=32,
    )
    for bad in (corrupt, _empty_aux(zstd(b"hello", content_size=False))):
        with pytest.raises(DecompressionError):
            decode_delta_blob(bad)
        assert decode_delta_blob(_compressed_codes(zstd(GOLDEN_CODES))) == golden_blob()
        assert decode_delta_blob(_empty_aux(zstd(b""))).aux.shape == (2, 0)


def _empty_aux(frame: bytes) -> bytes:
    return tiny_blob(aux=frame, aux_dim=0, compression={"aux": "zstd"}, raw_len={"aux": 0})


def test_zstd_of_an_empty_section() -> None:
    # Writers never do this (it cannot shrink), but it is valid zstd of the declared length.
    assert decode_delta_blob(_empty_aux(zstd(b""))).aux.shape == (2, 0)
    assert decode_delta_blob(_empty_aux(zstd(b"", content_size=False))).aux.shape == (2, 0)


def test_zstd_of_an_empty_section_with_trailing_garbage() -> None:
    with pytest.raises(DecompressionError, match="followed by 3 extra bytes"):
        decode_delta_blob(_empty_aux(zstd(b"") + b"abc"))


def test_zstd_declaring_zero_bytes_but_holding_some() -> None:
    # Frame header: single segment, content size 0; then a last raw block of 5 bytes.
    frame = b"\x28\xb5\x2f\xfd\x20\x00" + ((5 << 3) | 1).to_bytes(3, "little") + b"hello"
    with pytest.raises(DecompressionError, match="section aux: invalid zstd data"):
        decode_delta_blob(_empty_aux(frame))
    with pytest.raises(DecompressionError, match="section aux"):
        decode_delta_blob(_empty_aux(zstd(b"hello", content_size=False)))


# --- RowIndexError (crc fixed up, so the row check is reached) --------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"row_encoding": "bitmap", "rows": b"\x82\x00", "n_rows": 1}, "popcount is 2"),
        ({"row_encoding": "bitmap", "rows": b"\x02\x04"}, "padding bits set"),
        ({"rows": b"\x81\x80\x80\x80\x80\x00\x01"}, "6 bytes long, expected at most 5"),
        ({"rows": b"\x01\x86"}, "truncated varint"),
        ({"rows": b"\x01\x06\x01"}, "leftover bytes"),
        ({"rows": b"\x81\x06"}, "only 1 varints"),
        ({"rows": b"\x07\x00"}, "gap 0 at index 1"),
        ({"rows": b"\x0a\x01"}, "row id 10 at index 0 out of range"),
        ({"rows": b"\x01\x09"}, "row id 10 at index 1 out of range"),
    ],
)
def test_row_index(kwargs: dict[str, Any], match: str) -> None:
    n_rows = kwargs.get("n_rows", 2)
    data = tiny_blob(
        codes=b"\x00" * 2 * n_rows,
        scale_bias=b"\x00" * 4 * n_rows,
        aux=b"\x00" * 4 * n_rows,
        **kwargs,
    )
    with pytest.raises(RowIndexError, match=match):
        decode_delta_blob(data)


def test_row_index_checked_after_decompression() -> None:
    # A compressed rows section (larger than raw: legal for a reader) holding a gap of 0.
    data = tiny_blob(rows=zstd(b"\x07\x00"), compression={"rows": "zstd"}, raw_len={"rows": 2})
    with pytest.raises(RowIndexError, match="gap 0"):
        decode_delta_blob(data)


# --- the order of checks ----------------------------------------------------------------------


def test_checks_run_in_the_documented_order() -> None:
    # Each blob breaks two rules; the one earlier in FORMAT.md's order must win.
    too_short_bad_magic = b"XXXXXXXX" + GOLDEN[8:18]
    with pytest.raises(TruncatedBlobError):
        decode_delta_blob(too_short_bad_magic)
    with pytest.raises(BadMagicError):
        decode_delta_blob(b"XXXXXXXX\x02\x00" + GOLDEN[10:])
    with pytest.raises(UnsupportedVersionError):
        decode_delta_blob(assemble(b"not json", version=4))
    with pytest.raises(BadHeaderError):
        decode_delta_blob(tiny_blob(dim=0, raw_len={"codes": 2**50}))
    with pytest.raises(BlobTooLargeError):
        decode_delta_blob(tiny_blob(raw_len={"codes": 2**50}, stored_len={"codes": 3}))
    with pytest.raises(SectionLengthError):
        decode_delta_blob(tiny_blob(raw_len={"codes": 5}) + b"trailing")
    with pytest.raises(TrailingBytesError):
        decode_delta_blob(GOLDEN[:-1] + b"\x00\x00")  # also a wrong crc
    with pytest.raises(ChecksumMismatchError):  # also corrupt zstd
        corrupt = _compressed_codes(b"\x28\xb5\x2f\xfd" + b"\xff" * 8)
        decode_delta_blob(corrupt[:-1] + bytes([corrupt[-1] ^ 1]))
    with pytest.raises(DecompressionError):  # also a bad row index behind it
        decode_delta_blob(
            tiny_blob(
                rows=b"\x07\x00",
                codes=b"\x00" * 9,
                compression={"codes": "zstd"},
                raw_len={"codes": 4},
            )
        )


# --- peek_header ------------------------------------------------------------------------------


def test_peek_header_needs_only_the_prefix_and_header() -> None:
    header = peek_header(GOLDEN[: 16 + 374])
    assert (header.table, header.codec, header.dim, header.table_rows) == ("t", "int4", 3, 10)
    assert (header.n_rows, header.aux_dim, header.row_encoding) == (2, 1, "varint")
    assert [s.name for s in header.sections] == ["rows", "codes", "scale_bias", "aux"]
    assert header.header_len == 374 and header.total_len == len(GOLDEN)
    assert peek_header(GOLDEN) == header
    with pytest.raises(TruncatedBlobError):
        peek_header(GOLDEN[: 16 + 373])
    with pytest.raises(BadMagicError):
        peek_header(b"X" + GOLDEN[1:])
    with pytest.raises(SectionLengthError):
        peek_header(tiny_blob(raw_len={"codes": 5}))


# --- round trips ------------------------------------------------------------------------------


def random_blob(
    rng: np.random.Generator,
    *,
    codec: str,
    dim: int,
    table_rows: int,
    density: float,
    aux_dim: int,
    table: str = "emb",
) -> DeltaBlob:
    """A valid blob with random content (every bit pattern, NaNs included, for the floats)."""
    row_ids = np.flatnonzero(rng.random(table_rows) < density).astype(np.int64)
    n = row_ids.size
    per_row = n if is_integer_codec(codec) else 0
    return DeltaBlob(
        table=table,
        codec=codec,
        dim=dim,
        table_rows=table_rows,
        row_ids=row_ids,
        codes=rng.integers(0, 256, size=(n, row_bytes(codec, dim)), dtype=np.uint8),
        scale=rng.integers(0, 2**16, size=per_row, dtype=np.uint16).view(np.float16),
        bias=rng.integers(0, 2**16, size=per_row, dtype=np.uint16).view(np.float16),
        aux=rng.integers(0, 2**32, size=(n, aux_dim), dtype=np.uint32).view(np.float32),
    )


@settings(max_examples=200, deadline=None)
@given(
    codec=st.sampled_from(CODECS),
    dim=st.integers(1, 40),
    table_rows=st.integers(1, 400),
    density=st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.9, 1.0]),
    aux_dim=st.integers(0, 3),
    compress=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(
    codec: str,
    dim: int,
    table_rows: int,
    density: float,
    aux_dim: int,
    compress: bool,
    seed: int,
) -> None:
    blob = random_blob(
        np.random.default_rng(seed),
        codec=codec,
        dim=dim,
        table_rows=table_rows,
        density=density,
        aux_dim=aux_dim,
    )
    data = encode_delta_blob(blob, compress=compress)
    decoded = decode_delta_blob(data)
    assert decoded == blob
    decoded.validate()
    assert decoded.row_ids.dtype == np.int64
    assert decoded.codes.dtype == np.uint8
    assert decoded.scale.dtype == np.float16 and decoded.aux.dtype == np.float32
    header = peek_header(data)
    assert header.row_encoding == choose_encoding(blob.row_ids, table_rows)
    assert header.total_len == len(data)
    for section in header.sections:
        if section.compression == "zstd":
            assert compress and section.stored_len < section.raw_len
        else:
            assert section.stored_len == section.raw_len


@pytest.mark.parametrize("codec", CODECS)
def test_empty_blob(codec: str) -> None:
    blob = random_blob(
        np.random.default_rng(0), codec=codec, dim=5, table_rows=7, density=0.0, aux_dim=2
    )
    assert blob.n_rows == 0
    for compress in (False, True):
        data = encode_delta_blob(blob, compress=compress)
        header = peek_header(data)
        assert header.row_encoding == "varint"
        assert all(s.raw_len == 0 and s.stored_len == 0 for s in header.sections)
        decoded = decode_delta_blob(data)
        assert decoded == blob
        assert decoded.codes.shape == (0, row_bytes(codec, 5))
        assert decoded.aux.shape == (0, 2) and decoded.scale.shape == (0,)


def test_all_rows_blob() -> None:
    blob = random_blob(
        np.random.default_rng(1), codec="int8", dim=16, table_rows=1000, density=1.0, aux_dim=1
    )
    data = encode_delta_blob(blob)
    assert peek_header(data).row_encoding == "all"
    assert peek_header(data).sections[0].raw_len == 0
    assert decode_delta_blob(data) == blob


def test_compression_shrinks_a_compressible_blob() -> None:
    rng = np.random.default_rng(2)
    blob = random_blob(rng, codec="fp32", dim=64, table_rows=5000, density=0.3, aux_dim=1)
    zeros = DeltaBlob(
        table=blob.table,
        codec=blob.codec,
        dim=blob.dim,
        table_rows=blob.table_rows,
        row_ids=blob.row_ids,
        codes=np.zeros_like(blob.codes),
        scale=blob.scale,
        bias=blob.bias,
        aux=np.zeros_like(blob.aux),
    )
    packed = encode_delta_blob(zeros, compress=True)
    assert len(packed) < len(encode_delta_blob(zeros, compress=False)) // 10
    assert decode_delta_blob(packed) == zeros


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_decoding_is_zero_copy_and_read_only(wrap: Callable[[bytes], Any]) -> None:
    buffer = wrap(GOLDEN)
    blob = decode_delta_blob(buffer)
    whole = np.frombuffer(buffer, dtype=np.uint8)
    views: list[np.ndarray] = [blob.codes, blob.scale, blob.bias, blob.aux]
    for view in views:
        assert np.shares_memory(view, whole)
    for arr in [blob.row_ids, *views]:
        assert not arr.flags.writeable


def test_decoding_a_non_byte_memoryview() -> None:
    words = np.frombuffer(GOLDEN, dtype=np.uint32)  # 416 bytes: a whole number of words
    assert decode_delta_blob(memoryview(words.data)) == golden_blob()


# --- DeltaBlob.validate and equality ----------------------------------------------------------


def _replace(blob: DeltaBlob, **changes: Any) -> DeltaBlob:
    fields = {f: getattr(blob, f) for f in blob.__dataclass_fields__}
    fields.update(changes)
    return DeltaBlob(**fields)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"table": ""}, "table name of 0 chars"),
        ({"table": "\ud800"}, "not valid Unicode"),
        ({"codec": "int5"}, "codec 'int5' unknown"),
        ({"dim": 0}, "dim 0 out of range"),
        ({"dim": np.int64(3)}, "dim must be an integer"),
        ({"table_rows": 2**31 + 1}, "table_rows 2147483649 out of range"),
        ({"table_rows": 7}, r"row ids span 1..7, expected 0..6"),
        ({"row_ids": np.array([7, 1], dtype=np.int64)}, "strictly increasing: 1 follows 7"),
        ({"row_ids": np.array([1, 1], dtype=np.int64)}, "strictly increasing"),
        ({"row_ids": np.array([-1, 1], dtype=np.int64)}, r"span -1..1"),
        ({"row_ids": np.array([1, 7], dtype=np.int32)}, "row_ids is int32"),
        ({"row_ids": [1, 7]}, "row_ids must be a numpy array, got list"),
        ({"codes": np.zeros((2, 3), dtype=np.uint8)}, r"codes shape \(2, 3\), expected"),
        ({"codes": np.zeros((2, 2), dtype=np.int8)}, "codes is int8"),
        ({"scale": np.zeros(3, dtype=np.float16)}, r"scale shape \(3,\), expected \(2,\)"),
        ({"bias": np.zeros(2, dtype=np.float32)}, "bias is float32"),
        ({"aux": np.zeros((3, 1), dtype=np.float32)}, r"aux shape \(3, 1\), expected 2 rows"),
        ({"aux": np.zeros(2, dtype=np.float32)}, "aux is float32 with 1 dims"),
        ({"aux": np.zeros((2, 1), dtype=np.float64)}, "aux is float64"),
    ],
)
def test_validate_refuses(changes: dict[str, Any], match: str) -> None:
    blob = _replace(golden_blob(), **changes)
    with pytest.raises(ValueError, match=match):
        blob.validate()
    with pytest.raises(ValueError, match=match):
        encode_delta_blob(blob)


def test_validate_fp_codec_needs_empty_scale_and_bias() -> None:
    blob = _replace(golden_blob(), codec="fp16", codes=np.zeros((2, 6), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"scale shape \(2,\), expected \(0,\) for codec fp16"):
        blob.validate()


def test_equality_is_bitwise_and_blobs_are_unhashable() -> None:
    blob = golden_blob()
    assert blob == golden_blob()
    nan = _replace(blob, scale=np.array([np.nan, 0.5], dtype=np.float16))
    assert nan == _replace(blob, scale=np.array([np.nan, 0.5], dtype=np.float16))
    assert blob != _replace(blob, bias=np.array([-0.0, -1.0], dtype=np.float16))
    assert blob != _replace(blob, table="u")
    assert blob != "not a blob"
    with pytest.raises(TypeError):
        hash(blob)


def test_every_rejection_is_a_format_error() -> None:
    for error in (
        BlobTooLargeError,
        TruncatedBlobError,
        TrailingBytesError,
        BadMagicError,
        UnsupportedVersionError,
        BadHeaderError,
        ChecksumMismatchError,
        SectionLengthError,
        DecompressionError,
        RowIndexError,
    ):
        assert issubclass(error, FormatError)


# --- caps from the blob's table (BlobLimits.for_table) ----------------------------------------


def _blob_of(
    codec: str,
    table_rows: int,
    ids: list[int],
    dim: int = 5,
    aux_dim: int = 2,
    seed: int | None = 0,
) -> bytes:
    """A blob of random codes (all zero when `seed` is None: they compress to nothing)."""
    n = len(ids)
    per_row = n if is_integer_codec(codec) else 0
    shape = (n, row_bytes(codec, dim))
    if seed is None:
        codes = np.zeros(shape, dtype=np.uint8)
    else:
        codes = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return encode_delta_blob(
        DeltaBlob(
            table="t",
            codec=codec,
            dim=dim,
            table_rows=table_rows,
            row_ids=np.array(ids, dtype=np.int64),
            codes=codes,
            scale=np.ones(per_row, dtype=np.float16),
            bias=np.zeros(per_row, dtype=np.float16),
            aux=np.zeros((n, aux_dim), dtype=np.float32),  # zeros: the aux section is zstd
        )
    )


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "ids",
    [list(range(40)), [3], list(range(0, 40, 2)), [0, 39]],
    ids=["all", "varint", "bitmap", "sparse"],
)
def test_caps_for_its_own_table_admit_a_blob_whatever_its_encoding(
    codec: str, ids: list[int]
) -> None:
    data = _blob_of(codec, 40, ids)
    limits = BlobLimits.for_table(
        codec=codec, dim=5, table_rows=40, n_rows=len(ids), aux_dim=2, size=len(data)
    )
    assert decode_delta_blob(data, limits=limits) == decode_delta_blob(data)


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"table_rows": 39}, "table_rows 40 exceeds the cap of 39"),
        ({"dim": 4}, "dim 5 exceeds the cap of 4"),
        ({"aux_dim": 1}, "aux_dim 2 exceeds the cap of 1"),
        ({"n_rows": 3}, "exceeds the cap"),  # more rows than the entry holds
        ({"codec": "int4"}, "exceeds the cap"),  # wider rows than the entry's codec
        ({"size": 30}, "exceeds the cap of 30"),
    ],
)
def test_caps_for_a_smaller_table_refuse_the_header_before_inflating(
    table: dict[str, Any], match: str
) -> None:
    data = _blob_of("fp32", 40, list(range(0, 40, 10)))
    shape: dict[str, Any] = {
        "codec": "fp32",
        "dim": 5,
        "table_rows": 40,
        "n_rows": 4,
        "aux_dim": 2,
        "size": len(data),
    }
    limits = BlobLimits.for_table(**{**shape, **table})
    with pytest.raises(BlobTooLargeError, match=match):
        decode_delta_blob(data, limits=limits)


def test_a_zstd_bomb_is_refused_by_the_caps_of_its_table() -> None:
    # 64 MiB of zeros compress to a few KiB: the global 8 GiB cap lets them inflate, the caps of
    # the 1000 x 8 table the manifest names refuse the header first.
    rows, dim = 2**18, 64
    bomb = _blob_of("fp32", rows, list(range(rows)), dim=dim, aux_dim=0, seed=None)
    assert len(bomb) < 64 * 1024
    limits = BlobLimits.for_table(
        codec="fp32", dim=8, table_rows=1000, n_rows=1000, aux_dim=0, size=len(bomb)
    )
    _assert_small_peak(lambda: decode_delta_blob(bomb, limits=limits), BlobTooLargeError)


# --- version 2: aux_encoding ------------------------------------------------------------------


def test_tiny_blob_version_2_is_the_golden_v2_blob() -> None:
    hand_made = tiny_blob(version=2, aux=GOLDEN_V2_AUX, aux_encoding="bfloat16")
    assert decode_delta_blob(hand_made) == golden_v2_blob()


@pytest.mark.parametrize(
    ("version", "fields", "match"),
    [
        (
            1,
            {"aux_encoding": "float32"},
            r"version 1 header has unknown field\(s\) \['aux_enc",
        ),
        (2, {}, r"version 2 header lacks field\(s\) \['aux_encoding'\]"),
        (2, {"aux_encoding": "float16"}, "aux_encoding 'float16' unknown"),
        (2, {"aux_encoding": 2}, "aux_encoding 2 unknown"),
    ],
)
def test_aux_encoding_belongs_to_version_2(
    version: int, fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(BadHeaderError, match=match):
        decode_delta_blob(tiny_blob(version=version, **fields))


def test_a_float32_aux_under_version_2_reads_as_version_1() -> None:
    assert decode_delta_blob(tiny_blob(version=2, aux_encoding="float32")) == golden_blob()


def test_bfloat16_aux_section_length() -> None:
    # 2 rows x 1 column of bfloat16 is 4 bytes: the float32 length is refused.
    with pytest.raises(SectionLengthError, match="aux has raw_len 8, expected 4"):
        decode_delta_blob(tiny_blob(version=2, aux_encoding="bfloat16"))


def test_bfloat16_widening_counts_to_the_decoded_cap() -> None:
    # raw sections 2 + 4 + 8 + 4 = 18, row ids 16, widened aux 8: 42 bytes.
    with pytest.raises(BlobTooLargeError, match="decoding needs 42 bytes"):
        decode_delta_blob(GOLDEN_V2, limits=BlobLimits(max_decoded_bytes=41))
    assert decode_delta_blob(GOLDEN_V2, limits=BlobLimits(max_decoded_bytes=42)).n_rows == 2


def test_table_limits_admit_either_aux_encoding() -> None:
    for data in (GOLDEN, GOLDEN_V2):
        limits = BlobLimits.for_table(
            codec="int4", dim=3, table_rows=10, n_rows=2, aux_dim=1, size=len(data)
        )
        assert decode_delta_blob(data, limits=limits).n_rows == 2


@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=0, max_size=12),
    st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_bfloat16_round_trip(values: list[float], compress: bool) -> None:
    n = len(values)
    ids = np.arange(n, dtype=np.int64)
    blob = DeltaBlob(
        table="t",
        codec="int8",
        dim=1,
        table_rows=max(n, 1),
        row_ids=ids,
        codes=np.zeros((n, 1), dtype=np.uint8),
        scale=np.ones(n, dtype=np.float16),
        bias=np.zeros(n, dtype=np.float16),
        aux=round_to_bfloat16(np.array(values, dtype=np.float32).reshape(n, 1)),
        aux_encoding="bfloat16",
    )
    assert decode_delta_blob(encode_delta_blob(blob, compress=compress)) == blob


# --- version 3: scale_bias_encoding -----------------------------------------------------------

# An int8 blob with the byte kernel's float32 scale and bias: rows 1 and 7 of 10, codes [1, 2, 3]
# and [4, 5, 6], scales 0.5, 0.25, biases -1.0, 2.0, a float32 aux.
GOLDEN_V3_HEADER = (
    b'{"table":"t","codec":"int8","dim":3,"table_rows":10,"n_rows":2,"aux_dim":1,'
    b'"row_encoding":"varint","sections":['
    b'{"name":"rows","compression":"none","stored_len":2,"raw_len":2},'
    b'{"name":"codes","compression":"none","stored_len":6,"raw_len":6},'
    b'{"name":"scale_bias","compression":"none","stored_len":16,"raw_len":16},'
    b'{"name":"aux","compression":"none","stored_len":8,"raw_len":8}],'
    b'"aux_encoding":"float32","scale_bias_encoding":"float32"}'
)
GOLDEN_V3_CODES = b"\x01\x02\x03\x04\x05\x06"
GOLDEN_V3_SCALE_BIAS = (
    b"\x00\x00\x00\x3f\x00\x00\x80\x3e"  # float32 scales 0.5, 0.25
    b"\x00\x00\x80\xbf\x00\x00\x00\x40"  # float32 biases -1.0, 2.0
)
GOLDEN_V3 = (
    b"CNRDELTA"
    b"\x03\x00"  # format_version 3
    b"\x00\x00"
    b"\xb1\x01\x00\x00"  # header_len 433
    + GOLDEN_V3_HEADER
    + GOLDEN_ROWS
    + GOLDEN_V3_CODES
    + GOLDEN_V3_SCALE_BIAS
    + GOLDEN_AUX
    + b"\xfb\x01\x16\xb4"  # crc32 0xb41601fb
)


def golden_v3_blob() -> DeltaBlob:
    return DeltaBlob(
        table="t",
        codec="int8",
        dim=3,
        table_rows=10,
        row_ids=np.array([1, 7], dtype=np.int64),
        codes=np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8),
        scale=np.array([0.5, 0.25], dtype=np.float32),
        bias=np.array([-1.0, 2.0], dtype=np.float32),
        aux=np.array([[0.25], [2.0]], dtype=np.float32),
    )


def v3_blob(**fields: Any) -> bytes:
    """The golden v3 blob rebuilt by hand, with header fields replaced."""
    header: dict[str, Any] = {"codec": "int8", "aux_encoding": "float32"}
    header.update(scale_bias_encoding="float32", **fields)
    return tiny_blob(version=3, codes=GOLDEN_V3_CODES, scale_bias=GOLDEN_V3_SCALE_BIAS, **header)


def test_golden_v3_pins_the_float32_scale_and_bias() -> None:
    assert struct.unpack("<I", GOLDEN_V3[12:16]) == (len(GOLDEN_V3_HEADER),)
    assert struct.unpack("<I", GOLDEN_V3[-4:]) == (zlib.crc32(GOLDEN_V3[:-4]),)
    assert encode_delta_blob(golden_v3_blob(), compress=False) == GOLDEN_V3
    decoded = decode_delta_blob(GOLDEN_V3)
    assert decoded == golden_v3_blob()
    assert decoded.scale.dtype == decoded.bias.dtype == np.float32
    assert decoded.scale_bias_encoding == "float32"
    assert peek_header(GOLDEN_V3).scale_bias_encoding == "float32"


def test_tiny_blob_version_3_is_the_golden_v3_blob() -> None:
    assert decode_delta_blob(v3_blob()) == golden_v3_blob()


def test_fp16_fields_keep_versions_1_and_2() -> None:
    # Readers older than version 3 keep reading every table but an int8 one of this writer.
    assert encode_delta_blob(golden_blob())[8:10] == b"\x01\x00"
    assert encode_delta_blob(golden_v2_blob())[8:10] == b"\x02\x00"
    # An int8 blob with fp16 fields, as writers before version 3 wrote them, reads as before.
    old = replace(
        golden_v3_blob(),
        scale=np.array([0.5, 0.25], dtype=np.float16),
        bias=np.array([-1.0, 2.0], dtype=np.float16),
    )
    data = encode_delta_blob(old, compress=False)
    assert data[8:10] == b"\x01\x00" and b"scale_bias_encoding" not in data
    assert decode_delta_blob(data) == old


def test_a_bfloat16_aux_with_float32_fields_is_version_3() -> None:
    blob = replace(golden_v3_blob(), aux=np.array([[0.25], [2.0]], np.float32))
    blob = replace(blob, aux_encoding="bfloat16")
    data = encode_delta_blob(blob, compress=False)
    assert data[8:10] == b"\x03\x00"
    header = peek_header(data)
    assert (header.aux_encoding, header.scale_bias_encoding) == ("bfloat16", "float32")
    assert decode_delta_blob(data) == blob


@pytest.mark.parametrize(
    ("version", "fields", "match"),
    [
        (1, {"scale_bias_encoding": "float16"}, r"version 1 header has unknown field\(s\)"),
        (
            2,
            {"aux_encoding": "float32", "scale_bias_encoding": "float16"},
            r"version 2 header has unknown field\(s\) \['scale_bias_encoding'\]",
        ),
        (3, {"aux_encoding": "float32"}, r"lacks field\(s\) \['scale_bias_encoding'\]"),
        (3, {"scale_bias_encoding": "float16"}, r"lacks field\(s\) \['aux_encoding'\]"),
        (
            3,
            {"aux_encoding": "float32", "scale_bias_encoding": "bfloat16"},
            "scale_bias_encoding 'bfloat16' unknown",
        ),
        (
            3,
            {"aux_encoding": "float32", "scale_bias_encoding": 4},
            "scale_bias_encoding 4 unknown",
        ),
    ],
)
def test_scale_bias_encoding_belongs_to_version_3(
    version: int, fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(BadHeaderError, match=match):
        decode_delta_blob(tiny_blob(version=version, **fields))


@pytest.mark.parametrize("codec", ["int4", "int8-adaptive", "fp16"])
def test_float32_fields_only_for_a_codec_that_writes_them(codec: str) -> None:
    with pytest.raises(BadHeaderError, match=f"scale_bias_encoding 'float32' for codec {codec}"):
        decode_delta_blob(v3_blob(codec=codec))
    with pytest.raises(ValueError, match="expected float16"):
        encode_delta_blob(replace(golden_v3_blob(), codec=codec))


def test_float16_fields_under_version_3_read_as_version_1() -> None:
    hand_made = tiny_blob(version=3, aux_encoding="float32", scale_bias_encoding="float16")
    assert decode_delta_blob(hand_made) == golden_blob()


def test_float32_fields_section_length() -> None:
    # 2 rows of fp32 scale and bias are 16 bytes: the fp16 length is refused.
    with pytest.raises(SectionLengthError, match="scale_bias has raw_len 8, expected 16"):
        decode_delta_blob(
            tiny_blob(
                version=3,
                codec="int8",
                codes=GOLDEN_V3_CODES,
                aux_encoding="float32",
                scale_bias_encoding="float32",
            )
        )


def test_table_limits_admit_either_field_encoding() -> None:
    for data in (
        GOLDEN_V3,
        encode_delta_blob(
            replace(
                golden_v3_blob(),
                scale=np.ones(2, np.float16),
                bias=np.zeros(2, np.float16),
            )
        ),
    ):
        limits = BlobLimits.for_table(
            codec="int8", dim=3, table_rows=10, n_rows=2, aux_dim=1, size=len(data)
        )
        assert decode_delta_blob(data, limits=limits).n_rows == 2


def test_mixed_field_dtypes_are_refused() -> None:
    mixed = replace(golden_v3_blob(), bias=np.array([-1.0, 2.0], dtype=np.float16))
    with pytest.raises(ValueError, match="bias is float16"):
        encode_delta_blob(mixed)
