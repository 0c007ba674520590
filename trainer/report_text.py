"""Lines a person reads about a version (what its codec loses as served, one process or N ranks)
and about a training run (what `checknrun train` prints at the end)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from schemas.manifest import ServedLoss
from trainer.options import human_bytes


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


def summary_lines(doc: Mapping[str, Any]) -> list[str]:
    """What `checknrun train` prints at the end, from its `--json` document: what was trained,
    the progressive metrics, the versions published. A run that trained or published nothing
    (a resumed live trainer that saw no event) says so rather than print its empty figures.

    The progressive metrics are this process's: a resumed run counts them again from its start
    (the manifest keeps each version's AUC, not the score histograms an AUC over the whole
    history would need), and the line says so."""
    s, m = doc["summary"], doc["metrics"]
    if doc["samples"]:
        lines = [
            f"trained {doc['samples']:,} samples ({doc['start_offset']:,} -> "
            f"{doc['end_offset']:,}) in {doc['seconds']:.1f} s "
            f"({doc['samples_per_s']:,.0f} samples/s)"
        ]
    else:
        lines = [f"trained no samples in {doc['seconds']:.1f} s"]
    if "auc_cumulative" in m:
        lines.append(
            f"progressive AUC {m['auc_cumulative']:.4f}, log loss {m['logloss_cumulative']:.4f} "
            f"over the {doc['samples']:,} samples of this process (since it started)"
        )
    if s["versions"]:
        text = (
            f"{s['versions']} version(s) published (last v{s['last_version']}), "
            f"{s['merged']} merged"
        )
    else:
        text = "no version published" + (f", {s['merged']} merged" if s["merged"] else "")
    if s["stall_ms_median"] is not None:
        text += f"; stall median {s['stall_ms_median']} ms, max {s['stall_ms_max']} ms"
    if s["ratio"] is not None:
        text += f"; {human_bytes(s['bytes_written'])} written, {s['ratio']}x smaller than full fp32"
    lines.append(text)
    if s.get("non_finite_skipped"):
        lines.append(f"{s['non_finite_skipped']} checkpoint(s) not published: they held NaN or inf")
    return lines
