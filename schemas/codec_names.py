"""Codec names and the byte size of one encoded row, as fixed by the delta blob format.

The arithmetic lives in schemas/ (not in the codec implementation) because a reader of a blob
must know how many bytes each row takes before it trusts anything else in the blob.
"""

from __future__ import annotations

from typing import Final

#: bits per element of every codec the format knows.
CODEC_BITS: Final[dict[str, int]] = {
    "fp32": 32,
    "fp16": 16,
    "int8": 8,
    "int4": 4,
    "int3": 3,
    "int2": 2,
    "int8-adaptive": 8,
    "int4-adaptive": 4,
    "int3-adaptive": 3,
    "int2-adaptive": 2,
}

CODECS: Final[tuple[str, ...]] = tuple(CODEC_BITS)


def is_integer_codec(codec: str) -> bool:
    """True for the per-row affine codecs, which carry a fp16 scale and bias per row."""
    return codec.startswith("int")


def row_bytes(codec: str, dim: int) -> int:
    """Bytes one row of `dim` elements takes in the codes section."""
    bits = CODEC_BITS[codec]
    return (dim * bits + 7) // 8


def scale_bias_bytes(codec: str, n_rows: int) -> int:
    """Bytes of the scale/bias section for `n_rows` rows (fp16 scale + fp16 bias per row)."""
    return 4 * n_rows if is_integer_codec(codec) else 0
