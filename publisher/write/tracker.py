"""Which embedding rows changed since the last checkpoint: one bitmap per table.

Check-N-Run sets a bit per looked-up row on the embedding-lookup path; an incremental checkpoint
then holds only the rows whose bit is set. Here `attach` writes into a `DirtyRowTracker` from
one of two places per `nn.Embedding` / `nn.EmbeddingBag` of an arbitrary model:

- the optimizer step (`attach(model, optimizers=...)`, for a table with sparse gradients in
  one of those optimizers): a step pre-hook marks the rows of the table's sparse gradient, the
  ids torch has already gathered (and range-checked, in the lookup) for the optimizer. One hook
  per step instead of one per lookup, no range check, no copy: on the synthetic workload
  (26 tables, batch 512) training CPU time grew 4.4% with the per-lookup hooks and did not
  measurably grow with this (-2.0%, noise; `checknrun bench stall`, "tracking" section);
- the lookup (every other table): a forward pre-hook marks the ids it is given.

Marking at the step is sound for the same optimizers as marking at the lookup: those
`check_optimizers` accepts change a row (and its state) only when its gradient row is non-zero,
and a non-zero gradient row of a sparse gradient is one of its indices. It is also marked no
earlier than the row changes, so gradient accumulated over several forwards before one step is
marked by that step. What it cannot see is a change made outside the listed optimizers (an
in-place edit of a looked-up row), which is why only tables held by a listed optimizer are
marked this way, and why `max_norm` tables (renormalised in place by every forward) always keep
the lookup hook.

"Marked" equals "possibly changed" only under conditions this module also checks or helps
to check:

- the optimizer of each table changes the parameter and its per-row state only for rows with a
  non-zero gradient (`check_optimizers`; the rules were measured on torch, see
  `soundness_problems`);
- the table's weight is not shared with another module (weight tying) and not used outside its
  module (e.g. `F.linear(x, emb.weight)`); sharing through modules is detected, functional use
  is not, which is what `UntrackedRowVerifier` is for;
- the caller takes `snapshot_and_reset` at an optimizer-step boundary: after `step()` and before
  the next forward, with no gradient accumulated for a later step. Otherwise a row looked up
  before the boundary changes after it and lands in neither interval's delta.

Bitmaps are `torch.bool` (one byte per row: 1 GB per billion rows). Marking is one
`index_fill_` under a lock; a snapshot swaps in the spare (zeroed) bitmaps under the lock and
reads the old ones outside it, so training threads wait only for a dict swap. The old ones are
then zeroed and kept as the next spare: no allocation, and no page faults on the marking path
(a fresh `torch.zeros` maps its pages lazily). Reading a CPU bitmap is `np.flatnonzero`, about
twice as fast as `torch.nonzero` (4.2M rows, 4% set: 2.5-3.3 ms vs 5.0-5.5 ms of CPU).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from schemas.errors import BadDataError

EmbeddingModule: TypeAlias = nn.Embedding | nn.EmbeddingBag
RowIds: TypeAlias = npt.NDArray[np.int64]
_PreHook: TypeAlias = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]

__all__ = [
    "DirtyRowTracker",
    "EmbeddingModule",
    "LookupRecorder",
    "RowIdError",
    "SoundnessProblem",
    "TrackedEmbeddings",
    "TrackerError",
    "UnsoundOptimizerError",
    "UntrackedChangeError",
    "UntrackedRowVerifier",
    "attach",
    "check_optimizers",
    "find_embedding_tables",
    "soundness_problems",
]


class TrackerError(BadDataError):
    """Base of this module's errors; also raised for misuse (unknown table, mismatched tracker)."""


class RowIdError(TrackerError):
    """Row ids that cannot index the table: out of range, or not of an integer dtype."""


class UnsoundOptimizerError(TrackerError):
    """An optimizer (or weight sharing) may change rows that were never looked up.

    `problems` lists every offending table/optimizer pair.
    """

    def __init__(self, problems: Sequence[SoundnessProblem]) -> None:
        self.problems: tuple[SoundnessProblem, ...] = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            "dirty-row tracking would miss changed rows:\n"
            f"{lines}\n"
            "Fix: build the table with sparse=True and optimise it with torch.optim.SparseAdam or "
            "Adagrad(weight_decay=0), or use plain SGD (momentum=0, weight_decay=0); put the "
            "dense parameters in a separate optimizer; give a custom row-wise optimizer the "
            "attribute `sparse_row_updates = True`; or checkpoint with the full policy."
        )


