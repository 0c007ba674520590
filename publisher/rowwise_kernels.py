"""torch's row-wise quantization kernels (FBGEMM's, shipped inside torch), as codec steps.

`torch.ops.quantized.embedding_bag_{byte,4bit,2bit}_prepack` quantize float32 rows into fused
rows and `embedding_bag_{byte,4bit,2bit}_unpack` turn fused rows back into float32::

    8 bits:     | codes: dim bytes                  | scale: fp32 | bias: fp32 |
    4, 2 bits:  | codes: ceil(dim * bits / 8) bytes | scale: fp16 | bias: fp16 |

The codes are packed LSB first (element j at bit j*bits), the layout of a delta blob's codes
section (docs/FORMAT.md section 4), so fused rows and blob sections differ only by where (and,
for 8 bits, how wide) the scale and bias sit; `fields`, `split` and `fuse` move them, with one
cache-resident copy per chunk.

The 4- and 2-bit prepack kernels quantize exactly by the uniform rule of
publisher/codecs/affine_rule.py (which adopted theirs, so that its own code, used where a kernel
is missing, writes the same bytes): bias = fp16(min), scale = fp16((max - bias) / L), 1 where that
is 0, code = clamp(rint((x - bias) * (1 / scale)), 0, L). They need dim to be a multiple of
8 / bits. The byte kernel quantizes against the float32 range: scale = (max - min) / 255, bias =
min, code = rint((x - min) * (255 / ((max - min) + 1e-8))), any dim; the int8 codec stores these
float32 fields as they are (docs/FORMAT.md section 4.1). Its vectorised arithmetic
runs in another order than that rule evaluated elementwise, so a code may differ by one at a near
tie (52 of 16.8M on `checknrun bench codec`'s rows): the codec's own code, used without the
kernel, decodes within the same bound but need not write the same bytes. No prepack kernel looks
for NaN (it is quantised to code 0; the vectorised min and max drop it), so the caller checks its
input.

The unpack kernels compute bias + code * scale in float32 with one rounding (a fused multiply-add,
which `embedding_bag_byte_rowwise_offsets`, the server's lookup, computes too), for any dim: a
fused row of dim' = 8 * code bytes / bits elements decodes the padding codes too, which are
dropped. With a fp16 scale the product is exact, so a multiplication then an addition (the codec's
own decoding) gives the same floats; with the int8 codec's fp32 one it is not, and the kernel's
single rounding is the value to give.

A kernel is used only if this torch has it and it turns the probe rows below into the expected
bytes or floats (checked once, at import); otherwise the codec's own code runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import torch

__all__ = [
    "DECODE_BITS",
    "ENCODE_BITS",
    "PROBE_FUSED",
    "PROBE_ROWS",
    "decode_fused",
    "decodes",
    "encode_fused",
    "encodes",
    "field_dtype",
    "fields",
    "fuse",
    "fused_row_bytes",
    "split",
]

_Kernel = Callable[..., torch.Tensor]

#: rows a prepack kernel must turn into exactly `PROBE_FUSED`: 0.5 steps up from -1 (codes LSB
#: first); a constant row (scale 1, codes 0; 8 bits: scale 0); a range measured from fp16(1000.3)
#: = 1000.5 (8 bits: from float32 1000.3, with no code near a tie).
PROBE_ROWS: Final = np.array(
    [
        [-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 6.5],
        [0.5] * 8,
        [1000.3, 1007.8, 1001.0, 1002.2, 1003.9, 1004.1, 1005.5, 1006.7],
    ],
    dtype=np.float32,
)
#: the fused rows of `PROBE_ROWS`, one hex string per row.
PROBE_FUSED: Final = {
    8: b"".join(
        map(
            bytes.fromhex,
            (
                "00112233445566fff1f0f03c000080bf",
                "0000000000000000000000000000003f",
                "00ff18417a81b1daf1f0f03c33137a44",
            ),
        )
    ),
    4: b"".join(map(bytes.fromhex, ("103254f6003800bc", "00000000003c0038", "f03177dac937d163"))),
    2: b"".join(map(bytes.fromhex, ("40d5004100bc", "0000003c0038", "4ce5de40d163"))),
}
#: a fused row and the float32 bytes an unpack kernel must turn it into. The 8-bit row (codes
#: 248..255, fp32 scale 0.1, bias -12.7) decodes differently with two roundings in four places:
#: the kernel must round once, as the server's lookup kernel does.
_UNPACK_PROBES: Final = {
    8: (
        bytes.fromhex("f8f9fafbfcfdfeffcdcccc3d33334bc1"),
        bytes.fromhex("9a99414134334341cdcc444167664641010048419a99494134334b41cdcc4c41"),
    ),
    4: (
        bytes.fromhex("103254f6003800bc"),
        np.array([-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 6.5], np.float32).tobytes(),
    ),
    2: (
        bytes.fromhex("40d5004100bc"),
        np.array([-1.0, -1.0, -1.0, 1.5, 1.5, 1.5, 1.5, 6.5], np.float32).tobytes(),
    ),
}
_NAMES: Final = {8: "byte", 4: "4bit", 2: "2bit"}


def _op(name: str, works: Callable[[_Kernel], bool]) -> _Kernel | None:
    """torch.ops.quantized.NAME if this torch has it and it passes `works`, else None."""
    try:
        op: _Kernel = getattr(torch.ops.quantized, name)
        return op if works(op) else None
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):  # absent or unlike
        return None


def _prepack_works(bits: int) -> Callable[[_Kernel], bool]:
    def works(op: _Kernel) -> bool:
        return bool(op(torch.from_numpy(PROBE_ROWS)).numpy().tobytes() == PROBE_FUSED[bits])

    return works


def _unpack_works(bits: int) -> Callable[[_Kernel], bool]:
    row, expected = _UNPACK_PROBES[bits]

    def works(op: _Kernel) -> bool:
        fused = torch.from_numpy(np.frombuffer(row, dtype=np.uint8).reshape(1, -1).copy())
        return bool(op(fused).numpy().tobytes() == expected)

    return works


_PREPACK: Final = {
    bits: op
    for bits, name in _NAMES.items()
    if (op := _op(f"embedding_bag_{name}_prepack", _prepack_works(bits))) is not None
}
_UNPACK: Final = {
    bits: op
    for bits, name in _NAMES.items()
    if (op := _op(f"embedding_bag_{name}_unpack", _unpack_works(bits))) is not None
}
#: bit widths whose uniform encoding runs on a torch kernel (where dim allows, see `encodes`).
ENCODE_BITS: frozenset[int] = frozenset(_PREPACK)
#: bit widths whose decoding can run on a torch kernel.
DECODE_BITS: frozenset[int] = frozenset(_UNPACK)


def encodes(bits: int, dim: int) -> bool:
    """True if `encode_fused` can quantize rows of `dim` elements to `bits` bits."""
    return bits in ENCODE_BITS and dim % (8 // bits) == 0


def decodes(bits: int) -> bool:
    """True if `decode_fused` can decode `bits`-bit fused rows."""
    return bits in DECODE_BITS


def field_dtype(bits: int) -> type[np.floating]:
    """The dtype of a `bits`-bit fused row's scale and bias: float32 for 8 bits, else float16."""
    return np.float32 if bits == 8 else np.float16


