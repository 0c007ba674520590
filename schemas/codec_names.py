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
from typing import Final


@dataclass(frozen=True)
class CodecLayout:
    """A codec's sections in a delta blob: `bits` per element in `codes` (packed LSB first
    below 8), and for an affine codec (`scale_bias`) one fp16 scale and one fp16 bias per row
    in `scale_bias`."""

    name: str
    bits: int
    scale_bias: bool

    def row_bytes(self, dim: int) -> int:
        """Bytes one row of `dim` elements takes in the codes section."""
        return (dim * self.bits + 7) // 8

    def scale_bias_bytes(self, n_rows: int) -> int:
        """Bytes of the scale/bias section for `n_rows` rows."""
        return 4 * n_rows if self.scale_bias else 0


def _affine(name: str, bits: int) -> CodecLayout:
    return CodecLayout(name, bits, scale_bias=True)


#: every codec the format knows, by name, in the order the docs list them.
LAYOUTS: Final[Mapping[str, CodecLayout]] = MappingProxyType(
    {
        layout.name: layout
        for layout in (
            CodecLayout("fp32", 32, scale_bias=False),
            CodecLayout("fp16", 16, scale_bias=False),
            _affine("int8", 8),
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
    """True for the per-row affine codecs, which carry a fp16 scale and bias per row."""
    layout = LAYOUTS.get(codec)
    return layout is not None and layout.scale_bias


def row_bytes(codec: str, dim: int) -> int:
    """Bytes one row of `dim` elements takes in the codes section."""
    return LAYOUTS[codec].row_bytes(dim)


def scale_bias_bytes(codec: str, n_rows: int) -> int:
    """Bytes of the scale/bias section for `n_rows` rows (fp16 scale + fp16 bias per row)."""
    return LAYOUTS[codec].scale_bias_bytes(n_rows)
