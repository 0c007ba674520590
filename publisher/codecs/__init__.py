"""Row codecs: float32 embedding rows to the `codes` / `scale_bias` sections of a delta blob.

A codec is one object (`Codec`, publisher/codecs/base.py): its name and wire layout, how it
encodes and decodes, and the error bound it is tested to. `CODECS` (publisher/codecs/table.py)
holds them all; everything else asks it (`codec_of(name).bits`, `.affine`, `.lossless`,
`.row_bytes(dim)`) instead of branching on names. The byte layout is fixed by docs/FORMAT.md
section 4 and `schemas.codec_names`; the rules, per row x[0..dim) (all rows of a call share one
codec), are in the modules of each kind:

- ``fp32``, ``fp16``: publisher/codecs/floats.py.
- ``intB`` (B in 8, 4, 3, 2), uniform asymmetric per row: publisher/codecs/affine.py, with the
  arithmetic of FBGEMM's row-wise kernels (publisher/codecs/affine_rule.py).
- ``intB-adaptive``: the same layout and decoder, with the range searched as in Guan et al.
  2019 (publisher/codecs/range_search.py).

Codes narrower than a byte are packed LSB first (publisher/codecs/packing.py). Work runs on row
chunks that stay in cache, with torch kernels (torch.from_numpy shares memory); the API takes
and returns numpy arrays. No Python loop runs over rows or elements: the loops are over chunks,
over the positions inside one packing group (at most 8) and over search steps.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

if sys.byteorder != "little":  # codes are host memory viewed as little-endian wire bytes
    raise ImportError("publisher.codecs needs a little-endian host")

from publisher.codecs.affine import FP16_FIELDS_SAFE, KERNEL_CHUNK_ELEMENTS, AffineCodec
from publisher.codecs.base import CHUNK_ELEMENTS, Codec, QuantizedRows
from publisher.codecs.errors import (
    CodecError,
    NonFiniteRowsError,
    OutOfRangeRowsError,
    UnknownCodecError,
)
from publisher.codecs.floats import Float16Codec, Float32Codec
from publisher.codecs.packing import pack_codes, unpack_codes
from publisher.codecs.range_search import (
    ADAPTIVE_CHUNK_ELEMENTS,
    ADAPTIVE_NUM_BINS,
    ADAPTIVE_STEPS,
    RangeSearch,
)
from publisher.codecs.table import CODECS, codec_of, uniform_codec

__all__ = [
    "ADAPTIVE_CHUNK_ELEMENTS",
    "ADAPTIVE_NUM_BINS",
    "ADAPTIVE_STEPS",
    "CHUNK_ELEMENTS",
    "CODECS",
    "FP16_FIELDS_SAFE",
    "KERNEL_CHUNK_ELEMENTS",
    "AffineCodec",
    "Codec",
    "CodecError",
    "Float16Codec",
    "Float32Codec",
    "NonFiniteRowsError",
    "OutOfRangeRowsError",
    "QuantizedRows",
    "RangeSearch",
    "UnknownCodecError",
    "codec_of",
    "decode_rows",
    "encode_rows",
    "max_abs_error_bound",
    "pack_codes",
    "uniform_codec",
    "unpack_codes",
]


def encode_rows(
    codec: str,
    rows: np.ndarray | torch.Tensor,
    *,
    chunk_rows: int | None = None,
    checked_finite: bool = False,
    max_abs: float | None = None,
) -> QuantizedRows:
    """Encode float32 `rows` (n, dim) with the codec called `codec` (`Codec.encode` says how);
    UnknownCodecError for a name `CODECS` does not hold."""
    return codec_of(codec).encode(
        rows, chunk_rows=chunk_rows, checked_finite=checked_finite, max_abs=max_abs
    )


def decode_rows(q: QuantizedRows, out: np.ndarray | None = None) -> np.ndarray:
    """Float32 rows (n, dim) that `q` encodes, written into `out` if given (and returned)."""
    return codec_of(q.codec).decode(q, out)


def max_abs_error_bound(q: QuantizedRows) -> np.ndarray:
    """Per row, a bound on |x - decode(encode(x))| for every element (float64, shape (n,)):
    `Codec.error_bound` of `q`'s codec."""
    return codec_of(q.codec).error_bound(q)
