"""Part `paper`: write bandwidth, storage capacity and dirty rows of every policy x codec.

Training does not depend on the checkpoint policy or codec, so each workload is trained once.
At every interval boundary the rows looked up in the interval (the rows row-wise Adagrad
changed, from the trainer's dirty-row tracker) are fed to one instance of each policy, and the
rows each plan names, copied as the trainer copies them (`trainer.snapshot_capture`), are encoded
with the real encoder (`publisher.write.publishing.encode_table`: quantization, row index, zstd)
for every codec, giving exact bytes per checkpoint. Consecutive and intermittent deltas hold the
same rows, so each delta is encoded once per codec. A full checkpoint of a codec is encoded once (at
the first boundary) and its size reused: its size depends on the values only through zstd.

Alongside, the settings of `PUBLISHED` (the default, intermittent int4; intermittent with
`--codec auto`, the trainer's default, whose bits follow the loss it measures, so its bytes are
the committed versions' own; and the fewest bytes, consecutive int2) are captured as the trainer
captures them and published for real through
`CheckpointPublisher` into a file store, each version's manifest recording its served loss as
a live run records it (publisher/served_loss.py: the version as a server holds it next to the
trainer's fp32 state, paired on the latest progressive-validation samples); the default's latest
version is restored with `publisher.read.restore` and timed against `torch.load` of a full fp32
checkpoint of the same state; and the served model (the trainer's state through the default
codec) is scored on each upcoming interval next to the fp32 model.

Every checkpoint also carries the dense parameters and optimizer state in fp32, counted for
every policy and for the full fp32 reference alike (docs/FORMAT.md section 3.1).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.machine import describe_machine, log
from bench.workloads import (
    DEFAULT_CODEC,
    DEFAULT_POLICY,
    WORKLOADS,
    BenchTrainer,
    Workload,
    available,
    evaluate,
    make_workload,
    quantize_in_place,
)
from publisher.cli import positive_int
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.served_loss import ScoredBatch
from publisher.store import open_store
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.policies import POLICIES, Plan, ServedLossCodecRule, make_policy
from publisher.write.publishing import encode_table, reencoded_json
from publisher.write.tracker import attach, find_embedding_tables
from schemas.codec_names import CODECS
from schemas.manifest import Position, ServedLoss, full_fp32_bytes
from trainer.options import DEFAULT_SCORED_SAMPLES
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.recent_samples import RecentSamples
from trainer.snapshot_capture import SnapshotCapture

#: versions kept by the retention window (storage capacity over a window).
RETAIN = 4
#: checkpoints of the synthetic workload: more than one cycle of the default intermittent
#: policy (3.7% of its rows change per interval, so it takes a new baseline every ~27
#: versions), so the mean write bandwidth counts baselines at their long-run rate. Eight
#: checkpoints, which never reach the second baseline, weigh the first one at 1 in 8 instead.
SYNTHETIC_INTERVALS = 32
#: codecs replayed in quick mode (the machinery, not the numbers).
QUICK_CODECS = ("fp32", "int4", "int4-adaptive", "int2")
#: optimizer columns per table row: row-wise Adagrad's accumulator.
AUX_DIM = 1
#: manifest JSON per version (measured: ~1-3 KB); small next to the blobs but counted.
MANIFEST_BYTES = 2_048
#: (policy, codec) published for real, served loss measured per version; the default first.
#: "auto" is `checknrun train`'s default, `--codec auto`: bits chosen per version from that
#: measurement (publisher.write.policies.ServedLossCodecRule, from int4), so its bytes and loss
#: are the published versions' own, not a replay's.
PUBLISHED = ((DEFAULT_POLICY, DEFAULT_CODEC), (DEFAULT_POLICY, "auto"), ("consecutive", "int2"))
#: where `--codec auto` starts on these runs (no restores expected: the bit rule's floor).
AUTO_FLOOR = "int4"
#: the served-loss budget `--codec auto` holds a live run to (relative AUC, percent).
SERVED_LOSS_BUDGET_PCT = 0.01


class _PublishedArm:
    """One setting of `PUBLISHED`: its own capture (its codec), publisher and versions."""

    def __init__(self, trainer: BenchTrainer, store: Any, policy: str, codec: str) -> None:
        self.policy, self.codec = policy, codec
        default = (policy, codec) == (DEFAULT_POLICY, DEFAULT_CODEC)
        self.model = "paper" if default else f"paper-{policy}-{codec}"
        auto = codec == "auto"
        self.capture = _capture(trainer, AUTO_FLOOR if auto else codec)
        self.publisher = CheckpointPublisher(
            store,
            self.model,
            measure_served_loss=True,
            codec_rule=ServedLossCodecRule(AUTO_FLOOR) if auto else None,
        )
        self.versions: list[dict[str, Any]] = []
        self.served: list[ServedLoss | None] = []

    def publish(self, plan: Plan, steps: int, position: int, recent: RecentSamples) -> None:
        """Publish this setting's plan for real (checks the replayed bytes end to end)."""
        snapshot = self.capture.copy(
            plan,
            policy=self.policy,
            position=Position(step=steps, samples_seen=position, reader={"offset": position}),
        )
        result = self.publisher.publish(replace(snapshot, scored=recent.take().batches))
        self.served.append(result.manifest.served_loss)
        self.versions.append(
            {
                "version": result.ref.version,
                "kind": plan.kind,
                "bytes_written": result.bytes_written,
                # the manifest's own figure: the replay's `full_fp32_bytes` must equal it
                "full_fp32_bytes": result.full_fp32_bytes,
                "encode_s": round(result.encode_s, 4),
                "measure_s": round(result.measure_s, 4),
                "commit_s": round(result.commit_s, 4),
                "codecs": sorted({t.codec for t in result.manifest.tables}),
                "served_loss": None
                if result.manifest.served_loss is None
                else result.manifest.served_loss.model_dump(),
                # `--codec auto`: the codecs measured over the budget before the commit
                "reencoded": reencoded_json(result.reencoded),
            }
        )

    def close(self) -> None:
        self.publisher.close()
        self.capture.close()

    def describe(self) -> dict[str, Any]:
        """The versions, their served loss, and the write and storage reductions of the bytes
        actually committed (the replay's figures for a fixed codec, measured instead)."""
        doc: dict[str, Any] = {
            "policy": self.policy,
            "codec": self.codec,
            "versions": self.versions,
            "served_loss": served_loss_summary(self.served),
            "versions_encoded_again": sum(1 for v in self.versions if v["reencoded"]),
        }
        if self.versions:
            sizes = [v["bytes_written"] for v in self.versions]
            kinds = [v["kind"] for v in self.versions]
            full = statistics.fmean(v["full_fp32_bytes"] for v in self.versions)
            each = storage(kinds, sizes, self.policy, RETAIN)["restore_bytes_per_version"]
            doc["bandwidth_reduction_mean"] = full / statistics.fmean(sizes)
            doc["capacity_reduction_latest"] = full / each[-1]
            doc["capacity_reduction_mean"] = full / statistics.fmean(each)
        return doc


