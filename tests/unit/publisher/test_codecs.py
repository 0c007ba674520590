"""Row codecs (publisher/codecs/): round trips, error bounds, the documented rounding, golden
packing bytes, the adaptive search's never-worse guarantee, and every rejection.

Reference computations here are deliberately naive (float64 numpy, per-bit Python loops) so
that they check the vectorised torch code against the rules in docs/FORMAT.md section 4 rather
than against itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from bench.codec import embedding_like_rows
from publisher import codecs
from publisher.codecs import (
    CodecError,
    NonFiniteRowsError,
    OutOfRangeRowsError,
    QuantizedRows,
    UnknownCodecError,
    decode_rows,
    encode_rows,
    max_abs_error_bound,
    pack_codes,
    unpack_codes,
)
from schemas.codec_names import CODEC_BITS, CODECS, is_integer_codec, row_bytes

INT_CODECS = [c for c in CODECS if is_integer_codec(c)]
UNIFORM_INT = [c for c in INT_CODECS if not c.endswith("-adaptive")]
ADAPTIVE = [c for c in INT_CODECS if c.endswith("-adaptive")]


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Codec kernels work on cache-sized chunks and are meant to run on one intra-op thread;
    with two on a loaded two-core machine every small kernel waits at an OpenMP barrier for a
    descheduled thread (measured 50-200x slower), which would only slow these tests down."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def wide(codec: str) -> bool:
    """Whether `codec` writes float32 scales and biases (int8: the byte kernel's rule)."""
    return bool(codecs.CODECS[codec].field_dtype == np.float32)


def rows_for_tests(n: int = 300, dim: int = 64, seed: int = 0) -> np.ndarray:
    return embedding_like_rows(n, dim, seed=seed)


def row_sq_errors(q: QuantizedRows, x: np.ndarray) -> np.ndarray:
    err = decode_rows(q).astype(np.float64) - x.astype(np.float64)
    sse: np.ndarray = np.sum(err * err, axis=1)
    return sse


def reference_uniform(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scale, bias) by the documented formula, in float64 after the fp16 rounding."""
    levels = (1 << bits) - 1
    mn = x.min(axis=1)
    mx = x.max(axis=1)
    bias = mn.astype(np.float16)
    # float32 arithmetic, as encoded: the range starts at the rounded bias; a zero scale is 1.
    scale = ((mx - bias.astype(np.float32)) / np.float32(levels)).astype(np.float16)
    scale[scale == 0] = 1
    s = scale.astype(np.float64)[:, None]
    b = bias.astype(np.float64)[:, None]
    codes = np.clip(np.rint((x - b) / s), 0, levels).astype(np.uint8)
    return codes, scale, bias


def reference_fp32(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scale, bias) by the documented byte kernel rule, in float32 numpy."""
    levels = np.float32((1 << bits) - 1)
    lo = x.min(axis=1)
    span = x.max(axis=1) - lo
    scale = span / levels
    inverse = levels / (span + np.float32(1e-8))
    codes = np.clip(np.rint((x - lo[:, None]) * inverse[:, None]), 0, levels).astype(np.uint8)
    return codes, scale, lo


def read_bits(row: bytes, j: int, bits: int) -> int:
    """Element j of a packed row per FORMAT.md: the bits-bit uint starting at bit j*bits."""
    value = 0
    for k in range(bits):
        pos = j * bits + k
        value |= ((row[pos // 8] >> (pos % 8)) & 1) << k
    return value


# --- round trips and error bounds -----------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_within_bound(codec: str) -> None:
    x = rows_for_tests()
    q = encode_rows(codec, x)
    assert q.codec == codec and q.dim == 64 and q.n_rows == 300
    assert q.codes.dtype == np.uint8 and q.codes.shape == (300, row_bytes(codec, 64))
    assert q.codes.flags.c_contiguous
    n_sb = 300 if is_integer_codec(codec) else 0
    fields = np.float32 if wide(codec) else np.float16
    assert q.scale.dtype == fields and q.scale.shape == (n_sb,)
    assert q.bias.dtype == fields and q.bias.shape == (n_sb,)
    y = decode_rows(q)
    assert y.dtype == np.float32 and y.shape == x.shape
    err = np.abs(y.astype(np.float64) - x).max(axis=1)
    assert np.all(err <= max_abs_error_bound(q))


def test_fp32_is_bitwise_exact() -> None:
    x = rows_for_tests(50, 33)
    x[0, :3] = [-0.0, 1e-45, -3.4e38]  # negative zero, a subnormal, a huge value
    q = encode_rows("fp32", x)
    assert q.codes.tobytes() == x.astype("<f4").tobytes()
    assert decode_rows(q).tobytes() == x.tobytes()
    assert np.all(max_abs_error_bound(q) == 0)


def test_fp16_codes_are_ieee_half_bytes() -> None:
    x = rows_for_tests(40, 17)
    q = encode_rows("fp16", x)
    assert q.codes.tobytes() == x.astype("<f2").tobytes()
    np.testing.assert_array_equal(decode_rows(q), x.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("codec", UNIFORM_INT)
def test_uniform_matches_documented_formula(codec: str) -> None:
    bits = CODEC_BITS[codec]
    x = rows_for_tests(500, 40, seed=3)
    q = encode_rows(codec, x)
    codes, scale, bias = (reference_fp32 if wide(codec) else reference_uniform)(x, bits)
    np.testing.assert_array_equal(q.scale, scale)
    np.testing.assert_array_equal(q.bias, bias)
    got = unpack_codes(q.codes, bits, 40)
    differ = got != codes
    if differ.any():  # float32 (x - bias) * (1/scale) may only flip a code at a near-tie
        s = scale.astype(np.float64)[:, None]
        t = (x - bias.astype(np.float64)[:, None]) / s
        frac = np.abs(t - np.floor(t) - 0.5)
        assert np.all(frac[differ] < 1e-4)
        assert np.all(np.abs(got.astype(int) - codes)[differ] == 1)
    assert differ.mean() < 1e-3
    # Decoding is bias + code * scale, rounded once (exact products for fp16 fields; float64
    # then one rounding stands for the kernels' fused multiply-add for fp32 ones).
    exact = bias.astype(np.float64)[:, None] + got * scale.astype(np.float64)[:, None]
    np.testing.assert_array_equal(decode_rows(q), exact.astype(np.float32))


@pytest.mark.parametrize("codec", UNIFORM_INT)
def test_uniform_error_is_half_a_step_plus_fp16_rounding(codec: str) -> None:
    # (For int8's float32 fields the bias term is not even needed: the same allowance holds.)
    bits = CODEC_BITS[codec]
    x = rows_for_tests(2000, 64, seed=4)
    q = encode_rows(codec, x)
    err = np.abs(decode_rows(q).astype(np.float64) - x)
    scale = q.scale.astype(np.float64)
    bias = q.bias.astype(np.float64)
    levels = (1 << bits) - 1
    # Independent of max_abs_error_bound: half a step, fp16 rounding of bias, float32 slack.
    allowed = (
        scale / 2 + np.abs(bias) * 2.0**-11 + 2.0**-25 + 1e-6 * (np.abs(bias) + levels * scale)
    )
    assert np.all(err.max(axis=1) <= allowed)
    bound = max_abs_error_bound(q)
    assert np.all(err.max(axis=1) <= bound)
    # ...and both are tight: with dim 64 some element of most rows lands near half a step,
    # and the bound adds little to half a step.
    half_step = err.max(axis=1) / (scale / 2)
    assert half_step.max() > 0.99
    assert np.median(half_step) > 0.9
    assert np.all(bound <= 1.01 * allowed)


@pytest.mark.parametrize("codec", ["fp16", *INT_CODECS])
def test_tiny_and_huge_magnitudes_stay_within_bound(codec: str) -> None:
    rng = np.random.default_rng(5)
    x = np.concatenate(
        [
            rng.standard_normal((4, 24)) * 1e-7,  # fp16 subnormal scale and bias
            rng.standard_normal((4, 24)) * 1e-3 + 7.0,  # small range far from zero
            rng.standard_normal((4, 24)) * 1e3,  # large values
        ]
    ).astype(np.float32)
    q = encode_rows(codec, x)
    err = np.abs(decode_rows(q).astype(np.float64) - x).max(axis=1)
    assert np.all(err <= max_abs_error_bound(q))


# --- the adaptive search --------------------------------------------------------------------------


@st.composite
def rows_with_outliers(draw: st.DrawFn) -> np.ndarray:
    n = draw(st.integers(1, 6))
    dim = draw(st.integers(1, 70))
    base = draw(hnp.arrays(np.float32, (n, dim), elements=st.floats(-4, 4, width=32)))
    magnitude = draw(st.sampled_from([1e-6, 1e-3, 1.0, 300.0]))
    x = base * np.float32(magnitude)
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, n - 1))
        j = draw(st.integers(0, dim - 1))
        x[i, j] = np.float32(draw(st.floats(-50, 50)) * magnitude)
    return x.astype(np.float32)


def uniform_of(adaptive: str) -> codecs.Codec:
    """The uniform rule of an adaptive codec's own layout (its search's starting point: int8's
    differs in its fields)."""
    return replace(codecs.CODECS[adaptive], search=None)


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@settings(max_examples=60, deadline=None)
@given(x=rows_with_outliers())
def test_adaptive_never_worse_than_uniform_on_any_row(bits: int, x: np.ndarray) -> None:
    q_a = encode_rows(f"int{bits}-adaptive", x)
    q_u = uniform_of(f"int{bits}-adaptive").encode(x)
    sse_a = row_sq_errors(q_a, x)
    sse_u = row_sq_errors(q_u, x)
    assert np.all(sse_a <= sse_u * (1 + 1e-12))
    err = np.abs(decode_rows(q_a).astype(np.float64) - x).max(axis=1)
    assert np.all(err <= max_abs_error_bound(q_a))


@pytest.mark.parametrize("codec", ADAPTIVE)
def test_adaptive_beats_uniform_on_embedding_like_rows(codec: str) -> None:
    x = rows_for_tests(1000, 64, seed=6)
    sse_a = row_sq_errors(encode_rows(codec, x), x)
    sse_u = row_sq_errors(uniform_of(codec).encode(x), x)
    assert np.all(sse_a <= sse_u * (1 + 1e-12))
    if codec != "int8-adaptive":  # 8 bits: 1% steps rarely pay, and never cost
        assert sse_a.sum() < 0.9 * sse_u.sum()


def test_adaptive_search_shrinks_range_at_most_as_configured() -> None:
    x = rows_for_tests(500, 64, seed=7)
    q = encode_rows("int4-adaptive", x)
    full = x.max(axis=1) - x.min(axis=1)
    kept = 15 * q.scale.astype(np.float64)
    shrink = codecs.ADAPTIVE_STEPS / codecs.ADAPTIVE_NUM_BINS
    assert np.all(kept >= full * (1 - shrink) * (1 - 2.0**-10))
    assert np.all(kept <= full * (1 + 2.0**-10))
    assert np.any(kept < full * 0.99)  # the search does move on these rows


@pytest.mark.parametrize("codec", ["int4-adaptive", "int3-adaptive", "int2-adaptive"])
def test_default_search_is_as_good_as_guan_defaults(codec: str) -> None:
    x = rows_for_tests(2000, 64, seed=9)
    ours = row_sq_errors(encode_rows(codec, x), x).sum()
    guan_codec = replace(codecs.CODECS[codec], search=codecs.RangeSearch(num_bins=200, steps=32))
    guan = row_sq_errors(guan_codec.encode(x), x).sum()
    assert guan != ours  # the search ran with Guan et al.'s parameters
    assert ours <= 1.01 * guan


def test_adaptive_clips_a_lone_outlier() -> None:
    x = np.linspace(-1, 1, 64, dtype=np.float32)[None, :].copy()
    x[0, 5] = 3.0
    sse_a = row_sq_errors(encode_rows("int2-adaptive", x), x)
    sse_u = row_sq_errors(encode_rows("int2", x), x)
    assert sse_a[0] < 0.8 * sse_u[0]


# --- edge shapes and values -----------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "value", [0.0, -0.0, 0.5, -3.0, 65504.0, 1.2345678, 1e-6, 3000.7, -40000.3]
)
def test_constant_rows_decode_at_least_as_close_as_fp16_of_the_value(
    codec: str, value: float
) -> None:
    x = np.full((3, 10), value, dtype=np.float32)
    q = encode_rows(codec, x)
    y = decode_rows(q)
    fp16 = x.astype(np.float16).astype(np.float32)
    if codec == "fp32" or wide(codec):  # float32 fields: scale 0, the bias is the value
        np.testing.assert_array_equal(y, x)
        if wide(codec):
            assert np.all(q.scale == 0) and np.all(q.codes == 0)
    elif codec == "fp16" or fp16[0, 0] == value:  # range 0: scale 1, code 0, decodes to bias
        np.testing.assert_array_equal(y, fp16)
        if is_integer_codec(codec):
            assert np.all(q.scale == 1) and np.all(unpack_codes(q.codes, q.bits, 10) == 0)
    else:  # the range from fp16(value) to value is quantised too: never further than fp16
        assert np.all(np.abs(y.astype(np.float64) - x) <= np.abs(fp16.astype(np.float64) - x))
        codes, scale, bias = reference_uniform(x, q.bits)
        np.testing.assert_array_equal(q.scale, scale)
        np.testing.assert_array_equal(q.bias, bias)
        np.testing.assert_array_equal(unpack_codes(q.codes, q.bits, 10), codes)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_rows_are_rejected_with_the_first_bad_row(codec: str, bad: float) -> None:
    x = rows_for_tests(40, 8)
    x[29, 3] = bad
    x[35, 0] = np.nan
    with pytest.raises(NonFiniteRowsError, match="row 29") as info:
        encode_rows(codec, x, chunk_rows=7)  # the bad row sits inside the fifth chunk
    assert info.value.row == 29
    assert isinstance(info.value, CodecError) and isinstance(info.value, ValueError)


def test_values_beyond_fp16_are_rejected_not_turned_into_inf() -> None:
    x = np.zeros((3, 4), dtype=np.float32)
    x[1, 2] = 70000.0
    with pytest.raises(OutOfRangeRowsError, match="row 1") as info:
        encode_rows("fp16", x)
    assert info.value.row == 1
    x[1, 2] = -70000.0  # int codecs: the bias fp16(min) would overflow
    with pytest.raises(OutOfRangeRowsError, match="row 1"):
        encode_rows("int4", x)
    # A large range with a small min fits: scale = 100000 / 3 is a finite fp16.
    y = np.array([[0.0, 100000.0]], dtype=np.float32)
    q = encode_rows("int2", y)
    assert np.all(np.abs(decode_rows(q) - y) <= max_abs_error_bound(q)[:, None])


@pytest.mark.parametrize("codec", CODECS)
def test_finite_values_whose_sums_overflow_are_not_non_finite(codec: str) -> None:
    # The finite checks sum the rows (or their minima and maxima) first; with a few rows at
    # -3e38 those sums overflow, and only the closer look may decide.
    x = rows_for_tests(20, 8)
    x[4:8] = -3e38
    if codec == "fp32":
        assert encode_rows(codec, x).codes.view("<f4").tobytes() == x.tobytes()
        return
    if wide(codec):  # float32 fields hold these constant rows exactly
        q = encode_rows(codec, x)
        np.testing.assert_array_equal(decode_rows(q)[4:8], x[4:8])
        return
    with pytest.raises(OutOfRangeRowsError, match="row 4"):
        encode_rows(codec, x)


@pytest.mark.parametrize("codec", CODECS)
def test_empty_input(codec: str) -> None:
    q = encode_rows(codec, np.empty((0, 12), dtype=np.float32))
    assert q.n_rows == 0 and q.codes.shape == (0, row_bytes(codec, 12))
    assert q.scale.shape == (0,) and q.bias.shape == (0,)
    assert decode_rows(q).shape == (0, 12)
    assert max_abs_error_bound(q).shape == (0,)


@pytest.mark.parametrize("codec", CODECS)
def test_dim_one(codec: str) -> None:
    x = np.array([[1.5], [-2.0], [0.0], [3.14159]], dtype=np.float32)
    q = encode_rows(codec, x)
    assert q.codes.shape == (4, row_bytes(codec, 1))
    y = decode_rows(q)
    expected = x if codec == "fp32" else x.astype(np.float16).astype(np.float32)
    if is_integer_codec(codec):  # one element: min == max, as a constant row
        fp16_exact = expected == x
        np.testing.assert_array_equal(y[fp16_exact], x[fp16_exact])
        assert np.all(np.abs(y - x) <= np.abs(expected - x))
        assert np.abs(y - x)[3, 0] < np.abs(expected - x)[3, 0]  # 3.14159 is not an fp16
    else:
        np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("codec", CODECS)
def test_huge_dim(codec: str) -> None:
    x = embedding_like_rows(3, 65536, seed=8)
    q = encode_rows(codec, x)
    assert q.codes.shape == (3, row_bytes(codec, 65536))
    err = np.abs(decode_rows(q).astype(np.float64) - x).max(axis=1)
    assert np.all(err <= max_abs_error_bound(q))


@pytest.mark.parametrize("codec", CODECS)
def test_result_does_not_depend_on_chunking(codec: str) -> None:
    x = rows_for_tests(101, 19)
    a = encode_rows(codec, x)
    b = encode_rows(codec, x, chunk_rows=8)
    assert a.codes.tobytes() == b.codes.tobytes()
    assert a.scale.tobytes() == b.scale.tobytes() and a.bias.tobytes() == b.bias.tobytes()


@pytest.mark.parametrize("codec", ["fp16", "int4", "int3-adaptive"])
def test_result_does_not_depend_on_torch_threads(codec: str) -> None:
    x = rows_for_tests(1024, 64)  # 64k elements per kernel: above ATen's parallel grain size
    one = encode_rows(codec, x)
    torch.set_num_threads(2)
    two = encode_rows(codec, x)
    assert one.codes.tobytes() == two.codes.tobytes()
    assert one.scale.tobytes() == two.scale.tobytes() and one.bias.tobytes() == two.bias.tobytes()
    np.testing.assert_array_equal(decode_rows(one), decode_rows(two))


# --- packing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bits", "codes", "packed"),
    [
        (2, [1, 2, 3], [0b00111001]),  # 1 | 2 << 2 | 3 << 4
        (2, [3, 0, 0, 0, 1], [0b00000011, 0b00000001]),
        (4, [1, 2, 3], [0x21, 0x03]),
        (4, [15, 0, 0, 15], [0x0F, 0xF0]),
        (3, [1, 2, 3], [0b11010001, 0b00000000]),  # 1 | 2 << 3 | 3 << 6 = 0xD1, bit 8 = 0
        (3, [7, 7, 7], [0xFF, 0x01]),
        # 24-bit group 1 | 2<<3 | 3<<6 | 4<<9 | 5<<12 | 6<<15 | 7<<18 | 0<<21, then 1
        (3, [1, 2, 3, 4, 5, 6, 7, 0, 1], [0xD1, 0x58, 0x1F, 0x01]),
        (8, [0, 255, 7], [0, 255, 7]),
    ],
)
def test_packing_golden_bytes(bits: int, codes: list[int], packed: list[int]) -> None:
    c = np.array([codes, codes], dtype=np.uint8)
    got = pack_codes(c, bits)
    assert got.tolist() == [packed, packed]
    np.testing.assert_array_equal(unpack_codes(got, bits, len(codes)), c)


def test_encode_golden_bytes() -> None:
    # int2: [0, 1, 2, 3] has bias 0 and scale 1, so the codes are the values: 0b11100100.
    q = encode_rows("int2", np.array([[0.0, 1.0, 2.0, 3.0]], dtype=np.float32))
    assert q.codes.tobytes() == bytes([0xE4])
    assert q.scale.tolist() == [1.0] and q.bias.tolist() == [0.0]
    # int4: 0..15 step 0.5 from -1: codes 0..15 -> bytes 0x10, 0x32, ..., 0xFE.
    x = (np.arange(16, dtype=np.float32) * 0.5 - 1.0)[None, :]
    q = encode_rows("int4", x)
    assert q.codes.tobytes() == bytes([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    assert q.scale.tolist() == [0.5] and q.bias.tolist() == [-1.0]
    # int3, dim 3: codes 0, 3, 7 -> 0 | 3 << 3 | 7 << 6 = 0x1D8 -> bytes 0xD8, 0x01.
    q = encode_rows("int3", np.array([[0.0, 3.0, 7.0]], dtype=np.float32))
    assert q.codes.tobytes() == bytes([0xD8, 0x01])


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_packing_matches_the_bit_rule(bits: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 4))
    dim = data.draw(st.integers(1, 40))
    codes = data.draw(hnp.arrays(np.uint8, (n, dim), elements=st.integers(0, (1 << bits) - 1)))
    packed = pack_codes(codes, bits)
    assert packed.shape == (n, (dim * bits + 7) // 8)
    for i in range(n):
        row = packed[i].tobytes()
        assert [read_bits(row, j, bits) for j in range(dim)] == codes[i].tolist()
        used = dim * bits
        assert all(read_bits(row, k, 1) == 0 for k in range(used, 8 * len(row)))  # padding
    np.testing.assert_array_equal(unpack_codes(packed, bits, dim), codes)


# --- decode into a preallocated array -------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_preallocated_out(codec: str) -> None:
    x = rows_for_tests(50, 12)
    q = encode_rows(codec, x)
    expected = decode_rows(q)
    table = np.full((70, 12), -1.0, dtype=np.float32)
    out = table[10:60]
    assert decode_rows(q, out=out) is out
    np.testing.assert_array_equal(table[10:60], expected)
    assert np.all(table[:10] == -1.0) and np.all(table[60:] == -1.0)
    wide = np.zeros((50, 24), dtype=np.float32)
    strided = wide[:, ::2]  # non-contiguous rows work too
    decode_rows(q, out=strided)
    np.testing.assert_array_equal(strided, expected)


@pytest.mark.parametrize("codec", CODECS)
def test_decode_of_read_only_unaligned_blob_views(codec: str) -> None:
    # A fetched blob hands over read-only numpy views of its bytes at any offset.
    x = rows_for_tests(20, 10)
    q = encode_rows(codec, x)
    raw = b"\x00" + q.codes.tobytes() + q.scale.tobytes() + q.bias.tobytes()
    n_codes, n_sb = q.codes.size, q.scale.size
    codes = np.frombuffer(raw, dtype=np.uint8, count=n_codes, offset=1).reshape(q.codes.shape)
    sb = np.frombuffer(
        raw, dtype=q.scale.dtype.newbyteorder("<"), count=2 * n_sb, offset=1 + n_codes
    )
    view = QuantizedRows(codec=codec, dim=10, codes=codes, scale=sb[:n_sb], bias=sb[n_sb:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(decode_rows(view), decode_rows(q))
        np.testing.assert_array_equal(max_abs_error_bound(view), max_abs_error_bound(q))


def test_decode_rejects_bad_out() -> None:
    q = encode_rows("int4", rows_for_tests(5, 8))
    with pytest.raises(CodecError, match=r"shape \(5, 8\)"):
        decode_rows(q, out=np.empty((5, 9), dtype=np.float32))
    with pytest.raises(CodecError, match="float32"):
        decode_rows(q, out=np.empty((5, 8), dtype=np.float64))
    ro = np.empty((5, 8), dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(CodecError, match="writeable"):
        decode_rows(q, out=ro)


# --- input checking -------------------------------------------------------------------------------


def test_unknown_codec() -> None:
    with pytest.raises(UnknownCodecError, match="int5"):
        encode_rows("int5", np.zeros((1, 4), dtype=np.float32))
    assert issubclass(UnknownCodecError, CodecError)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (np.zeros((3, 4), dtype=np.float64), "float32"),
        (np.zeros((3, 4), dtype=">f4"), "float32"),
        (np.zeros(4, dtype=np.float32), r"shape \(n, dim\)"),
        (np.zeros((2, 2, 2), dtype=np.float32), r"shape \(n, dim\)"),
        (np.zeros((3, 0), dtype=np.float32), "dim >= 1"),
        (torch.zeros(3, 4, dtype=torch.float16), "float32"),
        ([[1.0, 2.0]], "numpy array or torch tensor"),
    ],
)
def test_bad_input_is_rejected(rows: object, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode_rows("int4", rows)  # type: ignore[arg-type]


def test_torch_and_strided_and_read_only_inputs() -> None:
    x = rows_for_tests(30, 16)
    reference = encode_rows("int4", x)
    from_torch = encode_rows("int4", torch.from_numpy(x.copy()).requires_grad_(True))
    assert from_torch.codes.tobytes() == reference.codes.tobytes()
    wide = np.zeros((30, 32), dtype=np.float32)
    wide[:, ::2] = x
    assert encode_rows("int4", wide[:, ::2]).codes.tobytes() == reference.codes.tobytes()
    assert encode_rows("int4", x[::-1]).codes.tobytes() == reference.codes[::-1].tobytes()
    ro = x.copy()
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert encode_rows("int4", ro).codes.tobytes() == reference.codes.tobytes()


def test_encoding_does_not_alias_the_input() -> None:
    x = rows_for_tests(4, 8)
    q = encode_rows("fp32", x)
    x[:] = 0
    assert decode_rows(q).any()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"codec": "int9"}, "unknown codec"),
        ({"dim": 0}, "dim"),
        ({"codes": np.zeros((2, 4), dtype=np.uint8)}, "3 bytes per row"),
        ({"codes": np.zeros((2, 3), dtype=np.int8)}, "uint8"),
        ({"codes": np.zeros((2, 6), dtype=np.uint8)[:, ::2]}, "each row contiguous"),
        # rows overlapping: 3-byte rows 2 bytes apart
        (
            {"codes": np.lib.stride_tricks.as_strided(np.zeros(8, np.uint8), (2, 3), (2, 1))},
            "apart",
        ),
        ({"scale": np.zeros(2, dtype=np.float32)}, "scale must be a float16 array"),
        (
            {
                "codec": "int8-adaptive",
                "codes": np.zeros((2, 5), np.uint8),
                "scale": np.zeros(2, np.float32),
            },
            "scale must be a float16 array",
        ),
        (
            {
                "codec": "int8",
                "codes": np.zeros((2, 5), np.uint8),
                "scale": np.zeros(2, np.float32),
            },
            "one dtype, got float32 and float16",
        ),
        (
            {
                "codec": "int8",
                "codes": np.zeros((2, 5), np.uint8),
                "scale": np.zeros(2, np.float64),
            },
            "scale must be a float16 or float32 array",
        ),
        ({"bias": np.zeros(3, dtype=np.float16)}, r"bias must be a float16 array of shape \(2,\)"),
    ],
)
def test_quantized_rows_validates_its_fields(kwargs: dict[str, object], match: str) -> None:
    fields: dict[str, object] = {
        "codec": "int4",
        "dim": 5,
        "codes": np.zeros((2, 3), dtype=np.uint8),
        "scale": np.zeros(2, dtype=np.float16),
        "bias": np.zeros(2, dtype=np.float16),
    }
    fields.update(kwargs)
    with pytest.raises(CodecError, match=match):
        QuantizedRows(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4", "int3", "int2-adaptive"])
@pytest.mark.parametrize("gap", [1, 4], ids=["odd", "even"])
def test_quantized_rows_may_sit_apart(codec: str, gap: int) -> None:
    # The publisher's encode keeps views of the kernel's fused rows (codes, then the fields);
    # rows and fields any number of bytes apart decode as their contiguous copies do.
    q = encode_rows(codec, rows_for_tests(6, 5 if codec != "int3" else 8))
    rb = q.codes.shape[1]
    apart = np.zeros((q.n_rows, rb + gap), dtype=np.uint8)
    apart[:, :rb] = q.codes
    width = 2 * q.scale.itemsize
    fields = np.zeros((q.n_rows, width + gap), dtype=np.uint8)
    pair = fields[:, :width].view(q.scale.dtype)
    scale, bias = (pair[:, 0], pair[:, 1]) if q.scale.size else (q.scale, q.bias)
    scale[:] = q.scale
    bias[:] = q.bias
    spread = QuantizedRows(codec, q.dim, apart[:, :rb], scale, bias)
    assert decode_rows(spread).tobytes() == decode_rows(q).tobytes()


def test_float_codecs_carry_no_scale_or_bias() -> None:
    with pytest.raises(CodecError, match=r"shape \(0,\)"):
        QuantizedRows(
            codec="fp16",
            dim=2,
            codes=np.zeros((1, 4), dtype=np.uint8),
            scale=np.zeros(1, dtype=np.float16),
            bias=np.zeros(0, dtype=np.float16),
        )


def test_decode_rejects_non_finite_scale() -> None:
    q = QuantizedRows(
        codec="int8",
        dim=2,
        codes=np.zeros((1, 2), dtype=np.uint8),
        scale=np.array([np.inf], dtype=np.float16),
        bias=np.zeros(1, dtype=np.float16),
    )
    with pytest.raises(CodecError, match="finite"):
        decode_rows(q)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_int8_decodes_either_field_width(dtype: type[np.floating]) -> None:
    # Blobs of versions 1 and 2 hold fp16 fields, version 3 the byte kernel's float32 ones.
    q = QuantizedRows(
        codec="int8",
        dim=3,
        codes=np.array([[0, 1, 255]], dtype=np.uint8),
        scale=np.array([0.5], dtype=dtype),
        bias=np.array([-1.0], dtype=dtype),
    )
    assert decode_rows(q).tolist() == [[-1.0, -0.5, 126.5]]
    with pytest.raises(CodecError, match="finite"):
        decode_rows(QuantizedRows("int8", 3, q.codes, np.array([np.inf], dtype=dtype), q.bias))
