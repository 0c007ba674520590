"""What a codec is (`Codec`) and what every codec encodes rows to (`QuantizedRows`).

A codec is one object: its name and wire layout (`schemas.codec_names.CodecLayout`: bits per
element, whether rows carry a scale and a bias, and how wide its writer stores them), the
arithmetic that encodes float32 rows into
that layout and decodes them back, and the per-row error bound its tests hold it to. The codecs
themselves are in `publisher.codecs.CODECS` (publisher/codecs/table.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Final

import numpy as np
import torch

from publisher.codecs.checks import as_float32_rows, describe
from publisher.codecs.errors import CodecError, UnknownCodecError
from schemas.codec_names import CODECS, LAYOUTS, CodecLayout

#: float32 elements per chunk for the codecs' own code and decoding (2 MiB; 4-16k rows of dim
#: 64 measured alike, smaller chunks pay more per-chunk bookkeeping).
CHUNK_ELEMENTS: Final = 1 << 19

# fp16 facts, for the fp16 codec's values and the affine codecs' fp16 scale and bias.
#: |x| at or above this rounds to inf in fp16.
FP16_OVERFLOW: Final = 65520.0
FP16_HALF_ULP_REL: Final = 2.0**-11  # half an ulp of a normal fp16, relative to its value
FP16_HALF_ULP_MIN: Final = 2.0**-25  # half the spacing of fp16 subnormals
FP16_MIN_NORMAL: Final = 2.0**-14


def layout_of(codec: str) -> CodecLayout:
    """The wire layout of `codec`, or UnknownCodecError."""
    if codec not in LAYOUTS:
        raise UnknownCodecError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    return LAYOUTS[codec]


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """Encoded rows: `codes` (n x row_bytes uint8) plus, for affine codecs, a scale and a bias per
    row.

    `scale` and `bias` are both fp16, or both fp32 for a codec whose layout stores fp32 fields
    (int8; its rows from a blob of version 1 or 2 have fp16 ones, which decode alike). They have
    shape
    (0,) for fp32 and fp16. The constructor checks every shape and dtype against the codec's
    layout, so a `QuantizedRows` built from blob bytes is safe to decode. (eq=False: numpy arrays
    have no single truth value.)
    """

    codec: str
    dim: int
    codes: np.ndarray
    scale: np.ndarray
    bias: np.ndarray

    def __post_init__(self) -> None:
        layout = layout_of(self.codec)
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 1:
            raise CodecError(f"dim must be an int >= 1, got {self.dim!r}")
        rb = layout.row_bytes(self.dim)
        codes = self.codes
        if not isinstance(codes, np.ndarray) or codes.dtype != np.uint8 or codes.ndim != 2:
            raise CodecError(f"codes must be a 2-D uint8 array, got {describe(codes)}")
        # Rows may sit apart (the kernel's fused rows, `AffineCodec`), each row's bytes
        # contiguous and no two rows overlapping.
        n = codes.shape[0]
        apart = n <= 1 or codes.strides[0] >= rb
        contiguous = n == 0 or rb <= 1 or codes.strides[1] == 1
        if codes.shape[1] != rb or not apart or not contiguous:
            raise CodecError(
                f"codes must have {rb} bytes per row ({self.codec}, dim {self.dim}), each row "
                f"contiguous and apart, got shape {codes.shape}, strides {codes.strides}"
            )
        n_sb = codes.shape[0] if layout.scale_bias else 0
        half = np.dtype(np.float16)
        types = (half, np.dtype(np.float32)) if layout.scale_bias_encoding == "float32" else (half,)
        for name in ("scale", "bias"):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype not in types or arr.shape != (n_sb,):
                raise CodecError(
                    f"{name} must be a {' or '.join(t.name for t in types)} array of shape "
                    f"({n_sb},) for {self.codec}, got {describe(arr)}"
                )
        if self.scale.dtype != self.bias.dtype:
            raise CodecError(
                f"scale and bias must have one dtype, got {self.scale.dtype} and {self.bias.dtype}"
            )

    @property
    def n_rows(self) -> int:
        """Number of encoded rows."""
        return int(self.codes.shape[0])

    @property
    def bits(self) -> int:
        """Bits per element of the codec."""
        return layout_of(self.codec).bits


@dataclass(frozen=True)
class Codec(ABC):
    """One row codec: `layout` (name, bits, sections) and the arithmetic behind it.

    `encode` and `decode` check their arguments and hand the work to the subclass; no Python
    loop runs over rows or elements, only over row chunks that stay in cache.
    """

    layout: CodecLayout
    #: whether decode(encode(x)) == x bit for bit (its error bound is 0).
    lossless: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """The codec's name, as a blob's header and a manifest spell it."""
        return self.layout.name

    @property
    def bits(self) -> int:
        """Bits per element in the codes section."""
        return self.layout.bits

    @property
    def affine(self) -> bool:
        """Whether a row decodes as bias + code * scale with a scale and a bias per row."""
        return self.layout.scale_bias

    @property
    def field_dtype(self) -> np.dtype[np.floating]:
        """The dtype of the scale and bias this codec's encoder writes (float16, or float32 for
        int8); its decoder also takes float16 ones (blobs of versions 1 and 2)."""
        wide = self.layout.scale_bias_encoding == "float32"
        return np.dtype(np.float32 if wide else np.float16)

    def row_bytes(self, dim: int) -> int:
        """Bytes one encoded row of `dim` elements takes in the codes section."""
        return self.layout.row_bytes(dim)

    @property
    def adaptive(self) -> bool:
        """Whether each row's range is searched for (slower to encode than [min, max])."""
        return False

    def encodes_on_kernel(self, dim: int) -> bool:
        """Whether rows of `dim` encode on one of torch's kernels (publisher/rowwise_kernels.py)."""
        return False

    def decodes_on_kernel(self) -> bool:
        """Whether rows decode on one of torch's kernels."""
        return False

    def encode(
        self,
        rows: np.ndarray | torch.Tensor,
        *,
        chunk_rows: int | None = None,
        checked_finite: bool = False,
        max_abs: float | None = None,
    ) -> QuantizedRows:
        """Encode float32 `rows` (shape (n, dim)) by this codec's rule.

        Raises CodecError for a wrong shape or dtype, NonFiniteRowsError for inf/NaN and
        OutOfRangeRowsError for values fp16 cannot hold. `chunk_rows` overrides the rows
        processed per chunk (a tuning knob; results do not depend on it). `checked_finite`
        says the caller has refused NaN and inf already (the publisher's
        `Snapshot.check_finite`): the kernel path, the only one whose NaN check is a read of its
        own (the kernels quantise NaN without a word), then skips it, and the result's codes,
        scale and bias are views of the kernel's fused rows (rows apart, not C-contiguous).
        Rows that do hold NaN then encode without an error, NaN as code 0. `max_abs`, with
        `checked_finite`, is a bound the caller knows on |rows| (the snapshot's check measures
        it): at most `FP16_FIELDS_SAFE`, no row's fp16 scale or bias can overflow, and the
        kernel path skips looking for one (4% of the int4 kernel's time).
        """
        x = as_float32_rows(rows)
        dim = x.shape[1]
        chunk = chunk_rows if chunk_rows is not None else max(1, self._chunk_elements(dim) // dim)
        if chunk < 1:
            raise CodecError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return self._encode(x, chunk, checked_finite, max_abs)

    def decode(self, q: QuantizedRows, out: np.ndarray | None = None) -> np.ndarray:
        """Float32 rows (n, dim) that `q` encodes, written into `out` if given (and returned)."""
        self._check_rows(q)
        n, dim = q.n_rows, q.dim
        if out is None:
            out = np.empty((n, dim), dtype=np.float32)
        elif not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n, dim):
            raise CodecError(
                f"out must be a float32 array of shape ({n}, {dim}), got {describe(out)}"
            )
        elif not out.flags.writeable:
            raise CodecError("out must be writeable")
        if n:
            self._decode_into(q, out)
        return out

    def error_bound(self, q: QuantizedRows) -> np.ndarray:
        """Per row, a bound on |x - decode(encode(x))| for every element (float64, shape (n,)):
        the bound the codec's tests hold every round trip to."""
        self._check_rows(q)
        return self._error_bound(q)

    def _check_rows(self, q: QuantizedRows) -> None:
        if not isinstance(q, QuantizedRows) or q.codec != self.name:
            got = q.codec if isinstance(q, QuantizedRows) else type(q).__name__
            raise CodecError(f"{self.name} cannot read rows encoded as {got}")

    @abstractmethod
    def _chunk_elements(self, dim: int) -> int:
        """float32 elements per chunk when encoding rows of `dim` (a measured tuning)."""

    @abstractmethod
    def _encode(
        self, x: torch.Tensor, chunk: int, checked_finite: bool, max_abs: float | None
    ) -> QuantizedRows:
        """Encode the checked float32 rows `x`, `chunk` rows at a time."""

    @abstractmethod
    def _decode_into(self, q: QuantizedRows, out: np.ndarray) -> None:
        """Write the n >= 1 rows `q` encodes into the checked float32 array `out`."""

    @abstractmethod
    def _error_bound(self, q: QuantizedRows) -> np.ndarray:
        """`error_bound` of rows already checked to be this codec's."""
