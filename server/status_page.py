"""`GET /status`: the release gate's story for a person, as one self-contained HTML page.

What this server serves (its track, version, freshness), where HEAD and RELEASED are, and the
newest versions: each one's status (released, held, rolled back, pending) and why, and its
quality on the events after it next to the released version's, with their intervals. The
quality trend is drawn as an inline SVG (no script, no stylesheet or font fetched: the page
works on a fleet's private network and in a headless browser alike). Every string that came
from the store is escaped.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from publisher.release.status import HistoryRow, ReleaseHistory

#: status -> (colour, the legend's words).
STATUS_STYLE = {
    "released": ("#1a7f37", "released (now)"),
    "superseded": ("#4c9a5f", "released, then superseded"),
    "rolled_back": ("#cf222e", "rolled back"),
    "held": ("#bc4c00", "held"),
    "passed": ("#8250df", "passed, not moved to"),
    "pending": ("#6e7781", "pending (its window is open)"),
    "unreadable": ("#cf222e", "unreadable evaluation"),
    "-": ("#6e7781", "no gate"),
}
WIDTH, HEIGHT, PAD = 960, 300, 48


def render(history: ReleaseHistory, server: dict[str, Any]) -> str:
    """The page: `history` (publisher.release.status.release_history) and this server's
    `server` facts (track, version, staleness_s, age_s)."""
    e = html.escape
    served = server.get("version")
    lines = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>checknrun: {e(history.model)}</title>",
        "<style>",
        "body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1f2328}",
        "h1{font-size:20px}h2{font-size:16px;margin-top:28px}",
        "table{border-collapse:collapse;width:100%}",
        "td,th{border-bottom:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}",
        "th{background:#f6f8fa}.num{text-align:right;font-variant-numeric:tabular-nums}",
        ".status{font-weight:600}.why{color:#57606a;max-width:520px}",
        ".facts span{margin-right:24px}",
        "</style></head><body>",
        f"<h1>checknrun model <code>{e(history.model)}</code></h1>",
        '<p class="facts" id="server">'
        f"<span>this server: track <b>{e(str(server.get('track')))}</b></span>"
        f"<span>serving <b>{_v(served)}</b></span>"
        f"<span>behind by {_seconds(server.get('staleness_s'))}</span>"
        f"<span>version age {_seconds(server.get('age_s'))}</span>"
        f"<span>HEAD <b>{_v(history.head)}</b></span>"
        f"<span>RELEASED <b>{_v(history.released)}</b></span>"
        "</p>",
    ]
    if history.released is None and not any(r.release.evaluation for r in history.rows):
        lines.append(
            "<p>This model has no release gate (train with <code>--gate</code>): the released "
            "track serves HEAD.</p>"
        )
    lines += ["<h2>Quality on the events after each version</h2>", _chart(history.rows)]
    lines += ["<h2>Versions, newest first</h2>", _table(history.rows, served)]
    lines.append(
        f"<p class='why'>Page made {datetime.now(UTC).isoformat(timespec='seconds')}; the same as "
        "JSON at <a href='/status.json'>/status.json</a>.</p></body></html>"
    )
    return "\n".join(lines)


def _v(version: object) -> str:
    return "-" if version is None else f"v{int(version)}"  # type: ignore[call-overload]


def _seconds(value: object) -> str:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return "-"
    return f"{value:.1f} s" if value < 120 else f"{value / 60:.1f} min"


def _table(rows: Sequence[HistoryRow], served: object) -> str:
    e = html.escape
    out = [
        '<table id="versions"><tr><th>version</th><th>created (UTC)</th><th>kind</th>'
        "<th>status</th><th>judged on</th><th class='num'>AUC</th>"
        "<th>vs released (95%)</th><th>why</th></tr>"
    ]
    for r in reversed(rows):
        colour, _ = STATUS_STYLE.get(r.release.status, STATUS_STYLE["-"])
        ev = r.release.evaluation
        auc = "-" if ev is None or ev.candidate.auc is None else f"{ev.candidate.auc:.4f}"
        judged = "-" if ev is None else f"{ev.window.examples:,} events"
        diff = "-"
        if ev is not None and ev.auc_diff is not None and ev.baseline is not None:
            d = ev.auc_diff
            diff = f"v{ev.baseline}: {d.estimate:+.4f} [{d.low:+.4f}, {d.high:+.4f}]"
        here = " (this server)" if r.version == served else ""
        out.append(
            f"<tr data-version='{r.version}' data-status='{e(r.release.status)}'>"
            f"<td>v{r.version}{here}</td>"
            f"<td>{e(r.created_at.astimezone(UTC).strftime('%H:%M:%S'))}</td>"
            f"<td>{e(r.kind)}</td>"
            f"<td class='status' style='color:{colour}'>{e(_status_words(r))}</td>"
            f"<td>{judged}</td><td class='num'>{auc}</td><td>{e(diff)}</td>"
            f"<td class='why'>{e(r.release.reason or '')}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def _status_words(row: HistoryRow) -> str:
    """`released by the gate`, `released by the person, superseded`, `held`..."""
    by = f" by the {row.release.by}" if row.release.by else ""
    return {
        "released": f"released{by}",
        "superseded": f"released{by}, superseded",
        "rolled_back": f"rolled back{by}",
    }.get(row.release.status, row.release.status)


def _chart(rows: Sequence[HistoryRow]) -> str:
    """An SVG: per judged version, its AUC on the events after it (a dot, coloured by its
    status, with its 95% interval) and the released version's on the same events (a grey
    tick)."""
    judged = [r for r in rows if r.release.evaluation is not None]
    values: list[float] = []
    for r in judged:
        ev = r.release.evaluation
        assert ev is not None
        for q in (ev.candidate, ev.released):
            if q is not None and q.auc is not None:
                se = q.auc_se or 0.0
                values += [q.auc - 1.96 * se, q.auc + 1.96 * se]
    if not values:
        return "<p id='chart'>No version judged yet.</p>"
    low, high = min(values), max(values)
    span = max(high - low, 1e-3)
    low, high = low - 0.05 * span, high + 0.05 * span
    first, last = judged[0].version, judged[-1].version

    def x(version: int) -> float:
        return PAD + (WIDTH - 2 * PAD) * (version - first) / max(last - first, 1)

    def y(value: float) -> float:
        return HEIGHT - PAD + (value - low) / (high - low) * (2 * PAD - HEIGHT)

    parts = [
        f"<svg id='chart' xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{HEIGHT}' "
        f"viewBox='0 0 {WIDTH} {HEIGHT}' role='img' aria-label='AUC of each version'>",
        f"<rect x='0' y='0' width='{WIDTH}' height='{HEIGHT}' fill='#ffffff'/>",
    ]
    for tick in range(5):
        value = low + (high - low) * tick / 4
        parts.append(
            f"<line x1='{PAD}' x2='{WIDTH - PAD}' y1='{y(value):.1f}' y2='{y(value):.1f}' "
            "stroke='#eaeef2'/>"
            f"<text x='{PAD - 6}' y='{y(value) + 4:.1f}' font-size='11' text-anchor='end' "
            f"fill='#57606a'>{value:.3f}</text>"
        )
    parts.append(
        f"<text x='{PAD}' y='18' font-size='12' fill='#1f2328'>AUC on the events after each "
        "version (95% interval); grey: the released version on the same events</text>"
    )
    for r in judged:
        ev = r.release.evaluation
        assert ev is not None
        colour, _ = STATUS_STYLE.get(r.release.status, STATUS_STYLE["-"])
        cx = x(r.version)
        if ev.released is not None and ev.released.auc is not None:
            parts.append(
                f"<line x1='{cx - 5:.1f}' x2='{cx + 5:.1f}' y1='{y(ev.released.auc):.1f}' "
                f"y2='{y(ev.released.auc):.1f}' stroke='#8c959f' stroke-width='2'/>"
            )
        auc = ev.candidate.auc
        if auc is None:
            continue
        se = ev.candidate.auc_se or 0.0
        parts.append(
            f"<line x1='{cx:.1f}' x2='{cx:.1f}' y1='{y(auc - 1.96 * se):.1f}' "
            f"y2='{y(auc + 1.96 * se):.1f}' stroke='{colour}' stroke-width='1.5'/>"
            f"<circle class='point' data-version='{r.version}' cx='{cx:.1f}' cy='{y(auc):.1f}' "
            f"r='4' fill='{colour}'><title>v{r.version} {html.escape(r.release.status)}: "
            f"AUC {auc:.4f}</title></circle>"
        )
        if r.version == first or r.version == last or len(judged) <= 24:
            parts.append(
                f"<text x='{cx:.1f}' y='{HEIGHT - PAD + 16}' font-size='10' text-anchor='middle' "
                f"fill='#57606a'>v{r.version}</text>"
            )
    legend_x = PAD
    for status in ("released", "superseded", "held", "rolled_back", "pending"):
        colour, words = STATUS_STYLE[status]
        parts.append(
            f"<circle cx='{legend_x}' cy='{HEIGHT - 12}' r='4' fill='{colour}'/>"
            f"<text x='{legend_x + 8}' y='{HEIGHT - 8}' font-size='11' fill='#1f2328'>"
            f"{words}</text>"
        )
        legend_x += 34 + 6 * len(words)
    parts.append("</svg>")
    return "\n".join(parts)
