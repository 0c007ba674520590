"""torch's row-wise quantization kernels (FBGEMM's, shipped inside torch), as codec steps.

`torch.ops.quantized.embedding_bag_{4bit,2bit}_prepack` quantize float32 rows into fused rows
and `embedding_bag_{4bit,2bit}_unpack` turn fused rows back into float32::

    | codes: ceil(dim * bits / 8) bytes | scale: fp16 | bias: fp16 |

The codes are packed LSB first (element j at bit j*bits), the layout of a delta blob's codes
section (docs/FORMAT.md section 4), so fused rows and blob sections differ only by where the
scale and bias sit; `fuse` and `split` move them, with one cache-resident copy per chunk.

The prepack kernels quantize exactly by the uniform rule of publisher/codecs/affine_rule.py (which
adopted theirs, so that its own code, used where a kernel is missing, writes the same bytes): bias
= fp16(min), scale = fp16((max - bias) / L), 1 where that is 0, code = clamp(rint((x - bias) * (1 /
scale)), 0, L). They need dim to be a multiple of 8 / bits, and they do not look for NaN (it is
quantised to code 0), so the caller checks its input. The unpack kernels compute bias + code *
scale in float32, as `codecs.decode_rows` does (the product is exact), for any dim: a fused row of
dim' = 8 * code bytes / bits elements decodes the padding codes too, which are dropped.

The 8-bit kernels are not used. `embedding_bag_byte_prepack` quantises against the float32
range / 255 (plus 1e-8), so its codes do not fit the fp16 scale and bias a blob stores; and 8-bit
codes need no unpacking, so the codec's own bias + code * scale decodes at 1.2x the speed of
`embedding_bag_byte_unpack` once the fused rows (float32 scale and bias) have been assembled.

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
    "fields",
    "fuse",
    "fused_row_bytes",
    "split",
]

_Kernel = Callable[..., torch.Tensor]

#: rows a prepack kernel must turn into exactly `PROBE_FUSED`: 0.5 steps up from -1 (codes LSB
#: first); a constant row (scale 1, codes 0); a range measured from fp16(1000.3) = 1000.5.
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
    4: b"".join(map(bytes.fromhex, ("103254f6003800bc", "00000000003c0038", "f03177dac937d163"))),
    2: b"".join(map(bytes.fromhex, ("40d5004100bc", "0000003c0038", "4ce5de40d163"))),
}
#: the first probe row's fused bytes and the floats an unpack kernel must turn them into.
_UNPACK_PROBES: Final = {
    4: (bytes.fromhex("103254f6003800bc"), [-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 6.5]),
    2: (bytes.fromhex("40d5004100bc"), [-1.0, -1.0, -1.0, 1.5, 1.5, 1.5, 1.5, 6.5]),
}


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
        return bool(op(fused).numpy().tobytes() == np.array([expected], np.float32).tobytes())

    return works


_PREPACK: Final = {
    bits: op
    for bits, name in ((4, "embedding_bag_4bit_prepack"), (2, "embedding_bag_2bit_prepack"))
    if (op := _op(name, _prepack_works(bits))) is not None
}
_UNPACK: Final = {
    bits: op
    for bits, name in ((4, "embedding_bag_4bit_unpack"), (2, "embedding_bag_2bit_unpack"))
    if (op := _op(name, _unpack_works(bits))) is not None
}
#: bit widths whose uniform encoding runs on a torch kernel (where dim allows, see `encodes`).
ENCODE_BITS: frozenset[int] = frozenset(_PREPACK)
#: bit widths whose decoding runs on a torch kernel.
DECODE_BITS: frozenset[int] = frozenset(_UNPACK)


def encodes(bits: int, dim: int) -> bool:
    """True if `encode_fused` can quantize rows of `dim` elements to `bits` bits."""
    return bits in ENCODE_BITS and dim % (8 // bits) == 0


def decodes(bits: int) -> bool:
    """True if `decode_fused` can decode `bits`-bit fused rows."""
    return bits in DECODE_BITS


def fused_row_bytes(bits: int, dim: int) -> int:
    """Bytes of one fused row: the codes, then fp16 scale and bias."""
    return (dim * bits + 7) // 8 + 4


def encode_fused(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Fused rows (m, fused_row_bytes) of the contiguous float32 rows `x` (all finite)."""
    return _PREPACK[bits](x)


def decode_fused(fused: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 rows (m, 8 * code bytes / bits) of `fused` rows; the caller drops padding."""
    return _UNPACK[bits](fused)


def split(fused: torch.Tensor, codes: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> None:
    """Copy fused rows into contiguous `codes` (m, rb) and fp16 `scale`, `bias` (m,)."""
    rb = codes.shape[1]
    rows = fused.numpy()
    _copy_rows(codes, rows[:, :rb])
    fields = rows[:, rb : rb + 4].view(np.uint16)
    scale.view(np.uint16)[:] = fields[:, 0]
    bias.view(np.uint16)[:] = fields[:, 1]


def fields(fused: np.ndarray, rb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of fused rows (m, rb + 4): the codes (m, rb), fp16 scale and bias (m,)."""
    halves = fused[:, rb : rb + 4].view(np.float16)
    return fused[:, :rb], halves[:, 0], halves[:, 1]


def fuse(fused: np.ndarray, codes: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> None:
    """Fill `fused` (m, fused_row_bytes) from codes (m, rb) and fp16 `scale`, `bias` (m,)."""
    rb = codes.shape[1]
    _copy_rows(fused[:, :rb], codes)
    fields = fused[:, rb : rb + 4].view(np.uint16)
    fields[:, 0] = scale.view(np.uint16)
    fields[:, 1] = bias.view(np.uint16)


def _copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for (m, rb) byte arrays whose rows are contiguous but may be strided: as one
    rb-byte record per row, which numpy moves whole (measured 1.5x a byte-wise copy)."""
    record = np.dtype((np.void, src.shape[1]))
    dst.view(record)[:, 0] = src.view(record)[:, 0]
