"""The affine codecs ``intB`` and ``intB-adaptive``: B-bit codes plus a scale and a bias per row,
decoded as bias + code * scale (publisher/codecs/affine_rule.py gives the rules).

Codecs with fp16 fields (all but ``int8``) quantise with the fp16-rounded scale and bias the
decoder will use, and the range starts at the rounded bias, so |x - x'| <= |scale|/2 plus the
fp16 rounding of bias (and, for a subnormal scale, L * 2**-25); see `AffineCodec.error_bound`. A
constant row c is no exception: the range from fp16(c) to c is quantised like any other (scale 1
and code 0 where it is 0 or below fp16's reach), so it decodes at least as close to c as
fp16(c). Where fp16(min) rounds above max the scale is negative, which decodes by the same
formula. The uniform 4- and 2-bit rows are quantized by `torch.ops.quantized.embedding_bag_{4,2}
bit_prepack` where this torch has them (publisher/rowwise_kernels.py) and by the same arithmetic
here otherwise, byte for byte.

``int8`` stores float32 fields (format version 3): the codes, scale and bias of
`embedding_bag_byte_prepack` as the kernel writes them (bias = the float32 min, scale = range /
255), so |x - x'| <= scale/2 + the kernel's 1e-8 + float32 rounding, and a constant row decodes
to its value exactly. Without the kernel the same rule runs on torch's elementwise ops; a code
may then differ by one at a near tie (the kernel's float32 operations run in another order), and
both decode within the same bound. Why this layout, measured on one core (`checknrun bench codec
--codec int8 --dim 64`, and `--dim 16`, 262,144 embedding-like rows; served: DLRM trained on
MovieLens-1M (400k samples, dim 16) and on the synthetic stream (100k samples, tables capped at
100k rows, dim 64), every table passed through the layout, mean |logit change| on the next
100k / 40k samples; the unmeasured layouts were timed the same way with their extra steps):

    scale, bias                bytes/row (16/64)  encode/kernel   rel MSE (64)  |dlogit| ML / syn
    fp16, fp16 (versions 1-2)  20 / 68            0.26x (own)     5.094e-05     1.192e-3 / 1.028e-3
    fp16, fp16 from the kernel 20 / 68            0.70x           5.197e-05     (1.20x its bound)
    fp32, fp16                 22 / 70            0.94x           5.140e-05     1.211e-3 / 1.112e-3
    fp32, fp32 (version 3)     24 / 72            0.97x           5.090e-05     1.190e-3 / 1.021e-3

A fp16 scale moves code 255 by up to 255 * 2**-11 of a step, past the bound; a fp16 bias shifts
a whole row alike by its rounding: within the bound, but served predictions move 2-8% more than
today's and rows far from zero (1 +- 0.1) get 28% more MSE, in the codec one picks for precision.
The kernel's fields cost 4 bytes a row (zstd: 7.2 where fp16 fields take 3.5) and are no worse
than the old layout anywhere; served log loss differs by less than its noise (0.001%) for all.

Decoding of 4- and 2-bit rows runs on torch's unpack kernels where this torch has them; so does
int8 rows' with fp32 fields, whose product of scale and code is not exact in float32: the
kernel's single rounding is what the server's lookup kernel computes too, and without the kernel
the sum runs in float64. Rows with fp16 fields decode by the codec's own multiplication and addition
(exact, and for 8 bits 1.2x the unpack kernel's speed). Codes are packed LSB first
(publisher/codecs/packing.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from publisher import rowwise_kernels
from publisher.codecs.affine_rule import (
    BYTE_KERNEL_EPSILON,
    affine_params,
    dequantize_fp32_into,
    dequantize_into,
    fp32_params,
    quantize_from_lo_into,
    quantize_into,
)
from publisher.codecs.base import (
    CHUNK_ELEMENTS,
    FP16_HALF_ULP_MIN,
    FP16_HALF_ULP_REL,
    FP16_MIN_NORMAL,
    Codec,
    QuantizedRows,
)
from publisher.codecs.checks import (
    check_finite,
    first_non_finite_field,
    shared_tensor,
    writable_tensor,
)
from publisher.codecs.errors import CodecError, OutOfRangeRowsError
from publisher.codecs.packing import group_codes, pack_into, unpack
from publisher.codecs.range_search import ADAPTIVE_CHUNK_ELEMENTS, RangeSearch

#: float32 elements per chunk on the prepack kernel (4 MiB: it stays in cache for the finite
#: check after the kernel; 2-8 MiB measured alike, smaller chunks pay more per chunk).
KERNEL_CHUNK_ELEMENTS: Final = 1 << 20
#: rows with every |x| <= this get finite fields from any affine codec: |bias| = |fp16(min)|
#: <= 16384 and scale = fp16((max - bias) / L) <= fp16(32768 / 1), both below fp16's overflow
#: (int8's float32 fields, min and (max - min) / 255, are further still from float32's).
FP16_FIELDS_SAFE: Final = 16384.0
_FP32_SLACK: Final = 2.0**-18  # float32 rounding: (x - bias) / scale, bias + code * scale, search


@dataclass(frozen=True)
class AffineCodec(Codec):
    """``intB`` (`search` None: the range is [min, max]) or ``intB-adaptive`` (the range that
    `search` finds); B is the layout's bits."""

    search: RangeSearch | None = None

    @property
    def levels(self) -> int:
        """L = 2**B - 1, the largest code."""
        return (1 << self.bits) - 1

    @property
    def adaptive(self) -> bool:
        return self.search is not None

    @property
    def wide_fields(self) -> bool:
        """Whether this codec writes float32 scales and biases (int8: the byte kernel's)."""
        return self.layout.scale_bias_encoding == "float32"

    def encodes_on_kernel(self, dim: int) -> bool:
        """Whether rows of `dim` encode on torch's prepack kernel: uniform codecs whose fields
        are the kernel's (the 8-bit kernel's are float32: int8, not a fp16-field 8-bit rule)."""
        return (
            self.search is None
            and self.field_dtype == rowwise_kernels.field_dtype(self.bits)
            and rowwise_kernels.encodes(self.bits, dim)
        )

    def decodes_on_kernel(self) -> bool:
        """Whether the rows this codec writes decode on torch's unpack kernel of this width."""
        return self._unpacks(self.field_dtype)

    def _unpacks(self, field_dtype: np.dtype[np.floating]) -> bool:
        """Whether rows with fields of `field_dtype` decode on the unpack kernel: fp32 fields
        always (it rounds once), fp16 ones where codes need unpacking (below 8 bits; 8-bit codes
        decode 1.2x faster by the codec's own exact multiply and add)."""
        if not rowwise_kernels.decodes(self.bits):
            return False
        return field_dtype == np.float32 or self.bits < 8

    def _chunk_elements(self, dim: int) -> int:
        if self.search is not None:
            return ADAPTIVE_CHUNK_ELEMENTS
        return KERNEL_CHUNK_ELEMENTS if self.encodes_on_kernel(dim) else CHUNK_ELEMENTS

    def _encode(
        self, x: torch.Tensor, chunk: int, checked_finite: bool, max_abs: float | None
    ) -> QuantizedRows:
        n, dim = x.shape
        on_kernel = self.encodes_on_kernel(dim)
        if on_kernel and checked_finite and n:
            fields_fit = max_abs is not None and max_abs <= FP16_FIELDS_SAFE
            return self._encode_checked_on_kernel(x, fields_fit)
        codes = np.empty((n, self.row_bytes(dim)), dtype=np.uint8)
        scale = np.empty(n, dtype=self.field_dtype)
        bias = np.empty(n, dtype=self.field_dtype)
        if on_kernel:
            self._encode_on_kernel(x, chunk, codes, scale, bias)
            return QuantizedRows(self.name, dim, codes, scale, bias)
        encoder = _ChunkEncoder(self, dim, min(chunk, max(n, 1)))
        codes_t = torch.from_numpy(codes)
        scale_t = torch.from_numpy(scale)
        bias_t = torch.from_numpy(bias)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            xc = x[start:stop]
            if not xc.is_contiguous():
                xc = xc.contiguous()
            sl = slice(start, stop)
            encoder.encode(xc, start, codes_t[sl], scale_t[sl], bias_t[sl])
        return QuantizedRows(self.name, dim, codes, scale, bias)

    def _encode_on_kernel(
        self,
        x: torch.Tensor,
        chunk: int,
        codes: np.ndarray,
        scale: np.ndarray,
        bias: np.ndarray,
    ) -> None:
        """Uniform encoding on torch's prepack kernel (publisher/rowwise_kernels.py), which
        writes the bytes `_ChunkEncoder` would (int8: up to a code at a near tie)."""
        n = x.shape[0]
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            xc = x[start:stop].contiguous()
            fused = rowwise_kernels.encode_fused(xc, self.bits)
            # The kernel quantises NaN to code 0 without a word, and its min and max skip a NaN,
            # so the scale and bias do not show it: the rows are checked after it, while they
            # are in cache. Their sum is non-finite if any element is; only a non-finite sum (or
            # an overflowing one) looks closer. An overflow in an earlier chunk is reported
            # first, as `_ChunkEncoder`, which checks chunk by chunk, reports it.
            if not math.isfinite(float(xc.sum())):
                self._check_fields(x, scale[:start], bias[:start])
                check_finite(xc.amin(1), xc.amax(1), start)
            sl = slice(start, stop)
            rowwise_kernels.split(fused.numpy(), self.bits, codes[sl], scale[sl], bias[sl])
        # Once for all rows, not per chunk: the per-chunk check cost 7% of the kernel's time.
        self._check_fields(x, scale, bias)

    def _encode_checked_on_kernel(self, x: torch.Tensor, fields_fit: bool) -> QuantizedRows:
        """Uniform encoding of rows the caller checked, in one kernel call: nothing to read
        while a chunk is in cache, so no chunks, and the codes, scale and bias stay views of the
        fused rows (a blob's writer copies each section once anyway). Measured 0.80x the bare
        kernel's throughput with the split into sections, ~1x without (`checknrun bench
        codec`). The fields are looked at unless `fields_fit` says they cannot have
        overflowed."""
        fused = rowwise_kernels.encode_fused(x.contiguous(), self.bits).numpy()
        codes, scale, bias = rowwise_kernels.fields(fused, self.bits, self.row_bytes(x.shape[1]))
        if not fields_fit:
            self._check_fields(x, scale, bias)
        return QuantizedRows(self.name, x.shape[1], codes, scale, bias)

    def _check_fields(self, x: torch.Tensor, scale: np.ndarray, bias: np.ndarray) -> None:
        """Raise OutOfRangeRowsError for the first of the rows x[:len(scale)], all finite, whose
        scale or bias overflowed to inf."""
        row = first_non_finite_field(scale, bias)
        if row is not None:
            raise self.out_of_range(row, x[row])

    def out_of_range(self, row: int, x_row: torch.Tensor) -> OutOfRangeRowsError:
        """The error for a row whose bias or scale overflowed."""
        low = float(x_row.amin())
        width = "float32" if self.wide_fields else "fp16"
        return OutOfRangeRowsError(row, self.name, f"min {low!r} or range does not fit {width}")

    def _decode_into(self, q: QuantizedRows, out: np.ndarray) -> None:
        out_t = writable_tensor(out)
        for name, arr in (("scale", q.scale), ("bias", q.bias)):
            row = first_non_finite_field(arr)
            if row is not None:
                raise CodecError(
                    f"{name} of row {row} is {arr[row]}; scale and bias must be finite"
                )
        n, dim, bits = q.n_rows, q.dim, self.bits
        chunk = max(1, CHUNK_ELEMENTS // dim)
        if self._unpacks(q.scale.dtype):
            self._decode_on_kernel(q, out_t, chunk)
            return
        codes_t = shared_tensor(q.codes)
        scale = shared_tensor(q.scale)
        bias = shared_tensor(q.bias)
        if q.scale.dtype == np.float32:  # no unpack kernel: float64, rounded once
            dequantize = dequantize_fp32_into
        else:
            scale, bias, dequantize = scale.float(), bias.float(), dequantize_into
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            codes_chunk = unpack(codes_t[start:stop], bits, dim)
            dequantize(out_t[start:stop], codes_chunk, scale[start:stop], bias[start:stop])

    def _decode_on_kernel(self, q: QuantizedRows, out: torch.Tensor, chunk: int) -> None:
        """Decode on torch's unpack kernel: chunk by chunk into a reused fused-row buffer, so
        the kernel's output stays in cache until it is copied into `out` (a whole-table call
        would fault in a fresh output array and be several times slower)."""
        n, dim, bits = q.n_rows, q.dim, self.bits
        fused = np.empty((min(chunk, n), rowwise_kernels.fused_row_bytes(bits, dim)), np.uint8)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            rows = fused[: stop - start]
            sl = slice(start, stop)
            rowwise_kernels.fuse(rows, bits, q.codes[sl], q.scale[sl], q.bias[sl])
            decoded = rowwise_kernels.decode_fused(torch.from_numpy(rows), bits)
            out[sl].copy_(decoded[:, :dim])

    def _error_bound(self, q: QuantizedRows) -> np.ndarray:
        """|scale|/2, plus a float32 arithmetic allowance, plus: for fp16 fields the fp16
        rounding of bias and L * 2**-25 when the scale is below the smallest normal fp16 (its
        rounding then is absolute); for float32 fields (the byte kernel's) its 1e-8 (its step is
        range / (range + 1e-8) of the stored one). An adaptive codec adds the error of elements
        clipped by the shrunk range, up to its search's `clip_ratio` * L * |scale|."""
        levels = self.levels
        scale = np.abs(q.scale.astype(np.float64))  # negative where fp16(min) rounds above max
        bias_mag = np.abs(q.bias.astype(np.float64))
        bound = scale / 2
        if q.scale.dtype == np.float32:
            bound += BYTE_KERNEL_EPSILON
        else:
            bound += np.maximum(bias_mag * FP16_HALF_ULP_REL, FP16_HALF_ULP_MIN)
            bound += np.where(scale < FP16_MIN_NORMAL, levels * FP16_HALF_ULP_MIN, 0.0)
        if self.search is not None:
            # Elements clipped by the shrunk range: each end moved by at most `steps` steps of
            # (max - min) / `num_bins`, and the kept range is at least (num_bins - steps) steps
            # ~ levels * scale.
            ratio = self.search.clip_ratio
            bound += (ratio + FP16_HALF_ULP_REL) * levels * scale
            bound += (ratio + 1.0) * levels * FP16_HALF_ULP_MIN
        bound += _FP32_SLACK * (bias_mag + levels * scale)
        return bound


class _ChunkEncoder:
    """Buffers and steps to encode one chunk of rows by the codecs' own code (no kernel);
    reused across the chunks of one call."""

    def __init__(self, codec: AffineCodec, dim: int, max_rows: int) -> None:
        self.codec = codec
        self.bits = codec.bits
        self.levels = codec.levels
        self.dim = dim
        self.t = torch.empty(max_rows, dim)
        self.t_np = self.t.numpy()
        # Codes narrower than a byte are staged here, padded to whole packing groups, and
        # packed; 8-bit codes are cast straight into the codes section.
        group = group_codes(self.bits)
        staged = -(-dim // group) * group if self.bits < 8 else 0
        self.u8 = np.zeros((max_rows, staged), dtype=np.uint8)
        search = codec.search
        self.searcher = None if search is None else search.searcher(max_rows, dim, self.levels)

    def encode(
        self,
        x: torch.Tensor,
        start: int,
        codes: torch.Tensor,
        scale_out: torch.Tensor,
        bias_out: torch.Tensor,
    ) -> None:
        """Encode the chunk `x`, whose first row is row `start`, into its sections."""
        m = x.shape[0]
        mn, mx = x.amin(1), x.amax(1)
        check_finite(mn, mx, start)
        t = self.t[:m]
        if self.codec.wide_fields:
            self._encode_fp32(x, mn, mx, start, t, codes, scale_out, bias_out)
            return
        bias16, scale16 = affine_params(mn, mx, self.levels)
        row = first_non_finite_field(bias16.numpy(), scale16.numpy())
        if row is not None:
            raise self.codec.out_of_range(start + row, x[row])
        if self.searcher is not None:
            bias16, scale16 = self.searcher.best_params(x, mn, mx, bias16, scale16, t)
        else:
            quantize_into(t, x, bias16.float(), scale16.float(), self.levels)
        if self.bits == 8:  # 8-bit codes need no packing: cast straight into the section
            np.copyto(codes.numpy(), self.t_np[:m], casting="unsafe")
        else:
            u8 = self.u8[:m]
            np.copyto(u8[:, : self.dim], self.t_np[:m], casting="unsafe")
            pack_into(codes, torch.from_numpy(u8), self.bits)
        scale_out.copy_(scale16)
        bias_out.copy_(bias16)

    def _encode_fp32(
        self,
        x: torch.Tensor,
        mn: torch.Tensor,
        mx: torch.Tensor,
        start: int,
        t: torch.Tensor,
        codes: torch.Tensor,
        scale_out: torch.Tensor,
        bias_out: torch.Tensor,
    ) -> None:
        """The byte kernel's rule by torch's elementwise ops (int8 where the kernel is missing):
        float32 fields, bias the min, codes from it."""
        m = x.shape[0]
        scale32, inverse = fp32_params(mn, mx, self.levels)
        row = first_non_finite_field(scale32.numpy())
        if row is not None:
            raise self.codec.out_of_range(start + row, x[row])
        quantize_from_lo_into(t, x, mn, inverse, self.levels)
        np.copyto(codes.numpy(), self.t_np[:m], casting="unsafe")
        scale_out.copy_(scale32)
        bias_out.copy_(mn)
