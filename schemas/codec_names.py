"""Codec names and how one codec's rows sit in a delta blob, as fixed by the format.

The layouts live in schemas/ (not with the codec arithmetic in publisher/codecs/) because a
reader of a blob must know how many bytes each row takes before it trusts anything else in the
blob, and schemas/ imports nothing of the publisher. `publisher.codecs.CODECS` pairs each layout
with its arithmetic (encode, decode, error bound) and refuses to import unless the two tables
name the same codecs; docs/FORMAT.md section 4.1 describes each one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

#: how a blob's scale_bias section stores each row's scale and bias (docs/FORMAT.md section 4).
ScaleBiasEncoding = Literal["float16", "float32"]
SCALE_BIAS_ENCODINGS: Final[tuple[ScaleBiasEncoding, ...]] = ("float16", "float32")
#: bytes of one stored scale (or bias), by encoding.
FIELD_BYTES: Final[Mapping[ScaleBiasEncoding, int]] = MappingProxyType({"float16": 2, "float32": 4})


@dataclass(frozen=True)
class CodecLayout:
    """A codec's sections in a delta blob: `bits` per element in `codes` (packed LSB first
    below 8), and for an affine codec (`scale_bias`) one scale and one bias per row in
    `scale_bias`. `scale_bias_encoding` is how its writer stores them: `float32` (format
    version 3) for int8, whose codes are the 8-bit kernel's, against its float32 fields; a blob
    of version 1 or 2 holds `float16` ones whatever the codec, and still reads."""

    name: str
    bits: int
    scale_bias: bool
    scale_bias_encoding: ScaleBiasEncoding = "float16"

    def row_bytes(self, dim: int) -> int:
        """Bytes one row of `dim` elements takes in the codes section."""
        return (dim * self.bits + 7) // 8

    def scale_bias_bytes(self, n_rows: int, encoding: ScaleBiasEncoding | None = None) -> int:
        """Bytes of the scale/bias section for `n_rows` rows, stored as `encoding` (default: as
        this codec's writer stores them)."""
        if not self.scale_bias:
            return 0
        return 2 * FIELD_BYTES[encoding or self.scale_bias_encoding] * n_rows

    def reads_fields(self, encoding: ScaleBiasEncoding) -> bool:
        """Whether a blob of this codec may store its scale and bias as `encoding`: fp16 always
        (versions 1 and 2 hold nothing else), fp32 where this codec's writer stores them so."""
        return encoding == "float16" or encoding == self.scale_bias_encoding


def _affine(name: str, bits: int, encoding: ScaleBiasEncoding = "float16") -> CodecLayout:
    return CodecLayout(name, bits, scale_bias=True, scale_bias_encoding=encoding)


#: every codec the format knows, by name, in the order the docs list them.
LAYOUTS: Final[Mapping[str, CodecLayout]] = MappingProxyType(
    {
        layout.name: layout
        for layout in (
            CodecLayout("fp32", 32, scale_bias=False),
            CodecLayout("fp16", 16, scale_bias=False),
            _affine("int8", 8, "float32"),
            _affine("int4", 4),
            _affine("int3", 3),
            _affine("int2", 2),
            _affine("int8-adaptive", 8),
            _affine("int4-adaptive", 4),
            _affine("int3-adaptive", 3),
            _affine("int2-adaptive", 2),
        )
    }
)

#: bits per element of every codec the format knows.
CODEC_BITS: Final[Mapping[str, int]] = MappingProxyType(
    {name: layout.bits for name, layout in LAYOUTS.items()}
)

CODECS: Final[tuple[str, ...]] = tuple(LAYOUTS)


def is_integer_codec(codec: str) -> bool:
    """True for the per-row affine codecs, which carry a scale and a bias per row."""
    layout = LAYOUTS.get(codec)
    return layout is not None and layout.scale_bias


def row_bytes(codec: str, dim: int) -> int:
    """Bytes one row of `dim` elements takes in the codes section."""
    return LAYOUTS[codec].row_bytes(dim)


def scale_bias_bytes(codec: str, n_rows: int, encoding: ScaleBiasEncoding | None = None) -> int:
    """Bytes of the scale/bias section for `n_rows` rows (a scale and a bias per row, stored as
    `encoding`; by default as the codec's writer stores them)."""
    return LAYOUTS[codec].scale_bias_bytes(n_rows, encoding)
