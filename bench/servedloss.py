"""Part `servedloss`: what measuring each version's served loss costs training, and what it says.

    checknrun bench servedloss [--data movielens|FILE [column options]] [--interval-samples N]
                               [--max-samples N] [--repeats R] [--publish-in thread|process]

Arms train the same model on the same batches (`checknrun train`'s defaults: intermittent
policy, thread publisher, a file store), alternating, in one process:

- `unmeasured`: int4, `served_loss_samples=0`: checkpointing as it was before the measurement;
- `int4`, `int8`: that codec, every version scored as served next to fp32 on the latest 16,384
  samples (publisher/served_loss.py), in the publisher thread;
- `auto`: `--codec auto` (`ServedLossCodecRule` from int4, budget 0.01% relative AUC).

Cost: `int4`'s training time over `unmeasured`'s (medians over repeats, wall clock and
training-thread CPU), and the publisher's time per measurement. Figures: each measured arm's
`auc_rel_loss` per version (last repeat), and the codecs `auto` chose.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bench.machine import describe_machine, log
from bench.stall_arms import ArmSettings, build_model
from bench.workloads import Workload, file_workload, make_workload
from publisher.cli import CommandError, positive_int
from publisher.write.policies import SERVED_LOSS_BUDGET, ServedLossCodecRule
from publisher.write.publishing import reencoded_json
from trainer.checkpointer import IncrementalCheckpointer
from trainer.online import train_online
from trainer.options import DEFAULT_SCORED_SAMPLES, add_file_args, is_live
from trainer.sources import open_stream

ARMS = ("unmeasured", "int4", "int8", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The data (MovieLens-1M or a file) and the run's sizes."""
    parser.add_argument("--data", default="movielens", help="movielens or a .csv/.parquet log")
    parser.add_argument("--interval-samples", type=positive_int, help="checkpoint every N")
    parser.add_argument("--max-samples", type=positive_int, help="samples each arm trains on")
    parser.add_argument("--repeats", type=positive_int, help="rounds of alternating arms")
    parser.add_argument(
        "--publish-in",
        choices=("thread", "process"),
        default="thread",
        help="where every arm publishes (and measures): `checknrun train --publish-in`",
    )
    add_file_args(parser)


def _workload(data: str, quick: bool, interval: int | None, columns: Mapping[str, Any]) -> Workload:
    if data == "movielens":
        return make_workload("movielens", quick, interval_samples=interval)
    if is_live(data) or data == "synthetic":
        raise CommandError(f"--data {data}: give movielens or a data file")
    stream = open_stream(argparse.Namespace(data=data, **columns))
    return file_workload(data, stream, quick, interval)


def _run_arm(
    arm: str, settings: ArmSettings, workload: Workload, store: Path, publish_in: str
) -> dict[str, Any]:
    model, optimizers = build_model(settings, workload.stream)
    shutil.rmtree(store, ignore_errors=True)
    ckpt = IncrementalCheckpointer(
        model,
        optimizers,
        store=f"file://{store}",
        model_name="bench",
        policy=settings.policy,
        codec="int8" if arm == "int8" else "int4",
        interval_samples=settings.interval_samples,
        served_loss_samples=0 if arm == "unmeasured" else DEFAULT_SCORED_SAMPLES,
        codec_rule=ServedLossCodecRule("int4") if arm == "auto" else None,
        publish_in="process" if publish_in == "process" else "thread",
    )
    with ckpt:
        report = train_online(
            model,
            optimizers,
            workload.stream,
            batch_size=settings.batch_size,
            stop=settings.max_samples,
            checkpointer=ckpt,
        )
        started = time.perf_counter()
        ckpt.flush()
        flush_s = time.perf_counter() - started
    versions = [r for r in report.records if r.version is not None]
    return {
        "train_s": report.seconds,
        "train_cpu_s": report.cpu_seconds,
        "samples": report.samples,
        "stall_ms": [r.stall_ms for r in report.records],
        "flush_s": flush_s,
        "auc": report.metrics.get("auc_cumulative"),
        "versions": [
            {
                "version": r.version,
                "kind": r.published_kind,
                "codec": r.codec,
                "samples_seen": r.samples_seen,
                "measure_ms": None if r.measure_s is None else round(r.measure_s * 1e3, 2),
                "served_loss": None if r.served_loss is None else r.served_loss.model_dump(),
                "reencoded": reencoded_json(r.reencoded),
            }
            for r in versions
        ],
    }