def served_loss_summary(losses: list[ServedLoss | None]) -> dict[str, Any]:
    """Median and worst per-version relative AUC loss (percent, positive = the served model
    ranks worse), how many versions went over the live run's budget, and how many surely did
    (the low end of the loss's 95% interval over it: what `--codec auto` judges by default)."""
    measured = [loss for loss in losses if loss is not None]
    rel = [loss.auc_rel_loss * 100 for loss in measured]
    if not rel:
        return {"versions_measured": 0}
    sure = [loss.sure_auc_rel_loss * 100 for loss in measured]
    return {
        "versions_measured": len(rel),
        "auc_rel_loss_pct_median": statistics.median(rel),
        "auc_rel_loss_pct_worst": max(rel),
        "over_budget": sum(1 for r in rel if r > SERVED_LOSS_BUDGET_PCT),
        "sure_auc_rel_loss_pct_worst": max(sure),
        "surely_over_budget": sum(1 for r in sure if r > SERVED_LOSS_BUDGET_PCT),
        "budget_pct": SERVED_LOSS_BUDGET_PCT,
    }


class _Sizer:
    """Encoded bytes of table rows per codec, with the caches the module docstring explains."""

    def __init__(self, capture: SnapshotCapture, codecs: tuple[str, ...]) -> None:
        self.capture = capture
        self.codecs = codecs
        self.full: dict[tuple[str, str], int] = {}
        self.delta: dict[tuple[str, str, int], int] = {}

    def encoded_bytes(self, table: str, ids: np.ndarray | None, codec: str) -> int:
        rows = replace(self.capture.rows(table, ids), codec=codec)
        return len(encode_table(rows).data)

    def size(self, table: str, ids: np.ndarray | None, codec: str) -> int:
        if ids is None:
            key = (codec, table)
            if key not in self.full:
                self.full[key] = self.encoded_bytes(table, None, codec)
            return self.full[key]
        dkey = (codec, table, id(ids))
        if dkey not in self.delta:
            self.delta[dkey] = self.encoded_bytes(table, ids, codec)
        return self.delta[dkey]

    def new_interval(self) -> None:
        self.delta.clear()  # ids arrays of the last boundary are gone: their id()s may recur


