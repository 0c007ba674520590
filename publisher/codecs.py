"""Row codecs: float32 embedding rows to the `codes` / `scale_bias` sections of a delta blob.

The byte layout is fixed by docs/FORMAT.md section 4 and the sizes by `schemas.codec_names`;
this module holds the arithmetic. Rules, per row x[0..dim) (all rows of a call share one codec):

- ``fp32``: codes are the little-endian float32 bytes of x (lossless).
- ``fp16``: codes are the little-endian IEEE half bytes of x, rounded to nearest-even.
  |x| must stay below 65520 (larger values would round to inf).
- ``intB`` (B in 8, 4, 3, 2; L = 2**B - 1), uniform asymmetric, per row, in float32::

      bias  = fp16(min x)                   # round to nearest fp16
      scale = fp16((max x - bias) / L)      # round to nearest fp16; 1 where that gives 0
      code  = clamp(rint((x - bias) * (1 / scale)), 0, L)
      x'    = bias + code * scale           # what the decoder returns (float32)

  This is the rule of FBGEMM's row-wise kernels that torch ships, so 4- and 2-bit rows are
  quantized by `torch.ops.quantized.embedding_bag_{4,2}bit_prepack` where this torch has them
  (publisher/rowwise_kernels.py) and by the same arithmetic here otherwise, byte for byte.
  The encoder quantises with the fp16-rounded scale and bias the decoder will use, and the range
  starts at the rounded bias, so |x - x'| <= |scale|/2 plus the fp16 rounding of bias (and, for
  a subnormal scale, L * 2**-25); see `max_abs_error_bound`. A constant row c is no exception:
  the range from fp16(c) to c is quantised like any other (scale 1 and code 0 where it is 0 or
  below fp16's reach), so it decodes at least as close to c as fp16(c). Where fp16(min) rounds
  above max the scale is negative, which decodes by the same formula. Rounding is to nearest,
  ties to even.
- ``intB-adaptive``: same layout and decoder; only the range [lo, hi] that yields bias and
  scale differs. Greedy search of Guan et al. 2019 (arXiv 1911.02079), as in Check-N-Run:
  step = (max - min) / ADAPTIVE_NUM_BINS (100); for ADAPTIVE_STEPS (16) rounds, try
  [lo + step, hi] and [lo, hi - step], move to the one with the lower L2 error and remember
  the best range seen (the full range included), so at most 16% of the range is cut.
  Losses use the fp16-rounded candidate scale and bias. A final
  exact comparison (float64 sums of the real decoded errors) against the uniform encoding
  keeps the uniform one unless the searched range is strictly better, so an adaptive row is
  never worse than its uniform encoding.

Codes of the int codecs are packed LSB first: element j of a row is the B-bit unsigned integer
starting at bit j*B of the row's bytes, and padding bits are 0::

    2 bits, codes c0..c3      byte 0 = c0 | c1 << 2 | c2 << 4 | c3 << 6
    4 bits, codes c0, c1      byte 0 = c0 | c1 << 4
    3 bits, codes c0..c7      bytes 0..2 = little-endian 24-bit c0 | c1 << 3 | ... | c7 << 21

Work runs on row chunks that stay in cache, with torch kernels (torch.from_numpy shares memory);
the API takes and returns numpy arrays. No Python loop runs over rows or elements: the loops are
over chunks, over the positions inside one packing group (at most 8) and over search steps.
Decoding of 4- and 2-bit rows runs on torch's unpack kernels where this torch has them.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from publisher import rowwise_kernels
from schemas.codec_names import CODEC_BITS, CODECS, is_integer_codec, row_bytes
from schemas.errors import BadDataError

if sys.byteorder != "little":  # codes are host memory viewed as little-endian wire bytes
    raise ImportError("publisher.codecs needs a little-endian host")

__all__ = [
    "ADAPTIVE_NUM_BINS",
    "ADAPTIVE_STEPS",
    "FP16_FIELDS_SAFE",
    "CodecError",
    "NonFiniteRowsError",
    "OutOfRangeRowsError",
    "QuantizedRows",
    "UnknownCodecError",
    "decode_rows",
    "encode_rows",
    "max_abs_error_bound",
    "pack_codes",
    "unpack_codes",
]

#: the adaptive search moves an end of the range by (max - min) / ADAPTIVE_NUM_BINS per step...
ADAPTIVE_NUM_BINS: Final = 100
#: ...for this many steps, so it cuts at most 16% of the range, as Guan et al.'s defaults
#: (200 bins, 32 steps) do; half as many, twice as large steps give the same error on
#: embedding-like rows (tests/unit/publisher/test_codecs.py checks it) at twice the speed.
ADAPTIVE_STEPS: Final = 16
#: float32 elements per chunk for the uniform codecs and decoding (2 MiB; 4-16k rows of dim 64
#: measured alike, smaller chunks pay more per-chunk bookkeeping).
CHUNK_ELEMENTS: Final = 1 << 19
#: float32 elements per chunk on the prepack kernel (4 MiB: it stays in cache for the finite
#: check after the kernel; 2-8 MiB measured alike, smaller chunks pay more per chunk).
KERNEL_CHUNK_ELEMENTS: Final = 1 << 20
#: float32 elements per chunk for the adaptive search (its buffers are 4x the chunk; larger
#: chunks spend less on per-step bookkeeping than they lose to L2 misses).
ADAPTIVE_CHUNK_ELEMENTS: Final = 1 << 18

#: |x| at or above this rounds to inf in fp16.
FP16_OVERFLOW: Final = 65520.0
#: rows with every |x| <= this get finite fp16 fields from any integer codec: |bias| = |fp16(min)|
#: <= 16384 and scale = fp16((max - bias) / L) <= fp16(32768 / 1), both below `FP16_OVERFLOW`.
FP16_FIELDS_SAFE: Final = 16384.0
_FP16_HALF_ULP_REL: Final = 2.0**-11  # half an ulp of a normal fp16, relative to its value
_FP16_HALF_ULP_MIN: Final = 2.0**-25  # half the spacing of fp16 subnormals
_FP16_MIN_NORMAL: Final = 2.0**-14
_FP32_SLACK: Final = 2.0**-18  # float32 rounding: (x - bias) / scale, bias + code * scale, search


class CodecError(BadDataError, ValueError):
    """Input a codec cannot encode or decode: bad shape, dtype or values."""


class UnknownCodecError(CodecError):
    """A codec name that `schemas.codec_names.CODECS` does not list."""


class NonFiniteRowsError(CodecError):
    """A row holds inf or NaN; `row` is the index of the first such row."""

    def __init__(self, row: int) -> None:
        super().__init__(
            f"row {row} holds a non-finite value (inf or NaN); codecs need finite rows"
        )
        self.row = row

    def __reduce__(self) -> tuple[type[NonFiniteRowsError], tuple[int]]:
        # Rebuilt from its fields, not its message, so it crosses to the parent process intact.
        return type(self), (self.row,)


class OutOfRangeRowsError(CodecError):
    """A row's values do not fit the codec's fp16 fields; `row` is the first such row."""

    def __init__(self, row: int, codec: str, detail: str) -> None:
        super().__init__(f"row {row} cannot be encoded as {codec}: {detail}")
        self.row = row
        self._fields = (row, codec, detail)

    def __reduce__(self) -> tuple[type[OutOfRangeRowsError], tuple[int, str, str]]:
        # Rebuilt from its fields, not its message, so it crosses to the parent process intact.
        return type(self), self._fields


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """Encoded rows: `codes` (n x row_bytes uint8) plus, for int codecs, fp16 scale and bias.

    `scale` and `bias` have shape (0,) for fp32 and fp16. The constructor checks every shape and
    dtype, so a `QuantizedRows` built from blob bytes is safe to decode. (eq=False: numpy arrays
    have no single truth value.)
    """

    codec: str
    dim: int
    codes: np.ndarray
    scale: np.ndarray
    bias: np.ndarray

    def __post_init__(self) -> None:
        _codec_bits(self.codec)
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 1:
            raise CodecError(f"dim must be an int >= 1, got {self.dim!r}")
        rb = row_bytes(self.codec, self.dim)
        codes = self.codes
        if not isinstance(codes, np.ndarray) or codes.dtype != np.uint8 or codes.ndim != 2:
            raise CodecError(f"codes must be a 2-D uint8 array, got {_describe(codes)}")
        # Rows may sit apart (the kernel's fused rows, `_encode_checked_on_kernel`), each
        # row's bytes contiguous and no two rows overlapping.
        n = codes.shape[0]
        apart = n <= 1 or codes.strides[0] >= rb
        contiguous = n == 0 or rb <= 1 or codes.strides[1] == 1
        if codes.shape[1] != rb or not apart or not contiguous:
            raise CodecError(
                f"codes must have {rb} bytes per row ({self.codec}, dim {self.dim}), each row "
                f"contiguous and apart, got shape {codes.shape}, strides {codes.strides}"
            )
        n_sb = codes.shape[0] if is_integer_codec(self.codec) else 0
        for name in ("scale", "bias"):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.float16 or arr.shape != (n_sb,):
                raise CodecError(
                    f"{name} must be a float16 array of shape ({n_sb},) for {self.codec}, "
                    f"got {_describe(arr)}"
                )

    @property
    def n_rows(self) -> int:
        """Number of encoded rows."""
        return int(self.codes.shape[0])

    @property
    def bits(self) -> int:
        """Bits per element of the codec."""
        return CODEC_BITS[self.codec]


# --- public API ---------------------------------------------------------------------------------


def encode_rows(
    codec: str,
    rows: np.ndarray | torch.Tensor,
    *,
    chunk_rows: int | None = None,
    checked_finite: bool = False,
    max_abs: float | None = None,
) -> QuantizedRows:
    """Encode float32 `rows` (shape (n, dim)) with `codec`; see the module docstring for rules.

    Raises UnknownCodecError for an unknown codec, CodecError for a wrong shape or dtype,
    NonFiniteRowsError for inf/NaN and OutOfRangeRowsError for values fp16 cannot hold.
    `chunk_rows` overrides the rows processed per chunk (a tuning knob; results do not depend
    on it). `checked_finite` says the caller has refused NaN and inf already (the publisher's
    `Snapshot.check_finite`): the kernel path, the only one whose NaN check is a read of its
    own (the kernels quantise NaN without a word), then skips it, and the result's codes,
    scale and bias are views of the kernel's fused rows (rows apart, not C-contiguous). Rows
    that do hold NaN then encode without an error, NaN as code 0. `max_abs`, with
    `checked_finite`, is a bound the caller knows on |rows| (the snapshot's check measures it):
    at most `FP16_FIELDS_SAFE`, no row's fp16 scale or bias can overflow, and the kernel path
    skips looking for one (4% of the int4 kernel's time).
    """
    bits = _codec_bits(codec)
    x = _as_float32_rows(rows)
    n, dim = x.shape
    adaptive = codec.endswith("-adaptive")
    on_kernel = not adaptive and rowwise_kernels.encodes(bits, dim)
    if adaptive:
        budget = ADAPTIVE_CHUNK_ELEMENTS
    else:
        budget = KERNEL_CHUNK_ELEMENTS if on_kernel else CHUNK_ELEMENTS
    chunk = chunk_rows if chunk_rows is not None else max(1, budget // dim)
    if chunk < 1:
        raise CodecError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if on_kernel and checked_finite and n:
        fields_fit = max_abs is not None and max_abs <= FP16_FIELDS_SAFE
        return _encode_checked_on_kernel(codec, x, fields_fit)
    codes = np.empty((n, row_bytes(codec, dim)), dtype=np.uint8)
    n_sb = n if is_integer_codec(codec) else 0
    scale = np.empty(n_sb, dtype=np.float16)
    bias = np.empty(n_sb, dtype=np.float16)
    if on_kernel:
        _encode_on_kernel(codec, x, chunk, codes, scale, bias)
        return QuantizedRows(codec=codec, dim=dim, codes=codes, scale=scale, bias=bias)
    encoder = _ChunkEncoder(codec, bits, dim, min(chunk, max(n, 1)), adaptive)
    codes_t = torch.from_numpy(codes)
    scale_t = torch.from_numpy(scale)
    bias_t = torch.from_numpy(bias)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        xc = x[start:stop]
        if not xc.is_contiguous():
            xc = xc.contiguous()
        if is_integer_codec(codec):
            sl = slice(start, stop)
            encoder.encode_int(xc, start, codes_t[sl], scale_t[sl], bias_t[sl])
        else:
            encoder.encode_float(xc, start, codes[start:stop])
    return QuantizedRows(codec=codec, dim=dim, codes=codes, scale=scale, bias=bias)


def decode_rows(q: QuantizedRows, out: np.ndarray | None = None) -> np.ndarray:
    """Float32 rows (n, dim) that `q` encodes, written into `out` if given (and returned)."""
    n, dim = q.n_rows, q.dim
    if out is None:
        out = np.empty((n, dim), dtype=np.float32)
    elif not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n, dim):
        raise CodecError(f"out must be a float32 array of shape ({n}, {dim}), got {_describe(out)}")
    elif not out.flags.writeable:
        raise CodecError("out must be writeable")
    if n == 0:
        return out
    if q.codec == "fp32":
        np.copyto(out, q.codes.view("<f4"))
        return out
    try:
        out_t = torch.from_numpy(out)
    except ValueError as exc:  # negative strides
        raise CodecError(f"out must have non-negative strides, got {out.strides}") from exc
    if q.codec == "fp16":
        out_t.copy_(_shared_tensor(q.codes.view("<f2")))
        return out
    bits = q.bits
    for name, arr in (("scale", q.scale), ("bias", q.bias)):
        row = _first_non_finite_half(arr)
        if row is not None:
            raise CodecError(f"{name} of row {row} is {arr[row]}; scale and bias must be finite")
    chunk = max(1, CHUNK_ELEMENTS // dim)
    if rowwise_kernels.decodes(bits):
        _decode_on_kernel(q, out_t, chunk)
        return out
    codes_t = _shared_tensor(q.codes)
    scale = _shared_tensor(q.scale).float()
    bias = _shared_tensor(q.bias).float()
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        codes_chunk = _unpack(codes_t[start:stop], bits, dim)
        _dequantize_into(out_t[start:stop], codes_chunk, scale[start:stop], bias[start:stop])
    return out


def _decode_on_kernel(q: QuantizedRows, out: torch.Tensor, chunk: int) -> None:
    """Decode on torch's unpack kernel: chunk by chunk into a reused fused-row buffer, so the
    kernel's output stays in cache until it is copied into `out` (a whole-table call would
    fault in a fresh output array and be several times slower)."""
    n, dim, bits = q.n_rows, q.dim, q.bits
    fused = np.empty((min(chunk, n), rowwise_kernels.fused_row_bytes(bits, dim)), np.uint8)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        rows = fused[: stop - start]
        sl = slice(start, stop)
        rowwise_kernels.fuse(rows, q.codes[sl], q.scale[sl], q.bias[sl])
        decoded = rowwise_kernels.decode_fused(torch.from_numpy(rows), bits)
        out[sl].copy_(decoded[:, :dim])


def max_abs_error_bound(q: QuantizedRows) -> np.ndarray:
    """Per row, a bound on |x - decode(encode(x))| for every element (float64, shape (n,)).

    fp32: 0. fp16: half an ulp of the row's largest decoded magnitude (relative 2**-11, plus
    2**-25 for subnormals). Int codecs: |scale|/2, plus the fp16 rounding of bias, plus L * 2**-25
    when the scale is below the smallest normal fp16 (its rounding then is absolute), plus a
    float32 arithmetic allowance. Adaptive codecs add the error of elements clipped by the
    shrunk range, up to ADAPTIVE_STEPS / (ADAPTIVE_NUM_BINS - ADAPTIVE_STEPS) * L * |scale|.
    """
    n = q.n_rows
    if q.codec == "fp32":
        return np.zeros(n, dtype=np.float64)
    if q.codec == "fp16":
        if n == 0:
            return np.zeros(0, dtype=np.float64)
        peak: np.ndarray = np.abs(q.codes.view("<f2")).max(axis=1).astype(np.float64)
        return peak * _FP16_HALF_ULP_REL + _FP16_HALF_ULP_MIN
    levels = (1 << q.bits) - 1
    scale = np.abs(q.scale.astype(np.float64))  # negative where fp16(min) rounds above max
    bias_mag = np.abs(q.bias.astype(np.float64))
    bound = scale / 2 + np.maximum(bias_mag * _FP16_HALF_ULP_REL, _FP16_HALF_ULP_MIN)
    bound += np.where(scale < _FP16_MIN_NORMAL, levels * _FP16_HALF_ULP_MIN, 0.0)
    if q.codec.endswith("-adaptive"):
        # Elements clipped by the shrunk range: each end moved by at most ADAPTIVE_STEPS steps
        # of (max - min) / ADAPTIVE_NUM_BINS, and the kept range is at least
        # (ADAPTIVE_NUM_BINS - ADAPTIVE_STEPS) steps ~ levels * scale.
        ratio = ADAPTIVE_STEPS / (ADAPTIVE_NUM_BINS - ADAPTIVE_STEPS)
        bound += (ratio + _FP16_HALF_ULP_REL) * levels * scale
        bound += (ratio + 1.0) * levels * _FP16_HALF_ULP_MIN
    bound += _FP32_SLACK * (bias_mag + levels * scale)
    return bound


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack (n, dim) uint8 codes (each < 2**bits) into (n, ceil(dim*bits/8)) bytes, LSB first."""
    if bits not in (2, 3, 4, 8):
        raise CodecError(f"bits must be 2, 3, 4 or 8, got {bits}")
    if not isinstance(codes, np.ndarray) or codes.dtype != np.uint8 or codes.ndim != 2:
        raise CodecError(f"codes must be a 2-D uint8 array, got {_describe(codes)}")
    if codes.size and int(codes.max()) >> bits:
        raise CodecError(f"codes must be < {1 << bits} for {bits} bits")
    n, dim = codes.shape
    packed = np.empty((n, (dim * bits + 7) // 8), dtype=np.uint8)
    if n and dim:
        group = _group_codes(bits)
        padded = np.zeros((n, -(-dim // group) * group), dtype=np.uint8)
        padded[:, :dim] = codes
        _pack_into(torch.from_numpy(packed), torch.from_numpy(padded), bits)
    return packed


def unpack_codes(packed: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """Inverse of `pack_codes`: (n, dim) uint8 codes from (n, ceil(dim*bits/8)) bytes."""
    if bits not in (2, 3, 4, 8):
        raise CodecError(f"bits must be 2, 3, 4 or 8, got {bits}")
    rb = (dim * bits + 7) // 8
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or packed.ndim != 2:
        raise CodecError(f"packed must be a 2-D uint8 array, got {_describe(packed)}")
    if packed.shape[1] != rb:
        raise CodecError(f"packed must have {rb} bytes per row, got shape {packed.shape}")
    out = np.empty((packed.shape[0], dim), dtype=np.uint8)
    if out.size:
        src = _shared_tensor(np.ascontiguousarray(packed))
        torch.from_numpy(out).copy_(_unpack(src, bits, dim))
    return out


# --- chunk encoders -------------------------------------------------------------------------------


def _encode_on_kernel(
    codec: str,
    x: torch.Tensor,
    chunk: int,
    codes: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray,
) -> None:
    """Uniform encoding on torch's prepack kernel (publisher/rowwise_kernels.py), which writes
    the bytes `_ChunkEncoder` would."""
    bits = CODEC_BITS[codec]
    n = x.shape[0]
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        xc = x[start:stop].contiguous()
        fused = rowwise_kernels.encode_fused(xc, bits)
        # The kernel quantises NaN to code 0 without a word, and its min and max skip a NaN, so
        # the scale and bias do not show it: the rows are checked after it, while they are in
        # cache. Their sum is non-finite if any element is; only a non-finite sum (or an
        # overflowing one) looks closer. An overflow in an earlier chunk is reported first, as
        # `_ChunkEncoder`, which checks chunk by chunk, reports it.
        if not math.isfinite(float(xc.sum())):
            _check_fields(codec, x, scale[:start], bias[:start])
            _check_finite(xc.amin(1), xc.amax(1), start)
        sl = slice(start, stop)
        rowwise_kernels.split(fused, codes[sl], scale[sl], bias[sl])
    # Once for all rows, not per chunk: the per-chunk check cost 7% of the kernel's time.
    _check_fields(codec, x, scale, bias)


def _encode_checked_on_kernel(codec: str, x: torch.Tensor, fields_fit: bool) -> QuantizedRows:
    """Uniform encoding of rows the caller checked, in one kernel call: nothing to read while
    a chunk is in cache, so no chunks, and the codes, scale and bias stay views of the fused
    rows (a blob's writer copies each section once anyway). Measured 0.80x the bare kernel's
    throughput with the split into sections, ~1x without (`checknrun bench codec`). The fp16
    fields are looked at unless `fields_fit` says they cannot have overflowed."""
    fused = rowwise_kernels.encode_fused(x.contiguous(), CODEC_BITS[codec]).numpy()
    codes, scale, bias = rowwise_kernels.fields(fused, row_bytes(codec, x.shape[1]))
    if not fields_fit:
        _check_fields(codec, x, scale, bias)
    return QuantizedRows(codec=codec, dim=x.shape[1], codes=codes, scale=scale, bias=bias)


def _check_fields(codec: str, x: torch.Tensor, scale: np.ndarray, bias: np.ndarray) -> None:
    """Raise OutOfRangeRowsError for the first of the rows x[:len(scale)], all finite, whose
    fp16 scale or bias overflowed to inf."""
    row = _first_non_finite_half(scale, bias)
    if row is not None:
        raise _out_of_range(codec, row, x[row])


class _ChunkEncoder:
    """Buffers and steps to encode one chunk of rows; reused across the chunks of one call."""

    def __init__(self, codec: str, bits: int, dim: int, max_rows: int, adaptive: bool) -> None:
        self.codec = codec
        self.bits = bits
        self.levels = (1 << bits) - 1
        self.dim = dim
        self.adaptive = adaptive
        self.t = torch.empty(max_rows, dim)
        self.t_np = self.t.numpy()
        # Codes narrower than a byte are staged here, padded to whole packing groups, and
        # packed; 8-bit codes are cast straight into the codes section.
        group = _group_codes(bits)
        staged = -(-dim // group) * group if bits < 8 else 0
        self.u8 = np.zeros((max_rows, staged), dtype=np.uint8)
        if adaptive:
            self.search = _AdaptiveSearch(max_rows, dim, self.levels)

    def encode_float(self, x: torch.Tensor, start: int, codes: np.ndarray) -> None:
        mn, mx = x.amin(1), x.amax(1)
        _check_finite(mn, mx, start)
        if self.codec == "fp32":
            torch.from_numpy(codes.view("<f4")).copy_(x)
            return
        peak = torch.maximum(mn.abs(), mx.abs())
        bad = peak >= FP16_OVERFLOW
        if bool(bad.any()):
            row = start + int(torch.nonzero(bad)[0, 0])
            raise OutOfRangeRowsError(row, self.codec, f"|x| >= {FP16_OVERFLOW} overflows fp16")
        torch.from_numpy(codes.view("<f2")).copy_(x)

    def encode_int(
        self,
        x: torch.Tensor,
        start: int,
        codes: torch.Tensor,
        scale_out: torch.Tensor,
        bias_out: torch.Tensor,
    ) -> None:
        m = x.shape[0]
        mn, mx = x.amin(1), x.amax(1)
        _check_finite(mn, mx, start)
        bias16, scale16 = _affine_params(mn, mx, self.levels)
        row = _first_non_finite_half(bias16.numpy(), scale16.numpy())
        if row is not None:
            raise _out_of_range(self.codec, start + row, x[row])
        t = self.t[:m]
        if self.adaptive:
            bias16, scale16 = self.search.best_params(x, mn, mx, bias16, scale16, t)
        else:
            _quantize_into(t, x, bias16.float(), scale16.float(), self.levels)
        if self.bits == 8:  # 8-bit codes need no packing: cast straight into the section
            np.copyto(codes.numpy(), self.t_np[:m], casting="unsafe")
        else:
            u8 = self.u8[:m]
            np.copyto(u8[:, : self.dim], self.t_np[:m], casting="unsafe")
            _pack_into(codes, torch.from_numpy(u8), self.bits)
        scale_out.copy_(scale16)
        bias_out.copy_(bias16)


class _AdaptiveSearch:
    """Guan et al.'s greedy range search, vectorised over the rows of a chunk.

    Both candidates of a step are evaluated together in (2, m, dim) buffers; the loss of a
    candidate is ||clamp(round(t), 0, L) - t|| * scale with t = (x - bias) / scale, i.e. the L2
    norm of the decoded error computed with the candidate's fp16 scale and bias.
    """

    def __init__(self, max_rows: int, dim: int, levels: int) -> None:
        self.levels = levels
        self.t = torch.empty(2, max_rows, dim)
        self.q = torch.empty(2, max_rows, dim)
        # [lo of both candidates, (hi - lo) / L of both candidates]; hi of both candidates.
        self.par = torch.empty(2, 2, max_rows)
        self.hi = torch.empty(2, max_rows)
        # candidate 0 moves lo up by a step, candidate 1 moves hi down by a step.
        self.lo_move = torch.tensor([[1.0], [0.0]])
        self.hi_move = torch.tensor([[0.0], [-1.0]])

    def _losses(self, x: torch.Tensor, par: torch.Tensor) -> torch.Tensor:
        """Losses (k, m) of the k candidates whose fp32 [lo, (hi - lo) / L] are in `par`."""
        _, k, m = par.shape
        p16 = par.half().float()
        bias, scale = p16[0], p16[1]
        # scale 0 gives inv = inf and a NaN loss, which no comparison ever picks.
        inv = torch.reciprocal(scale)
        t = self.t[:k, :m]
        q = self.q[:k, :m]
        torch.sub(x, bias.unsqueeze(-1), out=t)
        t.mul_(inv.unsqueeze(-1))
        torch.clamp(t, 0, self.levels, out=q)
        q.round_()
        q.sub_(t)
        loss: torch.Tensor = torch.linalg.vector_norm(q, dim=-1)
        return loss.mul_(scale)

    def best_params(
        self,
        x: torch.Tensor,
        mn: torch.Tensor,
        mx: torch.Tensor,
        bias_u: torch.Tensor,
        scale_u: torch.Tensor,
        t: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp16 (bias, scale) per row; leaves the codes (as float) of that choice in `t`."""
        m = x.shape[0]
        levels = self.levels
        step = (mx - mn) / ADAPTIVE_NUM_BINS
        par = self.par[:, :, :m]
        lo, rng, hi = par[0], par[1], self.hi[:, :m]
        lo[0].copy_(mn)
        torch.sub(mx, mn, out=rng[0]).div_(levels)
        best_loss = self._losses(x, par[:, :1])[0].clone()
        best_lo, best_hi = mn.clone(), mx.clone()
        cur_lo, cur_hi = mn.clone(), mx.clone()
        for _ in range(ADAPTIVE_STEPS):
            torch.addcmul(cur_lo, self.lo_move, step, out=lo)
            torch.addcmul(cur_hi, self.hi_move, step, out=hi)
            torch.sub(hi, lo, out=rng).div_(levels)
            loss_lo, loss_hi = self._losses(x, par)
            left = loss_lo < loss_hi
            torch.where(left, lo[0], cur_lo, out=cur_lo)
            torch.where(left, cur_hi, hi[1], out=cur_hi)
            cur_loss = torch.where(left, loss_lo, loss_hi)
            better = cur_loss < best_loss
            torch.where(better, cur_loss, best_loss, out=best_loss)
            torch.where(better, cur_lo, best_lo, out=best_lo)
            torch.where(better, cur_hi, best_hi, out=best_hi)
        bias_a, scale_a = _affine_params(best_lo, best_hi, levels)
        # Exact final check: the real decoded error of both encodings, summed in float64.
        q_u = self.q[0, :m]
        _quantize_into(q_u, x, bias_u.float(), scale_u.float(), levels)
        loss_u = _exact_sq_error(q_u, x, bias_u, scale_u, self.t[0, :m])
        _quantize_into(t, x, bias_a.float(), scale_a.float(), levels)
        loss_a = _exact_sq_error(t, x, bias_a, scale_a, self.t[1, :m])
        use_a = loss_a < loss_u
        torch.where(use_a.unsqueeze(1), t, q_u, out=t)
        return torch.where(use_a, bias_a, bias_u), torch.where(use_a, scale_a, scale_u)


# --- kernels --------------------------------------------------------------------------------------


def _affine_params(
    lo: torch.Tensor, hi: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (bias, scale) of the range [lo, hi]: bias = fp16(lo), scale = fp16((hi - bias) / L),
    1 where that is 0 (the rule of torch's prepack kernels, whose bytes these must equal)."""
    bias = lo.half()
    scale = ((hi - bias.float()) / levels).half()
    return bias, scale.masked_fill_(scale == 0, 1.0)


def _quantize_into(
    t: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor, levels: int
) -> None:
    """t = clamp(rint((x - bias) * (1 / scale)), 0, L) as float32 (scale is never 0).

    As in the kernels: a float32 multiplication by 1/scale, which can differ from a division
    only at a near-tie (both codes are then within half a step plus float32 rounding).
    """
    inv = torch.reciprocal(scale)
    torch.sub(x, bias.unsqueeze(1), out=t)
    t.mul_(inv.unsqueeze(1))
    t.clamp_(0, levels)
    t.round_()


def _dequantize_into(
    out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
) -> None:
    """out = bias + codes * scale in float32 (the product is exact: <= 8 x 11 mantissa bits)."""
    out.copy_(codes)
    out.mul_(scale.unsqueeze(1))
    out.add_(bias.unsqueeze(1))


def _exact_sq_error(
    codes: torch.Tensor,
    x: torch.Tensor,
    bias16: torch.Tensor,
    scale16: torch.Tensor,
    work: torch.Tensor,
) -> torch.Tensor:
    """Per row, the L2 norm of decoded - x in float64, decoding exactly as `decode_rows` does."""
    _dequantize_into(work, codes, scale16.float(), bias16.float())
    err = work.double().sub_(x)
    norm: torch.Tensor = torch.linalg.vector_norm(err, dim=1)
    return norm


def _first_non_finite_half(*arrays: np.ndarray) -> int | None:
    """The first index at which any of the equal-length fp16 arrays is inf or NaN, or None."""
    # An fp16 is inf or NaN iff its exponent bits are all ones, the largest masked value, so
    # the common case costs a mask and a max per array.
    exponents = [arr.view(np.uint16) & 0x7C00 for arr in arrays]
    if all(e.size == 0 or int(e.max()) != 0x7C00 for e in exponents):
        return None
    bad = np.logical_or.reduce([e == 0x7C00 for e in exponents])
    return int(np.flatnonzero(bad)[0])


def _out_of_range(codec: str, row: int, x_row: torch.Tensor) -> OutOfRangeRowsError:
    """The error for a row whose fp16 bias or scale overflowed."""
    low = float(x_row.amin())
    return OutOfRangeRowsError(row, codec, f"min {low!r} or range does not fit fp16")


def _check_finite(mn: torch.Tensor, mx: torch.Tensor, start: int) -> None:
    """Raise NonFiniteRowsError unless every row min and max is finite (amin/amax keep NaN)."""
    # The sums are finite unless a value is not (or they overflow, which looks closer): two
    # reductions cost a tenth of torch.isfinite's several passes on a chunk's 8k rows.
    if math.isfinite(float(mn.sum()) + float(mx.sum())):
        return
    ok = torch.isfinite(mn) & torch.isfinite(mx)
    if not bool(ok.all()):
        raise NonFiniteRowsError(start + int(torch.nonzero(~ok)[0, 0]))


def _group_codes(bits: int) -> int:
    """Codes in one packing group: the smallest run of codes that fills whole bytes."""
    return 8 // math.gcd(8, bits)


# Packing works on machine words instead of strided bytes, which torch does not vectorise:
# a group of `group` code bytes read as one little-endian word w holds code k in byte k, and the
# packed field of code k sits at bit bits*k, so shifting w right by (8 - bits)*k moves code k to
# its place. For 2 and 4 bits the other codes land outside the low byte (or are shifted out);
# for 3 bits the packed group is 24 bits wide, so each term is masked. Unpacking runs the same
# shifts to the left.
_WORD = {2: torch.int32, 4: torch.int16, 3: torch.int64}


def _pack_into(packed: torch.Tensor, codes: torch.Tensor, bits: int) -> None:
    """Pack contiguous (m, w) uint8 codes into (m, rb) bytes. w is dim rounded up to a whole
    packing group and the codes past dim are 0."""
    m, rb = packed.shape
    if bits == 8:
        packed.copy_(codes)
        return
    group = _group_codes(bits)
    words = codes.view(_WORD[bits])
    acc = words.clone()
    if bits == 3:
        acc.bitwise_and_(7)
        for k in range(1, group):
            acc.bitwise_or_((words >> (5 * k)).bitwise_and_(7 << (3 * k)))
        n_groups = words.shape[1]
        packed.copy_(acc.view(torch.uint8).view(m, n_groups, 8)[..., :3].reshape(m, -1)[:, :rb])
        return
    for k in range(1, group):
        acc.bitwise_or_(words >> ((8 - bits) * k))
    packed.copy_(acc.bitwise_and_(0xFF))


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """(m, dim) uint8 codes (possibly a strided view) from (m, rb) packed bytes."""
    m, rb = packed.shape
    if bits == 8:
        return packed
    group = _group_codes(bits)
    mask = (1 << bits) - 1
    if bits == 3:
        n_groups = -(-dim // group)
        word = torch.zeros(m, n_groups, 8, dtype=torch.uint8)  # 3 packed bytes per int64
        padded = packed
        if n_groups * 3 != rb:
            padded = torch.zeros(m, n_groups * 3, dtype=torch.uint8)
            padded[:, :rb] = packed
        word[..., :3] = padded.view(m, n_groups, 3)
        v = word.view(torch.int64).view(m, n_groups)
        acc = v.bitwise_and(7)
        for k in range(1, group):
            acc.bitwise_or_((v << (5 * k)).bitwise_and_(mask << (8 * k)))
        return acc.view(torch.uint8).view(m, n_groups * group)[:, :dim]
    wide = packed.to(_WORD[bits])
    acc = wide.clone()
    for k in range(1, group):
        acc.bitwise_or_(wide << ((8 - bits) * k))
    lanes = sum(mask << (8 * k) for k in range(group))
    acc.bitwise_and_(lanes)
    return acc.view(torch.uint8).view(m, rb * group)[:, :dim]


# --- input checks ---------------------------------------------------------------------------------


def _codec_bits(codec: str) -> int:
    if codec not in CODEC_BITS:
        raise UnknownCodecError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    return CODEC_BITS[codec]


def _as_float32_rows(rows: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A CPU float32 (n, dim) tensor sharing memory with `rows` where possible."""
    if isinstance(rows, torch.Tensor):
        t = rows.detach()
        if t.dtype != torch.float32:
            raise CodecError(f"rows must be float32, got {t.dtype}")
        t = t.cpu()
    elif isinstance(rows, np.ndarray):
        if rows.dtype != np.float32:
            raise CodecError(f"rows must be float32 (native byte order), got {rows.dtype}")
        arr = rows if all(s >= 0 for s in rows.strides) else np.ascontiguousarray(rows)
        t = _shared_tensor(arr)
    else:
        raise CodecError(f"rows must be a numpy array or torch tensor, got {type(rows).__name__}")
    if t.ndim != 2 or t.shape[1] < 1:
        raise CodecError(f"rows must have shape (n, dim) with dim >= 1, got {tuple(t.shape)}")
    return t


def _shared_tensor(arr: np.ndarray) -> torch.Tensor:
    """torch.from_numpy for arrays that are only read, such as views of a fetched blob's
    bytes, which are read-only (torch would warn) and may be unaligned (torch copes)."""
    if any(stride % arr.itemsize for stride in arr.strides):
        # torch takes strides in whole items only: fp16 fields or codes of rows that sit apart
        # by an odd number of bytes (`QuantizedRows`) are copied first.
        arr = np.ascontiguousarray(arr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    return type(value).__name__
