"""The per-row affine rule of the ``intB`` codecs (L = 2**B - 1), in float32::

    bias  = fp16(lo)                      # round to nearest fp16
    scale = fp16((hi - bias) / L)         # round to nearest fp16; 1 where that gives 0
    code  = clamp(rint((x - bias) * (1 / scale)), 0, L)
    x'    = bias + code * scale           # what the decoder returns (float32)

with [lo, hi] = [min x, max x] for the uniform codecs and a searched sub-range for the adaptive
ones (publisher/codecs/range_search.py). This is the rule of FBGEMM's row-wise kernels that
torch ships, so that the codecs' own code and those kernels (publisher/rowwise_kernels.py) write
the same bytes. Rounding is to nearest, ties to even.
"""

from __future__ import annotations

import torch


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


def dequantize_into(
    out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
) -> None:
    """out = bias + codes * scale in float32 (the product is exact: <= 8 x 11 mantissa bits)."""
    out.copy_(codes)
    out.mul_(scale.unsqueeze(1))
    out.add_(bias.unsqueeze(1))


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
