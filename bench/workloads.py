"""The two benchmark workloads and the small training loop every part shares.

`movielens`: MovieLens-1M replayed in timestamp order (dim 16, the trainer's default).
`synthetic`: the Criteo-like stream with table cap 730,000 (26 tables, ~4.2M rows x dim 64,
~1.08 GB of fp32 embeddings). Quick mode shrinks both so every part checks its machinery in
seconds. Training does not depend on the checkpoint policy or codec, so parts train once and
look at the state at each interval boundary.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from publisher.codecs import codec_of, decode_rows, encode_rows
from publisher.dlrm import DLRM, TABLE_PREFIX
from publisher.write.publishing import aux_encoding_for
from schemas.delta_blob import round_to_bfloat16
from trainer.online import (
    DLRMSettings,
    OptimizerSettings,
    build_dlrm,
    build_optimizers,
    train_step,
)
from trainer.options import default_embedding_dim
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.streams.base import Batch, DataError, InteractionStream

WORKLOADS = ("movielens", "synthetic")
#: the trainer's defaults (trainer.options): what "the default settings" of the targets mean.
DEFAULT_POLICY = "intermittent"
DEFAULT_CODEC = "int4"
BATCH_SIZE = 512


@dataclass(frozen=True)
class Workload:
    """A stream, the model sized for it, and the checkpoint interval."""

    name: str
    stream: InteractionStream
    embedding_dim: int
    interval_samples: int
    stop: int
    description: str

    @property
    def intervals(self) -> int:
        return -(-self.stop // self.interval_samples)

    def describe(self) -> dict[str, Any]:
        rows = sum(f.rows for f in self.stream.features)
        return {
            "name": self.name,
            "description": self.description,
            "tables": len(self.stream.features),
            "table_rows_total": rows,
            "embedding_dim": self.embedding_dim,
            "fp32_embedding_bytes": rows * self.embedding_dim * 4,
            "interval_samples": self.interval_samples,
            "samples": self.stop,
            "intervals": self.intervals,
            "batch_size": BATCH_SIZE,
        }


def make_workload(
    name: str,
    quick: bool,
    *,
    table_cap: int | None = None,
    intervals: int | None = None,
    interval_samples: int | None = None,
) -> Workload:
    """The named workload at full or quick size (overrides for the accuracy part's runs)."""
    if name == "movielens":
        from trainer.streams.movielens import load_movielens

        stream: InteractionStream = load_movielens()
        total = int(stream.num_samples or 0)
        interval = interval_samples or (5_000 if quick else 50_000)
        stop = min(total, interval * intervals) if intervals else total
        if quick and not intervals:
            stop = min(total, 3 * interval)
        return Workload(
            name,
            stream,
            default_embedding_dim(name),
            interval,
            stop,
            "MovieLens-1M in timestamp order (rating >= 4)",
        )
    if name == "synthetic":
        from trainer.streams.synthetic import (
            SyntheticConfig,
            SyntheticStream,
            criteo_like_cardinalities,
        )

        cap = table_cap or (500 if quick else 730_000)
        stream = SyntheticStream(SyntheticConfig(cardinalities=criteo_like_cardinalities(cap)))
        interval = interval_samples or (2_000 if quick else 50_000)
        n = intervals or (3 if quick else 8)
        return Workload(
            name,
            stream,
            default_embedding_dim(name),
            interval,
            interval * n,
            f"synthetic Criteo-like stream, 26 tables capped at {cap:,} rows, Zipf ids, drift",
        )
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


def file_workload(
    path: str, stream: InteractionStream, quick: bool, interval_samples: int | None = None
) -> Workload:
    """A data file (`checknrun train --data FILE`), replayed like MovieLens-1M: the whole file,
    checkpoint every 1/20 of it (at least 1,000 samples) unless `interval_samples` says; quick
    mode stops after 3 intervals."""
    total = int(stream.num_samples or 0)
    if total == 0:
        raise DataError(f"{path}: no samples to measure")
    interval = interval_samples or max(1_000, total // 20)
    stop = min(total, 3 * interval) if quick else total
    return Workload(
        Path(path).stem,
        stream,
        default_embedding_dim(path),
        interval,
        stop,
        f"{Path(path).name} in file (or timestamp) order, {total:,} samples",
    )


def available(name: str) -> bool:
    """Whether the workload's data is installed (MovieLens comes from a wheel)."""
    if name != "movielens":
        return True
    try:
        from trainer.streams.movielens import default_directory

        return (default_directory() / "ml-1m.inter").exists()
    except DataError:
        return False


class BenchTrainer:
    """DLRM + [row-wise Adagrad, Adam] on a workload; tables addressed by manifest name."""

    def __init__(self, workload: Workload, seed: int = 0) -> None:
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        self.workload = workload
        self.model: DLRM = build_dlrm(
            workload.stream.features,
            workload.stream.dense_names,
            DLRMSettings(embedding_dim=workload.embedding_dim),
            seed=seed,
        )
        self.optimizers = build_optimizers(self.model, OptimizerSettings())
        self.metrics = ProgressiveMetrics()
        self.features = [f.name for f in workload.stream.features]
        self.table_rows = {TABLE_PREFIX + f.name: f.rows for f in workload.stream.features}

    def weight(self, table: str) -> torch.Tensor:
        """The live weight of a table (`embeddings.<feature>`)."""
        module = self.model.embeddings[table.removeprefix(TABLE_PREFIX)]
        assert isinstance(module, torch.nn.EmbeddingBag)
        return module.weight

    def batches(self, start: int, stop: int) -> Iterator[Batch]:
        return self.workload.stream.batches(BATCH_SIZE, start=start, stop=stop)

    def train(self, batch: Batch) -> None:
        train_step(self.model, self.optimizers, batch, self.metrics)

    def dense_bytes(self) -> int:
        """Tensor bytes of the dense state, as a manifest counts it (docs/FORMAT.md 3.1).

        The dense blob's parameters and buffers (everything but the tables) and the dense
        optimizer's tensors (Adam's moments and step counters: none before its first step).
        """
        tables = {self.weight(t).data_ptr() for t in self.table_rows}
        dense = sum(
            v.nbytes for v in self.model.state_dict().values() if v.data_ptr() not in tables
        )
        dense_opt = self.optimizers[1].state_dict()["state"]
        moments = sum(v.nbytes for s in dense_opt.values() for v in s.values())
        return int(dense + moments)

    def save_state(self) -> dict[str, Any]:
        """A deep copy of model, optimizers and metrics (what an exact fp32 restore gives)."""
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
            "metrics": copy.deepcopy(self.metrics),
        }

    def load_state(self, state: dict[str, Any], codec: str) -> None:
        """Restore a saved state as a checkpoint of `codec` holds it: every table row passed
        through `codec`, and the per-row optimizer columns stored as the publisher stores them
        for that codec (`publishing.aux_encoding_for`: bfloat16 for a lossy one)."""
        self.model.load_state_dict(state["model"])
        for opt, sd in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(copy.deepcopy(sd))
        self.metrics = copy.deepcopy(state["metrics"])
        if not codec_of(codec).lossless:  # a lossless round trip changes nothing
            with torch.no_grad():
                for table in self.table_rows:
                    quantize_in_place(self.weight(table), codec)
        if aux_encoding_for(codec) == "bfloat16":
            self._round_row_state()

    def _round_row_state(self) -> None:
        """The sparse optimizer's per-row columns (a table's aux) rounded to bfloat16."""
        sparse = self.optimizers[0]
        with torch.no_grad():
            for group in sparse.param_groups:
                for param in group["params"]:
                    for value in sparse.state[param].values():
                        # per-row columns only: never a step count
                        per_row = isinstance(value, torch.Tensor) and value.dim() >= 1
                        if per_row and value.shape[0] == param.shape[0]:
                            rows = value.numpy()
                            rows[...] = round_to_bfloat16(rows)


def quantize_in_place(weight: torch.Tensor, codec: str) -> None:
    """Replace a table's rows by what a reader decodes from `codec` (row chunks, bounded memory)."""
    data = weight.detach().numpy()
    chunk = 1 << 16
    for lo in range(0, data.shape[0], chunk):
        rows = np.ascontiguousarray(data[lo : lo + chunk])
        data[lo : lo + chunk] = decode_rows(encode_rows(codec, rows))


@torch.no_grad()
def evaluate(model: DLRM, batches: Iterator[Batch], metrics: ProgressiveMetrics) -> None:
    """Score batches without training (the served model's view of the upcoming samples)."""
    for batch in batches:
        metrics.update(model(batch.dense, batch.sparse), batch.labels)
