"""Part `stall`: per-checkpoint training stall and overhead, next to torch.save and DCP async_save.

    checknrun bench stall [--data movielens|synthetic] [--table-cap N] [--interval-samples N]
                          [--max-samples N] [--repeats R] [--policy P] [--codec C] [--quick]

The arms train the same model on the same batches, alternating, in one process:

- `off` and `on` are bench/stall_arms.py's arms: `off` writes the full state with `torch.save`
  at every boundary (that time is measured and left out of its training time); `on` runs
  `IncrementalCheckpointer` with the policy and codec (by default the trainer's), publishing to
  a file store.
- `on-process`: the same checkpointer with `publish_in="process"` (encode and commit in a
  child process, off the training process's GIL).
- `on-nice-10`: the same checkpointer with its publisher threads at nice +10
  (`Tunables.publisher_nice`; the default leaves them at the training thread's priority).
- `dcp`: `torch.distributed.checkpoint.async_save` of the same state (single process) at every
  boundary; its stall is the call's blocking time plus any wait for the previous save.
- `bare`, `tracker`, `tracker-lookup` (bench/stall_arms.py): plain training, and training with
  the dirty-row tracking alone, marked at the optimizer step or per lookup: the "tracking"
  section's ratios, with each delta's stall next to a bare copy of its rows.

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
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp

from bench.machine import describe_machine, log
from bench.paper import restore_vs_torch_load
from bench.stall_arms import (
    ArmSettings,
    build_model,
    run_bare,
    run_off,
    run_on,
    summarise,
    summarise_tracking,
)
from bench.workloads import DEFAULT_CODEC, DEFAULT_POLICY, WORKLOADS, available, make_workload
from publisher.store import open_store
from publisher.tunables import DEFAULT_TUNABLES
from publisher.write.policies import POLICIES
from schemas.codec_names import CODECS
from trainer.checkpointer import IncrementalCheckpointer
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One workload, its sizes, the policy and codec; unset sizes are the README run's (FULL or
    QUICK)."""
    parser.add_argument("--data", choices=WORKLOADS, help="only this workload (default: both)")
    parser.add_argument("--table-cap", type=int, help="synthetic: rows per table at most")
    parser.add_argument("--interval-samples", type=int, help="a checkpoint every N samples")
    parser.add_argument("--max-samples", type=int, help="samples each arm trains on")
    parser.add_argument("--repeats", type=int, help="rounds of the alternating arms")
    parser.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY)
    parser.add_argument("--codec", choices=CODECS, default=DEFAULT_CODEC)


def run_dcp(args: ArmSettings, stream: InteractionStream, scratch: Path) -> dict[str, Any]:
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


def run_on_process(args: ArmSettings, stream: InteractionStream, scratch: Path) -> dict[str, Any]:
    """stall_arms's `on` arm with `publish_in="process"`: encode and commit in a child process.

    Separate from `run_on` because that arm has no such knob; the thread publisher shares the
    GIL with the training loop, the process publisher does not
    (publisher/write/process_publisher.py).
    """
    return _run_variant(args, stream, scratch / "store-process", publish_in="process")


def run_on_nice_10(args: ArmSettings, stream: InteractionStream, scratch: Path) -> dict[str, Any]:
    """stall_arms's `on` arm with the publisher's threads at nice +10 (`Tunables.publisher_nice`,
    default 0): what a lower priority for the publisher buys the training thread."""
    tunables = replace(DEFAULT_TUNABLES, publisher_nice=10)
    return _run_variant(args, stream, scratch / "store-nice-10", tunables=tunables)