def restore_chain_bytes(kinds: list[str], sizes: list[int], policy: str) -> list[int]:
    """Indices of the versions needed to restore the latest one."""
    last = len(kinds) - 1
    base = max(i for i, k in enumerate(kinds) if k == "full")
    if kinds[last] == "full":
        return [last]
    if policy == "one-shot":
        return [base, last]
    return list(range(base, last + 1))


def storage(kinds: list[str], sizes: list[int], policy: str, retain: int) -> dict[str, Any]:
    """Bytes kept to restore the latest version, any of the last `retain` versions, and each
    version in turn (when it was the latest: the figure moves through a policy's cycle)."""
    latest = restore_chain_bytes(kinds, sizes, policy)
    keep: set[int] = set()
    for end in range(max(0, len(kinds) - retain), len(kinds)):
        keep.update(restore_chain_bytes(kinds[: end + 1], sizes[: end + 1], policy))
    each = [
        sum(sizes[i] for i in restore_chain_bytes(kinds[: end + 1], sizes[: end + 1], policy))
        for end in range(len(kinds))
    ]
    return {
        "latest_bytes": each[-1],
        "latest_chain_versions": len(latest),
        "window_bytes": sum(sizes[i] for i in keep),
        "window_versions_kept": len(keep),
        "restore_bytes_per_version": each,
    }


