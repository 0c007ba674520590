"""B-bit codes packed into bytes, LSB first: the codes section of the affine codecs.

Element j of a row is the B-bit unsigned integer starting at bit j*B of the row's bytes, and
padding bits are 0 (docs/FORMAT.md section 4)::

    2 bits, codes c0..c3      byte 0 = c0 | c1 << 2 | c2 << 4 | c3 << 6
    4 bits, codes c0, c1      byte 0 = c0 | c1 << 4
    3 bits, codes c0..c7      bytes 0..2 = little-endian 24-bit c0 | c1 << 3 | ... | c7 << 21

Packing works on machine words instead of strided bytes, which torch does not vectorise: a
group of `group` code bytes read as one little-endian word w holds code k in byte k, and the
packed field of code k sits at bit bits*k, so shifting w right by (8 - bits)*k moves code k to
its place. For 2 and 4 bits the other codes land outside the low byte (or are shifted out); for
3 bits the packed group is 24 bits wide, so each term is masked. Unpacking runs the same shifts
to the left. The loops run over the positions inside one packing group (at most 8), never over
rows or elements.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import torch

from publisher.codecs.checks import describe, shared_tensor
from publisher.codecs.errors import CodecError

#: the bit widths codes are packed at (8: one code per byte, no packing).
PACKED_BITS: Final = (2, 3, 4, 8)

_WORD = {2: torch.int32, 4: torch.int16, 3: torch.int64}


def group_codes(bits: int) -> int:
    """Codes in one packing group: the smallest run of codes that fills whole bytes."""
    return 8 // math.gcd(8, bits)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack (n, dim) uint8 codes (each < 2**bits) into (n, ceil(dim*bits/8)) bytes, LSB first."""
    _check_bits(bits)
    if not isinstance(codes, np.ndarray) or codes.dtype != np.uint8 or codes.ndim != 2:
        raise CodecError(f"codes must be a 2-D uint8 array, got {describe(codes)}")
    if codes.size and int(codes.max()) >> bits:
        raise CodecError(f"codes must be < {1 << bits} for {bits} bits")
    n, dim = codes.shape
    packed = np.empty((n, (dim * bits + 7) // 8), dtype=np.uint8)
    if n and dim:
        group = group_codes(bits)
        padded = np.zeros((n, -(-dim // group) * group), dtype=np.uint8)
        padded[:, :dim] = codes
        pack_into(torch.from_numpy(packed), torch.from_numpy(padded), bits)
    return packed


def unpack_codes(packed: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """Inverse of `pack_codes`: (n, dim) uint8 codes from (n, ceil(dim*bits/8)) bytes."""
    _check_bits(bits)
    rb = (dim * bits + 7) // 8
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or packed.ndim != 2:
        raise CodecError(f"packed must be a 2-D uint8 array, got {describe(packed)}")
    if packed.shape[1] != rb:
        raise CodecError(f"packed must have {rb} bytes per row, got shape {packed.shape}")
    out = np.empty((packed.shape[0], dim), dtype=np.uint8)
    if out.size:
        src = shared_tensor(np.ascontiguousarray(packed))
        torch.from_numpy(out).copy_(unpack(src, bits, dim))
    return out


def _check_bits(bits: int) -> None:
    if bits not in PACKED_BITS:
        raise CodecError(f"bits must be 2, 3, 4 or 8, got {bits}")


def pack_into(packed: torch.Tensor, codes: torch.Tensor, bits: int) -> None:
    """Pack contiguous (m, w) uint8 codes into (m, rb) bytes. w is dim rounded up to a whole
    packing group and the codes past dim are 0."""
    m, rb = packed.shape
    if bits == 8:
        packed.copy_(codes)
        return
    group = group_codes(bits)
    words = codes.view(_WORD[bits])
    acc = words.clone()
    if bits == 3:
        acc.bitwise_and_(7)
        for k in range(1, group):
            acc.bitwise_or_((words >> (5 * k)).bitwise_and_(7 << (3 * k)))
        n_groups = words.shape[1]
        packed.copy_(acc.view(torch.uint8).view(m, n_groups, 8)[..., :3].reshape(m, -1)[:, :rb])
        return
    for k in range(1, group):
        acc.bitwise_or_(words >> ((8 - bits) * k))
    packed.copy_(acc.bitwise_and_(0xFF))


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """(m, dim) uint8 codes (possibly a strided view) from (m, rb) packed bytes."""
    m, rb = packed.shape
    if bits == 8:
        return packed
    group = group_codes(bits)
    mask = (1 << bits) - 1
    if bits == 3:
        n_groups = -(-dim // group)
        word = torch.zeros(m, n_groups, 8, dtype=torch.uint8)  # 3 packed bytes per int64
        padded = packed
        if n_groups * 3 != rb:
            padded = torch.zeros(m, n_groups * 3, dtype=torch.uint8)
            padded[:, :rb] = packed
        word[..., :3] = padded.view(m, n_groups, 3)
        v = word.view(torch.int64).view(m, n_groups)
        acc = v.bitwise_and(7)
        for k in range(1, group):
            acc.bitwise_or_((v << (5 * k)).bitwise_and_(mask << (8 * k)))
        return acc.view(torch.uint8).view(m, n_groups * group)[:, :dim]
    wide = packed.to(_WORD[bits])
    acc = wide.clone()
    for k in range(1, group):
        acc.bitwise_or_(wide << ((8 - bits) * k))
    lanes = sum(mask << (8 * k) for k in range(group))
    acc.bitwise_and_(lanes)
    return acc.view(torch.uint8).view(m, rb * group)[:, :dim]
