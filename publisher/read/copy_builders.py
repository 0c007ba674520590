"""How a sink builds an empty copy of the model a version describes, once its copies fit the
memory budget: from a module factory or a template module (`ModuleSink`), or from the manifest
alone (`TensorSink`).

A factory is any `model_config -> nn.Module` function (`publisher.dlrm.build_served_model` for
the built-in DLRM, a user's `build` for their own model); it is called with the manifest's
`model_config` (hostile input: it comes from the store), so a version of another config is
another model, rebuilt from its full version. Its weights need not be initialised: every table
row and dense tensor is written by the full version before a reader sees the copy (the free rows
a full of a dynamic table leaves out are set to zero, docs/FORMAT.md 7.1).

The budget is checked before anything is allocated (publisher/memory_budget.py): the factory's
module is first built on the meta device (`torch.device("meta")`: shapes, no memory), its
parameters and buffers counted and its tables checked against the manifest's; only then is it
built for real. A factory that cannot build on the meta device is counted from the manifest
instead (its tables and dense blob), with a warning. A template is deep-copied (its own memory
counted); forward hooks on its embedding modules (a trainer's dirty-row tracking, when the
template is the model being trained) are not carried into the copies.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from publisher.memory_budget import MemoryBudget, served_id_maps_bytes
from publisher.model_factory import ModelFactory, ModelFactoryError, build_module
from publisher.read.errors import ApplyError
from publisher.read.held_tables import (
    Float32Table,
    HeldFormat,
    HeldTable,
    Lookup,
    held_format,
    looks_up,
    new_table,
)
from publisher.read.model_copy import ModelCopy, Touched, install_module
from publisher.state_dicts import weight_key
from publisher.write.tracker import find_embedding_tables
from schemas.manifest import Manifest

log = logging.getLogger(__name__)

#: the bytes of the module a `model_config` describes, from the config alone.
ModelBytes = Callable[[Mapping[str, Any]], int]


class CopyBuilder(ABC):
    """Builds the copies of one sink's model."""

    @abstractmethod
    def copy_bytes(self, manifest: Manifest) -> int:
        """What one copy of `manifest`'s model may take (ApplyError if its model cannot be
        built), before anything is allocated."""

    def check_tables(self, manifest: Manifest) -> None:  # noqa: B027 (optional hook)
        """ApplyError unless `manifest`'s model has its tables, before anything is allocated
        (after `copy_bytes`, whose probe it may read); by default nothing to check."""

    @abstractmethod
    def build(self, manifest: Manifest, formats: Mapping[str, HeldFormat]) -> ModelCopy:
        """An empty copy of `manifest`'s model, table `t` held in `formats[t]` where its
        module allows (default fp32)."""

    def new_copy(
        self, manifest: Manifest, budget: MemoryBudget, copies: int, *, quantized: bool
    ) -> ModelCopy:
        """An empty copy of `manifest`'s model once `copies` of it fit `budget`
        (MemoryBudgetError before anything is allocated); with `quantized`, each table starts
        in the format of its codec in `manifest` (a full version; held_tables.py).

        The budget counts float32 tables: a bound for every format, since tables may widen."""
        budget.check_copies(
            manifest, self.copy_bytes(manifest) + served_id_maps_bytes(manifest), copies
        )
        self.check_tables(manifest)
        formats = (
            {e.name: held_format(e.codec, e.dim) for e in manifest.tables} if quantized else {}
        )
        return self.build(manifest, formats)

    def clone(self, source: ModelCopy) -> ModelCopy:
        """A second copy of `source`'s model, bitwise equal, holding the same version."""
        other = self.build(source.manifest, source.formats)
        other.copy_from(source, Touched(whole=set(source.tables), dense=True))
        return other


