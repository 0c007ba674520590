"""The online training loop: progressive validation, training, checkpoints at interval boundaries.

    model = build_dlrm(stream.features, stream.dense_names, DLRMSettings(), seed=0)
    optimizers = build_optimizers(model, OptimizerSettings())
    report = train_online(model, optimizers, stream, batch_size=512, checkpointer=ckpt)

Each batch is first scored (those pre-update predictions feed the AUC / log loss, the online
metrics), then trained on; then the checkpointer is told about the step and may checkpoint. The
same loop runs with `checkpointer=None` to measure what checkpointing costs.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from publisher.dlrm import DLRM, DLRMConfig, SparseFeature
from schemas.manifest import ratio_to_full_fp32
from trainer.checkpointer import CheckpointRecord, IncrementalCheckpointer
from trainer.options import DENSE_OPTIMIZERS, SPARSE_OPTIMIZERS
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.rowwise_adagrad import RowWiseAdagrad
from trainer.streams.base import Batch, InteractionStream


@dataclass(frozen=True)
class DLRMSettings:
    """Architecture knobs (table sizes come from the stream)."""

    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64,)
    top_mlp: tuple[int, ...] = (64, 32)


@dataclass(frozen=True)
class OptimizerSettings:
    """Embedding rows get a sparse optimizer, the MLPs a dense one."""

    sparse: str = "rowwise-adagrad"
    sparse_lr: float = 0.05
    dense: str = "adam"
    dense_lr: float = 1e-3


def build_dlrm(
    features: Sequence[SparseFeature],
    dense_names: Sequence[str],
    settings: DLRMSettings = DLRMSettings(),
    *,
    seed: int = 0,
    extra: dict[str, Any] | None = None,
) -> DLRM:
    """A DLRM sized for a stream, its initial weights a function of `seed` only."""
    config = dlrm_config(features, dense_names, settings, extra=extra)
    torch.manual_seed(seed)
    return DLRM(config)


def dlrm_config(
    features: Sequence[SparseFeature],
    dense_names: Sequence[str],
    settings: DLRMSettings = DLRMSettings(),
    *,
    extra: dict[str, Any] | None = None,
) -> DLRMConfig:
    """The architecture of a DLRM sized for a stream (also the sharded trainer's)."""
    return DLRMConfig(
        sparse=tuple(features),
        dense=tuple(dense_names),
        embedding_dim=settings.embedding_dim,
        bottom_mlp=settings.bottom_mlp,
        top_mlp=settings.top_mlp,
        extra=dict(extra or {}),
    )


def build_optimizers(
    model: DLRM,
    settings: OptimizerSettings = OptimizerSettings(),
) -> list[torch.optim.Optimizer]:
    """[sparse optimizer over the embedding tables, dense optimizer over everything else]."""
    tables = [p for p in model.embeddings.parameters()]
    table_ids = {id(p) for p in tables}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    sparse_opt: torch.optim.Optimizer
    if settings.sparse == "rowwise-adagrad":
        sparse_opt = RowWiseAdagrad(tables, lr=settings.sparse_lr)
    elif settings.sparse == "adagrad":
        sparse_opt = torch.optim.Adagrad(tables, lr=settings.sparse_lr)
    elif settings.sparse == "sgd":
        sparse_opt = torch.optim.SGD(tables, lr=settings.sparse_lr)
    else:
        raise ValueError(
            f"unknown sparse optimizer {settings.sparse!r}; one of {SPARSE_OPTIMIZERS}"
        )
    return [sparse_opt, dense_optimizer(dense, settings.dense, settings.dense_lr)]


def dense_optimizer(params: Sequence[torch.Tensor], name: str, lr: float) -> torch.optim.Optimizer:
    """The optimizer `name` (one of DENSE_OPTIMIZERS) of the dense parameters."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"unknown dense optimizer {name!r}; one of {DENSE_OPTIMIZERS}")


@dataclass
class TrainingReport:
    """What one run of the loop did."""

    start_offset: int
    end_offset: int
    samples: int
    steps: int
    seconds: float
    #: CPU time of the training thread: unlike `seconds`, not inflated by other processes
    #: taking the cores (this machine is shared), but blind to waiting for the GIL.
    cpu_seconds: float
    metrics: dict[str, float]
    records: list[CheckpointRecord] = field(default_factory=list)
    stopped: bool = False

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Stall median/max, bytes, ratios and merges over the run's checkpoints."""
        stalls = [r.stall_ms for r in self.records]
        published = [r for r in self.records if r.version is not None]
        written = sum(r.bytes or 0 for r in published)
        full = sum(r.full_fp32_bytes or 0 for r in published)
        return {
            "checkpoints": len(self.records),
            "versions": len(published),
            "merged": sum(1 for r in self.records if r.merged_into is not None),
            "stall_ms_median": round(statistics.median(stalls), 3) if stalls else None,
            "stall_ms_max": round(max(stalls), 3) if stalls else None,
            "bytes_written": written,
            "full_fp32_bytes": full,
            "ratio": round(ratio_to_full_fp32(full, written), 3) if written else None,
            "last_version": published[-1].version if published else None,
        }


def train_step(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Batch,
    metrics: ProgressiveMetrics | None = None,
) -> float:
    """Score the batch (progressive validation), then train on it; returns the batch loss."""
    logits = model(batch.dense, batch.sparse)
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
    if metrics is not None:
        metrics.update(logits.detach(), batch.labels)
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    torch.autograd.backward(loss)
    for optimizer in optimizers:
        optimizer.step()
    return float(loss.detach())


def train_online(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    stream: InteractionStream,
    *,
    batch_size: int,
    start: int = 0,
    stop: int | None = None,
    checkpointer: IncrementalCheckpointer | None = None,
    metrics: ProgressiveMetrics | None = None,
    final_checkpoint: bool = True,
    on_batch: Callable[[Batch, ProgressiveMetrics], None] | None = None,
    on_wait: Callable[[], None] | None = None,
    stop_event: threading.Event | None = None,
) -> TrainingReport:
    """Train on `stream` from offset `start` to `stop` (or its end), checkpointing on the way.

    Checkpoints happen only at batch boundaries, with the reader position of the next sample,
    so a resumed run replays exactly the batches an uninterrupted run would. With
    `final_checkpoint`, the samples after the last interval boundary are checkpointed at the
    end (or when `stop_event` is set, which is checked between batches). `on_batch` is called
    after each batch trained, `on_wait` each time a live stream waited for events in vain
    (`InteractionStream.on_idle`, every `POLL_S` of trainer/streams/kafka_events.py).
    """
    metrics = metrics or ProgressiveMetrics()
    model.train()
    position = start
    steps = samples = 0
    stopped = False
    first_record = len(checkpointer.records) if checkpointer is not None else 0
    started = time.perf_counter()
    cpu_started = time.thread_time()

    def checkpoint_metrics() -> dict[str, float]:
        return {**metrics.take_window(), **stream.metrics()}

    checkpointed_reader = None
    untrained = True  # nothing trained since the last checkpoint

    def on_idle() -> None:
        # The stream is quiet: publish what was trained once the interval has passed, or a
        # new id would wait for the next event to be served.
        nonlocal checkpointed_reader, untrained
        if on_wait is not None:
            on_wait()
        if checkpointer is None or untrained:
            return
        reader = stream.reader_state(position)
        if checkpointer.maybe_checkpoint(reader, checkpoint_metrics) is not None:
            checkpointed_reader, untrained = reader, True

    stream.on_idle = on_idle
    try:
        for batch in stream.batches(batch_size, start=start, stop=stop):
            train_step(model, optimizers, batch, metrics)
            position = batch.end
            steps += 1
            samples += batch.size
            if checkpointer is not None:
                checkpointer.keep_scored((batch.dense, batch.sparse), batch.labels)
                checkpointer.step(batch.size)
                reader = stream.reader_state(position)
                untrained = False
                if checkpointer.maybe_checkpoint(reader, checkpoint_metrics) is not None:
                    checkpointed_reader, untrained = reader, True
            if on_batch is not None:
                on_batch(batch, metrics)
            if stop_event is not None and stop_event.is_set():
                stopped = True
                break
    finally:
        stream.on_idle = None
    if checkpointer is not None and final_checkpoint and samples:
        last = checkpointer.records[-1] if len(checkpointer.records) > first_record else None
        reader = stream.reader_state(position)
        # A live stream's reader also moves past bad records, which train nothing.
        if (
            last is None
            or last.samples_seen != checkpointer.samples_seen
            or (reader != checkpointed_reader)
        ):
            checkpointer.checkpoint_now(reader, checkpoint_metrics)
    seconds = time.perf_counter() - started
    cpu_seconds = time.thread_time() - cpu_started
    return TrainingReport(
        start_offset=start,
        end_offset=position,
        samples=samples,
        steps=steps,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        metrics={**metrics.window(), **metrics.cumulative()},
        records=[] if checkpointer is None else checkpointer.records[first_record:],
        stopped=stopped,
    )
