"""What a `Subscriber` applies versions to: a sink holds the served model and swaps versions in.

    sink = ModuleSink(build)                 # your model, rebuilt from each version's config
    sink = ModuleSink(model)                 # or copies of a module you built
    sink = TensorSink()                      # or plain tensors: tables, dense state, id maps
    with sink.reader() as copy:              # one version for the whole read
        scores = copy.module(*inputs)        # copy.version, copy.id_maps, copy.tables...

Every sink keeps the guarantees of its consistency scheme (publisher/read/consistency.py):

- `double-buffer` (default): two copies; a version is written into the hidden one and swapped
  in by pointer. Readers never wait for a write (the swap holds a lock for microseconds);
  memory is two copies.
- `rwlock`: one copy behind a writer-preferring reader-writer lock; a delta's rows are decoded
  outside the lock and scattered in under it (readers wait for the scatter: milliseconds per
  100k rows); a full version is built beside and swapped in. Memory: one copy between fulls.

Under either, a reader holding `reader()` sees exactly one version: the rows, the dense
tensors and the id maps of that version and no other, until it lets go. Outside `reader()`
nothing is promised: keep no reference to `copy.module` or its tensors past the `with`.

`ModuleSink(model_or_factory)` serves any `nn.Module` whose tables are `nn.Embedding` /
`nn.EmbeddingBag` modules, found where the trainer found them (their module paths are the
manifests' table names; TorchRec's unsharded `EmbeddingBagCollection` and
`EmbeddingCollection` hold exactly those), plus every other parameter and buffer of its
state_dict as the dense state. With `quantized=True` (the default) a table whose versions arrive
int8/int4/int2 is held in FBGEMM's fused rowwise format and looked up by torch's quantized
kernels through a module that takes its original module's call (publisher/read/held_tables.py);
a model that reads a table's `.weight` directly (weight tying, `F.linear(x, emb.weight)`) needs
`quantized=False`. The module is held on the CPU in float32, in eval mode with gradients off.

`TensorSink()` holds the same state with no module: `copy.values(table)` is a table as float32,
`copy.dense` the dense tensors, `copy.id_maps` the maps; for any other consumer (a serving
stack of your own, a feature store, an export job).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

from torch import nn

from publisher.dlrm import build_served_model, served_model_bytes
from publisher.memory_budget import MemoryBudget
from publisher.model_factory import ModelFactory
from publisher.read.catalog import VersionRef
from publisher.read.consistency import ModelSlot, UpdateResult, make_slot
from publisher.read.copy_builders import (
    CopyBuilder,
    ModelBytes,
    ModuleBuilder,
    TensorBuilder,
)
from publisher.read.model_copy import ModelCopy
from publisher.read.scheme_names import SCHEMES, ConsistencyScheme
from publisher.read.version_fetch import FetchFn


class VersionSink:
    """Holds the served copies of a model and applies plans of versions to them, one swap per
    plan (see the module docstring). Built as a `ModuleSink` or a `TensorSink`."""

    def __init__(
        self,
        builder: CopyBuilder,
        *,
        scheme: ConsistencyScheme = "double-buffer",
        quantized: bool = True,
        memory_budget: MemoryBudget | int | None = None,
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
        budget = (
            memory_budget
            if isinstance(memory_budget, MemoryBudget)
            else MemoryBudget.from_setting(memory_budget)
        )
        self.slot: ModelSlot = make_slot(scheme, builder, budget, quantized=quantized)

    @property
    def scheme(self) -> ConsistencyScheme:
        return self.slot.scheme

    def reader(self) -> AbstractContextManager[ModelCopy]:
        """Borrow the served copy for one read: it holds one version throughout
        (`NotBootstrappedError` before the first version)."""
        return self.slot.reader()

    def current(self) -> ModelCopy | None:
        """The served copy, for its metadata only (its tensors may change under a later
        update: read them under `reader()`)."""
        return self.slot.current()

    @property
    def version(self) -> int | None:
        """The version served now, if any."""
        copy = self.slot.current()
        return None if copy is None else copy.version

    def update(self, plan: Sequence[VersionRef], fetch: FetchFn) -> UpdateResult:
        """Apply `plan` (versions in order, fetched and verified by `fetch`) as one swap;
        raises, serving what it served, if any version fails (the subscriber calls this)."""
        return self.slot.update(plan, fetch)

    def nbytes(self) -> int:
        """Bytes of model tensors held by every copy."""
        return self.slot.nbytes()


class ModuleSink(VersionSink):
    """Versions applied to copies of a module (see the module docstring).

    `model` is either a factory, `model_config -> nn.Module` (each version's model is built
    from its manifest's `model_config`: a version of another config is rebuilt from its full
    version, as a new architecture), or a module to copy (every version must then have its
    tables, of the same shapes; the module itself is never written).

    A factory's module is sized for the memory budget by building it on the meta device, or by
    `model_bytes(model_config)` when given (publisher/read/copy_builders.py).
    """

    def __init__(
        self,
        model: nn.Module | ModelFactory,
        *,
        scheme: ConsistencyScheme = "double-buffer",
        quantized: bool = True,
        memory_budget: MemoryBudget | int | None = None,
        model_bytes: ModelBytes | None = None,
    ) -> None:
        builder = (
            ModuleBuilder(template=model)
            if isinstance(model, nn.Module)
            else ModuleBuilder(factory=model, model_bytes=model_bytes)
        )
        super().__init__(builder, scheme=scheme, quantized=quantized, memory_budget=memory_budget)


class TensorSink(VersionSink):
    """Versions applied to plain tensors: one table per manifest table, the dense tensors and
    the id maps (see the module docstring). Tables are float32 unless `quantized`."""

    def __init__(
        self,
        *,
        scheme: ConsistencyScheme = "double-buffer",
        quantized: bool = False,
        memory_budget: MemoryBudget | int | None = None,
    ) -> None:
        super().__init__(
            TensorBuilder(), scheme=scheme, quantized=quantized, memory_budget=memory_budget
        )


def dlrm_sink(
    *,
    scheme: ConsistencyScheme = "double-buffer",
    quantized: bool = True,
    memory_budget: MemoryBudget | int | None = None,
) -> ModuleSink:
    """The built-in DLRM's sink, as `checknrun serve` builds it without `--model-factory`:
    `publisher.dlrm.build_served_model`, sized by the config's arithmetic."""
    return ModuleSink(
        build_served_model,
        scheme=scheme,
        quantized=quantized,
        memory_budget=memory_budget,
        model_bytes=served_model_bytes,
    )
