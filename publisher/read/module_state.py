"""A restored version loaded into any module of its model, without a lease or a subscriber.

    state = restore(open_store(url), "ranker", version=7)
    model = build(state.manifest.model_config_)         # any nn.Module of that architecture
    id_maps = load_module_state(model, state)           # table -> IdMap (open id spaces)

The tables are the module's `nn.Embedding` / `nn.EmbeddingBag` modules, named by module path as
the manifests name them (`publisher.write.tracker.find_embedding_tables`); each gets its whole
restored weights (the rows no version of the chain carried, the free rows a full of a table
with a dynamic id map leaves out, as zero: docs/FORMAT.md 7.1; a trainer resuming keeps its
model's own values there, `keep_unwritten`), and the dense state (every other parameter and
buffer, as the trainer's state_dict named them) goes in with them in one `load_state_dict`.
Every table and shape is checked before anything is written, so a module that does not fit is
left as it was. Optimizer state is not a module's: `trainer.resume.load_restored` loads it into
a trainer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from publisher.id_map import IdMap
from publisher.read.restore import RestoredState
from publisher.state_dicts import weight_key
from publisher.write.tracker import EmbeddingModule, find_embedding_tables
from schemas.errors import BadDataError

__all__ = ["ModuleStateError", "load_module_state", "module_state_dict"]


class ModuleStateError(BadDataError):
    """A restored version does not fit the module it is loaded into: a table missing on
    either side, a table of another shape (or only a row range of it restored), or dense state
    the module does not hold."""


def module_state_dict(
    module: nn.Module,
    state: RestoredState,
    *,
    strict: bool = True,
    tables: Mapping[str, EmbeddingModule] | None = None,
    weight_keys: Mapping[str, str] | None = None,
    keep_unwritten: bool = False,
) -> dict[str, torch.Tensor]:
    """The state_dict that loads `state` into `module` (tensors sharing the restored arrays),
    checked: ModuleStateError when a table is missing or of another shape, or a key of it is
    not the module's or of another shape (with `strict`: not exactly the module's keys).

    `tables` (default: the module's, `find_embedding_tables`) are checked; `weight_keys` their
    weights' state_dict keys (default `publisher.state_dicts.weight_key` of each name). With
    `strict`, the version must hold exactly the module's tables; without, tables only one side
    has are left out (and the dense state is loaded with `strict=False` by
    `load_module_state`). `keep_unwritten`: the rows no version carried keep the module's
    values (a model just built: its own initialisation) instead of the restored zeros.
    """
    found = find_embedding_tables(module) if tables is None else dict(tables)
    missing = sorted(set(found) - set(state.tables))
    extra = sorted(set(state.tables) - set(found))
    if strict and (missing or extra):
        raise ModuleStateError(
            f"version {state.version} holds tables {sorted(state.tables)}, "
            f"{type(module).__name__} has {sorted(found)}"
            + (f" (missing: {missing})" if missing else "")
            + (f" (not in the module: {extra})" if extra else "")
        )
    weights: dict[str, torch.Tensor] = {}
    for name, table in found.items():
        restored = state.tables.get(name)
        if restored is None:
            continue
        shape = tuple(table.weight.shape)
        if restored.weights.shape != shape or restored.row_start != 0:
            raise ModuleStateError(
                f"table {name!r} is {shape} here but {restored.weights.shape} "
                f"(from row {restored.row_start}) in version {state.version}"
            )
        key = weight_key(name) if weight_keys is None else weight_keys[name]
        values = torch.from_numpy(restored.weights)
        if keep_unwritten and len(restored.unwritten):  # a copy: the arrays stay the version's
            rows = torch.from_numpy(restored.unwritten)
            values = values.clone()
            values[rows] = table.weight.detach()[rows].to(values.dtype)
        weights[key] = values
    dense = {k: torch.from_numpy(v) for k, v in state.dense.items()}
    loaded = {**dense, **weights}
    _check_keys(module, loaded, state.version, strict)
    return loaded


def _check_keys(
    module: nn.Module, loaded: Mapping[str, torch.Tensor], version: int, strict: bool
) -> None:
    """Every key of `loaded` the module holds, of its shape, and with `strict` every key the
    module holds: checked here because `load_state_dict` copies what fits before it raises
    for what does not."""
    own = module.state_dict()
    wrong = [
        f"{key} is {tuple(own[key].shape)} here, {tuple(value.shape)} in the version"
        for key, value in loaded.items()
        if key in own and tuple(own[key].shape) != tuple(value.shape)
    ]
    if strict:
        wrong += [f"{key} is not in the version" for key in sorted(own.keys() - loaded.keys())]
        wrong += [f"{key} is not in the module" for key in sorted(loaded.keys() - own.keys())]
    if wrong:
        shown = "; ".join(wrong[:8]) + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise ModuleStateError(f"version {version} does not fit {type(module).__name__}: {shown}")


def load_module_state(
    module: nn.Module, state: RestoredState, *, strict: bool = True
) -> dict[str, IdMap]:
    """Write the version's tables and dense state into `module` (`module_state_dict`, then one
    `load_state_dict(strict=strict)`); return its id maps by table (empty when it has none).

    ModuleStateError, with nothing written, when the version does not fit the module: a table,
    a key or a shape (all checked before `load_state_dict`, which would copy what fits before
    raising for what does not). The optimizer state in `state` is not loaded. The id maps are the
    state's own objects: copy them (`IdMap.copy`) before changing them if `state` is kept.
    """
    loaded = module_state_dict(module, state, strict=strict)
    with torch.no_grad():
        try:
            module.load_state_dict(loaded, strict=strict)
        except RuntimeError as exc:
            raise ModuleStateError(
                f"version {state.version} does not fit {type(module).__name__}: {exc}"
            ) from exc
    return dict(state.id_maps)
