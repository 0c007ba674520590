"""Part `accuracy`: what quantized checkpoints cost in AUC and log loss, and the bit-width rule.

(a) Served model: at every interval boundary the trainer's tables are passed through each codec
(what a server decodes: with any incremental policy every row's latest write is the row's
current value, so the served table is codec(current table)) and that model scores the next
interval, next to the fp32 model frozen at the same boundary. Dense layers stay fp32, as
published.

(b) Restores: a run fails k times at seeded random sample offsets (after the first
checkpoint); each time it restores the latest checkpoint (tables through the codec; optimizer
columns, dense layers and the reader position exact, as published) and trains on from there,
redoing the lost part of the interval. Its progressive metrics roll back with it, so every sample
is scored once, in its final pass. Compared with the uninterrupted fp32 run on the same stream
(single-threaded training is deterministic: the fp32 codec with the most failures reproduces it
exactly, which the results check).

The bit rule: for each number of expected restores, the fewest bits whose relative AUC
degradation stays within 0.01% on every workload (see `bench.bit_rule`).

`--data FILE` (with `checknrun train`'s column options) measures your own data set instead:

    checknrun bench accuracy --data ratings.csv --rating-col rating --json accuracy.json
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from bench.bit_rule import AUC_TOLERANCE, derive_rule
from bench.machine import describe_machine, log, write_json
from bench.workloads import (
    BenchTrainer,
    Workload,
    available,
    evaluate,
    file_workload,
    make_workload,
    quantize_in_place,
)
from publisher.cli import CommandError, positive_int
from trainer.options import add_file_args, is_live
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.sources import open_stream

FAILURES = (0, 1, 2, 5, 10)
QUICK_FAILURES = (0, 1)
#: codecs of the restore runs per workload (each run is a full training run: ~30 s on MovieLens
#: here, so the synthetic workload gets the codecs that decide the rule); the served-model
#: figures cover every codec.
CODECS_FULL = ("int8", "int4", "int3", "int2", "int4-adaptive", "int2-adaptive")
CODECS_SYNTHETIC = ("int8", "int4", "int2")
SERVED_CODECS = (
    "fp16",
    "int8",
    "int4",
    "int3",
    "int2",
    "int8-adaptive",
    "int4-adaptive",
    "int3-adaptive",
    "int2-adaptive",
)
QUICK_CODECS = ("int8", "int2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--data FILE` (with `checknrun train`'s column options): your own data set instead."""
    parser.add_argument(
        "--data",
        metavar="FILE",
        default=None,
        help="a .csv/.tsv/.parquet log, as `checknrun train --data FILE` takes it: measured "
        "instead of MovieLens-1M and the synthetic stream",
    )
    parser.add_argument(
        "--interval-samples",
        type=positive_int,
        default=None,
        help="with --data: checkpoint every N samples (default 1/20 of the file, >= 1000)",
    )
    add_file_args(parser)


def _workloads(
    quick: bool,
    data: str | None = None,
    interval_samples: int | None = None,
    columns: Mapping[str, Any] | None = None,
) -> list[Workload]:
    if data is not None:
        if is_live(data):
            raise CommandError(f"--data {data}: a live topic has no end to measure; give a file")
        stream = open_stream(argparse.Namespace(data=data, **(columns or {})))
        return [file_workload(data, stream, quick, interval_samples)]
    out = []
    if available("movielens"):
        # The whole MovieLens-1M stream, checkpoint every 50k samples (20 checkpoints).
        out.append(make_workload("movielens", quick))
    # A smaller synthetic model (tables capped at 20k rows): 40 training runs of the 1 GB one
    # would take hours here; the served-model figure of the 1 GB one is in the `paper` part.
    out.append(
        make_workload(
            "synthetic",
            quick,
            table_cap=500 if quick else 20_000,
            intervals=3 if quick else 8,
            interval_samples=2_000 if quick else 20_000,
        )
    )
    return out


def _metrics(m: ProgressiveMetrics, last_interval: bool = True) -> dict[str, float]:
    c, w = m.cumulative(), m.window()
    out = {
        "auc": c["auc_cumulative"],
        "logloss": c["logloss_cumulative"],
        "samples": c["samples_cumulative"],
    }
    if last_interval:  # the window restarts at each checkpoint (ProgressiveMetrics.take_window)
        out["auc_last_interval"] = w["auc"]
        out["logloss_last_interval"] = w["logloss"]
    return out


