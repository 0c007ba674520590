"""Put a restored checkpoint back into a live model and its optimizers.

`publisher.read.restore` rebuilds a version as numpy arrays (baseline plus chain); this module
checks that it fits the model it is loaded into (same architecture, same tables, same shapes,
same number of optimizers) and loads the weights, the dense state and every optimizer's state,
per-row columns included (`publisher.state_dicts.optimizer_state_dicts`), and the id maps of
an open id space into the trainer's own `IdMap` objects, in place. Rows no version of the chain
carried (the free rows a full of a table with a dynamic id map leaves out, docs/FORMAT.md 7.1)
keep the values the model had before the load (a model just built, as a resume's is: its own
initialisation) and their per-row optimizer state goes back to its initial value. The counters
and the reader position are the caller's: `state.position`; the load logs where it resumes
(`resumed_text`: after a SIGKILL and `--resume`, the one line that says where training goes on).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from publisher.id_map import IdMap
from publisher.read.module_state import ModuleStateError, module_state_dict
from publisher.read.restore import RestoredState
from publisher.state_dicts import (
    OptimizerStateLayout,
    RowState,
    optimizer_state_dicts,
    state_dict_misfits,
)
from publisher.write.tracker import EmbeddingModule, find_embedding_tables
from schemas.manifest import Position
from trainer.errors import CheckpointError

log = logging.getLogger(__name__)


def resumed_text(version: int, position: Position) -> str:
    """Where training goes on from `version`: the next offset of each partition for a Kafka
    source (docs/FORMAT.md 8.3), the next sample for a file replay, each rank's for a job:
    `resumed from v7 at offsets 0:1,204 1:998 of topic 'events' (step 40, 20,480 samples)`."""
    if position.ranks:
        where = "; ".join(f"rank {r.rank} {_reader_text(r.reader)}" for r in position.ranks)
    else:
        where = _reader_text(position.reader)
    return (
        f"resumed from v{version} {where} "
        f"(step {position.step:,}, {position.samples_seen:,} samples)"
    )


def _reader_text(reader: Mapping[str, int | str | dict[str, int]]) -> str:
    offsets, offset = reader.get("offsets"), reader.get("offset")
    if isinstance(offsets, dict):
        shown = " ".join(f"{p}:{o:,}" for p, o in offsets.items()) or "none yet"
        return f"at offsets {shown} of topic {reader.get('topic')!r}"
    if isinstance(offset, int):
        return f"at sample {offset:,} of {reader.get('source')!r}"
    return f"at reader position {dict(reader)!r}"


def load_restored(
    state: RestoredState,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    tables: Mapping[str, EmbeddingModule] | None = None,
    weight_keys: Mapping[str, str] | None = None,
    model_config: Mapping[str, Any],
    id_maps: Mapping[str, IdMap] | None = None,
) -> None:
    """Load `state` into `model`, `optimizers` and `id_maps`; CheckpointError when it does not
    fit (checked, for the model as `publisher.read.module_state` checks any module, before
    anything is loaded).

    `tables` are the model's embedding modules by name (default: `find_embedding_tables`),
    `weight_keys` their weights' state_dict keys (default: `publisher.state_dicts.weight_key`
    of each name), `model_config` the model's own config (an empty one skips that check),
    `id_maps` the trainer's id maps by table: the version must carry exactly those, of the same
    rows and mode; and exactly the model's tables and dense state (`load_state_dict(strict=True)`).
    """
    _check_id_maps(state, id_maps or {})
    stored_config = state.manifest.model_config_
    if model_config and stored_config and stored_config != model_config:
        raise CheckpointError(
            f"version {state.version} was trained with model_config {stored_config}, "
            f"this model has {dict(model_config)}"
        )
    tables = find_embedding_tables(model) if tables is None else tables
    try:
        weights = module_state_dict(
            model, state, tables=tables, weight_keys=weight_keys, keep_unwritten=True
        )
    except ModuleStateError as exc:
        raise CheckpointError(str(exc)) from exc
    _check_row_state_owners(state, optimizers, tables)
    optimizer_states = _optimizer_states(state, optimizers)
    with torch.no_grad():
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as exc:
            raise CheckpointError(
                f"version {state.version} does not fit this model: {exc}"
            ) from exc
    _load_optimizers(state, optimizers, optimizer_states)
    _reset_unwritten(state, optimizers, tables)
    if not _hashed_without_maps(state, id_maps or {}):
        for name, id_map in (id_maps or {}).items():
            id_map.load_from(state.id_maps[name])
    log.info("%s", resumed_text(state.version, state.position))


def _reset_unwritten(
    state: RestoredState,
    optimizers: Sequence[torch.optim.Optimizer],
    tables: Mapping[str, EmbeddingModule],
) -> None:
    """Initial per-row optimizer state for the rows no version carried (their weights kept the
    model's own values: `module_state_dict`)."""
    for name, table in state.tables.items():
        if len(table.unwritten) and name in tables:
            weight = tables[name].weight
            rows = torch.from_numpy(table.unwritten + table.row_start)
            OptimizerStateLayout(optimizers, {name: weight}).reset_rows(name, rows)


def _hashed_without_maps(state: RestoredState, id_maps: Mapping[str, IdMap]) -> bool:
    """A version of a sharded job in a hashed id space: its tables carry no id map (FORMAT.md
    3.3), and a hashed map holds nothing but counts, which such a job does not use (it trains
    no count feature), so the trainer's maps start from none."""
    return not state.id_maps and all(m.hashed for m in id_maps.values())


def _check_id_maps(state: RestoredState, id_maps: Mapping[str, IdMap]) -> None:
    if _hashed_without_maps(state, id_maps):
        return
    if set(state.id_maps) != set(id_maps):
        raise CheckpointError(
            f"version {state.version} carries id maps of tables {sorted(state.id_maps)}, "
            f"this trainer has id maps of {sorted(id_maps)}"
        )
    for name, id_map in id_maps.items():
        restored = state.id_maps[name]
        if (restored.rows, restored.hashed) != (id_map.rows, id_map.hashed):
            mode = {True: "hashed", False: "dynamic"}
            raise CheckpointError(
                f"table {name!r}: version {state.version} has a {mode[restored.hashed]} id map "
                f"of {restored.rows} rows, this trainer a {mode[id_map.hashed]} one of "
                f"{id_map.rows}"
            )


def _check_row_state_owners(
    state: RestoredState,
    optimizers: Sequence[torch.optim.Optimizer],
    tables: Mapping[str, EmbeddingModule],
) -> None:
    """Each table's per-row optimizer state must go to the optimizer parameter that is that
    table's weight here. A torch optimizer loads state by parameter position, so a version whose
    optimizer listed the tables in another order (a sharded job lists them by name) would hand
    one table's state to another, silently where their shapes agree."""
    layout = state.optimizer_meta.get("row_state", {})
    if not isinstance(layout, Mapping):
        return  # malformed: _load_optimizers says so
    here = {
        id(p): (i, j)
        for i, optimizer in enumerate(optimizers)
        for j, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
    }
    try:
        owners = {
            name: (entry.optimizer, entry.param_index)
            for name, entries in layout.items()
            if name in tables
            for entry in (RowState.from_json(e) for e in entries)
        }
    except _MALFORMED as exc:
        raise CheckpointError(
            f"version {state.version}: malformed per-row optimizer state: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    moved = {
        name: (kept, here.get(id(tables[name].weight)))
        for name, kept in owners.items()
        if here.get(id(tables[name].weight)) != kept
    }
    if moved:
        order = sorted(owners, key=owners.__getitem__)
        shown = "; ".join(
            f"table {name!r}: optimizers[{kept[0]}] parameter {kept[1]} there, "
            + (f"optimizers[{now[0]}] parameter {now[1]} here" if now else "in no optimizer here")
            for name, (kept, now) in moved.items()
        )
        raise CheckpointError(
            f"version {state.version} keeps per-row optimizer state of tables at other "
            f"optimizer parameters than this trainer ({shown}); give the optimizers the tables "
            f"in the version's order: {order}"
        )


#: what interpreting the optimizer metadata (JSON from the store, hostile like any fetched
#: data) and loading the state it describes raise when that metadata is malformed.
_MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError)