def _losses(run: Mapping[str, Any]) -> list[float]:
    return [v["served_loss"]["auc_rel_loss"] for v in run["versions"] if v["served_loss"]]


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    last = runs[-1]
    losses = _losses(last)
    measures = [v["measure_ms"] for v in last["versions"] if v["served_loss"]]
    return {
        "train_s_median": round(statistics.median(r["train_s"] for r in runs), 3),
        "train_cpu_s_median": round(statistics.median(r["train_cpu_s"] for r in runs), 3),
        "samples_per_s_median": round(
            statistics.median(r["samples"] / r["train_s"] for r in runs), 1
        ),
        "stall_ms_median": round(statistics.median(ms for r in runs for ms in r["stall_ms"]), 3),
        "auc_cumulative": last["auc"],
        "versions": len(last["versions"]),
        "measured_versions": len(losses),
        "auc_rel_loss_median": statistics.median(losses) if losses else None,
        "auc_rel_loss_max": max(losses) if losses else None,
        "over_budget_versions": sum(loss > SERVED_LOSS_BUDGET for loss in losses),
        "encoded_again_versions": sum(1 for v in last["versions"] if v.get("reencoded")),
        "measure_ms_median": statistics.median(measures) if measures else None,
        "codecs": [v["codec"] for v in last["versions"]],
        "per_version": last["versions"],
    }


def run(
    quick: bool,
    data: str = "movielens",
    interval_samples: int | None = None,
    max_samples: int | None = None,
    repeats: int | None = None,
    publish_in: str = "thread",
    **columns: Any,
) -> dict[str, Any]:
    """Alternate the arms `repeats` times on one workload; medians, the cost and the losses."""
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.set_num_threads(1)  # `checknrun train`'s default: the publisher has the other core
    workload = _workload(data, quick, interval_samples, columns)
    settings = ArmSettings(
        embedding_dim=workload.embedding_dim,
        interval_samples=workload.interval_samples,
        max_samples=min(max_samples or workload.stop, workload.stop),
        policy="intermittent",
        codec="int4",
    )
    repeats = repeats or (1 if quick else 3)
    scratch = Path(tempfile.mkdtemp(prefix="checknrun-servedloss-"))
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    try:
        for repeat in range(repeats):
            for arm in ARMS:
                result = _run_arm(arm, settings, workload, scratch / "store", publish_in)
                runs[arm].append(result)
                log(
                    f"servedloss {workload.name} {repeat + 1}/{repeats}: {arm} "
                    f"{result['train_s']:.1f} s"
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    arms = {arm: _summary(r) for arm, r in runs.items()}
    off, on = arms["unmeasured"], arms["int4"]
    doc = {
        "part": "servedloss",
        "quick": quick,
        "machine": describe_machine(),
        "workload": workload.describe(),
        "samples_per_arm": settings.max_samples,
        "repeats": repeats,
        "publish_in": publish_in,
        "scored_samples": DEFAULT_SCORED_SAMPLES,
        "budget_auc_rel": SERVED_LOSS_BUDGET,
        "cost": {
            "train_s_ratio": round(on["train_s_median"] / off["train_s_median"], 4),
            "train_cpu_s_ratio": round(on["train_cpu_s_median"] / off["train_cpu_s_median"], 4),
            "samples_per_s_unmeasured": off["samples_per_s_median"],
            "samples_per_s_measured": on["samples_per_s_median"],
            "measure_ms_median": on["measure_ms_median"],
            "stall_ms_median_unmeasured": off["stall_ms_median"],
            "stall_ms_median_measured": on["stall_ms_median"],
        },
        "arms": arms,
    }
    _print(doc)
    return doc


def _print(doc: Mapping[str, Any]) -> None:
    c = doc["cost"]
    print(
        f"{doc['workload']['name']}: measured/unmeasured training time x{c['train_s_ratio']} "
        f"(CPU x{c['train_cpu_s_ratio']}), {c['samples_per_s_unmeasured']:,.0f} -> "
        f"{c['samples_per_s_measured']:,.0f} samples/s, {c['measure_ms_median']} ms per version "
        f"in the publisher; stall median {c['stall_ms_median_unmeasured']} -> "
        f"{c['stall_ms_median_measured']} ms"
    )
    print(
        f"{'arm':<11} {'versions':>8} {'median loss':>12} {'max loss':>10} {'over':>5} "
        f"{'again':>5}  codecs"
    )
    for arm, a in doc["arms"].items():
        median = a["auc_rel_loss_median"]
        worst = a["auc_rel_loss_max"]
        print(
            f"{arm:<11} {a['versions']:>8} "
            f"{'-' if median is None else f'{100 * median:+.4f}%':>12} "
            f"{'-' if worst is None else f'{100 * worst:+.4f}%':>10} "
            f"{a['over_budget_versions']:>5} {a.get('encoded_again_versions', 0):>5}  "
            f"{','.join(sorted(set(a['codecs'])))}"
        )