def run_workload(workload: Workload, codecs: tuple[str, ...]) -> dict[str, Any]:
    """Train once, replay every policy x codec; see the module docstring."""
    trainer = BenchTrainer(workload)
    tables = list(trainer.table_rows)
    policies = {p: make_policy(p, trainer.table_rows) for p in POLICIES}
    tracked = attach(trainer.model)
    capture = _capture(trainer, DEFAULT_CODEC)
    sizer = _Sizer(capture, codecs)
    per: dict[str, dict[str, dict[str, list[Any]]]] = {
        p: {c: {"bytes": [], "kinds": []} for c in codecs} for p in POLICIES
    }
    dirty_fraction: list[float] = []
    dirty_by_table: list[dict[str, float]] = []
    served_ref, served_q = ProgressiveMetrics(), ProgressiveMetrics()
    scratch = Path(tempfile.mkdtemp(prefix="checknrun-paper-"))
    store = open_store(f"file://{scratch / 'store'}")
    arms = [_PublishedArm(trainer, store, p, c) for p, c in PUBLISHED]
    recent = RecentSamples(DEFAULT_SCORED_SAMPLES)
    total_rows = sum(trainer.table_rows.values())
    # Known from the first boundary on, once the dense optimizer holds its state.
    dense_bytes = fp32_full = 0
    since = position = steps = 0
    started = time.perf_counter()
    train_s = 0.0
    boundary = 0
    for batch in trainer.batches(0, workload.stop):
        t0 = time.perf_counter()
        trainer.train(batch)
        train_s += time.perf_counter() - t0
        recent.add(ScoredBatch.of(batch.dense, batch.sparse, batch.labels))
        since += batch.size
        position = batch.end
        steps += 1
        if since < workload.interval_samples and position < workload.stop:
            continue
        since = 0
        boundary += 1
        dirty = tracked.tracker.snapshot_and_reset()
        n_dirty = sum(len(v) for v in dirty.values())
        dirty_fraction.append(n_dirty / total_rows)
        dirty_by_table.append(
            {t: round(len(v) / trainer.table_rows[t], 6) for t, v in dirty.items()}
        )
        if boundary == 1:
            dense_bytes = trainer.dense_bytes()
            fp32_full = full_fp32_bytes(
                ((rows, workload.embedding_dim, AUX_DIM) for rows in trainer.table_rows.values()),
                dense_bytes,
            )
        sizer.new_interval()
        plans: dict[str, Plan] = {p: pol.plan(dirty) for p, pol in policies.items()}
        for p, plan in plans.items():
            for c in codecs:
                size = sum(sizer.size(t, plan.rows[t], c) for t in tables)
                per[p][c]["bytes"].append(size + dense_bytes + MANIFEST_BYTES)
                per[p][c]["kinds"].append(plan.kind)
        for arm in arms:
            arm.publish(plans[arm.policy], steps, position, recent)
        if position < workload.stop:
            _served_eval(trainer, position, workload, served_ref, served_q)
        log(
            f"{workload.name}: interval {boundary}/{workload.intervals} dirty "
            f"{n_dirty / total_rows:.2%}, {time.perf_counter() - started:.0f} s"
        )
    for arm in arms:
        arm.close()
    tracked.detach()
    capture.close()
    restore_doc = restore_vs_torch_load(store, "paper", scratch)
    shutil.rmtree(scratch, ignore_errors=True)

    results = []
    for p in POLICIES:
        for c in codecs:
            sizes, kinds = per[p][c]["bytes"], per[p][c]["kinds"]
            st = storage(kinds, sizes, p, RETAIN)
            steady = sizes[1:] or sizes
            ref_window = fp32_full * min(RETAIN, len(sizes))
            results.append(
                {
                    "policy": p,
                    "codec": c,
                    "bytes_per_interval": sizes,
                    "kinds": kinds,
                    "bytes_mean": statistics.fmean(sizes),
                    "bytes_max": max(sizes),
                    "bandwidth_reduction_mean": fp32_full / statistics.fmean(sizes),
                    "bandwidth_reduction_max": fp32_full / max(sizes),
                    "bandwidth_reduction_steady_mean": fp32_full / statistics.fmean(steady),
                    **st,
                    "capacity_reduction_latest": fp32_full / st["latest_bytes"],
                    "capacity_reduction_mean": fp32_full
                    / statistics.fmean(st["restore_bytes_per_version"]),
                    "capacity_reduction_worst": fp32_full / max(st["restore_bytes_per_version"]),
                    "capacity_reduction_window": ref_window / st["window_bytes"],
                }
            )
    served = _served_summary(served_ref, served_q)
    return {
        "workload": workload.describe(),
        "train_s": round(train_s, 2),
        "full_fp32_bytes": fp32_full,
        "dense_bytes": dense_bytes,
        "dirty_fraction": dirty_fraction,
        "dirty_fraction_by_table": dirty_by_table,
        "results": results,
        "published_default": arms[0].describe(),
        "published": [arm.describe() for arm in arms],
        "restore": restore_doc,
        "served_default_codec": served,
    }


def _capture(trainer: BenchTrainer, codec: str) -> SnapshotCapture:
    """The trainer's own snapshot copies (trainer/snapshot_capture.py), every table `codec`."""
    tables = find_embedding_tables(trainer.model)
    codecs = {name: codec for name in tables}
    return SnapshotCapture(
        trainer.model, tables, trainer.optimizers, codecs, trainer.model.config.to_json()
    )


def _served_eval(
    trainer: BenchTrainer,
    position: int,
    workload: Workload,
    ref: ProgressiveMetrics,
    served: ProgressiveMetrics,
) -> None:
    """Score the next interval with the fp32 model and with its tables through the codec."""
    stop = min(position + workload.interval_samples, workload.stop)
    evaluate(trainer.model, trainer.batches(position, stop), ref)
    saved = {t: trainer.weight(t).detach().clone() for t in trainer.table_rows}
    with torch.no_grad():
        for t in trainer.table_rows:
            quantize_in_place(trainer.weight(t), DEFAULT_CODEC)
        evaluate(trainer.model, trainer.batches(position, stop), served)
        for t, w in saved.items():
            trainer.weight(t).copy_(w)


