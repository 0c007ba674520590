"""Lines a person reads about a version: what its codec loses as served (one process or N ranks)."""

from __future__ import annotations

from collections.abc import Sequence

from schemas.manifest import ServedLoss


def served_text(
    codec: str | None, loss: ServedLoss | None, reencoded: Sequence[tuple[str, float]] = ()
) -> str:
    """The version's codec and what it loses as served (docs/FORMAT.md 3.2), when measured:
    `  int4 served AUC -0.0012% vs fp32`, `(noise)` after it when the loss's 95% interval
    holds 0, each codec refused first after it."""
    if loss is None:
        return f"  {codec}" if codec else ""
    text = f"  {codec} served AUC {-100 * loss.auc_rel_loss:+.4f}% vs fp32"
    if loss.auc_loss_low is not None and loss.auc_loss_low <= 0:
        text += " (noise)"  # the 95% interval of the loss holds 0 (docs/SERVED_LOSS.md)
    for tried, first in reencoded:
        text += f" ({tried} {-100 * first:+.4f}%: encoded again)"
    return text
