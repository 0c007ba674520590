"""The range search of the ``intB-adaptive`` codecs: Guan et al. 2019 (arXiv 1911.02079), as in
Check-N-Run.

Same layout and decoder as the uniform codecs; only the range [lo, hi] that yields bias and
scale differs (publisher/codecs/affine_rule.py). Greedy: step = (max - min) / num_bins; for
`steps` rounds, try [lo + step, hi] and [lo, hi - step], move to the one with the lower L2 error
and remember the best range seen (the full range included), so at most steps / num_bins of the
range is cut. Losses use the fp16-rounded candidate scale and bias. A final exact comparison
(float64 sums of the real decoded errors) against the uniform encoding keeps the uniform one
unless the searched range is strictly better, so an adaptive row is never worse than its uniform
encoding. The loop runs over search steps only, vectorised over the rows of a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from publisher.codecs.affine_rule import affine_params, exact_sq_error, quantize_into

#: the adaptive search moves an end of the range by (max - min) / ADAPTIVE_NUM_BINS per step...
ADAPTIVE_NUM_BINS: Final = 100
#: ...for this many steps, so it cuts at most 16% of the range, as Guan et al.'s defaults
#: (200 bins, 32 steps) do; half as many, twice as large steps give the same error on
#: embedding-like rows (tests/unit/publisher/test_codecs.py checks it) at twice the speed.
ADAPTIVE_STEPS: Final = 16
#: float32 elements per chunk for the adaptive search (its buffers are 4x the chunk; larger
#: chunks spend less on per-step bookkeeping than they lose to L2 misses).
ADAPTIVE_CHUNK_ELEMENTS: Final = 1 << 18


@dataclass(frozen=True)
class RangeSearch:
    """The search's parameters: each end moves by (max - min) / `num_bins` per step, for
    `steps` steps."""

    num_bins: int = ADAPTIVE_NUM_BINS
    steps: int = ADAPTIVE_STEPS

    def __post_init__(self) -> None:
        if not 1 <= self.steps < self.num_bins:
            raise ValueError(f"need 1 <= steps < num_bins, got {self.steps}, {self.num_bins}")

    @property
    def clip_ratio(self) -> float:
        """The most an end can move over the range kept, both in steps: the bound of what an
        element clipped by the shrunk range loses, in units of the kept range (L * scale)."""
        return self.steps / (self.num_bins - self.steps)

    def searcher(self, max_rows: int, dim: int, levels: int) -> RangeSearcher:
        """Buffers to search chunks of up to `max_rows` rows of `dim`, for L = `levels`."""
        return RangeSearcher(self, max_rows, dim, levels)


class RangeSearcher:
    """Guan et al.'s greedy range search, vectorised over the rows of a chunk.

    Both candidates of a step are evaluated together in (2, m, dim) buffers; the loss of a
    candidate is ||clamp(round(t), 0, L) - t|| * scale with t = (x - bias) / scale, i.e. the L2
    norm of the decoded error computed with the candidate's fp16 scale and bias.
    """

    def __init__(self, search: RangeSearch, max_rows: int, dim: int, levels: int) -> None:
        self.search = search
        self.levels = levels
        self.t = torch.empty(2, max_rows, dim)
        self.q = torch.empty(2, max_rows, dim)
        # [lo of both candidates, (hi - lo) / L of both candidates]; hi of both candidates.
        self.par = torch.empty(2, 2, max_rows)
        self.hi = torch.empty(2, max_rows)
        # candidate 0 moves lo up by a step, candidate 1 moves hi down by a step.
        self.lo_move = torch.tensor([[1.0], [0.0]])
        self.hi_move = torch.tensor([[0.0], [-1.0]])

    def _losses(self, x: torch.Tensor, par: torch.Tensor) -> torch.Tensor:
        """Losses (k, m) of the k candidates whose fp32 [lo, (hi - lo) / L] are in `par`."""
        _, k, m = par.shape
        p16 = par.half().float()
        bias, scale = p16[0], p16[1]
        # scale 0 gives inv = inf and a NaN loss, which no comparison ever picks.
        inv = torch.reciprocal(scale)
        t = self.t[:k, :m]
        q = self.q[:k, :m]
        torch.sub(x, bias.unsqueeze(-1), out=t)
        t.mul_(inv.unsqueeze(-1))
        torch.clamp(t, 0, self.levels, out=q)
        q.round_()
        q.sub_(t)
        loss: torch.Tensor = torch.linalg.vector_norm(q, dim=-1)
        return loss.mul_(scale)

    def best_params(
        self,
        x: torch.Tensor,
        mn: torch.Tensor,
        mx: torch.Tensor,
        bias_u: torch.Tensor,
        scale_u: torch.Tensor,
        t: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp16 (bias, scale) per row; leaves the codes (as float) of that choice in `t`."""
        m = x.shape[0]
        levels = self.levels
        step = (mx - mn) / self.search.num_bins
        par = self.par[:, :, :m]
        lo, rng, hi = par[0], par[1], self.hi[:, :m]
        lo[0].copy_(mn)
        torch.sub(mx, mn, out=rng[0]).div_(levels)
        best_loss = self._losses(x, par[:, :1])[0].clone()
        best_lo, best_hi = mn.clone(), mx.clone()
        cur_lo, cur_hi = mn.clone(), mx.clone()
        for _ in range(self.search.steps):
            torch.addcmul(cur_lo, self.lo_move, step, out=lo)
            torch.addcmul(cur_hi, self.hi_move, step, out=hi)
            torch.sub(hi, lo, out=rng).div_(levels)
            loss_lo, loss_hi = self._losses(x, par)
            left = loss_lo < loss_hi
            torch.where(left, lo[0], cur_lo, out=cur_lo)
            torch.where(left, cur_hi, hi[1], out=cur_hi)
            cur_loss = torch.where(left, loss_lo, loss_hi)
            better = cur_loss < best_loss
            torch.where(better, cur_loss, best_loss, out=best_loss)
            torch.where(better, cur_lo, best_lo, out=best_lo)
            torch.where(better, cur_hi, best_hi, out=best_hi)
        bias_a, scale_a = affine_params(best_lo, best_hi, levels)
        # Exact final check: the real decoded error of both encodings, summed in float64.
        q_u = self.q[0, :m]
        quantize_into(q_u, x, bias_u.float(), scale_u.float(), levels)
        loss_u = exact_sq_error(q_u, x, bias_u, scale_u, self.t[0, :m])
        quantize_into(t, x, bias_a.float(), scale_a.float(), levels)
        loss_a = exact_sq_error(t, x, bias_a, scale_a, self.t[1, :m])
        use_a = loss_a < loss_u
        torch.where(use_a.unsqueeze(1), t, q_u, out=t)
        return torch.where(use_a, bias_a, bias_u), torch.where(use_a, scale_a, scale_u)
