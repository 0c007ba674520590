"""Part `admission`: an open id space under real and hostile streams, before and after.

    checknrun bench admission [--events N] [--flood-events N] [--quick] [--json OUT]

Everything runs the trainer's own live path in-process, without a broker: events encoded by
`checknrun replay`'s encoder (trainer/replay.py `event_chunks`), parsed and numbered by the
reader's `RawEventsBuilder`, mapped by `KafkaEventStream.take` through each table's `IdSpace`,
and (cold start) trained by `train_step`. Measured side by side in one run:

1. Cold start: on MovieLens-1M (its first `--events` ratings, time order) and on a click log
   (the synthetic Criteo-like stream at a ~1% click rate: no click log shipped in a package
   reachable here has first-seen ids with clicks; Open Bandit's sample in `obp` has 280 first-
   seen user-feature tuples and no click among them), with `--cold-start unknown-row` (the
   default) and `off`. For every event whose user (item; on the click log: `c1`, `c2`) is seen
   for the first time, the score a server gives it before it is trained on: the model's forward
   with that id on the unknown row, as a server scores an id it does not know. Calibration =
   mean score / observed rate of those events (1.0 is perfect; the target is within 1.5x),
   next to the run's progressive AUC.
2. Flood: 3,000 real ids in the default table (100,000 rows), then one-off ids at 1x, 10x and
   30x the real ids' event rate for `--flood-events`, under the frequency admission (the
   default) and `recency` (any new id takes the least recently seen row: what came before):
   the share of real ids still holding their row, events refused, and the mapping rate.
3. Memory for ids without a row: the sketch's bytes per table (fixed), and what the numbering
   of never-seen 250-byte ids costs in the reader and the trainer per id (tracemalloc), with the
   bound the numbering budget sets (trainer/streams/event_columns.py).
"""

from __future__ import annotations

import argparse
import pickle
import time
import tracemalloc
from typing import Any

import numpy as np
import torch

from bench.machine import describe_machine, log
from publisher.cli import positive_int
from publisher.dlrm import SparseBatch
from publisher.id_map import UNKNOWN_ROW, IdMap
from publisher.live_features import LiveSpec
from publisher.write.tracker import find_embedding_tables
from schemas.events import encode_event
from trainer.admission import FrequencySketch
from trainer.id_space import IdSpace, IdSpacePolicy
from trainer.online import build_dlrm, build_optimizers, train_step
from trainer.options import DEFAULT_ID_CAPACITY
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.replay import event_chunks
from trainer.streams.base import InteractionStream
from trainer.streams.event_columns import MAX_KEY_CHARS, MAX_KEYS, RawEventsBuilder
from trainer.streams.kafka_events import KafkaEventStream
from trainer.streams.kafka_reader import EventSource

