"""Codecs on torch's row-wise kernels (publisher/rowwise_kernels.py): the kernel path and the
codec's own code, used where a torch build lacks a kernel, write the same bytes and decode to
the same floats, on random rows and on the edge cases of the uniform rule. int8 on the byte
kernel (float32 fields) is held to the relaxed rule: the own code decodes within the same bound,
with the same fields and codes off by one at a few near ties.

`own_code` turns the kernels off the way a torch build without them would leave them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from bench.codec import embedding_like_rows
from publisher import rowwise_kernels
from publisher.codecs import (
    FP16_FIELDS_SAFE,
    NonFiniteRowsError,
    OutOfRangeRowsError,
    QuantizedRows,
    decode_rows,
    encode_rows,
    max_abs_error_bound,
)
from schemas.codec_names import CODEC_BITS, row_bytes

needs_kernels = pytest.mark.skipif(
    not ({4, 2} <= rowwise_kernels.ENCODE_BITS and {4, 2} <= rowwise_kernels.DECODE_BITS),
    reason="this torch build lacks torch.ops.quantized.embedding_bag_* kernels",
)
KERNEL_CODECS = ["int4", "int2"]
#: every codec with a kernel path, int8 (the byte kernel's float32 fields) included.
ALL_KERNEL_CODECS = ["int8", *KERNEL_CODECS]
PREPACK = {4: "embedding_bag_4bit_prepack", 2: "embedding_bag_2bit_prepack"}
needs_byte_kernel = pytest.mark.skipif(
    not (8 in rowwise_kernels.ENCODE_BITS and 8 in rowwise_kernels.DECODE_BITS),
    reason="this torch build lacks torch.ops.quantized.embedding_bag_byte_* kernels",
)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
    monkeypatch.setattr(rowwise_kernels, "DECODE_BITS", frozenset())


def edge_rows(dim: int) -> np.ndarray:
    """Rows at the corners of the uniform rule, `dim` elements each."""
    rng = np.random.default_rng(11)
    ramp = np.linspace(0, 1, dim, dtype=np.float32)
    rows = [np.full(dim, v, dtype=np.float32) for v in (0.0, -0.0, 0.1, 1.2345678, -3.0, 1e-30)]
    rows += [np.full(dim, v, dtype=np.float32) for v in (65504.0, -65504.0, 3000.7, -40000.3)]
    rows += [
        ramp * 1e-9,  # the scale rounds to 0 in fp16: it becomes 1
        ramp * 1e-6,  # subnormal fp16 scale
        ramp * 1e-3 + 1000.0,  # fp16(min) far coarser than the range: scale from the bias
        ramp * 3e-4 + 7.0,  # fp16(min) may round above max: negative scale
        ramp * 131008.0 - 65504.0,  # the widest range whose bias fits
        ramp * 160000.0 - 65504.0,  # a range past fp16 whose scale fits: int2 53333
        np.where(np.arange(dim) % 2 == 0, -0.0, 0.0).astype(np.float32),  # signed zeros
        np.where(np.arange(dim) % 3 == 0, 1e-40, -1e-40).astype(np.float32),  # fp32 subnormals
    ]
    rows += [rng.standard_normal(dim).astype(np.float32) * 10.0**e for e in range(-8, 5)]
    return np.stack(rows).astype(np.float32)


def encode_both(
    codec: str, x: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> tuple[QuantizedRows, QuantizedRows]:
    on_kernel = encode_rows(codec, x)
    with monkeypatch.context() as m:
        m.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
        own = encode_rows(codec, x)
    return on_kernel, own


def assert_same_bytes(a: QuantizedRows, b: QuantizedRows) -> None:
    assert a.codes.tobytes() == b.codes.tobytes()
    assert a.scale.tobytes() == b.scale.tobytes()
    assert a.bias.tobytes() == b.bias.tobytes()


@needs_kernels
@pytest.mark.parametrize("codec", KERNEL_CODECS)
@pytest.mark.parametrize("dim", [64, 4, 8, 12, 100, 5, 63, 1])
def test_kernel_and_own_code_agree_byte_for_byte(
    codec: str, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = np.concatenate([embedding_like_rows(700, dim, seed=dim), edge_rows(dim)])
    on_kernel, own = encode_both(codec, x, monkeypatch)
    assert_same_bytes(on_kernel, own)
    decoded = decode_rows(on_kernel)
    with monkeypatch.context() as m:
        m.setattr(rowwise_kernels, "DECODE_BITS", frozenset())
        assert decode_rows(on_kernel).tobytes() == decoded.tobytes()
    err = np.abs(decoded.astype(np.float64) - x).max(axis=1)
    assert np.all(err <= max_abs_error_bound(on_kernel))


@needs_kernels
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dim", [64, 8, 12, 100])
def test_own_code_writes_the_torch_kernels_fused_rows(bits: int, dim: int, own_code: None) -> None:
    x = np.concatenate([embedding_like_rows(500, dim, seed=3), edge_rows(dim)])
    q = encode_rows(f"int{bits}", x)
    fused = getattr(torch.ops.quantized, PREPACK[bits])(torch.from_numpy(x)).numpy()
    rb = row_bytes(f"int{bits}", dim)
    assert fused.shape == (len(x), rb + 4)
    assert fused[:, :rb].tobytes() == q.codes.tobytes()
    fields = np.ascontiguousarray(fused[:, rb:]).view(np.float16)
    assert fields[:, 0].tobytes() == q.scale.tobytes()
    assert fields[:, 1].tobytes() == q.bias.tobytes()


@pytest.mark.parametrize("bits", [4, 2])
def test_own_code_writes_the_probe_bytes_a_kernel_must_match(bits: int, own_code: None) -> None:
    q = encode_rows(f"int{bits}", rowwise_kernels.PROBE_ROWS)
    fused = b"".join(
        q.codes[i].tobytes() + q.scale[i : i + 1].tobytes() + q.bias[i : i + 1].tobytes()
        for i in range(q.n_rows)
    )
    assert fused == rowwise_kernels.PROBE_FUSED[bits]


def test_a_kernel_is_used_only_if_it_exists_and_passes_its_probe() -> None:
    def fails(op: object) -> bool:
        raise RuntimeError("no CPU kernel")

    assert rowwise_kernels._op("no_such_kernel", lambda op: True) is None
    assert rowwise_kernels._op("embedding_bag_4bit_prepack", fails) is None
    # The 4-bit kernel does not write the 2-bit probe's bytes.
    works_for_2 = rowwise_kernels._prepack_works(2)
    assert rowwise_kernels._op("embedding_bag_4bit_prepack", works_for_2) is None
    if 4 in rowwise_kernels.ENCODE_BITS:
        works_for_4 = rowwise_kernels._prepack_works(4)
        assert rowwise_kernels._op("embedding_bag_4bit_prepack", works_for_4) is not None


@needs_kernels
def test_the_kernels_run_where_they_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    encode, decode = rowwise_kernels.encode_fused, rowwise_kernels.decode_fused

    def counting_encode(x: torch.Tensor, bits: int) -> torch.Tensor:
        calls.append(("encode", bits))
        return encode(x, bits)

    def counting_decode(fused: torch.Tensor, bits: int) -> torch.Tensor:
        calls.append(("decode", bits))
        return decode(fused, bits)

    monkeypatch.setattr(rowwise_kernels, "encode_fused", counting_encode)
    monkeypatch.setattr(rowwise_kernels, "decode_fused", counting_decode)
    x = embedding_like_rows(10, 12)
    for codec, expected in [
        ("int4", [("encode", 4), ("decode", 4)]),
        ("int2", [("encode", 2), ("decode", 2)]),
        ("int8", [("encode", 8), ("decode", 8)]),  # float32 fields: the byte kernel's
        ("int3", []),
        ("int4-adaptive", [("decode", 4)]),  # the search is the codec's own
        ("int8-adaptive", []),  # fp16 fields: 8-bit codes decode faster by the codec's own code
        ("fp16", []),
    ]:
        calls.clear()
        decode_rows(encode_rows(codec, x))
        assert calls == expected, codec
    calls.clear()
    decode_rows(encode_rows("int2", embedding_like_rows(10, 10)))  # 10 is not a multiple of 4
    assert calls == [("decode", 2)]


@pytest.mark.parametrize("codec", ALL_KERNEL_CODECS)
@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "own"])
@pytest.mark.parametrize("column", [0, 5, 7, 8, 31, 56, 63])
def test_nan_anywhere_in_a_row_is_rejected(
    codec: str, kernels: bool, column: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FBGEMM's vectorised min/max drop a NaN in most lanes: the check must not rely on them.
    if not kernels:
        monkeypatch.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
    x = embedding_like_rows(50, 64)
    x[37, column] = np.nan
    with pytest.raises(NonFiniteRowsError, match="row 37"):
        encode_rows(codec, x, chunk_rows=16)


@pytest.mark.parametrize("codec", ALL_KERNEL_CODECS)
@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "own"])
def test_rows_the_caller_checked_encode_to_the_same_bytes(
    codec: str, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
    x = embedding_like_rows(300, 64)
    checked = encode_rows(codec, x, chunk_rows=64, checked_finite=True)
    unchecked = encode_rows(codec, x, chunk_rows=64)
    for part in ("codes", "scale", "bias"):
        assert getattr(checked, part).tobytes() == getattr(unchecked, part).tobytes()


@needs_kernels
@pytest.mark.parametrize("codec", ALL_KERNEL_CODECS)
def test_the_kernel_path_trusts_a_caller_that_checked(codec: str) -> None:
    # The publisher refuses a snapshot holding NaN before it encodes (Snapshot.check_finite),
    # so its encode skips the kernel path's own read of the rows: a NaN it was told is not
    # there is quantised as the kernel does it, to code 0, with no error.
    x = embedding_like_rows(50, 64)
    x[37, 5] = np.nan
    q = encode_rows(codec, x, chunk_rows=16, checked_finite=True)
    clean = encode_rows(codec, np.delete(x, 37, axis=0))
    assert np.delete(q.codes, 37, axis=0).tobytes() == clean.codes.tobytes()
    with pytest.raises(NonFiniteRowsError, match="row 37"):
        encode_rows(codec, x, chunk_rows=16)


@pytest.mark.parametrize("codec", KERNEL_CODECS)
@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "own"])
def test_out_of_range_rows_are_rejected_alike(
    codec: str, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
    levels = (1 << CODEC_BITS[codec]) - 1
    x = embedding_like_rows(40, 8)
    x[21, 0] = -70000.0  # fp16(min) overflows
    x[30, :2] = [0.0, 65504.0 * levels * 1.01]  # the scale overflows, the bias fits
    with pytest.raises(OutOfRangeRowsError, match="row 21"):
        encode_rows(codec, x, chunk_rows=8)
    x[21, 0] = 0.0
    with pytest.raises(OutOfRangeRowsError, match="row 30"):
        encode_rows(codec, x, chunk_rows=8)
    # Finite values whose chunk sum overflows float32 are out of range, not non-finite.
    x[30, :] = 3e38
    x[30, 0] = -3e38
    with pytest.raises(OutOfRangeRowsError, match="row 30"):
        encode_rows(codec, x, chunk_rows=8)


@pytest.mark.parametrize("codec", KERNEL_CODECS)
@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "own"])
def test_the_first_bad_chunk_decides_the_error_alike(
    codec: str, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel path checks the fp16 fields once after all chunks; the own code, chunk by
    # chunk. Both report the first chunk that holds a bad row, non-finite rows first within it.
    if not kernels:
        monkeypatch.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
    x = embedding_like_rows(40, 8)
    x[3, 0] = -70000.0  # overflows fp16, chunk 0
    x[27, 1] = np.nan  # chunk 3
    with pytest.raises(OutOfRangeRowsError, match="row 3"):
        encode_rows(codec, x, chunk_rows=8)
    x[3, 0] = 0.0
    x[12, 0] = np.inf  # chunk 1, before an overflow in chunk 2 and the NaN in chunk 3
    x[21, 0] = -70000.0
    with pytest.raises(NonFiniteRowsError, match="row 12"):
        encode_rows(codec, x, chunk_rows=8)
    x[12, 0] = 0.0
    x[17, 2] = np.nan  # same chunk as the overflow in row 21: non-finite first
    with pytest.raises(NonFiniteRowsError, match="row 17"):
        encode_rows(codec, x, chunk_rows=8)


@needs_kernels
@pytest.mark.parametrize("codec", KERNEL_CODECS)
@pytest.mark.parametrize("dim", [64, 7, 13, 1])
def test_kernel_decode_of_any_finite_fields_matches_own_decode(
    codec: str, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hostile-looking but valid sections: random code bytes (padding bits set too, which a
    # reader ignores) and every finite fp16 scale and bias, subnormals and negatives included.
    rng = np.random.default_rng(dim)
    n = 3000
    codes = rng.integers(0, 256, size=(n, row_bytes(codec, dim)), dtype=np.uint8)
    fields = rng.integers(0, 1 << 16, size=(2, n), dtype=np.uint16)
    fields[(fields & 0x7C00) == 0x7C00] &= 0xBFFF  # drop inf/NaN: the decoder refuses them
    sb = fields.view(np.float16)
    q = QuantizedRows(codec=codec, dim=dim, codes=codes, scale=sb[0], bias=sb[1])
    decoded = decode_rows(q)
    monkeypatch.setattr(rowwise_kernels, "DECODE_BITS", frozenset())
    assert decode_rows(q).tobytes() == decoded.tobytes()


@pytest.mark.parametrize("codec", KERNEL_CODECS)
def test_a_bound_within_fp16_skips_only_the_field_check(codec: str) -> None:
    # The publisher's snapshot check measures each table's largest magnitude on the same read
    # that refuses NaN; within FP16_FIELDS_SAFE no fp16 scale or bias can overflow.
    x = embedding_like_rows(300, 64)
    bounded = encode_rows(codec, x, checked_finite=True, max_abs=float(np.abs(x).max()))
    plain = encode_rows(codec, x)
    for part in ("codes", "scale", "bias"):
        assert getattr(bounded, part).tobytes() == getattr(plain, part).tobytes()
    # The bound is safe for every integer codec: the widest row it allows encodes finite.
    edge = np.tile(np.array([-FP16_FIELDS_SAFE, FP16_FIELDS_SAFE], np.float32), (2, 32))
    q = encode_rows(codec, edge)
    assert np.isfinite(q.scale).all() and np.isfinite(q.bias).all()
    # A bound past it keeps the check.
    x[21, 0] = -70000.0
    with pytest.raises(OutOfRangeRowsError, match="row 21"):
        encode_rows(codec, x, checked_finite=True, max_abs=70000.0)
    with pytest.raises(OutOfRangeRowsError, match="row 21"):
        encode_rows(codec, x, checked_finite=True)


# --- int8 on the byte kernel: float32 fields, the relaxed fallback rule ----------------------


@needs_byte_kernel
@pytest.mark.parametrize("dim", [64, 16, 1, 5, 13, 100])
def test_int8_own_code_decodes_within_the_bound_the_kernel_does(
    dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = np.concatenate([embedding_like_rows(3000, dim, seed=dim), edge_rows(dim)])
    on_kernel = encode_rows("int8", x)
    with monkeypatch.context() as m:
        m.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
        m.setattr(rowwise_kernels, "DECODE_BITS", frozenset())
        own = encode_rows("int8", x)
        own_decoded = decode_rows(own)
        kernel_rows_own_decode = decode_rows(on_kernel)
    # Same fields; codes off by one at a few near ties.
    assert own.scale.tobytes() == on_kernel.scale.tobytes()
    assert own.bias.tobytes() == on_kernel.bias.tobytes()
    off = on_kernel.codes.astype(np.int16) - own.codes
    assert np.abs(off).max() <= 1 and np.count_nonzero(off) <= 1e-4 * off.size + 1
    # The own decoding (float64, rounded once) gives the kernel's floats.
    assert kernel_rows_own_decode.tobytes() == decode_rows(on_kernel).tobytes()
    for q, decoded in ((on_kernel, decode_rows(on_kernel)), (own, own_decoded)):
        err = np.abs(decoded.astype(np.float64) - x).max(axis=1)
        assert np.all(err <= max_abs_error_bound(q))


@needs_byte_kernel
def test_the_byte_kernel_writes_its_probe_and_its_unpack_rounds_once() -> None:
    op = torch.ops.quantized.embedding_bag_byte_prepack
    assert (
        op(torch.from_numpy(rowwise_kernels.PROBE_ROWS)).numpy().tobytes()
        == (rowwise_kernels.PROBE_FUSED[8])
    )
    row, expected = rowwise_kernels._UNPACK_PROBES[8]
    fused = np.frombuffer(row, dtype=np.uint8).reshape(1, -1)
    codes = fused[:, :8].astype(np.float32)
    scale, bias = fused[:, 8:].copy().view(np.float32)[0]
    twice = codes * scale + bias  # two roundings: not what the kernel gives
    assert twice.tobytes() != expected
    once = (codes.astype(np.float64) * np.float64(scale) + np.float64(bias)).astype(np.float32)
    assert once.tobytes() == expected


def test_int8_own_code_writes_the_byte_kernels_probe(own_code: None) -> None:
    q = encode_rows("int8", rowwise_kernels.PROBE_ROWS)
    fused = b"".join(
        q.codes[i].tobytes() + q.scale[i : i + 1].tobytes() + q.bias[i : i + 1].tobytes()
        for i in range(q.n_rows)
    )
    assert fused == rowwise_kernels.PROBE_FUSED[8]


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "own"])
def test_int8_float32_fields_refuse_only_a_range_past_float32(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(rowwise_kernels, "ENCODE_BITS", frozenset())
    x = embedding_like_rows(40, 8)
    x[21, 0] = -70000.0  # past fp16, not past float32: encodes
    q = encode_rows("int8", x, chunk_rows=8)
    err = np.abs(decode_rows(q).astype(np.float64) - x).max(axis=1)
    assert np.all(err <= max_abs_error_bound(q))
    x[30, :2] = [-3e38, 3e38]  # the range overflows float32
    with pytest.raises(OutOfRangeRowsError, match=r"row 30.*float32"):
        encode_rows("int8", x, chunk_rows=8)
    x[12, 1] = np.nan  # an earlier chunk's non-finite row is reported first
    with pytest.raises(NonFiniteRowsError, match="row 12"):
        encode_rows("int8", x, chunk_rows=8)
    x[12, 1] = 0.0
    with pytest.raises(OutOfRangeRowsError, match="row 30"):
        encode_rows("int8", x, chunk_rows=8, checked_finite=True)


@needs_byte_kernel
def test_int8_decodes_random_float32_fields_as_its_own_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Random codes and finite float32 scales and biases, decoded by the unpack kernel and by the
    # own code (float64, rounded once): the same floats for fields like an encoder's; for any
    # magnitudes and signs within an ulp (the float64 sum's rounding may land on a float32 tie).
    rng = np.random.default_rng(8)
    n, dim = 3000, 24
    codes = rng.integers(0, 256, size=(n, dim), dtype=np.uint8)
    scale = (rng.random(n) * 10.0 ** rng.integers(-6, 1, size=n)).astype(np.float32)
    bias = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3, size=n)).astype(np.float32)
    wild = rng.standard_normal((2, n)).astype(np.float32)
    wild *= (10.0 ** rng.integers(-30, 30, size=(2, n))).astype(np.float32)
    wild[~np.isfinite(wild)] = 1.0
    for s, b, ulps in ((scale, bias, 0), (wild[0], wild[1], 1)):
        q = QuantizedRows(codec="int8", dim=dim, codes=codes, scale=s, bias=b)
        decoded = decode_rows(q)
        with monkeypatch.context() as m:
            m.setattr(rowwise_kernels, "DECODE_BITS", frozenset())
            own = decode_rows(q)
        if ulps == 0:
            assert own.tobytes() == decoded.tobytes()
        else:
            np.testing.assert_array_max_ulp(own, decoded, maxulp=ulps)