class ModuleBuilder(CopyBuilder):
    """Copies of a module: built by `factory(model_config)`, or deep copies of `template`.

    `model_bytes(model_config)`, when given, sizes a factory's module from the config alone
    (the built-in DLRM's arithmetic), instead of building it on the meta device: a hostile
    config can make even a meta build slow (thousands of modules)."""

    def __init__(
        self,
        *,
        factory: ModelFactory | None = None,
        template: nn.Module | None = None,
        model_bytes: ModelBytes | None = None,
    ) -> None:
        if (factory is None) == (template is None):
            raise ValueError("give exactly one of a model factory and a template module")
        self.factory = factory
        self.template = template
        self.model_bytes = model_bytes
        self._meta_warned = False
        #: the module `copy_bytes` measured, for `check_tables` (None: none to check).
        self._probe: nn.Module | None = None

    def copy_bytes(self, manifest: Manifest) -> int:
        self._probe = self.template
        if self.template is None and self.model_bytes is not None:
            try:
                return self.model_bytes(manifest.model_config_)
            except Exception as exc:
                raise ApplyError(
                    f"version {manifest.version}: its model_config cannot be sized "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
        if self.template is None:
            try:
                with torch.device("meta"):
                    self._probe = self._call_factory(manifest)
            except ApplyError:
                raise
            except Exception as exc:  # a factory that needs real tensors to build
                if not self._meta_warned:
                    log.warning(
                        "the model factory cannot build on the meta device (%s: %s); the "
                        "memory budget is checked on the manifest's tables and dense blob",
                        type(exc).__name__,
                        exc,
                    )
                    self._meta_warned = True
                return manifest.served_fp32_bytes
        probe = self._probe
        assert probe is not None
        tensors = [*probe.parameters(), *probe.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def check_tables(self, manifest: Manifest) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            _check_tables(manifest, probe)

    def build(self, manifest: Manifest, formats: Mapping[str, HeldFormat]) -> ModelCopy:
        if self.template is not None:
            module = copy.deepcopy(self.template)
            for embedding in find_embedding_tables(module).values():
                embedding._forward_pre_hooks.clear()
                embedding._forward_hooks.clear()
        else:
            module = self._call_factory(manifest)
        _check_tables(manifest, module)
        module.eval()
        module.requires_grad_(False)  # in-place writes on leaves need no autograd
        embeddings = find_embedding_tables(module)
        table_keys = {weight_key(name) for name in embeddings}
        state = module.state_dict(keep_vars=True)
        dense = {k: v.data for k, v in state.items() if k not in table_keys}
        tables: dict[str, HeldTable] = {}
        for name, embedding in embeddings.items():
            lookup = Lookup.of(embedding)
            fmt = formats.get(name, "fp32")
            if not lookup.quantizable or not looks_up(fmt, embedding.embedding_dim):
                fmt = "fp32"
            if fmt == "fp32":
                try:
                    tables[name] = Float32Table(embedding)
                except ValueError as exc:
                    raise ApplyError(f"table {name!r} cannot be served: {exc}") from exc
            else:  # the module's float32 table is dropped: the held one replaces it
                rows, dim = embedding.num_embeddings, embedding.embedding_dim
                tables[name] = new_table(rows, dim, fmt, lookup)
                install_module(module, name, tables[name].module)
        return ModelCopy(
            model_config=manifest.model_config_,
            tables=tables,
            dense=dense,
            mapped=_mapped(manifest),
            module=module,
            config_bound=self.factory is not None,
        )

    def _call_factory(self, manifest: Manifest) -> nn.Module:
        assert self.factory is not None
        try:
            return build_module(self.factory, manifest.model_config_)
        except ModelFactoryError as exc:
            raise ApplyError(f"version {manifest.version}: {exc}") from exc


class TensorBuilder(CopyBuilder):
    """Copies of plain tensors: one table per manifest table, and the dense tensors a full
    version brings (no module)."""

    def copy_bytes(self, manifest: Manifest) -> int:
        return manifest.served_fp32_bytes

    def build(self, manifest: Manifest, formats: Mapping[str, HeldFormat]) -> ModelCopy:
        tables = {
            e.name: new_table(e.rows, e.dim, formats.get(e.name, "fp32")) for e in manifest.tables
        }
        return ModelCopy(
            model_config=manifest.model_config_,
            tables=tables,
            dense={},
            mapped=_mapped(manifest),
            adopts_dense=True,
        )


def _mapped(manifest: Manifest) -> frozenset[str]:
    return frozenset(e.name for e in manifest.tables if e.has_id_map)


def _check_tables(manifest: Manifest, module: nn.Module) -> None:
    """ApplyError unless `module`'s tables are those `manifest` names, of the same shapes
    (a full version names every table; a delta some of them)."""
    found = {
        name: (int(t.num_embeddings), int(t.embedding_dim))
        for name, t in find_embedding_tables(module).items()
    }
    named = {e.name: (e.rows, e.dim) for e in manifest.tables}
    wrong = {n: shape for n, shape in named.items() if found.get(n) != shape}
    missing = set(found) - set(named) if manifest.kind == "full" else set()
    if wrong or missing:
        raise ApplyError(
            f"version {manifest.version} ({manifest.kind}) has tables {named}; the model built "
            f"for it has {found}"
        )
