"""Checks every codec runs on its input: float32 rows in, finite values, readable fields.

No Python loop over rows: each check is a reduction, and only a failing one looks for the row.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from publisher.codecs.errors import CodecError, NonFiniteRowsError


def as_float32_rows(rows: np.ndarray | torch.Tensor) -> torch.Tensor:
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
        t = shared_tensor(arr)
    else:
        raise CodecError(f"rows must be a numpy array or torch tensor, got {type(rows).__name__}")
    if t.ndim != 2 or t.shape[1] < 1:
        raise CodecError(f"rows must have shape (n, dim) with dim >= 1, got {tuple(t.shape)}")
    return t


def shared_tensor(arr: np.ndarray) -> torch.Tensor:
    """torch.from_numpy for arrays that are only read, such as views of a fetched blob's
    bytes, which are read-only (torch would warn) and may be unaligned (torch copes)."""
    if any(stride % arr.itemsize for stride in arr.strides):
        # torch takes strides in whole items only: fp16 fields or codes of rows that sit apart
        # by an odd number of bytes (`QuantizedRows`) are copied first.
        arr = np.ascontiguousarray(arr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def writable_tensor(out: np.ndarray) -> torch.Tensor:
    """torch.from_numpy of an output array, or CodecError for one torch cannot write into."""
    try:
        return torch.from_numpy(out)
    except ValueError as exc:  # negative strides
        raise CodecError(f"out must have non-negative strides, got {out.strides}") from exc


def check_finite(mn: torch.Tensor, mx: torch.Tensor, start: int) -> None:
    """Raise NonFiniteRowsError unless every row min and max is finite (amin/amax keep NaN)."""
    # The sums are finite unless a value is not (or they overflow, which looks closer): two
    # reductions cost a tenth of torch.isfinite's several passes on a chunk's 8k rows.
    if math.isfinite(float(mn.sum()) + float(mx.sum())):
        return
    ok = torch.isfinite(mn) & torch.isfinite(mx)
    if not bool(ok.all()):
        raise NonFiniteRowsError(start + int(torch.nonzero(~ok)[0, 0]))


#: (unsigned view, exponent mask) of the float dtypes a codec's fields come in.
_EXPONENTS = {2: (np.uint16, 0x7C00), 4: (np.uint32, 0x7F800000)}


def first_non_finite_field(*arrays: np.ndarray) -> int | None:
    """The first index at which any of the equal-length fp16 or fp32 arrays is inf or NaN, or
    None."""
    # A float is inf or NaN iff its exponent bits are all ones, the largest masked value, so
    # the common case costs a mask and a max per array.
    exponents = []
    for arr in arrays:
        unsigned, mask = _EXPONENTS[arr.dtype.itemsize]
        exponents.append((arr.view(unsigned) & mask, mask))
    if all(e.size == 0 or int(e.max()) != mask for e, mask in exponents):
        return None
    bad = np.logical_or.reduce([e == mask for e, mask in exponents])
    return int(np.flatnonzero(bad)[0])


def describe(value: object) -> str:
    """A value's dtype and shape (or its type), for an error message."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    return type(value).__name__