def served(workload: Workload, codecs: tuple[str, ...]) -> dict[str, Any]:
    """(a): codec(trainer state) vs the fp32 state, each boundary scoring the next interval."""
    trainer = BenchTrainer(workload)
    ref = ProgressiveMetrics()
    per = {c: ProgressiveMetrics() for c in codecs}
    since = 0
    for batch in trainer.batches(0, workload.stop):
        trainer.train(batch)
        since += batch.size
        if since < workload.interval_samples or batch.end >= workload.stop:
            continue
        since = 0
        stop = min(batch.end + workload.interval_samples, workload.stop)
        evaluate(trainer.model, trainer.batches(batch.end, stop), ref)
        saved = {t: trainer.weight(t).detach().clone() for t in trainer.table_rows}
        with torch.no_grad():
            for codec in codecs:
                for t, w in saved.items():
                    trainer.weight(t).copy_(w)
                    quantize_in_place(trainer.weight(t), codec)
                evaluate(trainer.model, trainer.batches(batch.end, stop), per[codec])
            for t, w in saved.items():
                trainer.weight(t).copy_(w)
    r = _metrics(ref, last_interval=False)
    rows = []
    for codec, m in per.items():
        q = _metrics(m, last_interval=False)
        rows.append(
            {
                "codec": codec,
                **q,
                "auc_rel_degradation": (r["auc"] - q["auc"]) / r["auc"],
                "logloss_rel_increase": (q["logloss"] - r["logloss"]) / r["logloss"],
            }
        )
    return {"fp32": r, "codecs": rows}


def failure_run(workload: Workload, codec: str, failures: int, seed: int = 0) -> dict[str, Any]:
    """(b): train with `failures` restores from `codec` checkpoints; final metrics."""
    rng = np.random.default_rng([seed, failures])
    lo = workload.interval_samples  # the first checkpoint must exist before a failure
    points = sorted(rng.integers(lo, workload.stop, size=failures).tolist())
    trainer = BenchTrainer(workload)
    checkpoint: dict[str, Any] | None = None
    checkpoint_at = 0
    position = since = 0
    lost = 0
    while position < workload.stop:
        failed = False
        for batch in trainer.batches(position, workload.stop):
            trainer.train(batch)
            position = batch.end
            since += batch.size
            if since >= workload.interval_samples:
                since = 0
                trainer.metrics.take_window()
                checkpoint, checkpoint_at = trainer.save_state(), position
            if points and position >= points[0] and checkpoint is not None:
                points.pop(0)
                lost += position - checkpoint_at
                trainer.load_state(checkpoint, codec)
                position, since, failed = checkpoint_at, 0, True
                break
        if not failed:
            break
    return {
        "codec": codec,
        "failures": failures,
        "samples_redone": lost,
        **_metrics(trainer.metrics),
    }


def run(
    quick: bool,
    workloads: tuple[str, ...] | None = None,
    partial: str | None = None,
    data: str | None = None,
    interval_samples: int | None = None,
    **columns: Any,
) -> dict[str, Any]:
    """Both workloads (or `workloads`), or the data file `data` read with the column options
    `columns` (`add_file_args`); returns the part's document with the derived bit rule.

    With `partial`, the document so far is rewritten there after every run, so a run cut short
    by a deadline still leaves its measurements.
    """
    torch.set_num_threads(1)  # deterministic and comparable: every run on one core
    codecs: tuple[str, ...] = QUICK_CODECS if quick else CODECS_FULL
    ks = QUICK_FAILURES if quick else FAILURES
    doc: dict[str, Any] = {
        "part": "accuracy",
        "quick": quick,
        "machine": describe_machine(),
        "auc_tolerance_rel": AUC_TOLERANCE,
        "failures": list(ks),
        "workloads": {},
    }
    for wl in _workloads(quick, data, interval_samples, columns):
        if workloads is not None and wl.name not in workloads:
            continue
        served_codecs = codecs if quick else SERVED_CODECS
        if wl.name == "synthetic" and not quick:
            codecs = CODECS_SYNTHETIC
        log(f"accuracy: {wl.name}: served model, {len(served_codecs)} codecs")
        entry: dict[str, Any] = {"workload": wl.describe(), "served": served(wl, served_codecs)}
        log(f"accuracy: {wl.name}: uninterrupted fp32 run")
        ref = failure_run(wl, "fp32", 0)
        check = failure_run(wl, "fp32", max(ks))
        runs: list[dict[str, Any]] = []
        entry["reference_fp32"] = ref
        entry["fp32_restores_check"] = {
            **check,
            "equals_reference": check["auc"] == ref["auc"] and check["logloss"] == ref["logloss"],
        }
        entry["restores"] = runs
        doc["workloads"][wl.name] = entry
        # k outermost: a run cut short still has every codec at the smaller k.
        for k in ks:
            for codec in codecs:
                if k == 0:
                    continue  # training is fp32: without a restore every codec equals ref
                r = failure_run(wl, codec, k)
                r["auc_rel_degradation"] = (ref["auc"] - r["auc"]) / ref["auc"]
                r["logloss_rel_increase"] = (r["logloss"] - ref["logloss"]) / ref["logloss"]
                runs.append(r)
                log(
                    f"accuracy: {wl.name} {codec} k={k}: AUC {r['auc']:.5f} "
                    f"({r['auc_rel_degradation'] * 100:+.4f}%)"
                )
                if partial is not None:
                    write_json({**doc, "bit_rule": derive_rule(doc), "partial": True}, partial)
    doc["bit_rule"] = derive_rule(doc)
    return doc


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from per-workload runs (e.g. run in parallel), with the rule re-derived."""
    out = {**docs[0], "workloads": {}, "machines": [d["machine"] for d in docs]}
    for d in docs:
        out["workloads"].update(d["workloads"])
    out.pop("partial", None)
    out["bit_rule"] = derive_rule(out)
    return out
