"""The `off` and `on` arms of the `stall` part: what checkpointing costs the trainer.

Each arm runs the same training (same seed, same batches) as the part alternates them:

- `off`: no incremental checkpointing. At every interval boundary the full state (model
  state_dict and optimizer state_dicts) is written with `torch.save` to a local file, the
  synchronous checkpoint a plain PyTorch trainer would stall on; that time is measured per
  checkpoint and left out of the arm's training time.
- `on`: `IncrementalCheckpointer` with the given policy and codec, publishing to a file store in
  the scratch directory. Right after each delta's stall it also times a bare `index_select` of
  the same dirty rows into touched buffers (the copy floor the stall is compared with); that
  time is left out of its training time.
- `bare`: training only, nothing tracked; `tracker`: training with the checkpointer's dirty-row
  tracking alone (marked at the optimizer step), `tracker-lookup`: with a hook per lookup (how
  it was marked before). Their ratios to `bare` are what tracking costs.

Overhead = (training time on / training time off) - 1, from the medians over the repeats. The
machine is shared, so alternating arms and taking medians is what keeps noise from deciding.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from publisher.dlrm import DLRM
from publisher.write.tracker import attach
from schemas.manifest import ratio_to_full_fp32
from trainer.checkpointer import IncrementalCheckpointer
from trainer.online import (
    DLRMSettings,
    TrainingReport,
    build_dlrm,
    build_optimizers,
    train_online,
)
from trainer.streams.base import Batch, InteractionStream


@dataclass(frozen=True)
class ArmSettings:
    """The training every arm repeats: the model and optimizers `checknrun train` builds by
    default (for the data's embedding dim), and the checkpoint settings."""

    embedding_dim: int
    interval_samples: int
    max_samples: int
    policy: str
    codec: str
    batch_size: int = 512
    seed: int = 0


def build_model(
    args: ArmSettings, stream: InteractionStream
) -> tuple[DLRM, list[torch.optim.Optimizer]]:
    """A fresh model and optimizers: the same initial weights for every arm and repeat."""
    model = build_dlrm(
        stream.features,
        stream.dense_names,
        DLRMSettings(embedding_dim=args.embedding_dim),
        seed=args.seed,
    )
    return model, build_optimizers(model)


def _stop(args: ArmSettings, stream: InteractionStream) -> int:
    stop = args.max_samples or stream.num_samples
    if stop is None:
        raise SystemExit("the synthetic stream never ends: give --max-samples")
    return min(stop, stream.num_samples or stop)


def _train(
    args: ArmSettings,
    stream: InteractionStream,
    model: DLRM,
    optimizers: list[torch.optim.Optimizer],
    on_batch: Callable[[Batch, object], None],
    checkpointer: IncrementalCheckpointer | None = None,
) -> TrainingReport:
    """One arm's training pass over the same batches as every other arm."""
    return train_online(
        model,
        optimizers,
        stream,
        batch_size=args.batch_size,
        stop=_stop(args, stream),
        checkpointer=checkpointer,
        on_batch=on_batch,
    )


def run_off(args: ArmSettings, stream: InteractionStream, scratch: Path) -> dict[str, Any]:
    """Train without incremental checkpoints; torch.save the full state at each boundary."""
    model, optimizers = build_model(args, stream)
    interval = args.interval_samples
    path = scratch / "torch_save.pt"
    saves: list[float] = []
    save_cpu: list[float] = []
    since = 0
    size = 0

    def on_batch(batch: Batch, _: object) -> None:
        nonlocal since, size
        since += batch.size
        if since < interval:
            return
        since = 0
        started, cpu_started = time.perf_counter(), time.thread_time()
        torch.save(
            {"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers]},
            path,
        )
        saves.append(time.perf_counter() - started)
        save_cpu.append(time.thread_time() - cpu_started)
        size = path.stat().st_size

    report = _train(args, stream, model, optimizers, on_batch)
    path.unlink(missing_ok=True)
    return {
        "train_s": report.seconds - sum(saves),
        "train_cpu_s": report.cpu_seconds - sum(save_cpu),
        "samples": report.samples,
        "torch_save_ms": [s * 1e3 for s in saves],
        "torch_save_bytes": size,
        "auc": report.metrics.get("auc_cumulative"),
    }


def run_bare(
    args: ArmSettings,
    stream: InteractionStream,
    tracking: Literal["none", "step", "lookup"] = "none",
) -> dict[str, Any]:
    """Train only; with `tracking`, mark dirty rows as the checkpointer does (at the step) or
    with a hook per lookup, and read and reset the bitmaps at each interval boundary."""
    model, optimizers = build_model(args, stream)
    tracked = None
    if tracking != "none":
        tracked = attach(model, optimizers=optimizers if tracking == "step" else ())
    since = 0

    def on_batch(batch: Batch, _: object) -> None:
        nonlocal since
        since += batch.size
        if since >= args.interval_samples and tracked is not None:
            since = 0
            tracked.tracker.snapshot_and_reset()

    report = _train(args, stream, model, optimizers, on_batch)
    if tracked is not None:
        tracked.detach()
    return {"train_s": report.seconds, "train_cpu_s": report.cpu_seconds}


class BareCopy:
    """Times `index_select` of given rows of the live tables into buffers touched beforehand:
    the least a stall that copies those rows can cost.

    It runs right after the stall copied the same rows, so it first writes 64 MiB elsewhere:
    the rows must come from memory, as the stall's did, not from the cache the stall filled.
    """

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights
        self.buffers: dict[str, torch.Tensor] = {}
        self._evict = torch.zeros(16 << 20)

    def __call__(self, rows: dict[str, np.ndarray]) -> tuple[float, float]:
        """Seconds (wall, CPU of this thread) to copy `rows` (table -> sorted ids)."""
        for name, ids in rows.items():  # (re)allocated and touched outside the timing
            if name not in self.buffers or len(self.buffers[name]) < len(ids):
                shape = (int(len(ids) * 1.25), int(self.weights[name].shape[1]))
                self.buffers[name] = torch.zeros(shape).fill_(0.0)
        self._evict.fill_(1.0)
        started, started_cpu = time.perf_counter(), time.thread_time()
        for name, ids in rows.items():
            out = self.buffers[name][: len(ids)]
            torch.index_select(self.weights[name], 0, torch.from_numpy(ids), out=out)
        return time.perf_counter() - started, time.thread_time() - started_cpu


def run_on(args: ArmSettings, stream: InteractionStream, scratch: Path) -> dict[str, Any]:
    """Train with the incremental checkpointer publishing to a file store."""
    model, optimizers = build_model(args, stream)
    store = f"file://{scratch / 'store'}"
    ckpt = IncrementalCheckpointer(
        model,
        optimizers,
        store=store,
        model_name="bench",
        policy=args.policy,
        codec=args.codec,
        interval_samples=args.interval_samples,
    )
    bare_copy = BareCopy({name: t.weight.detach() for name, t in ckpt.tables.items()})
    #: record index -> seconds (wall, CPU) of the bare copy of its rows
    copies: dict[int, tuple[float, float]] = {}
    copies_cpu = 0.0

    def on_batch(batch: Batch, _: object) -> None:
        nonlocal copies_cpu
        record = ckpt.records[-1] if ckpt.records else None
        if record is None or record.kind != "delta" or record.index in copies:
            return
        cpu_started = time.thread_time()
        copies[record.index] = bare_copy(ckpt.last_dirty)
        copies_cpu += time.thread_time() - cpu_started

    with ckpt:
        report = _train(args, stream, model, optimizers, on_batch, checkpointer=ckpt)
        started = time.perf_counter()
        ckpt.flush()
        flush_s = time.perf_counter() - started
        merges = ckpt.background.merges
        peak = ckpt.background.peak_pending_bytes
    records = [r.to_json() for r in report.records]
    for rec in records:
        if rec["index"] in copies:
            wall, cpu = copies[rec["index"]]
            rec["bare_copy_ms"], rec["bare_copy_cpu_ms"] = round(wall * 1e3, 3), round(cpu * 1e3, 3)
    return {
        "train_s": report.seconds - sum(wall for wall, _ in copies.values()),
        "train_cpu_s": report.cpu_seconds - copies_cpu,
        "samples": report.samples,
        "flush_s": flush_s,
        "merges": merges,
        "peak_pending_bytes": peak,
        "records": records,
        "auc": report.metrics.get("auc_cumulative"),
    }


def _overhead(arm: list[dict[str, Any]], reference: list[dict[str, Any]], key: str) -> float | None:
    """Percent more of `key` (median over repeats) in `arm` than in `reference`."""
    if not arm or not reference:
        return None
    ratio = float(statistics.median(r[key] for r in arm)) / float(
        statistics.median(r[key] for r in reference)
    )
    return round((ratio - 1) * 100, 2)


def summarise_tracking(
    bare: list[dict[str, Any]],
    tracker: list[dict[str, Any]],
    lookup: list[dict[str, Any]],
    ons: list[dict[str, Any]],
) -> dict[str, Any]:
    """What tracking and checkpointing cost next to plain training, and each delta's stall next
    to a bare copy of its rows (median of the per-checkpoint ratios)."""
    deltas = [
        rec for r in ons for rec in r["records"] if rec["kind"] == "delta" and "bare_copy_ms" in rec
    ]
    fulls = [rec for r in ons for rec in r["records"] if rec["kind"] == "full"]
    return {
        "train_s_bare": round(statistics.median(r["train_s"] for r in bare), 3),
        "tracker_overhead_pct": _overhead(tracker, bare, "train_s"),
        "tracker_overhead_cpu_pct": _overhead(tracker, bare, "train_cpu_s"),
        "tracker_lookup_overhead_pct": _overhead(lookup, bare, "train_s"),
        "tracker_lookup_overhead_cpu_pct": _overhead(lookup, bare, "train_cpu_s"),
        "on_over_bare_pct": _overhead(ons, bare, "train_s"),
        "on_over_bare_cpu_pct": _overhead(ons, bare, "train_cpu_s"),
        "delta_stall_ms_median": (
            round(statistics.median(rec["stall_ms"] for rec in deltas), 3) if deltas else None
        ),
        "bare_copy_ms_median": (
            round(statistics.median(rec["bare_copy_ms"] for rec in deltas), 3) if deltas else None
        ),
        "delta_stall_over_bare_copy_median": (
            round(statistics.median(rec["stall_ms"] / rec["bare_copy_ms"] for rec in deltas), 3)
            if deltas
            else None
        ),
        "delta_stall_cpu_ms_median": (
            round(statistics.median(rec["stall_cpu_ms"] for rec in deltas), 3) if deltas else None
        ),
        "bare_copy_cpu_ms_median": (
            round(statistics.median(rec["bare_copy_cpu_ms"] for rec in deltas), 3)
            if deltas
            else None
        ),
        "delta_stall_cpu_over_bare_copy_cpu_median": (
            round(
                statistics.median(rec["stall_cpu_ms"] / rec["bare_copy_cpu_ms"] for rec in deltas),
                3,
            )
            if deltas
            else None
        ),
        "full_longest_stop_ms_max": (
            round(max(rec["stall_ms"] for rec in fulls), 3) if fulls else None
        ),
    }


def summarise(offs: list[dict[str, Any]], ons: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats and per-checkpoint statistics of the last `on` run."""
    off_s = statistics.median(r["train_s"] for r in offs)
    on_s = statistics.median(r["train_s"] for r in ons)
    off_cpu = statistics.median(r["train_cpu_s"] for r in offs)
    on_cpu = statistics.median(r["train_cpu_s"] for r in ons)
    saves = [ms for r in offs for ms in r["torch_save_ms"]]
    stalls = [rec["stall_ms"] for r in ons for rec in r["records"]]
    last = ons[-1]["records"]
    published = [rec for rec in last if rec["bytes"]]
    written = sum(rec["bytes"] for rec in published)
    full = sum(rec["full_fp32_bytes"] for rec in published)
    dirty = [rec["dirty_fraction_total"] for rec in last]
    deltas = [rec for rec in published if rec["kind"] == "delta"]
    return {
        "samples": ons[-1]["samples"],
        "train_s_off": round(off_s, 3),
        "train_s_on": round(on_s, 3),
        "overhead_pct": round((on_s / off_s - 1) * 100, 2),
        "train_cpu_s_off": round(off_cpu, 3),
        "train_cpu_s_on": round(on_cpu, 3),
        "overhead_cpu_pct": round((on_cpu / off_cpu - 1) * 100, 2),
        "stall_total_s": round(sum(stalls) / 1e3 / len(ons), 3),
        "samples_per_s_off": round(ons[-1]["samples"] / off_s, 1),
        "samples_per_s_on": round(ons[-1]["samples"] / on_s, 1),
        "checkpoints": len(last),
        "stall_ms_median": round(statistics.median(stalls), 3) if stalls else None,
        "stall_ms_max": round(max(stalls), 3) if stalls else None,
        "torch_save_ms_median": round(statistics.median(saves), 3) if saves else None,
        "torch_save_ms_max": round(max(saves), 3) if saves else None,
        "torch_save_bytes": offs[-1]["torch_save_bytes"],
        "dirty_fraction_median": round(float(np.median(dirty)), 6) if dirty else None,
        "dirty_fraction_max": round(max(dirty), 6) if dirty else None,
        "bytes_written": written,
        "full_fp32_bytes": full,
        "ratio_overall": round(ratio_to_full_fp32(full, written), 2) if written else None,
        "ratio_delta_median": (
            round(statistics.median(r["ratio"] for r in deltas), 2) if deltas else None
        ),
        "versions": len(published),
        "merges": ons[-1]["merges"],
        "flush_s": round(ons[-1]["flush_s"], 3),
        "peak_pending_bytes": ons[-1]["peak_pending_bytes"],
        "auc_off": offs[-1]["auc"],
        "auc_on": ons[-1]["auc"],
    }
