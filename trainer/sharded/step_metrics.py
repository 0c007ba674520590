"""A sharded job's training metrics: each rank scores its samples, the versions carry the job's.

Every rank counts the progressive metrics of its own samples (scored by the step's forward,
before its update; padding samples are not counted): the histograms, loss sum, samples and
positives of trainer/progressive_metrics.py. At a checkpoint the ranks sum those counts (one
all_reduce on the vote group), so each version's metrics are the job's window since the last
version and its cumulative figures, exactly what one process training the same samples reports.
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.progressive_metrics import Counts, ProgressiveMetrics
from trainer.sharded.data import RankBatch
from trainer.sharded.step_votes import StepAgreement


class StepMetrics:
    """This rank's progressive metrics and training loss, and the job's at a checkpoint."""

    def __init__(self, agreement: StepAgreement) -> None:
        self.agreement = agreement
        self.progressive = ProgressiveMetrics()
        self._loss_sum = 0.0
        self._samples = 0

    def add(self, logits: torch.Tensor, batch: RankBatch) -> None:
        """Count one step's samples of this rank (`logits` from before its update)."""
        real = batch.weights > 0
        if not bool(real.any()):
            return
        logits, labels = logits.detach().cpu()[real.cpu()], batch.labels.detach().cpu()[real.cpu()]
        self.progressive.update(logits, labels)
        self._loss_sum += float(
            torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        )
        self._samples += int(real.sum())

    @property
    def rank_loss(self) -> float:
        """Mean training loss of this rank's samples so far (NaN before any)."""
        return self._loss_sum / self._samples if self._samples else float("nan")

    def job(self) -> dict[str, float]:
        """The job's metrics since the last call and in all (a collective call: every rank makes
        it at the same step), then a new window."""
        window, total = self.progressive.take_window_counts()
        both = np.concatenate([window.as_array(), total.as_array()])
        summed = self.agreement.sum_floats(both)
        half = len(both) // 2
        return ProgressiveMetrics.metrics_of(
            Counts.from_array(summed[:half]), Counts.from_array(summed[half:])
        )
