"""What quantization costs the version a server holds, measured as each version is written.

A run's own AUC cannot show codec loss: checkpoints never feed back into training. So the
publisher keeps one copy of the model as the chain builds it, off the training thread: the
**served** copy, every table row as the codec of its latest write decodes it, i.e. exactly the
weights a server computes from the chain. Dense layers are published fp32 and written as they
are.

The fp32 side needs no copy of its own. A version's snapshot holds the trainer's fp32 value of
every row it carries, so for one version (`ServedLossMeter`):

1. `score_fp32`: the snapshot's fp32 rows are copied over the served copy's (`index_copy_`),
   and the samples are scored: that is the trainer's model at the version on every row the
   snapshot carries;
2. `apply_table`, per table as it is encoded: the version's decoded rows replace them, which
   the served copy needs anyway;
3. `measure`: the served copy scores the same samples, and the paired difference becomes the
   manifest's `served_loss` (docs/FORMAT.md 3.2). Paired on the same samples, the difference is
   the codec's alone, not sampling noise.

A row the snapshot does not carry holds its served value in step 1, not its fp32 one, so only
samples whose every looked-up row the snapshot carries are scored: the others are dropped from
the window for this version (`rows_carried`). Every row a sample of the current interval looks
up was trained on, hence marked dirty and carried, so those always count; older samples count
when their rows were touched again; on a full version every sample counts. Feed steps 1 and 2
from the snapshot's rows, never from the rows a delta blob ends up holding: a row a delta left
out because its encoded bytes did not change still moved in fp32, and must be overlaid.

Memory: one fp32 copy of the model in the publisher (thread or process), plus a bitmap of the
carried rows (one byte a row) while a delta's samples are filtered. Scoring 16k samples twice
takes a few tens of ms on MovieLens-1M's model, once per version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.nn import functional as F

from publisher.dlrm import (
    TABLE_PREFIX,
    ArchitectureError,
    SparseBatch,
    build_model,
    table_weight_names,
)
from schemas.manifest import ServedLoss


@dataclass(frozen=True)
class ScoredBatch:
    """One progressive-validation batch, kept to score versions on: the model's inputs
    (`SparseBatch` per feature, as `DLRM.forward` takes them) and the labels."""

    dense: np.ndarray  # float32 (B, n_dense)
    sparse: Mapping[str, tuple[np.ndarray, np.ndarray]]  # feature -> (values, offsets), int64
    labels: np.ndarray  # float32 (B,)

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def inputs(self) -> tuple[torch.Tensor, dict[str, SparseBatch]]:
        """(dense, sparse) as `DLRM.forward` takes them (no copy)."""
        sparse = {
            name: SparseBatch(torch.from_numpy(values), torch.from_numpy(offsets))
            for name, (values, offsets) in self.sparse.items()
        }
        return torch.from_numpy(self.dense), sparse

    def bag_of_each_id(self, feature: str) -> np.ndarray:
        """For each id of `feature`'s flat values, the sample (bag) it belongs to."""
        values, offsets = self.sparse[feature]
        lengths = np.diff(offsets, append=len(values))
        return np.repeat(np.arange(self.size), lengths)

    def select(self, keep: np.ndarray) -> ScoredBatch:
        """The samples where `keep` (bool, one per sample) holds, in order (a copy)."""
        sparse = {}
        for feature, (values, offsets) in self.sparse.items():
            lengths = np.diff(offsets, append=len(values))[keep]
            starts = np.zeros(len(lengths), dtype=np.int64)
            np.cumsum(lengths[:-1], out=starts[1:])
            sparse[feature] = (values[keep[self.bag_of_each_id(feature)]], starts)
        return ScoredBatch(self.dense[keep], sparse, self.labels[keep])


class VersionRows(Protocol):
    """One table's rows of a snapshot as trained (`publisher.write.snapshot.TableRows`)."""

    @property
    def name(self) -> str: ...
    @property
    def row_ids(self) -> np.ndarray: ...
    @property
    def values(self) -> np.ndarray: ...


def rows_carried(
    samples: Iterable[ScoredBatch], carried: Mapping[str, np.ndarray]
) -> tuple[ScoredBatch, ...]:
    """The samples whose every looked-up row is carried (`carried`: feature -> a bool per row of
    its table); batches left empty are dropped."""
    kept = []
    for batch in samples:
        missing = np.zeros(batch.size, dtype=bool)
        for feature, rows in carried.items():
            values, _ = batch.sparse[feature]
            missing[batch.bag_of_each_id(feature)[~rows[values]]] = True
        if not missing.any():
            kept.append(batch)
        elif not missing.all():
            kept.append(batch.select(~missing))
    return tuple(kept)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Exact ROC AUC (equal scores count one half); None when one class is absent.

    Exact, not binned like the progressive metrics: a codec moves scores by far less than a bin.
    """
    positive = labels > 0.5
    n_pos = int(positive.sum())
    n_neg = int(labels.shape[0]) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # 1-based, ties averaged
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


@dataclass(frozen=True)
class Fp32Scores:
    """Step 1 of a version's measurement: the samples scored and the fp32 logits on them."""

    samples: tuple[ScoredBatch, ...]
    logits: torch.Tensor  # float32 (n,)


