"""A row whose id was evicted starts over: fresh weights, fresh optimizer state, marked dirty.

A live id space (trainer/id_space.py) frees the rows of evicted ids and gives them to new ids
later. The new id must not inherit anything of the old one, and every version must carry the
change (docs/FORMAT.md section 7: each id-map change touches a row the version carries), so at
eviction the row's weights are drawn again from the table's initial distribution, its per-row
optimizer state goes back to its initial value, and the row is marked dirty in the tracker.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from publisher.dlrm import init_embedding_rows
from publisher.state_dicts import OptimizerStateLayout
from publisher.write.tracker import DirtyRowTracker


class RowReset:
    """Re-initialises evicted rows of one table (an `IdSpace`'s `reset_rows`)."""

    def __init__(
        self,
        table: str,
        weight: torch.Tensor,
        layout: OptimizerStateLayout,
        tracker: DirtyRowTracker | None,
    ) -> None:
        self.table = table
        self.weight = weight
        self.layout = layout
        self.tracker = tracker

    def mark(self, rows: npt.NDArray[np.int64]) -> None:
        """Mark `rows` dirty only (rows given to new ids: their map entries changed)."""
        if self.tracker is not None:
            self.tracker.mark(self.table, torch.from_numpy(np.ascontiguousarray(rows, np.int64)))

    def __call__(self, rows: npt.NDArray[np.int64]) -> None:
        index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        init_embedding_rows(self.weight.data, index)
        self.layout.reset_rows(self.table, index)
        if self.tracker is not None:
            self.tracker.mark(self.table, index)
