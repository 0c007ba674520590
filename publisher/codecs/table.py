"""Every codec, by name: the one table the rest of the project asks.

Adding a codec touches this table (one entry: its layout in `schemas.codec_names.LAYOUTS`, which
the blob reader needs without the publisher, and its arithmetic), its test
(tests/unit/publisher/test_codec_table.py walks the table: no new test code for a codec of an
existing kind) and its section of docs/FORMAT.md (4.1). Nothing else branches on codec names:
modules ask a codec for its `bits`, `affine`, `lossless` or `row_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from publisher.codecs.affine import AffineCodec
from publisher.codecs.base import Codec
from publisher.codecs.errors import UnknownCodecError
from publisher.codecs.floats import Float16Codec, Float32Codec
from publisher.codecs.range_search import RangeSearch
from schemas.codec_names import LAYOUTS

_ADAPTIVE: Final = RangeSearch()

#: every codec, in the order schemas.codec_names.CODECS lists them.
CODECS: Final[Mapping[str, Codec]] = MappingProxyType(
    {
        codec.name: codec
        for codec in (
            Float32Codec(LAYOUTS["fp32"]),
            Float16Codec(LAYOUTS["fp16"]),
            AffineCodec(LAYOUTS["int8"]),
            AffineCodec(LAYOUTS["int4"]),
            AffineCodec(LAYOUTS["int3"]),
            AffineCodec(LAYOUTS["int2"]),
            AffineCodec(LAYOUTS["int8-adaptive"], search=_ADAPTIVE),
            AffineCodec(LAYOUTS["int4-adaptive"], search=_ADAPTIVE),
            AffineCodec(LAYOUTS["int3-adaptive"], search=_ADAPTIVE),
            AffineCodec(LAYOUTS["int2-adaptive"], search=_ADAPTIVE),
        )
    }
)

if tuple(CODECS) != tuple(LAYOUTS):  # a layout without arithmetic, or the reverse
    raise ImportError(
        f"publisher.codecs.CODECS {tuple(CODECS)} and schemas.codec_names.LAYOUTS "
        f"{tuple(LAYOUTS)} must name the same codecs in the same order"
    )


def codec_of(name: str) -> Codec:
    """The codec called `name`, or UnknownCodecError."""
    codec = CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise UnknownCodecError(f"unknown codec {name!r}; expected one of {', '.join(CODECS)}")
    return codec


def uniform_codec(bits: int) -> AffineCodec:
    """The uniform affine codec of `bits` bits: it decodes any affine rows of that width (the
    adaptive codecs differ only in how they encode)."""
    for codec in CODECS.values():
        if isinstance(codec, AffineCodec) and codec.search is None and codec.bits == bits:
            return codec
    raise UnknownCodecError(f"no uniform affine codec has {bits} bits")
