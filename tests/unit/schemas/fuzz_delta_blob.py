"""Fuzz target for the delta blob reader: hostile bytes raise a `FormatError`, nothing else.

Under pytest (run it explicitly, `pytest tests/unit/schemas/fuzz_delta_blob.py`, or add
``fuzz_*.py`` to ``python_files``) hypothesis mutates valid blobs (bit flips, truncation,
insertion, deletion, header edits and section swaps with the header length and crc32 recomputed, so
the mutation reaches the checks behind the crc) and throws random bytes, for a bounded number of
examples. Run as a script with atheris installed for coverage-guided fuzzing::

    python tests/unit/schemas/fuzz_delta_blob.py -atheris_runs=1000000

Every input must either decode to a blob that validates and re-encodes to an equal blob, or raise
a `schemas.errors.FormatError` subclass.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import struct
import sys
import zlib
from dataclasses import replace
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.codec_names import LAYOUTS, is_integer_codec, row_bytes
from schemas.delta_blob import (
    BlobLimits,
    DeltaBlob,
    decode_delta_blob,
    encode_delta_blob,
    peek_header,
    round_to_bfloat16,
)
from schemas.errors import FormatError

# Small caps keep a mutated header from making a fuzz run allocate much, while leaving every
# check reachable.
FUZZ_LIMITS = BlobLimits(max_total_bytes=1 << 20, max_decoded_bytes=1 << 22)
FUZZ_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _seed_blob(
    codec: str, dim: int, table_rows: int, density: float, aux_dim: int, seed: int
) -> DeltaBlob:
    rng = np.random.default_rng(seed)
    row_ids = np.flatnonzero(rng.random(table_rows) < density).astype(np.int64)
    n = row_ids.size
    per_row = n if is_integer_codec(codec) else 0
    # Low-entropy codes so that compression kicks in and the zstd paths get mutated too.
    return DeltaBlob(
        table="emb",
        codec=codec,
        dim=dim,
        table_rows=table_rows,
        row_ids=row_ids,
        codes=rng.integers(0, 4, size=(n, row_bytes(codec, dim)), dtype=np.uint8),
        scale=rng.random(per_row).astype(np.float16),
        bias=rng.random(per_row).astype(np.float16),
        aux=rng.random((n, aux_dim)).astype(np.float32),
    )


def _seed_corpus() -> list[bytes]:
    shapes = [
        ("int4", 3, 10, 0.2, 1, 0),
        ("int8", 16, 200, 0.6, 0, 1),  # bitmap
        ("int3-adaptive", 7, 50, 1.0, 2, 2),  # all rows
        ("fp16", 4, 1000, 0.01, 1, 3),  # sparse varint
        ("fp32", 2, 5, 0.0, 0, 4),  # empty
        ("int2", 33, 64, 0.5, 3, 5),
    ]
    corpus = []
    for shape in shapes:
        blob = _seed_blob(*shape)
        corpus.append(encode_delta_blob(blob, compress=False))
        corpus.append(encode_delta_blob(blob, compress=True))
        # The same rows with a bfloat16 aux: format version 2.
        v2 = replace(blob, aux=round_to_bfloat16(blob.aux), aux_encoding="bfloat16")
        corpus.append(encode_delta_blob(v2, compress=True))
        if LAYOUTS[blob.codec].scale_bias_encoding == "float32":
            # The byte kernel's float32 scale and bias: format version 3.
            wide = replace(
                blob, scale=blob.scale.astype(np.float32), bias=blob.bias.astype(np.float32)
            )
            corpus.append(encode_delta_blob(wide, compress=False))
    return corpus


SEEDS = _seed_corpus()


def check_decode(data: bytes) -> None:
    """The property: decode succeeds with a self-consistent blob, or raises a FormatError."""
    with contextlib.suppress(FormatError):
        peek_header(data, limits=FUZZ_LIMITS)
    try:
        blob = decode_delta_blob(data, limits=FUZZ_LIMITS)
    except FormatError:
        return
    blob.validate()
    assert decode_delta_blob(encode_delta_blob(blob, compress=False)) == blob


# --- mutations --------------------------------------------------------------------------------


def _split(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """A valid blob's header as JSON and its stored section payloads."""
    (header_len,) = struct.unpack_from("<I", data, 12)
    header = json.loads(data[16 : 16 + header_len])
    payloads, offset = [], 16 + header_len
    for section in header["sections"]:
        payloads.append(data[offset : offset + section["stored_len"]])
        offset += section["stored_len"]
    return header, payloads


