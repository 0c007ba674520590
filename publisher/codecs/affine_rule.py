"""The per-row affine rules of the ``intB`` codecs (L = 2**B - 1), in float32.

Codecs with fp16 fields (every one but ``int8``)::

    bias  = fp16(lo)                      # round to nearest fp16
    scale = fp16((hi - bias) / L)         # round to nearest fp16; 1 where that gives 0
    code  = clamp(rint((x - bias) * (1 / scale)), 0, L)
    x'    = bias + code * scale           # what the decoder returns (float32; the product is exact)

with [lo, hi] = [min x, max x] for the uniform codecs and a searched sub-range for the adaptive
ones (publisher/codecs/range_search.py). This is the rule of FBGEMM's 4- and 2-bit row-wise
kernels that torch ships, so that the codecs' own code and those kernels
(publisher/rowwise_kernels.py) write the same bytes.

``int8``, whose scale and bias are float32 (format version 3), follows FBGEMM's byte kernel::

    bias  = lo                            # float32
    scale = (hi - lo) / L                 # float32; 0 for a constant row, which decodes to lo
    code  = clamp(rint((x - lo) * (L / ((hi - lo) + 1e-8))), 0, L)
    x'    = bias + code * scale           # float32, rounded once (a fused multiply-add)

Rounding is to nearest, ties to even.
"""

from __future__ import annotations

from typing import Final

import torch

#: the byte kernel's epsilon: the range it divides L by is (hi - lo) + this.
BYTE_KERNEL_EPSILON: Final = 1e-8


def affine_params(
    lo: torch.Tensor, hi: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (bias, scale) of the range [lo, hi]: bias = fp16(lo), scale = fp16((hi - bias) / L),
    1 where that is 0 (the rule of torch's prepack kernels, whose bytes these must equal)."""
    bias = lo.half()
    scale = ((hi - bias.float()) / levels).half()
    return bias, scale.masked_fill_(scale == 0, 1.0)


def quantize_into(
    t: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor, levels: int
) -> None:
    """t = clamp(rint((x - bias) * (1 / scale)), 0, L) as float32 (scale is never 0).

    As in the kernels: a float32 multiplication by 1/scale, which can differ from a division
    only at a near-tie (both codes are then within half a step plus float32 rounding).
    """
    inv = torch.reciprocal(scale)
    torch.sub(x, bias.unsqueeze(1), out=t)
    t.mul_(inv.unsqueeze(1))
    t.clamp_(0, levels)
    t.round_()


def fp32_params(
    lo: torch.Tensor, hi: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 scale, float32 inverse step) of the range [lo, hi] by the byte kernel's rule:
    scale = (hi - lo) / L, inverse = L / ((hi - lo) + 1e-8); the bias is lo itself."""
    span = hi - lo
    return span / levels, levels / (span + BYTE_KERNEL_EPSILON)


def quantize_from_lo_into(
    t: torch.Tensor, x: torch.Tensor, lo: torch.Tensor, inverse: torch.Tensor, levels: int
) -> None:
    """t = clamp(rint((x - lo) * inverse), 0, L) as float32: the byte kernel's codes, up to the
    order of its float32 operations (a code may differ by one at a near tie)."""
    torch.sub(x, lo.unsqueeze(1), out=t)
    t.mul_(inverse.unsqueeze(1))
    t.clamp_(0, levels)
    t.round_()


def dequantize_into(
    out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
) -> None:
    """out = bias + codes * scale in float32 for fp16 fields (the product is exact: <= 8 x 11
    mantissa bits, so this equals the kernels' single rounding)."""
    out.copy_(codes)
    out.mul_(scale.unsqueeze(1))
    out.add_(bias.unsqueeze(1))


def dequantize_fp32_into(
    out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
) -> None:
    """out = bias + codes * scale for float32 fields, in float64 (the product is exact there)
    rounded to float32: the unpack kernel's single rounding, except where the float64 sum's own
    rounding lands on a float32 tie (within the codec's bound either way)."""
    wide = codes.double()
    wide.mul_(scale.double().unsqueeze(1))
    wide.add_(bias.double().unsqueeze(1))
    out.copy_(wide)


def exact_sq_error(
    codes: torch.Tensor,
    x: torch.Tensor,
    bias16: torch.Tensor,
    scale16: torch.Tensor,
    work: torch.Tensor,
) -> torch.Tensor:
    """Per row, the L2 norm of decoded - x in float64, decoding exactly as the codecs do."""
    dequantize_into(work, codes, scale16.float(), bias16.float())
    err = work.double().sub_(x)
    norm: torch.Tensor = torch.linalg.vector_norm(err, dim=1)
    return norm
