"""Part `dense`: what the events' numeric fields give a live model (`--dense-features`).

    checknrun bench dense [--events N] [--quick] [--json OUT]

A click stream whose clicks follow two numbers as much as its ids: `price` (log-normal, a third
of the events send none) and `affinity` (uniform in [0, 1]); a user's and an item's own rate
add the rest. Each arm trains the trainer's own live path in-process, without a broker (as
part `admission` does): events encoded by `schemas.events.encode_event`, parsed by the
reader's `RawEventsBuilder`, mapped and given their dense inputs by `KafkaEventStream.take`,
trained by `train_step`. Side by side on the same events:

- `ids only`: the model a user could train before dense features (the numbers ignored);
- `bucket ids`: what a user could do instead, the numbers sent as ids of their bucket
  (`price_b`: round(4 * log1p(price)), `affinity_b`: its tenth), each a feature of its own;
- `dense features`: `--dense-features price,affinity:raw` at the default `--dense-lr`;
- `dense, lr 0.01`: the same with `--dense-lr 0.01`;

each with its progressive AUC (every event scored before it is trained on) over the whole
stream and its second half, next to the AUC of the stream's own click probabilities (the best
any model can do).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

from bench.machine import describe_machine, log
from publisher.cli import positive_int
from publisher.live_features import LiveSpec
from publisher.write.tracker import find_embedding_tables
from schemas.events import encode_event
from trainer.online import OptimizerSettings, build_dlrm, build_optimizers, train_step
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.streams.event_columns import RawEventsBuilder
from trainer.streams.kafka_events import KafkaEventStream
from trainer.streams.kafka_reader import EventSource

#: option -> (default, --quick).
SIZES = {"events": (200_000, 6_000)}
BATCH = 256
USERS, ITEMS = 2_000, 500
FEATURES = "user,item"
DENSE = "price,affinity:raw"
BUCKETS = "price_b,affinity_b"
#: arm -> (--features, --dense-features, --dense-lr)
ARMS = {
    "ids only": (FEATURES, "", 1e-3),
    "bucket ids": (f"{FEATURES},{BUCKETS}", "", 1e-3),
    "dense features": (FEATURES, DENSE, 1e-3),
    "dense, lr 0.01": (FEATURES, DENSE, 1e-2),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default, quick = SIZES["events"]
    parser.add_argument(
        "--events", type=positive_int, default=None, help=f"default {default:,} (--quick {quick:,})"
    )


def run(quick: bool, events: int | None = None) -> dict[str, Any]:
    n = events or SIZES["events"][1 if quick else 0]
    values, labels, truth = _stream(n)
    doc: dict[str, Any] = {
        "machine": describe_machine(),
        "events": n,
        "ctr": round(float(labels.mean()), 4),
        "best_auc": round(roc_auc(truth, labels), 4),
        "best_auc_second_half": round(roc_auc(truth[n // 2 :], labels[n // 2 :]), 4),
        "arms": {},
    }
    for arm, (features, dense, lr) in ARMS.items():
        log(f"dense: {arm}: {n:,} events")
        doc["arms"][arm] = _train(values, n, features, dense, lr)
    _print(doc)
    return doc


def _stream(n: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """The events, their labels and their true click probabilities."""
    rng = np.random.default_rng(0)
    user_bias = rng.normal(0.0, 0.6, USERS)
    item_bias = rng.normal(0.0, 0.6, ITEMS)
    users = rng.integers(0, USERS, n)
    items = rng.integers(0, ITEMS, n)
    price = rng.lognormal(4.6, 1.0, n)
    has_price = rng.random(n) < 2 / 3
    affinity = rng.random(n)
    logit = (
        -2.0
        + user_bias[users]
        + item_bias[items]
        + np.where(has_price, 1.2 * (np.log1p(price) - 4.6), 0.3)
        + 2.5 * (affinity - 0.5)
    )
    truth = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < truth).astype(np.float64)
    values = [
        encode_event(
            ts=1_700_000_000.0 + i,
            label=float(labels[i]),
            ids={
                "user": f"u{users[i]}",
                "item": f"i{items[i]}",
                "price_b": round(4 * math.log1p(price[i])) if has_price[i] else None,
                "affinity_b": int(affinity[i] * 10),
            },
            extra={
                "price": float(price[i]) if has_price[i] else None,
                "affinity": float(affinity[i]),
            },
        )
        for i in range(n)
    ]
    return values, labels, truth


def _train(values: list[bytes], n: int, features: str, dense: str, lr: float) -> dict[str, Any]:
    spec = LiveSpec(
        features=LiveSpec.parse_features(features),
        count_features=("user", "item"),
        dense_features=LiveSpec.parse_dense_features(dense),
    )
    rows = {"user": USERS * 2, "item": ITEMS * 2, "price_b": 256, "affinity_b": 16}
    rows = {name: rows[name] for name in spec.names}
    stream = KafkaEventStream(EventSource.parse("kafka://127.0.0.1:9/bench"), spec, rows)
    model = build_dlrm(stream.features, stream.dense_names, seed=0)
    optimizers = build_optimizers(model, OptimizerSettings(dense_lr=lr))
    stream.attach(find_embedding_tables(model), optimizers, None)
    metrics = ProgressiveMetrics()
    builder = RawEventsBuilder(stream.fields)
    late = ProgressiveMetrics()
    started = time.perf_counter()
    for lo in range(0, n, BATCH):
        for i, value in enumerate(values[lo : lo + BATCH]):
            builder.add(value, partition=0, offset=lo + i)
        batch = stream.take(builder.take(), lo)
        assert batch is not None
        train_step(model, optimizers, batch, late if lo >= n // 2 else metrics)
    seconds = time.perf_counter() - started
    first, second = metrics.cumulative(), late.cumulative()
    return {
        "features": features,
        "dense_features": dense or None,
        "dense_lr": lr,
        "dense_inputs": len(stream.dense_names),
        "auc_first_half": round(first["auc_cumulative"], 4),
        "auc_second_half": round(second["auc_cumulative"], 4),
        "events_per_s": round(n / seconds) if seconds > 0 else math.inf,
    }


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The exact AUC of `scores` (Mann-Whitney, ties counted half)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    ranks = (sums / counts)[inverse]  # the mean rank of each tie
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _print(doc: dict[str, Any]) -> None:
    print(
        f"\nDense features ({doc['events']:,} events, CTR {doc['ctr']:.1%}; progressive AUC, "
        f"the best possible: {doc['best_auc']:.4f}, 2nd half {doc['best_auc_second_half']:.4f}):"
    )
    print(f"{'arm':<16} {'dense inputs':>12} {'AUC 1st half':>13} {'AUC 2nd half':>13} {'ev/s':>7}")
    for arm, r in doc["arms"].items():
        print(
            f"{arm:<16} {r['dense_inputs']:>12} {r['auc_first_half']:>13.4f} "
            f"{r['auc_second_half']:>13.4f} {r['events_per_s']:>7,}"
        )