def _served_summary(ref: ProgressiveMetrics, served: ProgressiveMetrics) -> dict[str, Any]:
    r, q = ref.cumulative(), served.cumulative()
    if not r["samples_cumulative"]:
        return {"codec": DEFAULT_CODEC, "samples": 0}
    return {
        "codec": DEFAULT_CODEC,
        "samples": int(r["samples_cumulative"]),
        "auc_fp32": r["auc_cumulative"],
        "auc_served": q["auc_cumulative"],
        "logloss_fp32": r["logloss_cumulative"],
        "logloss_served": q["logloss_cumulative"],
        "auc_rel_degradation_pct": (r["auc_cumulative"] - q["auc_cumulative"])
        / r["auc_cumulative"]
        * 100,
        "logloss_rel_increase_pct": (q["logloss_cumulative"] - r["logloss_cumulative"])
        / r["logloss_cumulative"]
        * 100,
    }


def restore_vs_torch_load(
    store: Any, model: str, scratch: Path, repeats: int = 3
) -> dict[str, Any]:
    """Median restore of the latest default-setting version vs torch.load of the same state."""
    times = []
    state = None
    for _ in range(repeats):
        state = restore(store, model)
        times.append(state.seconds)
    assert state is not None
    full = {f"{n}.weight": torch.from_numpy(t.weights) for n, t in state.tables.items()}
    full.update({f"{n}.aux": torch.from_numpy(t.aux) for n, t in state.tables.items()})
    full.update({k: torch.from_numpy(v) for k, v in state.dense.items()})
    full.update({f"optimizer.{k}": torch.from_numpy(v) for k, v in state.optimizer.items()})
    path = scratch / "full_fp32.pt"
    torch.save(full, path)
    loads = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.load(path)
        loads.append(time.perf_counter() - t0)
    restore_s, load_s = statistics.median(times), statistics.median(loads)
    return {
        "version": state.version,
        "chain_versions": state.version - _baseline_of(store, model) + 1,
        "bytes_read": state.bytes_read,
        "restore_s_median": round(restore_s, 4),
        "torch_load_s_median": round(load_s, 4),
        "torch_load_bytes": path.stat().st_size,
        "restore_over_torch_load": round(restore_s / load_s, 3),
        "note": "both from the page cache (file store and file on the same local disk)",
    }


def _baseline_of(store: Any, model: str) -> int:
    return Catalog(store, model).find().manifest.baseline


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--synthetic-intervals",
        type=positive_int,
        default=SYNTHETIC_INTERVALS,
        metavar="N",
        help=f"checkpoints of the synthetic workload (default {SYNTHETIC_INTERVALS}: more than "
        "one cycle of the default policy; --quick: 3)",
    )


def run(
    quick: bool,
    workloads: tuple[str, ...] = WORKLOADS,
    synthetic_intervals: int = SYNTHETIC_INTERVALS,
) -> dict[str, Any]:
    """Both workloads (those installed); returns the part's document."""
    torch.set_num_threads(1)  # the trainer's default: one core trains, the other publishes
    codecs = QUICK_CODECS if quick else tuple(CODECS)
    doc: dict[str, Any] = {
        "part": "paper",
        "quick": quick,
        "machine": describe_machine(),
        "policies": list(POLICIES),
        "codecs": list(codecs),
        "retain_versions": RETAIN,
        "default": {"policy": DEFAULT_POLICY, "codec": DEFAULT_CODEC},
        "workloads": {},
    }
    for name in workloads:
        if not available(name):
            log(f"paper: {name} data not installed, skipped")
            continue
        intervals = synthetic_intervals if name == "synthetic" and not quick else None
        wl = make_workload(name, quick, intervals=intervals)
        log(f"paper: {name}: {wl.describe()}")
        doc["workloads"][name] = run_workload(wl, codecs)
    return doc
