"""What quantization costs the version a server holds, measured as each version is written.

A run's own AUC cannot show codec loss: checkpoints never feed back into training. So the
publisher keeps two copies of the model as the chain builds them, off the training thread:

- `fp32`: every table row as the trainer had it at the version (each snapshot's rows scattered
  in: the rows a version does not carry did not change since they were last written);
- `served`: the same rows as the version's codec decodes them, i.e. exactly the weights a
  server computes from the chain (a row keeps the codec of its latest write).

Dense layers are published fp32, so both copies share them. Each snapshot carries the trainer's
most recent progressive-validation samples (`ScoredBatch`, a bounded window); both copies score
them and the paired difference becomes the manifest's `served_loss` (docs/FORMAT.md 3.2).
Paired on the same samples, the difference is the codec's alone, not sampling noise.

Memory: two fp32 copies of the model in the publisher (thread or process). Scoring 16k samples
twice takes a few tens of ms on MovieLens-1M's model, once per version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from publisher.dlrm import DLRM, ArchitectureError, SparseBatch, build_model, table_weight_names
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


class ServedLossMeter:
    """The fp32 and served copies of one model, kept as versions are written, and their score.

    Call `apply_table` for every table of a version (before `measure`), `apply_dense` with its
    dense state, then `measure` with the samples it carried. Before the first full version
    (every row known) a measurement says nothing and `measure` returns None.
    """

    def __init__(self, model_config: Mapping[str, Any]) -> None:
        self.model_config = dict(model_config)
        self.fp32: DLRM = build_model(model_config).eval()
        self.served: DLRM = build_model(model_config).eval()
        self._weights = {
            which: {
                table: model.state_dict()[key] for table, key in table_weight_names(model).items()
            }
            for which, model in (("fp32", self.fp32), ("served", self.served))
        }
        self._missing = set(self._weights["fp32"])  # tables not written in full yet

    @classmethod
    def for_config(cls, model_config: Mapping[str, Any]) -> ServedLossMeter | None:
        """A meter for a model this module can rebuild (a DLRM), else None."""
        try:
            return cls(model_config)
        except ArchitectureError:
            return None

    @torch.no_grad()
    def apply_table(
        self, table: str, row_ids: np.ndarray, fp32_rows: np.ndarray, served_rows: np.ndarray
    ) -> None:
        """Write one table's rows of a version: as trained, and as the version decodes them."""
        if table not in self._weights["fp32"]:
            return
        index = torch.from_numpy(row_ids)
        for which, rows in (("fp32", fp32_rows), ("served", served_rows)):
            self._weights[which][table].index_copy_(0, index, torch.from_numpy(rows))
        if len(row_ids) == int(self._weights["fp32"][table].shape[0]):
            self._missing.discard(table)

    @torch.no_grad()
    def apply_dense(self, dense: Mapping[str, np.ndarray]) -> None:
        """The version's dense state (published fp32: the same in both copies)."""
        for model in (self.fp32, self.served):
            state = model.state_dict()
            for key, value in dense.items():
                if key in state:
                    state[key].copy_(torch.from_numpy(value))

    @torch.no_grad()
    def measure(self, samples: Sequence[ScoredBatch]) -> ServedLoss | None:
        """Both copies scored on `samples`; None before every row is known, without samples,
        when the samples hold one class only or a copy scores NaN or inf."""
        if self._missing or not samples:
            return None
        logits: dict[str, list[torch.Tensor]] = {"fp32": [], "served": []}
        for batch in samples:
            dense, sparse = batch.inputs()
            logits["fp32"].append(self.fp32(dense, sparse))
            logits["served"].append(self.served(dense, sparse))
        labels = torch.from_numpy(np.concatenate([b.labels for b in samples]))
        scored = {k: torch.cat(v).float() for k, v in logits.items()}
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
