"""Torch state as the named numpy arrays a checkpoint holds, and where each optimizer tensor goes.

Module parameters and buffers are copied by state_dict name. Optimizer state dicts are nested;
they are flattened to `state.<param index>.<name>` tensors plus the JSON of `param_groups` and the
non-tensor state, which goes into the blob's metadata (schemas/tensor_blob.py).

Optimizer-state layout (`OptimizerStateLayout`): every tensor an optimizer keeps for an embedding
weight whose first dimension equals the table's rows (row-wise Adagrad's accumulator, Adagrad's
`sum`, SparseAdam's moments) travels with its row, reshaped to (rows, -1), as the table blob's
`aux` columns, in name order:

    aux of table t, float32 (rows, aux_dim)
    +--------------------------+--------------------------+-----
    | row_state[t][0]          | row_state[t][1]          | ...
    | width = prod(trailing)   | width = prod(trailing)   |
    +--------------------------+--------------------------+-----

Anything else the optimizers hold (Adam moments of the MLPs, step counters) goes in the dense
optimizer blob, optimizer i's tensors under `optimizers.<i>.`. The blob's metadata records both
halves, so `optimizer_state_dicts` puts every tensor back where it came from:

    {"optimizers": [{"param_groups": ..., "scalars": ..., "shapes": {key: shape}}, ...],
     "row_state": {table: [[optimizer, param index, name, trailing shape], ...]}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from schemas.tensor_blob import TensorBlobError

#: key prefix of optimizer i's tensors in the dense optimizer blob.
OPTIMIZER_PREFIX = "optimizers.{}."


def weight_key(table: str) -> str:
    """The state_dict key of an embedding table's weight (`table` is its module path)."""
    return f"{table}.weight" if table else "weight"


