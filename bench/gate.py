"""Part `gate`: the release gate on clean and poisoned streams, and what it costs.

    checknrun bench gate [--quick] [--json OUT] [--screenshot PNG]

- clean: whole streams trained with `--gate` (`checknrun train`, the file trainer): MovieLens-1M
  and the synthetic stream as a click log (`--label-bias -9`: 0.6% positives), 1M samples
  each, 20,000 samples a version, the default window (16,384):
  the share of versions held or rolled back (false holds: nothing is wrong with these streams),
  and the widths of the intervals at that window (the gate's paired AUC difference, the
  served-loss interval of each manifest).
- cost: MovieLens trained with and without `--gate` (both measuring the served loss on the same
  window, so the gate's scoring is the only difference), alternating, 2 rounds: samples/s and
  the evaluation's seconds and CPU per version.
- poisons (needs Kafka): MovieLens' first 400,000 ratings replayed through the real broker with
  a stretch broken by `checknrun replay --poison` (labels flipped; item ids scrambled; a derived
  numeric input sent in each event, the item's like rate, sent in percent), trained live with
  `--gate`:
  the versions and events from the first poisoned event to the first hold (and the seconds that
  is at the live demo's 2,000 events/s), versions trained and judged on the poison that were
  released (must be 0), the first version released after it heals, and holds outside it.
- a screenshot of `GET /status` on the flipped-labels store, in headless Chromium.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pyarrow import csv

from bench.live import checknrun_json, delete_topic, kafka_bootstrap
from bench.machine import describe_machine, log
from publisher.read.catalog import Catalog
from publisher.release import ReleaseLog
from publisher.store import FileStore

INTERVAL = 20_000
POISON_EVENTS = 400_000
POISON_START, POISON_STOP = 200_000, 260_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--screenshot",
        type=Path,
        default=None,
        help="write the status page of the flipped-labels run here (PNG; needs Chromium)",
    )


def run(quick: bool, *, screenshot: Path | None = None) -> dict[str, Any]:
    """Measure (see the module docstring); progress to stderr, the table to stdout."""
    with tempfile.TemporaryDirectory(prefix="bench-gate-") as tmp:
        root = Path(tmp)
        doc: dict[str, Any] = {"part": "gate", "machine": describe_machine(), "quick": quick}
        doc["clean"] = {
            data: _clean(root, data, 200_000 if quick else None)
            for data in ("movielens", "synthetic")
        }
        doc["cost"] = _cost(root, 100_000 if quick else 1_000_209, 1 if quick else 2)
        doc["poisons"] = _poisons(root, quick, screenshot)
    _print(doc)
    return doc


# --- clean streams -------------------------------------------------------------------------


def _train(store: Path, data: list[str], *extra: str) -> dict[str, Any]:
    return checknrun_json(
        "trainer.cli",
        [
            "train",
            *data,
            *("--store", f"file://{store}", "--model", "m", "--codec", "int4"),
            *("--json", "--no-progress", *extra),
        ],
    )


def _clean(root: Path, data: str, samples: int | None) -> dict[str, Any]:
    log(f"gate: clean {data}")
    store = root / f"clean-{data}"
    limit = ["--max-samples", str(samples or 1_000_000)]
    # The synthetic stream as a click log: 0.6% positives, tables the publisher keeps up with.
    click = ["--label-bias", "-9", "--table-cap", "100000"] if data == "synthetic" else []
    report = _train(
        store, ["--data", data, *limit, *click], "--interval-samples", str(INTERVAL), "--gate"
    )
    fs = FileStore(store)
    log_ = ReleaseLog(fs, "m")
    evaluations = [e for v in log_.evaluated_versions() if (e := log_.evaluation(v)) is not None]
    held = [e.version for e in evaluations if e.decision == "hold"]
    rollbacks = [r.previous_version for r in log_.records() if r.action == "rollback"]
    widths = [e.auc_diff.high - e.auc_diff.low for e in evaluations if e.auc_diff is not None]
    served = [
        ref.manifest.served_loss
        for ref in Catalog(fs, "m").versions()
        if ref.manifest.served_loss is not None
    ]
    served_widths = [
        (s.auc_loss_high - s.auc_loss_low) / s.auc_fp32
        for s in served
        if s.auc_loss_high is not None and s.auc_loss_low is not None
    ]
    positives = [e.window.positives / e.window.examples for e in evaluations]
    return {
        "samples": report["samples"],
        "versions_judged": len(evaluations),
        "held": held,
        "rolled_back": rollbacks,
        "false_hold_share": round((len(held) + len(rollbacks)) / max(len(evaluations), 1), 4),
        "reasons": {e.version: e.reason for e in evaluations if e.decision == "hold"},
        "positive_rate": round(statistics.median(positives), 4) if positives else None,
        "gate_auc_diff_width_median": _median(widths),
        "served_loss_rel_width_median": _median(served_widths),
    }


def _median(values: list[float]) -> float | None:
    return None if not values else round(statistics.median(values), 6)


# --- cost ----------------------------------------------------------------------------------


def _cost(root: Path, samples: int, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(rounds):
        for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
            log(f"gate: cost round {r + 1}/{rounds}, gate {arm}")
            report = _train(
                root / f"cost-{arm}-{r}",
                ["--data", "movielens", "--max-samples", str(samples)],
                "--interval-samples",
                str(INTERVAL),
                *(["--gate"] if arm == "on" else []),
            )
            words = [c["gate"] for c in report["checkpoints"] if c.get("gate")]
            runs[arm].append(
                {
                    "samples_per_s": report["samples_per_s"],
                    "gate_seconds": [w["seconds"] for w in words],
                    "gate_cpu_s": [w["cpu_s"] for w in words],
                }
            )
    off = statistics.median(r["samples_per_s"] for r in runs["off"])
    on = statistics.median(r["samples_per_s"] for r in runs["on"])
    seconds = [s for r in runs["on"] for s in r["gate_seconds"]]
    cpu = [s for r in runs["on"] for s in r["gate_cpu_s"]]
    return {
        "samples": samples,
        "rounds": rounds,
        "samples_per_s_off": round(off),
        "samples_per_s_on": round(on),
        "throughput_ratio": round(on / off, 3),
        "gate_seconds_median": _median(seconds),
        "gate_cpu_s_median": _median(cpu),
        "runs": runs,
    }


# --- poisons -------------------------------------------------------------------------------


def movielens_with_rate(path: Path, events: int) -> None:
    """MovieLens-1M's first `events` ratings as a data file with a numeric column:
    `item_like_rate`, the share of the item's earlier ratings that were likes (smoothed: (likes
    + 1) / (ratings + 2)), a derived input of the kind a feature pipeline computes, which replay
    sends as each event's dense field (`--dense-cols item_like_rate`). Poisoned as `*100`, it is
    the rate sent in percent."""
    from trainer.streams.movielens import load_movielens

    stream = load_movielens()
    n = min(events, stream.num_samples)
    assert stream.timestamps is not None
    items = stream.column("item").values[:n]
    labels = stream.labels[:n].astype(np.float64)
    # per item, in stream order: ratings and likes before each event
    order = np.argsort(items, kind="stable")
    sorted_items = items[order]
    first = np.r_[True, sorted_items[1:] != sorted_items[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    likes = np.cumsum(labels[order])
    likes_before = likes - labels[order] - np.where(group_start > 0, likes[group_start - 1], 0.0)
    count_before = np.arange(n) - group_start
    rate = np.empty(n)
    rate[order] = (likes_before + 1.0) / (count_before + 2.0)
    table = pa.table(
        {
            "user": stream.column("user").raw(0, n),
            "item": stream.column("item").raw(0, n),
            "timestamp": stream.timestamps[:n],
            "label": stream.labels[:n].astype(np.int64),
            "item_like_rate": np.round(rate, 4),
        }
    )
    csv.write_csv(table, path)


def _poisons(root: Path, quick: bool, screenshot: Path | None) -> dict[str, Any]:
    bootstrap = kafka_bootstrap("gate")
    scale = 4 if quick else 1
    events, start, stop = POISON_EVENTS // scale, POISON_START // scale, POISON_STOP // scale
    rated = root / "movielens-rate.csv"
    movielens_with_rate(rated, events)
    cases = {
        "labels flipped": (["--data", "movielens"], f"labels:{start}:{stop}", []),
        "item ids scrambled": (["--data", "movielens"], f"ids:item:{start}:{stop}", []),
        "like rate in percent": (
            ["--data", str(rated), "--dense-cols", "item_like_rate"],
            f"dense:item_like_rate*100:{start}:{stop}",
            ["--features", "user,item", "--dense-features", "item_like_rate:raw"],
        ),
    }
    out: dict[str, Any] = {}
    for name, (source, spec, features) in cases.items():
        topic = f"bench-gate-{uuid.uuid4().hex[:10]}"
        url = f"kafka://{bootstrap}/{topic}"
        log(f"gate: {name}: {events:,} events, poison {spec}")
        store = root / f"poison-{len(out)}"
        checknrun_json(
            "trainer.replay",
            [
                *("replay", *source, "--to", f"{url}?partitions=1"),
                *("--max-events", str(events), "--poison", spec, "--json", "--no-progress"),
            ],
        )
        report = checknrun_json(
            "trainer.cli",
            [
                *("train", "--data", url, *features),
                *("--store", f"file://{store}", "--model", "live", "--codec", "int4"),
                *("--interval-samples", str(INTERVAL), "--gate", "--stop-at-end"),
                *("--json", "--no-progress"),
            ],
        )
        delete_topic(bootstrap, topic)
        out[name] = {"spec": spec, "samples": report["samples"], **_detection(store, start, stop)}
        if name == "labels flipped" and screenshot is not None:
            _screenshot(store, root, screenshot)
    return out


def _detection(store: Path, start: int, stop: int) -> dict[str, Any]:
    """From the store: how soon the poison was held, what was released, holds elsewhere."""
    fs = FileStore(store)
    refs = Catalog(fs, "live").versions()
    seen = {r.version: r.manifest.position.samples_seen for r in refs}
    log_ = ReleaseLog(fs, "live")
    evaluations = {v: e for v in log_.evaluated_versions() if (e := log_.evaluation(v))}
    released = {r.version for r in log_.records() if r.action == "release"}

    def window(v: int) -> tuple[int, int]:
        end = seen.get(v + 1, seen[v])
        return max(seen[v], end - 16_384), end

    def trained(v: int) -> tuple[int, int]:
        return seen.get(v - 1, 0), seen[v]

    def overlaps(span: tuple[int, int]) -> bool:
        return span[0] < stop and start < span[1]

    # the last version before any poisoned event was trained: its snapshot is the poison's start
    before = max((v for v in seen if seen[v] <= start), default=None)
    holds = sorted(v for v, e in evaluations.items() if e.decision == "hold")
    first_hold = next((v for v in holds if overlaps(window(v))), None)
    unproven = {v for v in evaluations if overlaps(trained(v)) and overlaps(window(v))}
    healed = sorted(v for v in released if trained(v)[0] >= stop)
    # before the poison: false holds; after it, a version still carrying what the poison taught
    # (judged on the healed stream, it is worse than the released one) is held while recovering
    before_poison = [v for v in holds if window(v)[1] <= start]
    recovering = [v for v in holds if window(v)[0] >= stop]
    # The hold is decided when the snapshot after the held version arrives: that many events
    # after the first poisoned one (seconds: at a stream's rate, plus the evaluation's time).
    events = None if first_hold is None else seen.get(first_hold + 1, seen[first_hold]) - start
    return {
        "versions": len(refs),
        "first_poisoned_version": None if before is None else before + 1,
        "first_hold": first_hold,
        "detection_versions": None if first_hold is None or before is None else first_hold - before,
        "detection_events": events,
        "detection_s_at_2000_per_s": None if events is None else round(events / 2000, 1),
        "unproven_released": sorted(unproven & released),
        "first_release_after": healed[0] if healed else None,
        "held_before": before_poison,
        "held_recovering": recovering,
        "reasons": {v: evaluations[v].reason for v in holds},
        "made_at": datetime.now().isoformat(timespec="seconds"),
    }


def _screenshot(store: Path, root: Path, out: Path) -> None:
    from bench.browser import BrowserError, chromium_path, screenshot
    from bench.child_server import ChildServer

    if chromium_path() is None:
        log("gate: no Chromium: no screenshot of the status page")
        return
    with ChildServer(f"file://{store}", "live", root / "server.log") as server:
        server.wait_ready()
        try:
            screenshot(f"{server.url}/status", out, 1100, 1500)
            log(f"gate: wrote {out}")
        except BrowserError as exc:
            log(f"gate: no screenshot: {exc}")


def _print(doc: dict[str, Any]) -> None:
    print("release gate: clean streams (20,000 samples a version, window 16,384)")
    print(f"{'stream':<10} {'judged':>7} {'held':>5} {'rolled back':>12} {'false holds':>12} "
          f"{'AUC diff width':>15} {'served-loss width':>18} {'CTR':>6}")  # fmt: skip
    for name, c in doc["clean"].items():
        print(
            f"{name:<10} {c['versions_judged']:>7} {len(c['held']):>5} {len(c['rolled_back']):>12} "
            f"{c['false_hold_share']:>12.1%} {c['gate_auc_diff_width_median'] or 0:>15.4f} "
            f"{c['served_loss_rel_width_median'] or 0:>18.4%} {c['positive_rate'] or 0:>6.3f}"
        )
    cost = doc["cost"]
    print(
        f"cost: training {cost['samples_per_s_on']:,} samples/s with the gate, "
        f"{cost['samples_per_s_off']:,} without ({cost['throughput_ratio']}x); the evaluation "
        f"{cost['gate_seconds_median']} s wall, {cost['gate_cpu_s_median']} s CPU a version"
    )
    print("poisons (live, through Kafka):")
    for name, p in doc["poisons"].items():
        print(
            f"  {name:<20} first hold v{p['first_hold']} ({p['detection_versions']} version(s), "
            f"{p['detection_events'] or 0:,} events after the poison began: "
            f"{p['detection_s_at_2000_per_s']} s at 2,000 events/s); unproven versions released: "
            f"{p['unproven_released'] or 'none'}; released again from v{p['first_release_after']}"
            f"; held before it: {p['held_before'] or 'none'}, while recovering: "
            f"{p['held_recovering'] or 'none'}"
        )
