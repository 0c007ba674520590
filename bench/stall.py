"""Part `stall`: per-checkpoint training stall and overhead, next to torch.save and DCP async_save.

Three arms train the same model on the same batches, alternating, in one process:

- `off` and `on` are bench.stall_arms's arms: `off` writes the full state with `torch.save`
  at every boundary (that time is measured and left out of its training time); `on` runs
  `IncrementalCheckpointer` with the default policy and codec, publishing to a file store.
- `on-process`: the same checkpointer with `publish_in="process"` (encode and commit in a
  child process, off the training process's GIL).
- `dcp`: `torch.distributed.checkpoint.async_save` of the same state (single process) at every
  boundary; its stall is the call's blocking time plus any wait for the previous save.

Overhead is training time relative to `off`'s, from medians over repeats. Restore of the `on`
arm's latest version (baseline + chain) is timed next to `torch.load` of the same state.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp

from bench.machine import describe_machine, log
from bench.paper import restore_vs_torch_load
from bench.stall_arms import run_off, run_on, summarise
from bench.workloads import DEFAULT_CODEC, DEFAULT_POLICY, available
from publisher.store import open_store
from trainer.checkpointer import IncrementalCheckpointer
from trainer.cli import add_train_args, build_model, open_stream
from trainer.online import (
    train_online,
)
from trainer.streams.base import Batch, InteractionStream

#: (workload, table cap, interval samples, samples, repeats) for full and quick runs.
FULL = (
    ("movielens", None, 50_000, 1_000_209, 3),
    ("synthetic", 730_000, 50_000, 1_000_000, 2),
)
QUICK = (
    ("movielens", None, 5_000, 15_000, 1),
    ("synthetic", 500, 2_000, 6_000, 1),
)


def _args(data: str, cap: int | None, interval: int, samples: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    argv = [
        "--data",
        data,
        "--policy",
        DEFAULT_POLICY,
        "--codec",
        DEFAULT_CODEC,
        "--interval-samples",
        str(interval),
        "--max-samples",
        str(samples),
    ]
    if cap is not None:
        argv += ["--table-cap", str(cap)]
    args = parser.parse_args(argv)
    args.store = None  # bench_stall's arms publish to a file store in their scratch directory
    return args


def run_dcp(args: argparse.Namespace, stream: InteractionStream, scratch: Path) -> dict[str, Any]:
    """Train with DCP async_save of the full state at each boundary."""
    model, optimizers = build_model(args, stream)
    stalls: list[float] = []
    pending: Future[Any] | None = None
    since = 0
    count = 0

    def on_batch(batch: Batch, _: object) -> None:
        nonlocal since, pending, count
        since += batch.size
        if since < args.interval_samples:
            return
        since = 0
        started = time.perf_counter()
        if pending is not None:
            pending.result()  # one save in flight at a time, as a real trainer would
        state = {"model": model.state_dict()}
        state.update({f"optimizer{i}": o.state_dict() for i, o in enumerate(optimizers)})
        count += 1
        pending = cast(
            "Future[Any]",
            dcp.async_save(state, checkpoint_id=str(scratch / f"dcp-{count % 2}")),  # type: ignore[attr-defined]
        )
        stalls.append(time.perf_counter() - started)

    stop = min(args.max_samples, stream.num_samples or args.max_samples)
    report = train_online(
        model, optimizers, stream, batch_size=args.batch_size, stop=stop, on_batch=on_batch
    )
    if pending is not None:
        pending.result()
    return {
        "train_s": report.seconds,
        "train_cpu_s": report.cpu_seconds,
        "stall_ms": [s * 1e3 for s in stalls],
    }


def run_on_process(
    args: argparse.Namespace, stream: InteractionStream, scratch: Path
) -> dict[str, Any]:
    """bench_stall's `on` arm with `publish_in="process"`: encode and commit in a child process.

    Separate from `run_on` because that arm has no such knob; the thread publisher shares the
    GIL with the training loop, the process publisher does not
    (publisher/write/process_publisher.py).
    """
    model, optimizers = build_model(args, stream)
    shutil.rmtree(scratch / "store-process", ignore_errors=True)
    ckpt = IncrementalCheckpointer(
        model,
        optimizers,
        store=f"file://{scratch / 'store-process'}",
        model_name="bench",
        policy=args.policy,
        codec=args.codec,
        interval_samples=args.interval_samples,
        publish_in="process",
    )
    stop = min(args.max_samples, stream.num_samples or args.max_samples)
    with ckpt:
        report = train_online(
            model, optimizers, stream, batch_size=args.batch_size, stop=stop, checkpointer=ckpt
        )
        ckpt.flush()
    return {
        "train_s": report.seconds,
        "train_cpu_s": report.cpu_seconds,
        "stall_ms": [r.stall_ms for r in report.records],
    }


def run_workload(
    data: str, cap: int | None, interval: int, samples: int, repeats: int
) -> dict[str, Any]:
    """Alternate off / on / on-process / dcp `repeats` times on one workload; medians and ratios."""
    warnings.filterwarnings("ignore")
    args = _args(data, cap, interval, samples)
    stream = open_stream(args)
    scratch = Path(tempfile.mkdtemp(prefix="checknrun-stall-"))
    offs: list[dict[str, Any]] = []
    ons: list[dict[str, Any]] = []
    dcps: list[dict[str, Any]] = []
    procs: list[dict[str, Any]] = []
    arms = (
        ("off", run_off, offs),
        ("on", run_on, ons),
        ("on-process", run_on_process, procs),
        ("dcp", run_dcp, dcps),
    )
    try:
        for repeat in range(repeats):
            for arm, fn, out in arms:
                if arm == "on":
                    shutil.rmtree(scratch / "store", ignore_errors=True)
                out.append(fn(args, stream, scratch))
                log(f"stall {data} repeat {repeat + 1}/{repeats}: {arm} {out[-1]['train_s']:.1f} s")
        summary = summarise(offs, ons)
        restore = restore_vs_torch_load(open_store(f"file://{scratch / 'store'}"), "bench", scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    off_s = statistics.median(r["train_s"] for r in offs)
    dcp_s = statistics.median(r["train_s"] for r in dcps)
    dcp_stalls = [ms for r in dcps for ms in r["stall_ms"]]
    stall = summary["stall_ms_median"]
    save = summary["torch_save_ms_median"]
    dcp_ms = statistics.median(dcp_stalls) if dcp_stalls else None
    proc_s = statistics.median(r["train_s"] for r in procs)
    proc_cpu = statistics.median(r["train_cpu_s"] for r in procs)
    off_cpu = statistics.median(r["train_cpu_s"] for r in offs)
    proc_stalls = [ms for r in procs for ms in r["stall_ms"]]
    return {
        "data": data,
        "table_cap": cap,
        "interval_samples": interval,
        "samples": samples,
        "repeats": repeats,
        "policy": DEFAULT_POLICY,
        "codec": DEFAULT_CODEC,
        "summary": summary,
        "dcp": {
            "train_s": round(dcp_s, 3),
            "overhead_pct": round((dcp_s / off_s - 1) * 100, 2),
            "stall_ms_median": None if dcp_ms is None else round(dcp_ms, 3),
            "stall_ms_max": round(max(dcp_stalls), 3) if dcp_stalls else None,
        },
        "process_publisher": {
            "train_s": round(proc_s, 3),
            "overhead_pct": round((proc_s / off_s - 1) * 100, 2),
            "overhead_cpu_pct": round((proc_cpu / off_cpu - 1) * 100, 2),
            "stall_ms_median": round(statistics.median(proc_stalls), 3) if proc_stalls else None,
        },
        "stall_over_torch_save": round(stall / save, 5) if stall and save else None,
        "stall_over_dcp_async": round(stall / dcp_ms, 4) if stall and dcp_ms else None,
        "restore": restore,
        "checkpoints": ons[-1]["records"],
    }


def run(quick: bool) -> dict[str, Any]:
    """Both workloads (MovieLens when installed); returns the part's document."""
    torch.set_num_threads(1)  # the trainer's default (--threads 1)
    doc: dict[str, Any] = {"part": "stall", "quick": quick, "machine": describe_machine()}
    doc["workloads"] = {}
    for data, cap, interval, samples, repeats in QUICK if quick else FULL:
        if not available(data):
            log(f"stall: {data} data not installed, skipped")
            continue
        doc["workloads"][data] = run_workload(data, cap, interval, samples, repeats)
    return doc