class MeterOrderError(RuntimeError):
    """`measure` was called while a table still held the fp32 overlay (no `apply_table`)."""


class ServedLossMeter:
    """The served copy of one model, kept as versions are written, and the paired score.

    Per version: `score_fp32` with the snapshot's rows, dense state and samples; `apply_table`
    for every table with its decoded rows (the same row ids); then `measure`. Before the first
    full version (every row known) a measurement says nothing: `score_fp32` returns None.
    """

    def __init__(self, model_config: Mapping[str, Any]) -> None:
        self.model_config = dict(model_config)
        self.served = build_model(model_config).eval()
        state = self.served.state_dict()
        self._weights = {
            table: state[key] for table, key in table_weight_names(self.served).items()
        }
        self._missing = set(self._weights)  # tables not written in full yet
        self._overlaid: set[str] = set()  # tables holding fp32 rows until `apply_table`

    @classmethod
    def for_config(cls, model_config: Mapping[str, Any]) -> ServedLossMeter | None:
        """A meter for a model this module can rebuild (a DLRM), else None."""
        try:
            return cls(model_config)
        except ArchitectureError:
            return None

    @torch.no_grad()
    def score_fp32(
        self,
        tables: Sequence[VersionRows],
        dense: Mapping[str, np.ndarray],
        samples: Sequence[ScoredBatch],
    ) -> Fp32Scores | None:
        """Write the version's dense state, overlay its fp32 rows and score the samples whose
        rows it carries; None (and no overlay) when nothing can be measured: a table not yet
        written in full, or no sample left."""
        if self._overlaid:
            # A version left fp32 rows behind (it failed between the steps): those tables are
            # unknown until written in full again.
            self._missing |= self._overlaid
            self._overlaid.clear()
        state = self.served.state_dict()
        for key, value in dense.items():
            if key in state:
                state[key].copy_(torch.from_numpy(value))
        ours = [t for t in tables if t.name in self._weights]
        full = {t.name for t in ours if len(t.row_ids) == int(self._weights[t.name].shape[0])}
        if self._missing - full or not samples:
            return None
        kept = tuple(samples)
        if len(full) < len(self._weights):
            kept = rows_carried(kept, self._carried(ours))
            if not kept:
                return None
        for t in ours:
            self._weights[t.name].index_copy_(
                0, torch.from_numpy(t.row_ids), torch.from_numpy(t.values)
            )
            self._overlaid.add(t.name)
        return Fp32Scores(kept, self._score(kept))

    def _carried(self, tables: Sequence[VersionRows]) -> dict[str, np.ndarray]:
        """Feature -> a bool per row of its table: whether this version carries the row."""
        carried = {}
        by_name = {t.name: t for t in tables}
        for table, weight in self._weights.items():
            rows = np.zeros(int(weight.shape[0]), dtype=bool)
            if table in by_name:
                rows[by_name[table].row_ids] = True
            carried[table.removeprefix(TABLE_PREFIX)] = rows
        return carried

    @torch.no_grad()
    def apply_table(self, table: str, row_ids: np.ndarray, served_rows: np.ndarray) -> None:
        """Write one table's rows of a version as the version decodes them."""
        if table not in self._weights:
            return
        self._weights[table].index_copy_(
            0, torch.from_numpy(row_ids), torch.from_numpy(served_rows)
        )
        self._overlaid.discard(table)
        if len(row_ids) == int(self._weights[table].shape[0]):
            self._missing.discard(table)

    @torch.no_grad()
    def measure(self, fp32: Fp32Scores | None) -> ServedLoss | None:
        """The served copy scored on `fp32`'s samples against `fp32`'s logits; None when step 1
        measured nothing, the samples hold one class only or a side scores NaN or inf."""
        if fp32 is None:
            return None
        if self._overlaid:
            raise MeterOrderError(
                f"tables {sorted(self._overlaid)} still hold the fp32 overlay: apply_table first"
            )
        samples = fp32.samples
        scored = {"fp32": fp32.logits, "served": self._score(samples)}
        labels = torch.from_numpy(np.concatenate([b.labels for b in samples]))
        if not all(bool(torch.isfinite(v).all()) for v in scored.values()):
            return None  # a diverged model: there is no loss to speak of
        aucs = {k: roc_auc(v.numpy(), labels.numpy()) for k, v in scored.items()}
        if aucs["fp32"] is None or aucs["served"] is None:
            return None
        loss = {k: float(F.binary_cross_entropy_with_logits(v, labels)) for k, v in scored.items()}
        return ServedLoss.of(
            int(labels.shape[0]),
            auc_fp32=aucs["fp32"],
            auc_served=aucs["served"],
            logloss_fp32=loss["fp32"],
            logloss_served=loss["served"],
        )

    def _score(self, samples: Sequence[ScoredBatch]) -> torch.Tensor:
        return torch.cat([self.served(*b.inputs()) for b in samples]).float()