def _run_variant(
    args: ArmSettings, stream: InteractionStream, store: Path, **options: Any
) -> dict[str, Any]:
    """The `on` arm's checkpointer with other `options`, into a fresh `store`."""
    model, optimizers = build_model(args, stream)
    shutil.rmtree(store, ignore_errors=True)
    ckpt = IncrementalCheckpointer(
        model,
        optimizers,
        store=f"file://{store}",
        model_name="bench",
        policy=args.policy,
        codec=args.codec,
        interval_samples=args.interval_samples,
        **options,
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
    data: str,
    cap: int | None,
    interval: int,
    samples: int,
    repeats: int,
    policy: str = DEFAULT_POLICY,
    codec: str = DEFAULT_CODEC,
) -> dict[str, Any]:
    """Alternate off / on / on-process / dcp `repeats` times on one workload; medians and ratios."""
    warnings.filterwarnings("ignore")
    workload = make_workload(data, quick=False, table_cap=cap)  # quick or not: sizes are given
    stream = workload.stream
    args = ArmSettings(
        embedding_dim=workload.embedding_dim,
        interval_samples=interval,
        max_samples=samples,
        policy=policy,
        codec=codec,
    )
    scratch = Path(tempfile.mkdtemp(prefix="checknrun-stall-"))
    offs: list[dict[str, Any]] = []
    ons: list[dict[str, Any]] = []
    dcps: list[dict[str, Any]] = []
    procs: list[dict[str, Any]] = []
    nice_10: list[dict[str, Any]] = []
    bare: list[dict[str, Any]] = []
    tracker: list[dict[str, Any]] = []
    lookup: list[dict[str, Any]] = []
    arms: tuple[tuple[str, Callable[[ArmSettings, InteractionStream, Path], Any], list[Any]], ...]
    arms = (
        ("bare", lambda a, s, _: run_bare(a, s), bare),
        ("off", run_off, offs),
        ("tracker", lambda a, s, _: run_bare(a, s, "step"), tracker),
        ("on", run_on, ons),
        ("tracker-lookup", lambda a, s, _: run_bare(a, s, "lookup"), lookup),
        ("on-process", run_on_process, procs),
        ("on-nice-10", run_on_nice_10, nice_10),
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
    off_cpu = statistics.median(r["train_cpu_s"] for r in offs)
    proc_stalls = [ms for r in procs for ms in r["stall_ms"]]
    return {
        "data": data,
        "table_cap": cap,
        "interval_samples": interval,
        "samples": samples,
        "repeats": repeats,
        "policy": policy,
        "codec": codec,
        "summary": summary,
        "tracking": summarise_tracking(bare, tracker, lookup, ons),
        "dcp": {
            "train_s": round(dcp_s, 3),
            "overhead_pct": round((dcp_s / off_s - 1) * 100, 2),
            "stall_ms_median": None if dcp_ms is None else round(dcp_ms, 3),
            "stall_ms_max": round(max(dcp_stalls), 3) if dcp_stalls else None,
        },
        "process_publisher": {
            **_variant_overhead(procs, off_s, off_cpu),
            "stall_ms_median": round(statistics.median(proc_stalls), 3) if proc_stalls else None,
        },
        "publisher_nice_10": _variant_overhead(nice_10, off_s, off_cpu),
        "stall_over_torch_save": round(stall / save, 5) if stall and save else None,
        "stall_over_dcp_async": round(stall / dcp_ms, 4) if stall and dcp_ms else None,
        "restore": restore,
        "checkpoints": ons[-1]["records"],
    }


def _variant_overhead(runs: list[dict[str, Any]], off_s: float, off_cpu: float) -> dict[str, float]:
    """A checkpointer variant's median training time, and its wall and CPU overhead over `off`."""
    train_s = statistics.median(r["train_s"] for r in runs)
    train_cpu = statistics.median(r["train_cpu_s"] for r in runs)
    return {
        "train_s": round(train_s, 3),
        "overhead_pct": round((train_s / off_s - 1) * 100, 2),
        "overhead_cpu_pct": round((train_cpu / off_cpu - 1) * 100, 2),
    }


def run(
    quick: bool,
    *,
    data: str | None = None,
    table_cap: int | None = None,
    interval_samples: int | None = None,
    max_samples: int | None = None,
    repeats: int | None = None,
    policy: str = DEFAULT_POLICY,
    codec: str = DEFAULT_CODEC,
) -> dict[str, Any]:
    """Both workloads (MovieLens when installed) or `data`; returns the part's document.

    Sizes left None are the README run's (FULL, or QUICK with `quick`).
    """
    torch.set_num_threads(1)  # the trainer's default (--threads 1)
    doc: dict[str, Any] = {"part": "stall", "quick": quick, "machine": describe_machine()}
    doc["workloads"] = {}
    for name, cap, interval, samples, rounds in QUICK if quick else FULL:
        if data is not None and name != data:
            continue
        if not available(name):
            log(f"stall: {name} data not installed, skipped")
            continue
        doc["workloads"][name] = run_workload(
            name,
            table_cap or cap,
            interval_samples or interval,
            max_samples or samples,
            repeats or rounds,
            policy,
            codec,
        )
    return doc