def fused_row_bytes(bits: int, dim: int) -> int:
    """Bytes of one fused row: the codes, then the scale and the bias."""
    return (dim * bits + 7) // 8 + 2 * np.dtype(field_dtype(bits)).itemsize


def encode_fused(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Fused rows (m, fused_row_bytes) of the contiguous float32 rows `x` (all finite)."""
    return _PREPACK[bits](x)


def decode_fused(fused: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 rows (m, 8 * code bytes / bits) of `fused` rows; the caller drops padding."""
    return _UNPACK[bits](fused)


def fields(fused: np.ndarray, bits: int, rb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of `bits`-bit fused rows (m, rb + fields): the codes (m, rb), the scale and the bias
    (m,) in `field_dtype(bits)`."""
    width = 2 * np.dtype(field_dtype(bits)).itemsize
    pair = fused[:, rb : rb + width].view(field_dtype(bits))
    return fused[:, :rb], pair[:, 0], pair[:, 1]


def split(
    fused: np.ndarray, bits: int, codes: np.ndarray, scale: np.ndarray, bias: np.ndarray
) -> None:
    """Copy `bits`-bit fused rows into contiguous `codes` (m, rb) and `scale`, `bias` (m,), each
    converted to its array's dtype as numpy assigns (float32 into float16 rounds to nearest)."""
    fused_codes, fused_scale, fused_bias = fields(fused, bits, codes.shape[1])
    _copy_rows(codes, fused_codes)
    scale[:] = fused_scale
    bias[:] = fused_bias


def fuse(
    fused: np.ndarray, bits: int, codes: np.ndarray, scale: np.ndarray, bias: np.ndarray
) -> None:
    """Fill `bits`-bit `fused` rows (m, fused_row_bytes) from codes (m, rb) and `scale`, `bias`
    (m,): their values, widened to the fused rows' fields where narrower (fp16 into fp32 is
    exact)."""
    rb = codes.shape[1]
    _copy_rows(fused[:, :rb], codes)
    _, fused_scale, fused_bias = fields(fused, bits, rb)
    if fused_scale.dtype == scale.dtype == bias.dtype == np.float16:  # move the bits
        fused_scale.view(np.uint16)[:] = scale.view(np.uint16)
        fused_bias.view(np.uint16)[:] = bias.view(np.uint16)
    else:
        fused_scale[:] = scale
        fused_bias[:] = bias


def _copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for (m, rb) byte arrays whose rows are contiguous but may be strided: as one
    rb-byte record per row, which numpy moves whole (measured 1.5x a byte-wise copy)."""
    record = np.dtype((np.void, src.shape[1]))
    dst.view(record)[:, 0] = src.view(record)[:, 0]
