"""The codec table (`publisher.codecs.CODECS`), walked: every codec round-trips within its own
error bound, its `row_bytes` is what its encoder writes into a blob, its bytes for fixed rows are
the ones stored checkpoints hold, and docs/FORMAT.md section 4.1 documents its layout.

A new codec gets these checks from its table entry and its FORMAT.md row, with no test code.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.codec import embedding_like_rows
from publisher import rowwise_kernels
from publisher.codecs import CODECS, Codec, QuantizedRows, UnknownCodecError, codec_of
from schemas import codec_names
from schemas.delta_blob import DeltaBlob, decode_delta_blob, encode_delta_blob, peek_header

FORMAT_MD = Path(__file__).resolve().parents[3] / "docs" / "FORMAT.md"
ALL = list(CODECS.values())
IDS = list(CODECS)

#: sha256 (first 16 hex digits) of codes + scale + bias of `golden_rows(37, dim)` for dim 13 and
#: 16, computed by publisher/codecs.py before it became a table: the bytes stored checkpoints
#: hold. A codec added later pins its own here; int8 pins its format version 3 bytes (float32
#: fields) as its own code writes them (the byte kernel's may differ by one code at a near tie:
#: `test_the_byte_kernel_writes_the_rule_up_to_near_ties`).
GOLDEN = {
    "fp32": ("1e4aa1206a49eba0", "c05fe760d3619247"),
    "fp16": ("61e20f1c2e5cd22f", "bb785ebde9576490"),
    "int8": ("348db56616f398fb", "9a462757cb9fa600"),
    "int4": ("c3d60f6ba53c02f2", "a607442d999d9cfe"),
    "int3": ("258972767f863322", "9fd30b23fdcf1311"),
    "int2": ("c642a545f7b5e86c", "66c52381c2fcb6a8"),
    "int8-adaptive": ("8f4e55cc9f186485", "5f0ea544172d2be7"),
    "int4-adaptive": ("2e59699cede7d6b8", "90ca6cfa24a263b7"),
    "int3-adaptive": ("fd6429c36f259fcc", "a6db5345541612f5"),
    "int2-adaptive": ("8c5e072a8c1adef3", "b7a274b6d700a0e1"),
}


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread, as in test_codecs.py: small kernels on a loaded two-core machine
    otherwise wait at OpenMP barriers."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def golden_rows(n: int, dim: int) -> np.ndarray:
    """Rows from integer arithmetic and one float64 product each (correctly rounded, so the same
    on every machine): four magnitudes, and a constant row."""
    i = np.arange(n)[:, None]
    j = np.arange(dim)[None, :]
    ints = (i * 7919 + j * 104729) % 2003 - 1001
    scale = np.array([1 / 137, 1 / 3, 1e-4, 7.0])[i % 4]
    x = (ints * scale).astype(np.float32)
    x[5] = 0.3
    return x


def hard_rows(dim: int) -> np.ndarray:
    """Rows at the edges of the fp16 fields: constants, subnormal ranges, a negative scale."""
    rows = [
        np.zeros(dim),
        np.full(dim, -3.0),
        np.full(dim, 1.2345678),
        np.linspace(0, 1e-6, dim),
        np.linspace(-1e-7, 1e-7, dim),
        np.linspace(1000.3, 1000.31, dim),  # fp16(min) rounds above max
        np.linspace(-16384, 16384, dim),
    ]
    return np.array(rows, dtype=np.float32)


def digest(q: QuantizedRows) -> str:
    h = hashlib.sha256()
    for arr in (q.codes, q.scale, q.bias):
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


# --- the table -----------------------------------------------------------------------------------


def test_the_table_and_the_format_layouts_name_the_same_codecs() -> None:
    assert tuple(CODECS) == codec_names.CODECS
    for name, codec in CODECS.items():
        assert codec.name == name
        assert codec.layout is codec_names.LAYOUTS[name]
        assert codec.bits == codec_names.CODEC_BITS[name]
        assert codec.affine == codec_names.is_integer_codec(name)
    assert set(GOLDEN) == set(CODECS), "pin the new codec's bytes in GOLDEN"


def test_an_unknown_name_is_refused() -> None:
    for name in ("int5", "INT4", "", None):
        with pytest.raises(UnknownCodecError, match="unknown codec"):
            codec_of(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", ALL, ids=IDS)
@pytest.mark.parametrize("dim", [1, 3, 13, 16, 64])
def test_every_codec_round_trips_within_its_bound(codec: Codec, dim: int) -> None:
    x = np.concatenate([embedding_like_rows(200, dim, seed=dim), hard_rows(dim)])
    q = codec.encode(x)
    decoded = codec.decode(q)
    bound = codec.error_bound(q)
    assert decoded.dtype == np.float32 and decoded.shape == x.shape
    assert bound.shape == (x.shape[0],) and np.all(bound >= 0)
    err = np.abs(decoded.astype(np.float64) - x.astype(np.float64)).max(axis=1)
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), f"row {worst}: error {err[worst]!r} over bound {bound[worst]!r}"
    if codec.lossless:
        assert np.all(bound == 0) and decoded.tobytes() == x.tobytes()
    elif dim > 1 or codec.field_dtype != np.float32:
        # A lossy codec that loses nothing here tests nothing (but a row of one element is
        # constant, which float32 fields hold exactly).
        assert np.any(err > 0)


@pytest.mark.parametrize("codec", ALL, ids=IDS)
@pytest.mark.parametrize("dim", [1, 5, 13, 16, 67])
def test_row_bytes_is_what_the_encoder_writes_into_a_blob(codec: Codec, dim: int) -> None:
    n = 9
    x = embedding_like_rows(n, dim, seed=1)
    q = codec.encode(x)
    assert q.codes.shape == (n, codec.row_bytes(dim))
    assert q.scale.shape == q.bias.shape == ((n,) if codec.affine else (0,))
    blob = DeltaBlob(
        table="t",
        codec=codec.name,
        dim=dim,
        table_rows=n,
        row_ids=np.arange(n, dtype=np.int64),
        codes=np.ascontiguousarray(q.codes),
        scale=np.ascontiguousarray(q.scale),
        bias=np.ascontiguousarray(q.bias),
        aux=np.zeros((n, 0), dtype=np.float32),
    )
    data = encode_delta_blob(blob, compress=False)
    raw = {s.name: s.raw_len for s in peek_header(data).sections}
    assert raw["codes"] == n * codec.row_bytes(dim)
    field_bytes = codec.field_dtype.itemsize
    assert raw["scale_bias"] == codec.layout.scale_bias_bytes(n)
    assert raw["scale_bias"] == (2 * field_bytes * n if codec.affine else 0)
    read = decode_delta_blob(data)
    back = QuantizedRows(read.codec, read.dim, read.codes, read.scale, read.bias)
    assert codec.decode(back).tobytes() == codec.decode(q).tobytes()


def byte_exact_on_kernel(codec: Codec) -> bool:
    """Whether the kernel path writes the own code's bytes (all but the byte kernel's codecs)."""
    return codec.field_dtype != np.float32


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "own-code"])
@pytest.mark.parametrize("codec", ALL, ids=IDS)
def test_every_codec_writes_the_bytes_stored_checkpoints_hold(
    codec: Codec, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
    elif not byte_exact_on_kernel(codec) and codec.encodes_on_kernel(16):
        pytest.skip("the byte kernel's bytes may differ at near ties (test below)")
    for dim, pinned in zip((13, 16), GOLDEN[codec.name], strict=True):
        x = golden_rows(37, dim)
        assert digest(codec.encode(x)) == pinned, f"{codec.name}, dim {dim}"
        assert digest(codec.encode(x, checked_finite=True, max_abs=7007.0)) == pinned


@pytest.mark.parametrize(
    "codec", [c for c in ALL if not byte_exact_on_kernel(c)], ids=lambda c: c.name
)
@pytest.mark.parametrize("dim", [13, 16, 64])
def test_the_byte_kernel_writes_the_rule_up_to_near_ties(
    codec: Codec, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The relaxed rule for a fallback: the same fields, codes off by one at a few near ties,
    # and both within the codec's bound.
    if not codec.encodes_on_kernel(dim):
        pytest.skip("this torch lacks the byte kernel")
    x = np.concatenate([golden_rows(37, dim), embedding_like_rows(3000, dim, seed=dim)])
    kernel = codec.encode(x)
    with monkeypatch.context() as m:
        m.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
        own = codec.encode(x)
    assert kernel.scale.tobytes() == own.scale.tobytes()
    assert kernel.bias.tobytes() == own.bias.tobytes()
    off = kernel.codes.astype(np.int16) - own.codes
    assert np.abs(off).max() <= 1 and np.count_nonzero(off) <= 1e-4 * off.size
    for q in (kernel, own):
        err = np.abs(codec.decode(q).astype(np.float64) - x).max(axis=1)
        assert np.all(err <= codec.error_bound(q))


#: an int8 blob as writers before format version 3 wrote it (fp16 scale and bias; version 1,
#: uncompressed): rows 0, 2, 4 of 5, encoded from `OLD_INT8_ROWS`.
OLD_INT8_BLOB = (
    b"CNRDELTA\x01\x00\x00\x00\x79\x01\x00\x00"
    b'{"table":"t","codec":"int8","dim":8,"table_rows":5,"n_rows":3,"aux_dim":0,'
    b'"row_encoding":"bitmap","sections":['
    b'{"name":"rows","compression":"none","stored_len":1,"raw_len":1},'
    b'{"name":"codes","compression":"none","stored_len":24,"raw_len":24},'
    b'{"name":"scale_bias","compression":"none","stored_len":12,"raw_len":12},'
    b'{"name":"aux","compression":"none","stored_len":0,"raw_len":0}]}'
    + bytes.fromhex(
        "15"  # bitmap: rows 0, 2, 4
        "003060789fbfefff0024496d92b6dbff0000111a34578cff"  # codes
        "0424"
        "9f19"
        "5427"  # fp16 scales
        "00bc"
        "662e"
        "d163"  # fp16 biases -1.0, 0.09998, 1000.5
        "cb73769e"  # crc32
    )
)
OLD_INT8_ROWS = np.array(
    [
        [-1.0, -0.25, 0.5, 0.875, 1.5, 2.0, 2.75, 3.0],
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
        [1000.3, 1000.5, 1001.0, 1001.25, 1002.0, 1003.0, 1004.5, 1007.8],
    ],
    dtype=np.float32,
)
#: what that blob decoded to when it was written.
OLD_INT8_DECODED = np.array(
    [
        *(-1.0, -0.2470703125, 0.505859375, 0.88232421875, 1.49407958984375, 1.99603271484375),
        *(2.74896240234375, 2.99993896484375, 0.0999755859375, 0.19878387451171875),
        *(0.3003368377685547, 0.39914512634277344, 0.5006980895996094, 0.5995063781738281),
        *(0.7010593414306641, 0.7998676300048828, 1000.5, 1000.5, 1000.9866333007812),
        *(1001.2442626953125, 1001.988525390625, 1002.9904174804688, 1004.507568359375),
        1007.7994995117188,
    ],
    dtype=np.float32,
).reshape(3, 8)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "own-code"])
def test_an_int8_blob_from_before_version_3_decodes_as_it_did(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(rowwise_kernels, "DECODE_BITS", frozenset())
    blob = decode_delta_blob(OLD_INT8_BLOB)
    assert blob.codec == "int8" and blob.scale_bias_encoding == "float16"
    assert blob.row_ids.tolist() == [0, 2, 4]
    q = QuantizedRows(blob.codec, blob.dim, blob.codes, blob.scale, blob.bias)
    decoded = codec_of("int8").decode(q)
    assert decoded.tobytes() == OLD_INT8_DECODED.tobytes()
    err = np.abs(decoded.astype(np.float64) - OLD_INT8_ROWS).max(axis=1)
    assert np.all(err <= codec_of("int8").error_bound(q))
    # The same rows written now: format version 3, float32 fields, within the bound too, and
    # closer in all (the third row's fp16 bias 1000.5 is past its min 1000.3).
    now = codec_of("int8").encode(OLD_INT8_ROWS)
    assert now.scale.dtype == now.bias.dtype == np.float32
    diff_now = codec_of("int8").decode(now).astype(np.float64) - OLD_INT8_ROWS
    assert np.all(np.abs(diff_now).max(axis=1) <= codec_of("int8").error_bound(now))
    diff = decoded.astype(np.float64) - OLD_INT8_ROWS
    assert np.sum(diff_now**2) < np.sum(diff**2)


def test_a_codec_reads_only_its_own_rows() -> None:
    q = codec_of("int4").encode(embedding_like_rows(3, 8))
    for other in ("int2", "int4-adaptive", "fp16"):
        with pytest.raises(ValueError, match="cannot read rows encoded as int4"):
            codec_of(other).decode(q)
        with pytest.raises(ValueError, match="cannot read rows encoded as int4"):
            codec_of(other).error_bound(q)


# --- docs/FORMAT.md section 4.1 ------------------------------------------------------------------


def format_section() -> str:
    text = FORMAT_MD.read_text(encoding="utf-8")
    match = re.search(r"^### 4\.1 Codecs\n(.*?)(?=^#{2,3} )", text, re.MULTILINE | re.DOTALL)
    assert match, "docs/FORMAT.md has no section '### 4.1 Codecs'"
    return match.group(1)


def documented_rows() -> dict[str, list[str]]:
    """The cells of section 4.1's table, by codec name."""
    rows: dict[str, list[str]] = {}
    for line in format_section().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells and re.fullmatch(r"`[^`]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def documented_bits(cell: str) -> int:
    """Bits per element of a `codes per row` cell: `4*dim` (bytes) or `ceil(dim*4/8)` (bits)."""
    match = re.fullmatch(r"`(?:(\d+)\*dim|ceil\(dim\*(\d+)/8\))`", cell)
    assert match, f"unreadable codes-per-row cell {cell!r}"
    whole_bytes, bits = match.groups()
    return 8 * int(whole_bytes) if whole_bytes else int(bits)


def test_format_md_lists_exactly_the_table() -> None:
    assert list(documented_rows()) == list(CODECS)
    text = FORMAT_MD.read_text(encoding="utf-8")
    rule = re.search(r"^\| `codec` \| one of (.*) \|$", text, re.MULTILINE)
    assert rule, "the header rule of `codec` is missing from docs/FORMAT.md section 4"
    assert re.findall(r"`([^`]+)`", rule.group(1)) == list(CODECS)


@pytest.mark.parametrize("codec", ALL, ids=IDS)
def test_format_md_documents_each_codec_layout(codec: Codec) -> None:
    cells = documented_rows().get(codec.name)
    assert cells is not None, f"docs/FORMAT.md section 4.1 has no row for {codec.name}"
    bits, codes, scale_bias, decodes, search = cells
    assert int(bits) == codec.bits
    per_element = documented_bits(codes)
    for dim in range(1, 71):
        assert math.ceil(dim * per_element / 8) == codec.row_bytes(dim)
    width = "fp32" if codec.field_dtype == np.float32 else "fp16"
    assert scale_bias == (f"{width} scale, {width} bias" if codec.affine else "none")
    assert (decodes == "bias + code * scale") == codec.affine
    assert (search == "searched") == codec.adaptive
