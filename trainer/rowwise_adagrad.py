"""Row-wise Adagrad: one accumulator per embedding row, updated only for looked-up rows.

The DLRM papers' default optimizer for embedding tables. Per row r with gradient g_r (dim,)::

    state[r] += mean(g_r ** 2)
    w_r      -= lr * g_r / (sqrt(state[r]) + eps)

It keeps one float per row instead of one per element (Adagrad) and touches only rows with a
non-zero gradient, so rows that were not looked up stay bitwise unchanged, parameter and state:
that is what lets the dirty-row tracker trust it (`sparse_row_updates = True`) and what makes
its state fit in a checkpoint as one `aux` column per row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer


class RowWiseAdagrad(Optimizer):
    """Row-wise Adagrad for 2-D parameters with sparse (or dense) gradients.

    State per parameter: `sum`, float32 (rows,), created at construction so a checkpoint taken
    before the first step already has the optimizer columns.
    """

    #: read by publisher.write.tracker: a row with no gradient changes neither weight nor state.
    sparse_row_updates = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.05,
        eps: float = 1e-8,
        initial_accumulator_value: float = 0.0,
    ) -> None:
        if lr <= 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if eps < 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if initial_accumulator_value < 0.0:
            raise ValueError(
                f"initial_accumulator_value must be >= 0, got {initial_accumulator_value}"
            )
        defaults = {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"RowWiseAdagrad needs 2-D (rows, dim) parameters, got {tuple(p.shape)}"
                    )
                self.state[p]["sum"] = torch.full(
                    (p.shape[0],),
                    group["initial_accumulator_value"],
                    dtype=p.dtype,
                    device=p.device,
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one update to the rows that have a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, values = _rows_with_gradient(p.grad)
                if rows.numel() == 0:
                    continue
                acc: torch.Tensor = self.state[p]["sum"]
                acc.index_add_(0, rows, values.pow(2).mean(dim=1))
                # rows are unique after coalescing, so gather-update-scatter is exact.
                denom = acc.index_select(0, rows).sqrt_().add_(eps)
                p.index_add_(0, rows, values / denom.unsqueeze(1), alpha=-lr)
        return loss


def _rows_with_gradient(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique row ids and their summed gradient rows, for a sparse or dense gradient."""
    if grad.is_sparse:
        g = grad.coalesce()  # sums duplicate ids: one update per row, as in the dense case
        return g.indices()[0], g.values()
    # A dense gradient: rows whose gradient is all zero must stay bitwise unchanged.
    rows = torch.nonzero(grad.ne(0).any(dim=1)).reshape(-1)
    return rows, grad.index_select(0, rows)
