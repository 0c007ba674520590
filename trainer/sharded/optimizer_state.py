"""A sharded model's optimizer state in the one-process trainer's layout, both ways.

The one-process trainer (trainer/online.py `build_optimizers`) has two optimizers: a
`RowWiseAdagrad` over the tables in table order, whose `sum` travels as each table's one aux
column, and a dense optimizer over everything else. A sharded job has FBGEMM's fused
EXACT_ROWWISE_ADAGRAD (the same update: `sum += mean(g**2)`, `w -= lr * g / (sqrt(sum) +
eps)`), whose `momentum1` is that aux column, and a torch optimizer for the dense part. Its
optimizer blob is written as if its fused optimizer were that RowWiseAdagrad (optimizer 0,
no tensors of its own, its hyper-parameters in `param_groups`) and its dense optimizer were
optimizer 1, through publisher/state_dicts.py: so a version of either trainer restores into
the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from publisher.read.restore import RestoredState
from publisher.state_dicts import (
    OPTIMIZER_PREFIX,
    OptimizerStateLayout,
    RowState,
    optimizer_state_dicts,
    state_dict_misfits,
)
from trainer.errors import CheckpointError

#: the per-row state the one-process RowWiseAdagrad keeps (its aux column).
ACCUMULATOR = "sum"


def job_optimizer_state(
    dense_optimizer: torch.optim.Optimizer,
    tables: Sequence[str],
    sparse_hyper: Mapping[str, float],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The optimizer blob's tensors and metadata: the dense optimizer's state as optimizer 1,
    and `tables`' accumulators declared as optimizer 0's per-row `sum` (their values travel in
    the tables' aux columns). `sparse_hyper`: the fused optimizer's `lr` and `eps`."""
    tensors, meta = OptimizerStateLayout([dense_optimizer], {}).dense_state({})
    dense_prefix, job_prefix = OPTIMIZER_PREFIX.format(0), OPTIMIZER_PREFIX.format(1)
    renamed = {job_prefix + k.removeprefix(dense_prefix): v for k, v in tensors.items()}
    sparse_meta = {
        "param_groups": [
            {
                "lr": float(sparse_hyper["lr"]),
                "eps": float(sparse_hyper["eps"]),
                "initial_accumulator_value": 0.0,
                "params": list(range(len(tables))),
            }
        ],
        "scalars": {},
        "shapes": {},
    }
    row_state = {name: [RowState(0, j, ACCUMULATOR, ()).to_json()] for j, name in enumerate(tables)}
    return renamed, {"optimizers": [sparse_meta, *meta["optimizers"]], "row_state": row_state}


def dense_optimizer_state(
    state: RestoredState, dense_optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Optimizer 1 of a restored version as `dense_optimizer`'s state_dict, checked to fit it
    (publisher/state_dicts.py `state_dict_misfits`); CheckpointError when the version's
    optimizers are not a row-wise sparse one and one dense one, or the dense one does not fit."""
    aux = {name: table.aux for name, table in state.tables.items()}
    # A rank restores only the tables it holds (restore_shards.py): the sparse optimizer's
    # columns of the others are not needed for the dense optimizer's state, nor there.
    try:
        row_state = state.optimizer_meta.get("row_state", {})
        meta = {
            **state.optimizer_meta,
            "row_state": {t: e for t, e in row_state.items() if t in aux},
        }
        dicts = optimizer_state_dicts(state.optimizer, meta, aux)
        if len(dicts) != 2:
            raise CheckpointError(
                f"version {state.version} holds {len(dicts)} optimizer(s); a sharded model "
                "loads a sparse row-wise one and a dense one"
            )
        stored_class = meta["optimizers"][1].get("class")
        misfits = state_dict_misfits(dense_optimizer, dicts[1], stored_class)
    except _MALFORMED as exc:
        raise CheckpointError(
            f"version {state.version}: dense optimizer state is malformed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if misfits:
        raise CheckpointError(
            f"version {state.version}: dense optimizer state does not fit: {'; '.join(misfits)}"
        )
    return dicts[1]


def load_dense_optimizer(
    state: RestoredState, dense_optimizer: torch.optim.Optimizer, checked: dict[str, Any]
) -> None:
    """Load `checked` (from `dense_optimizer_state`) into `dense_optimizer`."""
    try:
        dense_optimizer.load_state_dict(checked)
    except _MALFORMED as exc:
        raise CheckpointError(
            f"version {state.version}: dense optimizer state does not fit: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


#: what interpreting the optimizer metadata (JSON from the store) and loading it raise when it
#: is malformed.
_MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError)


def accumulator_column(state: RestoredState, table: str) -> np.ndarray:
    """The row-wise accumulator of `table` in a restored version, float32 (rows,)."""
    entries = state.optimizer_meta.get("row_state", {}).get(table)
    try:
        layout = [RowState.from_json(e) for e in entries] if isinstance(entries, list) else []
    except (IndexError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"version {state.version}: table {table!r}: malformed optimizer columns {entries!r}"
        ) from exc
    if [(s.name, s.width) for s in layout] != [(ACCUMULATOR, 1)]:
        raise CheckpointError(
            f"version {state.version}: table {table!r} carries optimizer columns "
            f"{[s.name for s in layout]}; a fused row-wise Adagrad loads one {ACCUMULATOR!r}"
        )
    return state.tables[table].aux[:, 0]