class UntrackedChangeError(TrackerError):
    """A row that was not marked dirty changed: an incremental checkpoint would miss it.

    `rows` maps each table to the changed, unmarked row ids that were found.
    """

    def __init__(self, rows: Mapping[str, RowIds]) -> None:
        self.rows: dict[str, RowIds] = dict(rows)
        shown = "; ".join(
            f"table {name!r}: {ids.size} row(s), ids {ids[:10].tolist()}"
            + (" ..." if ids.size > 10 else "")
            for name, ids in self.rows.items()
        )
        super().__init__(
            f"rows changed without being marked dirty ({shown}); the model changes embedding "
            "rows outside the tracked lookups (unsound optimizer, weight used outside its "
            "module, or in-place edits)"
        )


class DirtyRowTracker:
    """One dirty bitmap per table; thread-safe marking and snapshotting.

    A `mark` concurrent with `snapshot_and_reset` lands in that snapshot or in the next one;
    none is lost or reported twice.
    """

    def __init__(self, tables: Mapping[str, int], *, device: torch.device | str = "cpu") -> None:
        """`tables` maps a table name to its number of rows; bitmaps live on `device`."""
        rows: dict[str, int] = {}
        for name, n in tables.items():
            if not isinstance(name, str):
                raise TrackerError(f"table names must be str, got {name!r}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise TrackerError(f"table {name!r}: row count must be an int >= 0, got {n!r}")
            rows[name] = n
        self._rows = rows
        self._device = torch.device(device)
        self._lock = threading.Lock()
        self._bitmaps = self._fresh_bitmaps()
        #: zeroed bitmaps swapped in by the next snapshot (None while a snapshot reads them).
        self._spare: dict[str, torch.Tensor] | None = self._fresh_bitmaps()

    @property
    def table_rows(self) -> Mapping[str, int]:
        """Table name -> number of rows (read-only)."""
        return MappingProxyType(self._rows)

    @property
    def device(self) -> torch.device:
        """Where the bitmaps live; ids are moved there before marking."""
        return self._device

    def mark(self, table: str, ids: torch.Tensor | np.ndarray) -> None:
        """Mark rows `ids` (any integer dtype, any shape, duplicates allowed) of `table` dirty.

        Raises `RowIdError` (before marking anything) if an id is outside [0, rows).
        """
        rows = self._table_size(table)
        flat = _as_index(table, ids)
        if flat.numel() == 0:
            return
        # One reduction (a device sync for CUDA ids) buys a clear error instead of an index
        # failure or a device-side assert half-way through the write.
        lo, hi = (int(v) for v in torch.aminmax(flat))
        if lo < 0 or hi >= rows:
            bad = lo if lo < 0 else hi
            raise RowIdError(f"table {table!r}: row id {bad} out of range [0, {rows})")
        flat = flat.to(self._device)
        with self._lock:
            self._bitmaps[table].index_fill_(0, flat, True)

    def _mark_valid(self, marks: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Mark int64 ids known to be in range (a gradient's indices), several tables at once."""
        with self._lock:
            for table, ids in marks:
                self._bitmaps[table].index_fill_(0, ids.to(self._device), True)

    def snapshot_and_reset(self) -> dict[str, RowIds]:
        """Sorted unique dirty row ids per table (every table present); clears all bitmaps."""
        with self._lock:
            fresh, self._spare = self._spare, None
        if fresh is None:  # another thread's snapshot is reading the spare set: make one
            fresh = self._fresh_bitmaps()
        with self._lock:
            old, self._bitmaps = self._bitmaps, fresh
        rows = {name: _set_rows(bitmap) for name, bitmap in old.items()}
        for bitmap in old.values():
            bitmap.zero_()
        with self._lock:
            self._spare = old
        return rows

    def peek(self, table: str) -> RowIds:
        """Sorted unique dirty row ids of `table`, without clearing them."""
        self._table_size(table)
        with self._lock:
            return _set_rows(self._bitmaps[table])

    def dirty_counts(self) -> dict[str, int]:
        """Number of dirty rows per table."""
        with self._lock:
            return {name: int(torch.count_nonzero(b)) for name, b in self._bitmaps.items()}

    def _table_size(self, table: str) -> int:
        try:
            return self._rows[table]
        except KeyError:
            raise TrackerError(
                f"unknown table {table!r}; tracked tables: {sorted(self._rows)}"
            ) from None

    def _fresh_bitmaps(self) -> dict[str, torch.Tensor]:
        return {
            name: torch.zeros(n, dtype=torch.bool, device=self._device)
            for name, n in self._rows.items()
        }


def _as_index(table: str, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Flat int64 tensor of `ids`; bool/uint8 tensors would index as masks, so always cast."""
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise RowIdError(f"table {table!r}: row ids must be integers, got dtype {ids.dtype}")
        if ids.size and ids.dtype.kind == "u" and int(ids.max()) > np.iinfo(np.int64).max:
            raise RowIdError(f"table {table!r}: row id {int(ids.max())} out of range")
        flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
        if not flat.flags.writeable:  # torch warns on read-only buffers
            flat = flat.copy()
        return torch.from_numpy(flat)
    if isinstance(ids, torch.Tensor):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise RowIdError(f"table {table!r}: row ids must be integers, got dtype {ids.dtype}")
        return ids.detach().reshape(-1).to(torch.int64)
    raise RowIdError(
        f"table {table!r}: row ids must be a torch.Tensor or numpy array, got {type(ids)}"
    )


def _set_rows(bitmap: torch.Tensor) -> RowIds:
    if bitmap.device.type == "cpu":
        return np.flatnonzero(bitmap.numpy()).astype(np.int64, copy=False)
    rows: RowIds = torch.nonzero(bitmap).reshape(-1).cpu().numpy().astype(np.int64, copy=False)
    return rows


# --- hooks -------------------------------------------------------------------------------------


def find_embedding_tables(model: nn.Module) -> dict[str, EmbeddingModule]:
    """Every `nn.Embedding` / `nn.EmbeddingBag` (and subclass) of `model` by qualified name.

    Order is `named_modules` order; a module registered under two names appears once.
    """
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding | nn.EmbeddingBag)
    }


class TrackedEmbeddings:
    """The hooks `attach` installed on a model, and the tracker they write into."""

    def __init__(
        self,
        tracker: DirtyRowTracker,
        tables: Mapping[str, EmbeddingModule],
        handles: Sequence[RemovableHandle],
    ) -> None:
        self.tracker = tracker
        self.tables: Mapping[str, EmbeddingModule] = MappingProxyType(dict(tables))
        self._handles = list(handles)

    @property
    def attached(self) -> bool:
        """Whether the hooks are still installed."""
        return bool(self._handles)

    def detach(self) -> None:
        """Remove the hooks (idempotent); the tracker keeps its marks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> TrackedEmbeddings:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.detach()


def attach(
    model: nn.Module,
    tracker: DirtyRowTracker | None = None,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> TrackedEmbeddings:
    """Mark the rows every embedding module of `model` may change; tables are named by module path.

    A table with sparse gradients (`sparse=True`), no `max_norm`, whose weight is in one of
    `optimizers`, is marked by a step pre-hook on each optimizer holding it: the rows of its
    gradient, before the step applies it (see the module docstring for why that is sound).
    `optimizers` must then be every optimizer that changes the table, as
    `IncrementalCheckpointer` requires. Every other table is marked at its lookups, as follows.

    Handles `Embedding(input)` of any shape and `EmbeddingBag(input)` in the 2D form and in the
    1D form with `offsets` / `per_sample_weights`, passed positionally or by keyword.

    When a lookup is marked: whenever grad mode is on and the weight requires grad, whatever the
    module's training flag. Lookups under `no_grad` / `inference_mode` (or of a frozen table)
    put no gradient on the weight, so they cannot change rows and are skipped. Eval mode is NOT
    a reason to skip: a forward in eval mode with grad on can be followed by `backward` and
    `step` (training with `.eval()` to freeze dropout/batch-norm is common), and skipping it
    would lose changed rows silently; an evaluation loop without `no_grad` only costs extra
    dirty rows. Modules with `max_norm` renormalise the looked-up rows in place on every
    forward, so they are marked in every mode.

    If `tracker` is given its tables must be exactly the model's, with the same row counts.
    """
    tables = find_embedding_tables(model)
    if not tables:
        raise TrackerError(f"{type(model).__name__} has no nn.Embedding or nn.EmbeddingBag")
    sizes = {name: module.num_embeddings for name, module in tables.items()}
    if tracker is None:
        tracker = DirtyRowTracker(sizes)
    elif dict(tracker.table_rows) != sizes:
        raise TrackerError(
            f"tracker tables {dict(tracker.table_rows)} differ from the model's "
            f"embedding tables {sizes}"
        )
    by_optimizer = _tables_marked_at_step(tables, optimizers)
    at_step = {name for marked in by_optimizer for name, _ in marked}
    handles = [
        module.register_forward_pre_hook(_lookup_hook(tracker, name, module), with_kwargs=True)
        for name, module in tables.items()
        if name not in at_step
    ]
    handles += [
        optimizer.register_step_pre_hook(_gradient_hook(tracker, marked))
        for optimizer, marked in zip(optimizers, by_optimizer, strict=True)
        if marked
    ]
    return TrackedEmbeddings(tracker, tables, handles)


def _lookup_hook(tracker: DirtyRowTracker, table: str, module: EmbeddingModule) -> _PreHook:
    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        can_change = torch.is_grad_enabled() and module.weight.requires_grad
        if not can_change and module.max_norm is None:
            return
        ids = _looked_up_ids(args, kwargs)
        if ids is not None:
            tracker.mark(table, ids)

    return hook


def _looked_up_ids(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The ids an embedding module's forward is given (positionally or as `input=`, TorchRec's
    way); None when they are no tensor: the forward then raises its own error."""
    ids = args[0] if args else kwargs.get("input")
    return ids if isinstance(ids, torch.Tensor) else None


class LookupRecorder:
    """The rows a model's forwards read, per table, while the recorder is entered:

        with LookupRecorder(find_embedding_tables(model)) as lookups:
            model(*inputs)
        rows = lookups.rows()          # table -> sorted unique row ids

    Forward pre-hooks on every embedding module, in any grad mode (unlike `attach`, which marks
    the rows a lookup may change, this records the rows it reads: the served-loss meter's
    question, asked under `no_grad`). The ids are kept as given and made unique once, in
    `rows()`: O(ids) per forward, not O(rows) as a bitmap would be. An id out of range is the
    forward's error, raised by it as usual.
    """

    def __init__(self, tables: Mapping[str, EmbeddingModule]) -> None:
        self.tables: Mapping[str, EmbeddingModule] = MappingProxyType(dict(tables))
        self._ids: dict[str, list[torch.Tensor]] = {name: [] for name in self.tables}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> LookupRecorder:
        for name in self._ids:
            self._ids[name].clear()
        self._handles = [
            module.register_forward_pre_hook(self._hook(name), with_kwargs=True)
            for name, module in self.tables.items()
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, table: str) -> _PreHook:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ids = _looked_up_ids(args, kwargs)
            if ids is not None:
                self._ids[table].append(ids.detach().reshape(-1))

        return hook

    def rows(self) -> dict[str, RowIds]:
        """Table -> the sorted unique rows read since `__enter__` (every table present)."""
        out: dict[str, RowIds] = {}
        for name, chunks in self._ids.items():
            if not chunks:
                out[name] = np.zeros(0, dtype=np.int64)
                continue
            ids = torch.cat([c.to("cpu", torch.int64) for c in chunks])
            out[name] = torch.unique(ids).numpy()
        return out


def _tables_marked_at_step(
    tables: Mapping[str, EmbeddingModule], optimizers: Sequence[torch.optim.Optimizer]
) -> list[list[tuple[str, torch.Tensor]]]:
    """Per optimizer, the (table, weight) pairs its step pre-hook marks."""
    eligible = {
        id(module.weight): name
        for name, module in tables.items()
        if module.sparse and module.max_norm is None
    }
    marked: list[list[tuple[str, torch.Tensor]]] = []
    for optimizer in optimizers:
        held = [p for group in optimizer.param_groups for p in group["params"]]
        marked.append([(eligible[id(p)], p) for p in held if id(p) in eligible])
    return marked


def _gradient_hook(
    tracker: DirtyRowTracker, tables: Sequence[tuple[str, torch.Tensor]]
) -> Callable[[torch.optim.Optimizer, tuple[Any, ...], dict[str, Any]], None]:
    def hook(_: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tracker._mark_valid(
            [(name, _gradient_rows(w.grad)) for name, w in tables if w.grad is not None]
        )

    return hook


def _gradient_rows(grad: torch.Tensor) -> torch.Tensor:
    """Ids of the rows a gradient may move: a sparse one's indices (duplicates and all, as
    the lookups left them: coalescing would cost a sort), a dense one's non-zero rows."""
    if grad.is_sparse:
        return grad._indices()[0]
    return torch.nonzero(grad.ne(0).any(dim=1)).reshape(-1)


# --- soundness -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoundnessProblem:
    """Why rows of `table` may change without being looked up."""

    table: str
    #: e.g. "optimizers[1] (Adam)"; empty when the problem is not an optimizer's.
    optimizer: str
    reason: str

    def __str__(self) -> str:
        who = f", {self.optimizer}" if self.optimizer else ""
        return f"table {self.table!r}{who}: {self.reason}"


_MOMENT_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)
_DECAYING_STATE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)


def soundness_problems(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    tables: Mapping[str, EmbeddingModule] | None = None,
) -> list[SoundnessProblem]:
    """Every reason the tracked rows of `tables` (default: all of `model`'s) may miss a change.

    The optimizer rules, measured on torch by training and comparing rows and per-row optimizer
    state bitwise (tests/unit/publisher/test_tracker.py re-measures them):

    - SGD with momentum=0 and weight_decay=0: sound, dense or sparse gradients (a zero gradient
      row moves by exactly 0; no per-row state).
    - Adagrad with weight_decay=0: sound, dense or sparse (the squared sum of a zero row gets
      +0; lr_decay only scales the step).
    - SparseAdam with sparse=True: sound (lazy: only rows in the gradient move).
    - SGD with momentum (also sparse: the buffer keeps every row seen), any weight_decay,
      Adam/AdamW/Adamax/NAdam/RAdam (moments move rows long after their lookup; torch rejects
      their sparse gradients), RMSprop/Adadelta (the parameter stays but the per-row running
      averages decay every step, and checkpoints carry optimizer state), SparseAdam on dense
      gradients (torch rejects them), and any other optimizer class (exact type match; a
      subclass may change `step`): unsound.
    - An optimizer with attribute `sparse_row_updates = True` is trusted.

    Frozen weights (requires_grad=False) and weights in no optimizer cannot change and pass.
    A weight that is also a parameter of another module is reported whatever its optimizer.
    """
    if tables is None:
        tables = find_embedding_tables(model)
    problems: list[SoundnessProblem] = []
    for table, module in tables.items():
        weight = module.weight
        for owner, pname, param in _parameters_with_owner(model):
            if param is weight and owner is not module:
                problems.append(
                    SoundnessProblem(
                        table,
                        "",
                        f"its weight is also parameter {pname!r}: changes made through that "
                        "module are not tracked for this table",
                    )
                )
        if not weight.requires_grad:
            continue
        for index, optimizer in enumerate(optimizers):
            for group in optimizer.param_groups:
                if any(p is weight for p in group["params"]):
                    reason = _optimizer_problem(optimizer, group, sparse=bool(module.sparse))
                    if reason is not None:
                        label = f"optimizers[{index}] ({type(optimizer).__name__})"
                        problems.append(SoundnessProblem(table, label, reason))
    return problems


def check_optimizers(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    tables: Mapping[str, EmbeddingModule] | None = None,
) -> None:
    """Raise `UnsoundOptimizerError` listing every `soundness_problems` entry, if any."""
    problems = soundness_problems(model, optimizers, tables)
    if problems:
        raise UnsoundOptimizerError(problems)


def _parameters_with_owner(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    found: list[tuple[nn.Module, str, nn.Parameter]] = []
    for mod_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            found.append((module, f"{mod_name}.{pname}" if mod_name else pname, param))
    return found


def _hyper(group: Mapping[str, Any], key: str) -> float:
    return float(group.get(key, 0.0) or 0.0)


def _optimizer_problem(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], *, sparse: bool
) -> str | None:
    if getattr(optimizer, "sparse_row_updates", False) is True:
        return None
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        if _hyper(group, "momentum") != 0.0:
            return (
                f"momentum={_hyper(group, 'momentum')} keeps moving rows looked up in earlier "
                "steps (the momentum buffer holds them, with dense or sparse gradients)"
            )
        if _hyper(group, "weight_decay") != 0.0:
            return _weight_decay_reason(group, sparse)
        return None
    if kind is torch.optim.Adagrad:
        if _hyper(group, "weight_decay") != 0.0:
            return _weight_decay_reason(group, sparse)
        return None
    if kind is torch.optim.SparseAdam:
        if not sparse:
            return "SparseAdam needs sparse gradients; build the table with sparse=True"
        return None
    rejects_sparse = "; torch also rejects its sparse gradients" if sparse else ""
    if kind in _MOMENT_OPTIMIZERS:
        return f"its moment estimates keep moving rows after their last lookup{rejects_sparse}"
    if kind in _DECAYING_STATE_OPTIMIZERS:
        return (
            "its per-row running averages decay on every step, so the optimizer state of rows "
            f"that were not looked up changes{rejects_sparse}"
        )
    return (
        f"unknown optimizer class {kind.__module__}.{kind.__qualname__}: cannot tell whether it "
        "leaves rows without gradient unchanged"
    )


def _weight_decay_reason(group: Mapping[str, Any], sparse: bool) -> str:
    if sparse:
        return (
            f"weight_decay={_hyper(group, 'weight_decay')} is rejected by torch with sparse "
            "gradients"
        )
    return f"weight_decay={_hyper(group, 'weight_decay')} shrinks every row on every step"


# --- debug verification ----------------------------------------------------------------------


class UntrackedRowVerifier:
    """Spot-checks that rows not marked dirty did not change over an interval.

    Usage around each checkpoint interval::

        verifier = UntrackedRowVerifier(tracked.tables, sample=256, seed=0)
        verifier.before()                      # right after the previous snapshot
        ...train the interval...
        dirty = tracker.snapshot_and_reset()   # at a step boundary
        verifier.after(dirty)                  # raises UntrackedChangeError
        verifier.before()                      # arm for the next interval

    `before` copies `sample` random rows per table (a new draw each time), `after` compares
    them bitwise (NaN payloads and the sign of zero count) with the live weights: cost
    O(sample x dim) per table, independent of table size.
    """

    def __init__(
        self,
        tables: Mapping[str, EmbeddingModule | torch.Tensor],
        *,
        sample: int = 256,
        seed: int | None = 0,
    ) -> None:
        if sample < 1:
            raise TrackerError(f"sample must be >= 1, got {sample}")
        self._tables = dict(tables)
        self._sample = sample
        self._rng = np.random.default_rng(seed)
        self._saved: dict[str, tuple[RowIds, torch.Tensor]] | None = None

    @property
    def armed(self) -> bool:
        """Whether `before` was called and `after` has not consumed it yet."""
        return self._saved is not None

    def before(self) -> None:
        """Record a fresh random sample of rows (copies) of every table."""
        saved: dict[str, tuple[RowIds, torch.Tensor]] = {}
        for name in self._tables:
            weight = self._weight(name)
            n = int(weight.shape[0])
            k = min(self._sample, n)
            rows: RowIds = np.sort(self._rng.choice(n, size=k, replace=False)).astype(np.int64)
            index = torch.from_numpy(rows).to(weight.device)
            saved[name] = (rows, weight[index].clone())
        self._saved = saved

    def after(self, dirty: Mapping[str, np.ndarray]) -> int:
        """Check the sampled rows not in `dirty` (table -> row ids) are bitwise unchanged.

        A table missing from `dirty` has no dirty rows. Returns how many rows were checked;
        raises `UntrackedChangeError` naming every changed unmarked row found.
        """
        if self._saved is None:
            raise TrackerError("UntrackedRowVerifier.after() called without before()")
        saved, self._saved = self._saved, None
        checked = 0
        bad: dict[str, RowIds] = {}
        for name, (rows, old) in saved.items():
            weight = self._weight(name)
            if weight.shape[1:] != old.shape[1:] or (rows.size and rows[-1] >= weight.shape[0]):
                raise TrackerError(
                    f"table {name!r} changed shape to {tuple(weight.shape)} during the interval"
                )
            marked = np.isin(rows, np.asarray(dirty.get(name, np.empty(0, np.int64))))
            unmarked = rows[~marked]
            checked += int(unmarked.size)
            if unmarked.size == 0:
                continue
            keep = torch.from_numpy(~marked).to(old.device)
            now = weight[torch.from_numpy(unmarked).to(weight.device)]
            changed = (_row_bytes(now) != _row_bytes(old[keep])).any(dim=1).cpu().numpy()
            if changed.any():
                bad[name] = unmarked[changed]
        if bad:
            raise UntrackedChangeError(bad)
        return checked

    def _weight(self, name: str) -> torch.Tensor:
        table = self._tables[name]
        weight = table if isinstance(table, torch.Tensor) else table.weight
        return weight.detach()


def _row_bytes(rows: torch.Tensor) -> torch.Tensor:
    """(k, bytes per row) uint8 view, so comparison is bitwise rather than numeric."""
    return rows.reshape(rows.shape[0], -1).contiguous().view(torch.uint8)