def _optimizer_states(
    state: RestoredState, optimizers: Sequence[torch.optim.Optimizer]
) -> list[dict[str, Any]]:
    """The state_dicts the version holds for `optimizers`, each checked to fit its optimizer
    (publisher/state_dicts.py `state_dict_misfits`) before anything is loaded."""
    # The one place the trainer interprets that metadata: whatever it holds ends here as a
    # CheckpointError (exit 1 for `train --resume`), never as an escaping KeyError.
    try:
        metas = state.optimizer_meta.get("optimizers", [])
        if len(metas) != len(optimizers):
            raise CheckpointError(
                f"version {state.version} holds state of {len(metas)} optimizer(s), "
                f"this trainer has {len(optimizers)}"
            )
        aux = {name: table.aux for name, table in state.tables.items()}
        dicts = optimizer_state_dicts(state.optimizer, state.optimizer_meta, aux)
        misfits = [
            f"optimizers[{i}]: {why}"
            for i, (optimizer, sd, meta) in enumerate(zip(optimizers, dicts, metas, strict=True))
            for why in state_dict_misfits(optimizer, sd, meta.get("class"))
        ]
    except _MALFORMED as exc:
        raise CheckpointError(
            f"version {state.version}: optimizer state is malformed: {type(exc).__name__}: {exc}"
        ) from exc
    if misfits:
        raise CheckpointError(
            f"version {state.version}: optimizer state does not fit: {'; '.join(misfits)}"
        )
    return dicts


def _load_optimizers(
    state: RestoredState,
    optimizers: Sequence[torch.optim.Optimizer],
    dicts: Sequence[dict[str, Any]],
) -> None:
    try:
        for optimizer, sd in zip(optimizers, dicts, strict=True):
            optimizer.load_state_dict(sd)
    except _MALFORMED as exc:
        raise CheckpointError(
            f"version {state.version}: optimizer state does not fit: {type(exc).__name__}: {exc}"
        ) from exc