def _join(header: dict[str, Any] | bytes, payloads: list[bytes]) -> bytes:
    """Reassemble with a correct header_len and crc32, so later checks are reached."""
    header_bytes = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = b"CNRDELTA" + struct.pack("<HHI", 1, 0, len(header_bytes)) + header_bytes
    body += b"".join(payloads)
    return body + struct.pack("<I", zlib.crc32(body))


def _fix_crc(data: bytes) -> bytes:
    if len(data) < 4:
        return data
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 2**32)
    | st.sampled_from([0, 1, 2, 3, 4, 5, 2**31, 2**31 + 1, 65536, 65537, 10**30])
    | st.floats(allow_nan=False)
    | st.sampled_from(["none", "zstd", "all", "bitmap", "varint", "rows", "codes", "int4", ""])
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=5,
)
HEADER_KEYS = ["table", "codec", "dim", "table_rows", "n_rows", "aux_dim", "row_encoding"]
SECTION_KEYS = ["name", "compression", "stored_len", "raw_len"]


@st.composite
def mutated_blobs(draw: st.DrawFn) -> bytes:
    data = draw(st.sampled_from(SEEDS))
    op = draw(
        st.sampled_from(
            [
                "flip",
                "truncate",
                "insert",
                "delete",
                "header",
                "section_field",
                "section_flip",
                "section_flip",
                "payload",
            ]
        )
    )
    if op == "flip":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            bit = draw(st.integers(0, 8 * len(out) - 1))
            out[bit // 8] ^= 1 << (bit % 8)
        mutated = bytes(out)
        return _fix_crc(mutated) if draw(st.booleans()) else mutated
    if op == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if op == "insert":
        at = draw(st.integers(0, len(data)))
        mutated = data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
        return _fix_crc(mutated) if draw(st.booleans()) else mutated
    if op == "delete":
        at = draw(st.integers(0, len(data) - 1))
        mutated = data[:at] + data[at + draw(st.integers(1, 8)) :]
        return _fix_crc(mutated) if draw(st.booleans()) else mutated
    header, payloads = _split(data)
    if op == "header":
        key = draw(st.sampled_from([*HEADER_KEYS, "extra", "sections"]))
        if key == "sections" and draw(st.booleans()):
            del header["sections"][draw(st.integers(0, 3))]
        else:
            header[key] = draw(JSON_VALUES)
        return _join(header, payloads)
    if op == "section_field":
        index = draw(st.integers(0, 3))
        key = draw(st.sampled_from(SECTION_KEYS))
        value = draw(JSON_VALUES | st.integers(0, 64))
        header["sections"][index][key] = value
        return _join(header, payloads)
    if op == "section_flip":
        # Bit flips inside one section, lengths kept: reaches the zstd and row-index checks.
        index = draw(st.integers(0, 3))
        flipped = bytearray(payloads[index])
        if flipped:
            for _ in range(draw(st.integers(1, 3))):
                bit = draw(st.integers(0, 8 * len(flipped) - 1))
                flipped[bit // 8] ^= 1 << (bit % 8)
        payloads[index] = bytes(flipped)
        return _join(header, payloads)
    # "payload": replace one section's bytes, keeping the header's lengths consistent with it
    index = draw(st.integers(0, 3))
    section = header["sections"][index]
    payload = draw(
        st.binary(max_size=64)
        | st.builds(lambda b: b * 3, st.binary(max_size=16))
        | st.just(payloads[index][::-1])
    )
    payloads[index] = payload
    section["stored_len"] = len(payload)
    if section["compression"] == "none" or draw(st.booleans()):
        section["raw_len"] = len(payload)
    return _join(header, payloads)


@FUZZ_SETTINGS
@given(mutated_blobs())
def test_mutated_blobs_raise_format_errors_only(data: bytes) -> None:
    check_decode(data)


@FUZZ_SETTINGS
@given(st.binary(max_size=512))
def test_random_bytes_raise_format_errors_only(data: bytes) -> None:
    check_decode(data)


@FUZZ_SETTINGS
@given(st.binary(max_size=512))
def test_random_bytes_after_a_valid_prefix(tail: bytes) -> None:
    check_decode(b"CNRDELTA\x01\x00\x00\x00" + tail)


def test_seeds_decode() -> None:
    for seed in SEEDS:
        check_decode(seed)
        decode_delta_blob(seed, limits=FUZZ_LIMITS)


def main() -> None:
    """Coverage-guided fuzzing with atheris (optional dependency)."""
    try:
        atheris = importlib.import_module("atheris")
    except ImportError:
        sys.exit("atheris is not installed: pip install atheris (or run this file with pytest)")
    atheris.instrument_all()
    atheris.Setup(sys.argv, check_decode)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