#: option -> (default, --quick).
SIZES: dict[str, tuple[int, int]] = {
    "events": (200_000, 8_000),
    "flood_events": (1_000_000, 50_000),
}
BATCH = 512
REAL_IDS = 3_000
FLOOD_RATES = (1, 10, 30)
#: the click log: a few Criteo-like tables, the largest two user- and item-like.
CLICK_TABLES = (200_000, 50_000, 10_000, 1_000, 100, 20, 5, 3)
CLICK_BIAS = -6.0
KEY_BYTES = 250


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes of the cold-start streams and of the flood."""
    for name, (default, quick) in SIZES.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=positive_int,
            default=None,
            help=f"default {default:,} (--quick: {quick:,})",
        )


def run(quick: bool, events: int | None = None, flood_events: int | None = None) -> dict[str, Any]:
    pick = 1 if quick else 0
    n_events = events or SIZES["events"][pick]
    n_flood = flood_events or SIZES["flood_events"][pick]
    doc: dict[str, Any] = {"machine": describe_machine(), "events": n_events}
    doc["cold_start"] = {
        "movielens": _cold_start_arms("movielens", n_events),
        "click_log": _cold_start_arms("click_log", n_events),
    }
    doc["flood"] = _flood(n_flood)
    doc["memory"] = _memory(quick)
    _print(doc)
    return doc


# --- cold start ---------------------------------------------------------------------------


def _source(name: str, n: int) -> tuple[InteractionStream, str, tuple[str, str]]:
    """The stream, its live `--features` and the two features whose first sightings count."""
    if name == "movielens":
        from trainer.streams.movielens import load_movielens

        ml = load_movielens()
        features = ",".join(f"{f.name}[]" if f.bag else f.name for f in ml.features)
        return ml, features, ("user", "item")
    from trainer.streams.synthetic import SyntheticConfig, SyntheticStream

    config = SyntheticConfig(cardinalities=CLICK_TABLES, label_bias=CLICK_BIAS, num_samples=n)
    synthetic = SyntheticStream(config)
    return synthetic, ",".join(f.name for f in synthetic.features), ("c1", "c2")


def _cold_start_arms(name: str, n: int) -> dict[str, Any]:
    stream, features, watched = _source(name, n)
    log(f"admission: {name}: encoding {n:,} events")
    values = [v for chunk in event_chunks(stream, 0, n) for v in chunk.values]
    out: dict[str, Any] = {"events": len(values), "watched": list(watched)}
    for arm, cold in (("unknown-row", True), ("off", False)):
        log(f"admission: {name}: cold start {arm}")
        out[arm] = _cold_start_run(values, features, watched, cold)
    return out


def _cold_start_run(
    values: list[bytes], features: str, watched: tuple[str, str], cold: bool
) -> dict[str, Any]:
    spec = LiveSpec(
        features=LiveSpec.parse_features(features),
        count_features=tuple(w for w in watched if w in features.split(",")),
    )
    rows = {f.name: DEFAULT_ID_CAPACITY for f in spec.features}
    policy = IdSpacePolicy(cold_start=cold)
    stream = KafkaEventStream(EventSource.parse("kafka://127.0.0.1:9/bench"), spec, rows, policy)
    model = build_dlrm(stream.features, stream.dense_names, seed=0)
    optimizers = build_optimizers(model)
    stream.attach(find_embedding_tables(model), optimizers, None)
    metrics = ProgressiveMetrics()
    builder = RawEventsBuilder(stream.fields)
    seen = dict.fromkeys(watched, 0)  # per feature: keys numbered so far
    # per feature, and for all events: score sum, events, positives; in all and in the second
    # half of the stream (past the model's own warm-up, when every score is off).
    sums: dict[str, list[Any]] = {w: [0.0, 0, 0] for w in watched}
    late: dict[str, list[Any]] = {w: [0.0, 0, 0] for w in (*watched, "all")}
    half = len(values) // 2
    singles = stream.fields.singles
    started = time.perf_counter()
    for lo in range(0, len(values), BATCH):
        for i, value in enumerate(values[lo : lo + BATCH]):
            builder.add(value, partition=0, offset=lo + i)
        raw = builder.take()
        first = {}
        for w in watched:
            _, numbers = raw.singles[singles.index(w)]
            new = numbers >= seen[w]
            _, at = np.unique(numbers, return_index=True)
            once = np.zeros(len(numbers), dtype=np.bool_)
            once[at] = True
            first[w] = new & once & (numbers >= 0)
            seen[w] = max(seen[w], int(numbers.max(initial=-1)) + 1)
        batch = stream.take(raw, lo)
        assert batch is not None
        labels = batch.labels.numpy() > 0.5
        with torch.no_grad():  # what a server gives each first-seen id: the unknown row
            if lo >= half:
                _add(late["all"], torch.sigmoid(model(batch.dense, batch.sparse)).numpy(), labels)
            for w in watched:
                mask = first[w]
                if not mask.any():
                    continue
                sparse = dict(batch.sparse)
                served = sparse[w].values.clone()
                served[torch.from_numpy(mask)] = UNKNOWN_ROW
                sparse[w] = SparseBatch(served, sparse[w].offsets)
                scores = torch.sigmoid(model(batch.dense, sparse)).numpy()[mask]
                _add(sums[w], scores, labels[mask])
                if lo >= half:
                    _add(late[w], scores, labels[mask])
        train_step(model, optimizers, batch, metrics)
    seconds = time.perf_counter() - started
    total = metrics.cumulative()
    out: dict[str, Any] = {
        "auc": round(total["auc_cumulative"], 4),
        "ctr": round(total["ctr_cumulative"], 4),
        "seconds": round(seconds, 1),
    }
    for w in watched:
        out[w] = {**_calibration(sums[w]), "second_half": _calibration(late[w])}
    out["all_second_half"] = _calibration(late["all"])
    return out


def _add(acc: list[Any], scores: np.ndarray, labels: np.ndarray) -> None:
    acc[0] += float(scores.sum())
    acc[1] += len(scores)
    acc[2] += int(labels.sum())


def _calibration(acc: list[Any]) -> dict[str, Any]:
    score_sum, count, positives = acc
    mean = score_sum / count if count else float("nan")
    rate = positives / count if count else float("nan")
    return {
        "events": count,
        "positives": positives,
        "mean_score": round(mean, 4),
        "observed_rate": round(rate, 4),
        "calibration": round(mean / rate, 3) if positives else None,
    }


# --- flood --------------------------------------------------------------------------------


def _flood(n_flood: int) -> dict[str, Any]:
    out: dict[str, Any] = {"real_ids": REAL_IDS, "capacity": DEFAULT_ID_CAPACITY, "arms": []}
    for admission in ("frequency", "recency"):
        for rate in FLOOD_RATES:
            log(f"admission: flood at {rate}x the real ids' rate, {admission} admission")
            out["arms"].append(_flood_arm(admission, rate, n_flood))
    return out


def _flood_arm(admission: str, rate: int, n_flood: int) -> dict[str, Any]:
    space = IdSpace(IdMap(DEFAULT_ID_CAPACITY), IdSpacePolicy(admission=admission))
    rng = np.random.default_rng(rate)
    real = [f"user-{i}" for i in range(REAL_IDS)]
    space.learn(real)
    numbered = REAL_IDS
    clock = 0.0

    def feed(numbers: np.ndarray) -> None:
        nonlocal clock
        clock += 1.0
        space.map(numbers.astype(np.int32), np.full(len(numbers), clock), now=clock)

    for lo in range(0, REAL_IDS, BATCH):  # every real id gets its row
        feed(np.arange(lo, min(lo + BATCH, REAL_IDS)))
    per_real = max(1, BATCH // (1 + rate))
    per_flood = BATCH - per_real
    flooded = 0
    started = time.perf_counter()
    mapped = 0
    while flooded < n_flood:
        fresh = [f"flood-{numbered + i}" for i in range(per_flood)]
        space.learn(fresh)
        numbers = np.concatenate(
            [rng.integers(0, REAL_IDS, per_real), np.arange(numbered, numbered + per_flood)]
        )
        numbered += per_flood
        feed(rng.permutation(numbers))
        flooded += per_flood
        mapped += len(numbers)
    seconds = time.perf_counter() - started
    kept = sum(space.id_map.row_of(k) is not None for k in real)
    return {
        "admission": admission,
        "flood_rate": rate,
        "flood_events": flooded,
        "real_events": mapped - flooded,
        "real_ids_kept": round(kept / REAL_IDS, 4),
        "refused_events": space.refused,
        "evicted": space.evicted,
        "events_per_s": round(mapped / seconds),
    }


# --- memory -------------------------------------------------------------------------------


def _memory(quick: bool) -> dict[str, Any]:
    n = 20_000 if quick else 200_000
    log(f"admission: memory of {n:,} never-seen {KEY_BYTES}-byte ids")
    spec = LiveSpec(features=LiveSpec.parse_features("user"))
    stream = KafkaEventStream(
        EventSource.parse("kafka://127.0.0.1:9/bench"), spec, {"user": DEFAULT_ID_CAPACITY}
    )
    keys = [f"{i:0{KEY_BYTES}d}" for i in range(n)]
    values = [encode_event(ts=1.0, label=0, ids={"user": k}) for k in keys]
    builder = RawEventsBuilder(stream.fields)
    tracemalloc.start()
    raws = []
    before = tracemalloc.get_traced_memory()[0]
    for lo in range(0, n, BATCH):
        for i, value in enumerate(values[lo : lo + BATCH]):
            builder.add(value, partition=0, offset=lo + i)
        raws.append(builder.take())
    reader = tracemalloc.get_traced_memory()[0] - before
    space = stream.id_spaces["user"]
    before = tracemalloc.get_traced_memory()[0]
    for raw in raws:  # the keys arrive through a pipe: the trainer holds its own copies
        space.learn(pickle.loads(pickle.dumps(raw.singles[0][0])))
    trainer = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    reader_per_id, trainer_per_id = reader / n, trainer / n
    bound = min(MAX_KEYS, MAX_KEY_CHARS // KEY_BYTES)
    return {
        "sketch_bytes_per_table": FrequencySketch.for_capacity(DEFAULT_ID_CAPACITY - 1).nbytes,
        "ids": n,
        "key_bytes": KEY_BYTES,
        "reader_bytes_per_id": round(reader_per_id),
        "trainer_bytes_per_id": round(trainer_per_id),
        "numbered_keys_at_most": bound,
        "bound_mib_per_feature": round((reader_per_id + trainer_per_id) * bound / 2**20, 1),
        "bound_mib_per_feature_before": round(
            (reader_per_id + trainer_per_id) * (1 << 22) / 2**20, 1
        ),
    }


def _print(doc: dict[str, Any]) -> None:
    print(f"\nCold start ({doc['events']:,} events each; calibration = mean score / observed rate")
    print("of the events of first-seen ids, scored as a server scores an id it does not know;")
    print("2nd half: the same past the stream's first half; `all events`: every event there):")
    print(
        f"{'stream':<10} {'arm':<12} {'AUC':>7} {'events of':>10} {'events':>7} {'pos':>6} "
        f"{'score':>7} {'rate':>7} {'calib':>6} {'2nd half':>9}"
    )
    for name, arms in doc["cold_start"].items():
        for arm in ("unknown-row", "off"):
            run_ = arms[arm]
            for w in arms["watched"]:
                r = run_[w]
                print(
                    f"{name:<10} {arm:<12} {run_['auc']:>7.4f} {'new ' + w:>10} {r['events']:>7} "
                    f"{r['positives']:>6} {r['mean_score']:>7.4f} {r['observed_rate']:>7.4f} "
                    f"{r['calibration'] or '-':>6} {r['second_half']['calibration'] or '-':>9}"
                )
            every = run_["all_second_half"]
            print(
                f"{name:<10} {arm:<12} {run_['auc']:>7.4f} {'all events':>10} {'':>7} {'':>6} "
                f"{'':>7} {'':>7} {'':>6} {every['calibration'] or '-':>9}"
            )
    flood = doc["flood"]
    print(f"\nFlood: {flood['real_ids']:,} real ids in {flood['capacity']:,} rows:")
    print(
        f"{'admission':<10} {'rate':>5} {'flood events':>13} {'real kept':>10} "
        f"{'refused':>9} {'evicted':>8} {'events/s':>9}"
    )
    for a in flood["arms"]:
        print(
            f"{a['admission']:<10} {a['flood_rate']:>4}x {a['flood_events']:>13,} "
            f"{a['real_ids_kept']:>10.2%} {a['refused_events']:>9,} {a['evicted']:>8,} "
            f"{a['events_per_s']:>9,}"
        )
    m = doc["memory"]
    print(
        f"\nMemory: sketch {m['sketch_bytes_per_table'] / 2**20:.1f} MiB a table (fixed); a "
        f"never-seen {m['key_bytes']}-byte id costs {m['reader_bytes_per_id']} B in the reader "
        f"and {m['trainer_bytes_per_id']} B in the trainer until the numbering restarts (at "
        f"most {m['numbered_keys_at_most']:,} keys: {m['bound_mib_per_feature']} MiB a feature, "
        f"{m['bound_mib_per_feature_before']} MiB before)"
    )