def module_tensors(module: torch.nn.Module, skip: set[str]) -> dict[str, np.ndarray]:
    """Copies of a module's parameters and buffers by state_dict name, except those in `skip`."""
    return {
        name: value.detach().to("cpu", copy=True).numpy()
        for name, value in module.state_dict().items()
        if name not in skip
    }


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The name the optimizer blob records for an optimizer's class (docs/FORMAT.md 5)."""
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def state_dict_misfits(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], stored_class: object
) -> list[str]:
    """Why an optimizer state_dict a checkpoint holds would not fit `optimizer`; [] if it fits.

    torch's `load_state_dict` checks only the number of parameters per group and hands state
    over by position: another optimizer's state loads and fails at the next step (SGD finding
    no `momentum`), and a parameter's moments land on whichever parameter now sits at its
    position. So: the class the blob recorded (`stored_class`, None for an older blob) must be
    the optimizer's, and every state tensor must fit the parameter at its position: one value
    (a step count), the parameter's shape, or one entry per row (a row-wise accumulator).
    Parameters of equal shapes that swapped places cannot be told apart here.
    """
    found = optimizer_class(optimizer)
    if stored_class is not None and stored_class != found:
        return [f"the state is of a {stored_class}, this optimizer a {found}"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    misfits = []
    for index, per_param in sorted(state_dict.get("state", {}).items()):
        if not isinstance(index, int) or not 0 <= index < len(params):
            misfits.append(f"state of parameter {index!r}: this optimizer has {len(params)}")
            continue
        shape = tuple(params[index].shape)
        for name, value in sorted(per_param.items()):
            if not isinstance(value, torch.Tensor) or value.numel() == 1:
                continue
            got = tuple(value.shape)
            if got != shape and not (got and shape and got[0] == shape[0]):
                misfits.append(f"parameter {index} is {shape} here, its {name!r} is {got}")
    return misfits


def flatten_optimizer_state(
    state: dict[str, Any],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Split a torch optimizer state_dict into tensors and JSON metadata."""
    tensors: dict[str, np.ndarray] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().to("cpu", copy=True).numpy()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(
    tensors: dict[str, np.ndarray], meta: dict[str, Any]
) -> dict[str, Any]:
    """The torch optimizer state_dict that `flatten_optimizer_state` split."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        prefix, index, name = key.split(".", 2)
        if prefix != "state":
            raise TensorBlobError(f"unexpected optimizer tensor {key!r}")
        state.setdefault(int(index), {})[name] = torch.from_numpy(value.copy())
    for index, values in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


@dataclass(frozen=True)
class RowState:
    """One per-row optimizer tensor of a table: where it lives and which aux columns it fills."""

    optimizer: int
    param_index: int
    name: str
    trailing: tuple[int, ...]

    @property
    def width(self) -> int:
        return int(np.prod(self.trailing, dtype=np.int64)) if self.trailing else 1

    def to_json(self) -> list[Any]:
        return [self.optimizer, self.param_index, self.name, list(self.trailing)]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> RowState:
        return cls(int(value[0]), int(value[1]), str(value[2]), tuple(int(x) for x in value[3]))


class OptimizerStateLayout:
    """Which optimizer tensors of the embedding `weights` are per-row aux columns; copies of both
    halves (see the module docstring).

    The layout is read from the optimizers' state each time it is asked for: SparseAdam, for
    one, creates its state at the first step, after the checkpointer was built.
    """

    def __init__(
        self, optimizers: Sequence[torch.optim.Optimizer], weights: Mapping[str, torch.Tensor]
    ) -> None:
        self.optimizers = list(optimizers)
        self.weights = dict(weights)

    def row_state(self, table: str) -> list[RowState]:
        """The per-row optimizer tensors of `table`, in aux column order."""
        weight = self.weights[table]
        rows = int(weight.shape[0])
        where = self._param_index().get(id(weight))
        if where is None:
            return []
        i, j = where
        state = self.optimizers[i].state.get(weight, {})
        return [
            RowState(i, j, key, tuple(int(x) for x in value.shape[1:]))
            for key, value in sorted(state.items())
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows
        ]

    def copy_row_state(
        self,
        table: str,
        layout: Sequence[RowState],
        index: torch.Tensor | slice | None,
        out: np.ndarray,
    ) -> None:
        """Copy the aux columns (`layout`, from `row_state`) of rows `index` (ids, a slice of
        rows, or None: all rows) into `out`, a float32 (n, aux width) array."""
        target = torch.from_numpy(out)
        rows = int(self.weights[table].shape[0])
        col = 0
        ids = None if isinstance(index, slice) else index
        for entry in layout:
            source = self._state_tensor(entry).detach().reshape(rows, -1)
            if isinstance(index, slice):
                source = source[index]
            width = entry.width
            if len(layout) == 1:  # the common case: straight into the contiguous buffer
                if ids is None:
                    target.copy_(source)
                else:
                    torch.index_select(source, 0, ids, out=target)
            else:
                picked = source if ids is None else source.index_select(0, ids)
                target[:, col : col + width] = picked
            col += width

    def reset_rows(self, table: str, rows: torch.Tensor) -> None:
        """Put the per-row optimizer state of `rows` back where a fresh optimizer starts it:
        Adagrad's `sum` (torch's and row-wise) at the group's `initial_accumulator_value`,
        anything else (moments, momentum) at 0. For a row whose id was evicted."""
        weight = self.weights[table]
        for entry in self.row_state(table):
            initial = 0.0
            if entry.name == "sum":
                group = self._group_of(entry.optimizer, weight)
                initial = float(group.get("initial_accumulator_value", 0.0))
            with torch.no_grad():
                self._state_tensor(entry).index_fill_(0, rows, initial)

    def _group_of(self, optimizer: int, weight: torch.Tensor) -> dict[str, Any]:
        for group in self.optimizers[optimizer].param_groups:
            if any(p is weight for p in group["params"]):
                return group
        raise KeyError(f"optimizer {optimizer} does not hold this weight")

    def dense_state(
        self, layouts: Mapping[str, Sequence[RowState]]
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Copies of every optimizer tensor that is not an aux column of `layouts` (table ->
        `row_state`), and the metadata that records both halves."""
        skip: dict[int, dict[int, set[str]]] = {}
        for layout in layouts.values():
            for s in layout:
                skip.setdefault(s.optimizer, {}).setdefault(s.param_index, set()).add(s.name)
        tensors: dict[str, np.ndarray] = {}
        metas: list[dict[str, Any]] = []
        for i, optimizer in enumerate(self.optimizers):
            state = optimizer.state_dict()
            rowwise = skip.get(i, {})
            dense = {
                "state": {
                    j: {k: v for k, v in per.items() if k not in rowwise.get(j, ())}
                    for j, per in state["state"].items()
                },
                "param_groups": state["param_groups"],
            }
            flat, meta = flatten_optimizer_state(dense)
            # The tensor blob stores 0-d arrays (Adam's `step`) as shape (1,): keep the shapes
            # so a resume puts back exactly what the optimizer had.
            meta["shapes"] = {k: list(v.shape) for k, v in flat.items()}
            meta["class"] = optimizer_class(optimizer)
            tensors.update({OPTIMIZER_PREFIX.format(i) + k: v for k, v in flat.items()})
            metas.append(meta)
        row_state = {name: [s.to_json() for s in layout] for name, layout in layouts.items()}
        return tensors, {"optimizers": metas, "row_state": row_state}

    def _param_index(self) -> dict[int, tuple[int, int]]:
        """id(parameter) -> (optimizer index, index in that optimizer's state_dict)."""
        found: dict[int, tuple[int, int]] = {}
        for i, optimizer in enumerate(self.optimizers):
            j = 0
            for group in optimizer.param_groups:
                for p in group["params"]:
                    found.setdefault(id(p), (i, j))
                    j += 1
        return found

    def _state_tensor(self, entry: RowState) -> torch.Tensor:
        optimizer = self.optimizers[entry.optimizer]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        value = optimizer.state[params[entry.param_index]][entry.name]
        assert isinstance(value, torch.Tensor)
        return value


def optimizer_state_dicts(
    tensors: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
    aux: Mapping[str, np.ndarray],
) -> list[dict[str, Any]]:
    """The optimizers' state_dicts a checkpoint holds: the dense optimizer blob (`tensors`,
    `meta`) with each table's `aux` columns put back; the inverse of `OptimizerStateLayout`."""
    dicts = []
    for i, opt_meta in enumerate(meta.get("optimizers", [])):
        prefix = OPTIMIZER_PREFIX.format(i)
        mine = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        shapes = opt_meta.get("shapes", {})
        mine = {k: v.reshape(shapes.get(k, v.shape)) for k, v in mine.items()}
        dicts.append(unflatten_optimizer_state(mine, opt_meta))
    for table, entries in meta.get("row_state", {}).items():
        columns = aux[table]
        rows = columns.shape[0]
        col = 0
        for entry in map(RowState.from_json, entries):
            part = np.ascontiguousarray(columns[:, col : col + entry.width]).copy()
            value = torch.from_numpy(part)
            per_param = dicts[entry.optimizer]["state"].setdefault(entry.param_index, {})
            per_param[entry.name] = value.reshape(rows, *entry.trailing)
            col += entry.width
    return dicts
