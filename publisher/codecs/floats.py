"""The float codecs, which store each element as it is or as the nearest IEEE half:

- ``fp32``: codes are the little-endian float32 bytes of x (lossless).
- ``fp16``: codes are the little-endian IEEE half bytes of x, rounded to nearest-even.
  |x| must stay below 65520 (larger values would round to inf).

Neither has a scale or bias (docs/FORMAT.md section 4.1).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from publisher.codecs.base import (
    CHUNK_ELEMENTS,
    FP16_HALF_ULP_MIN,
    FP16_HALF_ULP_REL,
    FP16_OVERFLOW,
    Codec,
    QuantizedRows,
)
from publisher.codecs.checks import check_finite, shared_tensor, writable_tensor
from publisher.codecs.errors import OutOfRangeRowsError


@dataclass(frozen=True)
class _FloatCodec(Codec):
    """A codec whose codes are one float per element: chunks are checked, then copied."""

    def _chunk_elements(self, dim: int) -> int:
        return CHUNK_ELEMENTS

    def _encode(
        self, x: torch.Tensor, chunk: int, checked_finite: bool, max_abs: float | None
    ) -> QuantizedRows:
        n, dim = x.shape
        codes = np.empty((n, self.row_bytes(dim)), dtype=np.uint8)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            xc = x[start:stop]
            if not xc.is_contiguous():
                xc = xc.contiguous()
            mn, mx = xc.amin(1), xc.amax(1)
            check_finite(mn, mx, start)
            self._store(xc, mn, mx, start, codes[start:stop])
        none = np.empty(0, dtype=np.float16)
        return QuantizedRows(self.name, dim, codes, none, none.copy())

    @abstractmethod
    def _store(
        self, x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, start: int, codes: np.ndarray
    ) -> None:
        """Write the finite rows `x` (row minima `mn`, maxima `mx`, the first at row `start`)
        into their `codes`."""


@dataclass(frozen=True)
class Float32Codec(_FloatCodec):
    """``fp32``: the float32 bytes themselves."""

    lossless: ClassVar[bool] = True

    def _store(
        self, x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, start: int, codes: np.ndarray
    ) -> None:
        torch.from_numpy(codes.view("<f4")).copy_(x)

    def _decode_into(self, q: QuantizedRows, out: np.ndarray) -> None:
        np.copyto(out, q.codes.view("<f4"))

    def _error_bound(self, q: QuantizedRows) -> np.ndarray:
        """0: the rows come back bit for bit."""
        return np.zeros(q.n_rows, dtype=np.float64)


@dataclass(frozen=True)
class Float16Codec(_FloatCodec):
    """``fp16``: IEEE half, rounded to nearest-even; |x| >= 65520 is refused."""

    def _store(
        self, x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, start: int, codes: np.ndarray
    ) -> None:
        peak = torch.maximum(mn.abs(), mx.abs())
        bad = peak >= FP16_OVERFLOW
        if bool(bad.any()):
            row = start + int(torch.nonzero(bad)[0, 0])
            raise OutOfRangeRowsError(row, self.name, f"|x| >= {FP16_OVERFLOW} overflows fp16")
        torch.from_numpy(codes.view("<f2")).copy_(x)

    def _decode_into(self, q: QuantizedRows, out: np.ndarray) -> None:
        writable_tensor(out).copy_(shared_tensor(q.codes.view("<f2")))

    def _error_bound(self, q: QuantizedRows) -> np.ndarray:
        """Half an ulp of the row's largest decoded magnitude (relative 2**-11, plus 2**-25
        for subnormals)."""
        if q.n_rows == 0:
            return np.zeros(0, dtype=np.float64)
        peak: np.ndarray = np.abs(q.codes.view("<f2")).max(axis=1).astype(np.float64)
        return peak * FP16_HALF_ULP_REL + FP16_HALF_ULP_MIN
