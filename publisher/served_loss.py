"""What quantization costs the version a server holds, measured as each version is written.

A run's own AUC cannot show codec loss: checkpoints never feed back into training. So the
publisher keeps one copy of the model as the chain builds it, off the training thread: the
**served** copy, every table row as the codec of its latest write decodes it, i.e. exactly the
weights a server computes from the chain. Dense layers are published fp32 and written as they
are.

The fp32 side needs no copy of its own. A version's snapshot holds the trainer's fp32 value of
every row it carries, so for one version (`ServedLossMeter`):

1. `score_fp32`: the snapshot's fp32 rows are copied over the served copy's (`index_copy_`),
   and the samples are scored: that is the trainer's model at the version on every row the
   snapshot carries;
2. `apply_table`, per table as it is encoded: the version's decoded rows replace them, which
   the served copy needs anyway;
3. `measure`: the served copy scores the same samples, and the paired difference becomes the
   manifest's `served_loss` (docs/FORMAT.md 3.2). Paired on the same samples, the difference is
   the codec's alone, not sampling noise.

A row the snapshot does not carry holds its served value in step 1, not its fp32 one, so only
samples whose every looked-up row the snapshot carries are scored: the others are dropped from
the window for this version. Every row a sample of the current interval looks up was trained
on, hence marked dirty and carried, so those always count; older samples count when their rows
were touched again; on a full version every sample counts. Feed steps 1 and 2 from the
snapshot's rows, never from the rows a delta blob ends up holding: a row a delta left out
because its encoded bytes did not change still moved in fp32, and must be overlaid.

Which samples a version carries is the one thing that depends on the model, so the meter asks
one of two small sample rules:

- `DLRMBatches`, the built-in DLRM's: a kept batch is a `ScoredBatch` (its ids as numpy
  arrays per feature), filtered per sample (`rows_carried`), scored by the DLRM's forward;
- `ModelBatches`, any other model's: a kept batch is a `KeptBatch` (whatever the user's
  `score(module, inputs)` takes: a tuple of tensors, a KeyedJaggedTensor...), filtered per
  batch: the rows it looks up are recorded by forward pre-hooks on the served copy's embedding
  modules (`publisher.write.tracker.LookupRecorder`) the first time it is scored, and cached
  by the batch's number; a batch counts for a version when every one of those rows is carried.
  The rows a batch reads must follow from its inputs alone (not from the weights), which holds
  for every lookup of ids given in the inputs.

Memory: one fp32 copy of the model in the publisher (thread or process), plus a bitmap of the
carried rows (one byte a row) while a delta's samples are filtered, and for `ModelBatches` the
unique rows of each kept batch. Scoring 16k samples twice takes a few tens of ms on
MovieLens-1M's model, once per version.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from publisher.dlrm import TABLE_PREFIX, ArchitectureError, SparseBatch, build_model
from publisher.model_factory import ModelFactory, ModelFactoryError, build_module
from publisher.paired_quality import delong_auc_diff
from publisher.write.tracker import EmbeddingModule, LookupRecorder, find_embedding_tables
from schemas.errors import BadDataError
from schemas.manifest import ServedLoss

#: a user's scoring function: the logits (B,) of a kept batch's `inputs` on `module`.
Score: TypeAlias = Callable[[nn.Module, Any], torch.Tensor]


class ServedLossError(BadDataError):
    """The meter cannot score a version: a served copy whose tables are not the version's, a
    model factory that fails, a `score` that returns no logits (B,), or kept batches of another
    kind than the model's sample rule takes."""


@dataclass(frozen=True)
class ScoredBatch:
    """One progressive-validation batch of the built-in DLRM, kept to score versions on: the
    model's inputs (`SparseBatch` per feature, as `DLRM.forward` takes them) and the labels."""

    dense: np.ndarray  # float32 (B, n_dense)
    sparse: Mapping[str, tuple[np.ndarray, np.ndarray]]  # feature -> (values, offsets), int64
    labels: np.ndarray  # float32 (B,)

    @classmethod
    def of(
        cls, dense: torch.Tensor, sparse: Mapping[str, SparseBatch], labels: torch.Tensor
    ) -> ScoredBatch:
        """A batch as `DLRM.forward` takes it, as numpy views (no copy, on the training thread:
        the streams build fresh tensors for every batch, so a kept batch never changes)."""
        return cls(
            dense=dense.detach().numpy(),
            sparse={n: (b.values.numpy(), b.offsets.numpy()) for n, b in sparse.items()},
            labels=labels.detach().numpy(),
        )

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

    def bag_of_each_id(self, feature: str) -> np.ndarray:
        """For each id of `feature`'s flat values, the sample (bag) it belongs to."""
        values, offsets = self.sparse[feature]
        lengths = np.diff(offsets, append=len(values))
        return np.repeat(np.arange(self.size), lengths)

    @classmethod
    def concat(cls, batches: Sequence[ScoredBatch]) -> ScoredBatch:
        """One batch of `batches`' samples, in order (a copy)."""
        if len(batches) == 1:
            return batches[0]
        sparse = {}
        for feature in batches[0].sparse:
            values = [b.sparse[feature][0] for b in batches]
            starts = np.cumsum([0, *(len(v) for v in values[:-1])])
            offsets = [
                b.sparse[feature][1] + start for b, start in zip(batches, starts, strict=True)
            ]
            sparse[feature] = (np.concatenate(values), np.concatenate(offsets))
        return cls(
            np.concatenate([b.dense for b in batches]),
            sparse,
            np.concatenate([b.labels for b in batches]),
        )

    def select(self, keep: np.ndarray) -> ScoredBatch:
        """The samples where `keep` (bool, one per sample) holds, in order (a copy)."""
        sparse = {}
        for feature, (values, offsets) in self.sparse.items():
            lengths = np.diff(offsets, append=len(values))[keep]
            starts = np.zeros(len(lengths), dtype=np.int64)
            np.cumsum(lengths[:-1], out=starts[1:])
            sparse[feature] = (values[keep[self.bag_of_each_id(feature)]], starts)
        return ScoredBatch(self.dense[keep], sparse, self.labels[keep])


#: samples scored by one forward of the built-in DLRM (`DLRMBatches.score`).
SCORE_CHUNK = 8192

#: numbers of the `KeptBatch`es of this process: what a meter caches a batch's rows by (a
#: number survives the pickling to a publisher process, an object's identity does not).
_batch_numbers = itertools.count()


@dataclass(frozen=True, eq=False)
class KeptBatch:
    """One batch of any model, kept to score versions on: `inputs` as the user's `score`
    takes them, CPU tensors the publisher owns, and the labels."""

    inputs: Any
    labels: np.ndarray  # float32 (B,)
    #: unique in this process, kept across pickling (see `_batch_numbers`).
    number: int = field(default_factory=lambda: next(_batch_numbers))

    @classmethod
    def of(cls, inputs: Any, labels: torch.Tensor) -> KeptBatch:
        """Copies of `inputs` (every tensor of its pytree: tuples, lists, dicts, TorchRec's
        KeyedJaggedTensor, which TorchRec registers as a pytree node) and `labels`, on the CPU.

        Copies, unlike `ScoredBatch.of`: a user's loop may reuse its input buffers (or keep
        them on an accelerator), and the publisher reads the batch for as long as the window
        holds it. A batch's ids and features are small: microseconds per batch.
        """
        copied = pytree.tree_map(
            lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x,
            inputs,
        )
        flat = labels.detach().to(device="cpu", dtype=torch.float32, copy=True).reshape(-1)
        return cls(copied, flat.numpy())

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


#: a kept batch of either sample rule.
KeptSample: TypeAlias = ScoredBatch | KeptBatch


class VersionRows(Protocol):
    """One table's rows of a snapshot as trained (`publisher.write.snapshot.TableRows`)."""

    @property
    def name(self) -> str: ...
    @property
    def table_rows(self) -> int: ...
    @property
    def row_ids(self) -> np.ndarray: ...
    @property
    def values(self) -> np.ndarray: ...
    @property
    def whole(self) -> bool:
        """The rows are the table's whole state: any other row is zero (docs/FORMAT.md 7.1)."""
        ...


def rows_carried(
    samples: Iterable[ScoredBatch], carried: Mapping[str, np.ndarray]
) -> tuple[ScoredBatch, ...]:
    """The samples whose every looked-up row is carried (`carried`: feature -> a bool per row of
    its table); batches left empty are dropped."""
    kept = []
    for batch in samples:
        missing = np.zeros(batch.size, dtype=bool)
        for feature, rows in carried.items():
            values, _ = batch.sparse[feature]
            missing[batch.bag_of_each_id(feature)[~rows[values]]] = True
        if not missing.any():
            kept.append(batch)
        elif not missing.all():
            kept.append(batch.select(~missing))
    return tuple(kept)


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


@dataclass(frozen=True)
class Fp32Scores:
    """Step 1 of a version's measurement: the samples scored and the fp32 logits on them."""

    samples: tuple[KeptSample, ...]
    logits: torch.Tensor  # float32 (n,)


class MeterOrderError(RuntimeError):
    """`measure` was called while a table still held the fp32 overlay (no `apply_table`)."""


#: table -> a bool per row of it: whether the version carries the row; None: every row.
Carried: TypeAlias = Mapping[str, np.ndarray] | None


class SampleRule(Protocol):
    """How a meter scores the kept batches of one kind of model and tells which a version
    carries (see the module docstring): `DLRMBatches` or `ModelBatches`."""

    def score_carried(
        self, module: nn.Module, samples: Sequence[KeptSample], carried: Carried
    ) -> tuple[tuple[KeptSample, ...], torch.Tensor]:
        """The samples whose every looked-up row is carried, and their logits on `module`."""
        ...

    def score(self, module: nn.Module, samples: Sequence[KeptSample]) -> torch.Tensor:
        """The logits of `samples` on `module`, concatenated (float32)."""
        ...


class DLRMBatches:
    """The built-in DLRM's rule: `ScoredBatch`es, filtered per sample, scored by its forward."""

    def score_carried(
        self, module: nn.Module, samples: Sequence[KeptSample], carried: Carried
    ) -> tuple[tuple[KeptSample, ...], torch.Tensor]:
        batches = _of_kind(samples, ScoredBatch)
        if carried is not None:
            by_feature = {t.removeprefix(TABLE_PREFIX): rows for t, rows in carried.items()}
            batches = rows_carried(batches, by_feature)
        return batches, self.score(module, batches)

    def score(self, module: nn.Module, samples: Sequence[KeptSample]) -> torch.Tensor:
        batches = _of_kind(samples, ScoredBatch)
        # Scored in chunks of SCORE_CHUNK samples, not batch by batch: one forward of 8,192
        # samples costs less than 16 of 512 (the modules' call overhead; measured: the release
        # gate's three scorings of a 16k window 0.11 -> 0.05 s on MovieLens' DLRM).
        chunks: list[list[ScoredBatch]] = [[]]
        held = 0
        for b in batches:
            if held >= SCORE_CHUNK:
                chunks.append([])
                held = 0
            chunks[-1].append(b)
            held += b.size
        return _cat([module(*ScoredBatch.concat(c).inputs()) for c in chunks if c])


class ModelBatches:
    """Any model's rule: `KeptBatch`es scored by the user's `score(module, inputs)`, filtered
    per batch by the rows it looks up (recorded the first time it is scored, then cached)."""

    def __init__(self, score: Score) -> None:
        self.score_fn = score
        #: batch number -> table -> the sorted unique rows the batch looks up.
        self._rows: dict[int, dict[str, np.ndarray]] = {}

    def score_carried(
        self, module: nn.Module, samples: Sequence[KeptSample], carried: Carried
    ) -> tuple[tuple[KeptSample, ...], torch.Tensor]:
        batches = _of_kind(samples, KeptBatch)
        held = {b.number for b in batches}
        self._rows = {n: rows for n, rows in self._rows.items() if n in held}
        recorder = LookupRecorder(find_embedding_tables(module))
        kept: list[KeptSample] = []
        logits = []
        for batch in batches:
            rows = self._rows.get(batch.number)
            scored = None
            if rows is None:
                # The fp32 score and the rows it read in one forward: a batch is scored once
                # more than a cached one only when it is not carried.
                with recorder:
                    scored = self._logits(module, batch)
                rows = self._rows[batch.number] = recorder.rows()
            if carried is None or all(bool(carried[t][r].all()) for t, r in rows.items()):
                kept.append(batch)
                logits.append(self._logits(module, batch) if scored is None else scored)
        return tuple(kept), _cat(logits)

    def score(self, module: nn.Module, samples: Sequence[KeptSample]) -> torch.Tensor:
        return _cat([self._logits(module, b) for b in _of_kind(samples, KeptBatch)])

    def _logits(self, module: nn.Module, batch: KeptBatch) -> torch.Tensor:
        out = self.score_fn(module, batch.inputs)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (batch.size,):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ServedLossError(
                f"score({type(module).__name__}, inputs) returned {got} for a batch of "
                f"{batch.size} labels; it must return the logits, a tensor of shape "
                f"({batch.size},)"
            )
        return out


def _of_kind(samples: Sequence[KeptSample], kind: type[Any]) -> tuple[Any, ...]:
    """`samples`, checked to be of the kind a rule scores."""
    wrong = next((b for b in samples if not isinstance(b, kind)), None)
    if wrong is not None:
        raise ServedLossError(
            f"this meter scores {kind.__name__}es, got a {type(wrong).__name__}: a model "
            "scored by `score(module, inputs)` keeps KeptBatch, the built-in DLRM ScoredBatch"
        )
    return tuple(samples)


def _cat(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    if not logits:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([x.detach().reshape(-1) for x in logits]).float()


@dataclass(frozen=True)
class ServedModel:
    """What the publisher measures a model with other than by rebuilding the built-in DLRM
    from its config: the served copy (`copy`, a module the meter then owns, or `factory`) and
    the sample rule (`score`; None: the DLRM's own forward on `ScoredBatch`es).

    A publisher process gets this by pickling: `factory` and `score` must then be importable
    functions (by reference), and `copy` None.
    """

    score: Score | None = None
    factory: ModelFactory | None = None
    copy: nn.Module | None = None

    def meter(self, model_config: Mapping[str, Any]) -> ServedLossMeter:
        """A meter of the model `model_config` describes."""
        module = self.copy
        if module is None and self.factory is not None:
            try:
                module = build_module(self.factory, model_config)
            except ModelFactoryError as exc:
                raise ServedLossError(str(exc)) from exc
        rule: SampleRule = DLRMBatches() if self.score is None else ModelBatches(self.score)
        return ServedLossMeter(model_config, module, rule)


class ServedLossMeter:
    """The served copy of one model, kept as versions are written, and the paired score.

    Per version: `score_fp32` with the snapshot's rows, dense state and samples; `apply_table`
    for every table with its decoded rows (the same row ids); then `measure`. Before the first
    full version (every row known) a measurement says nothing: `score_fp32` returns None.

    `served` is the copy (default: the DLRM `model_config` describes), `rule` how its kept
    batches are scored (default: `DLRMBatches`). The meter owns the copy: it writes its rows.
    """

    def __init__(
        self,
        model_config: Mapping[str, Any],
        served: nn.Module | None = None,
        rule: SampleRule | None = None,
    ) -> None:
        self.model_config = dict(model_config)
        module = build_model(model_config) if served is None else served
        # The copy's kept batches are CPU tensors, and it is never trained.
        self.served = module.cpu().eval().requires_grad_(False)
        self.rule: SampleRule = DLRMBatches() if rule is None else rule
        tables: dict[str, EmbeddingModule] = find_embedding_tables(self.served)
        if not tables:
            raise ServedLossError(
                f"the served copy ({type(self.served).__name__}) has no nn.Embedding / "
                "nn.EmbeddingBag"
            )
        self._weights = {name: table.weight.detach() for name, table in tables.items()}
        self._missing = set(self._weights)  # tables not written in full yet
        self._overlaid: set[str] = set()  # tables holding fp32 rows until `apply_table`

    @property
    def complete(self) -> bool:
        """Whether the copy holds a whole version as served: every table written in full once,
        and no fp32 overlay left (what the release gate scores, publisher/release/gate.py)."""
        return not self._missing and not self._overlaid

    @classmethod
    def for_config(cls, model_config: Mapping[str, Any]) -> ServedLossMeter | None:
        """A meter for a model this module can rebuild (a DLRM), else None."""
        try:
            return cls(model_config)
        except ArchitectureError:
            return None

    @torch.no_grad()
    def score_fp32(
        self,
        tables: Sequence[VersionRows],
        dense: Mapping[str, np.ndarray],
        samples: Sequence[KeptSample],
    ) -> Fp32Scores | None:
        """Write the version's dense state, overlay its fp32 rows and score the samples whose
        rows it carries; None when nothing can be measured: a table not yet written in full
        (no overlay then), or no sample left. ServedLossError when the version's tables are
        not the served copy's."""
        if self._overlaid:
            # A version left fp32 rows behind (it failed between the steps): those tables are
            # unknown until written in full again.
            self._missing |= self._overlaid
            self._overlaid.clear()
        self._check_tables(tables)
        state = self.served.state_dict()
        for key, value in dense.items():
            if key in state:
                state[key].copy_(torch.from_numpy(value))
        full = {
            t.name
            for t in tables
            if t.whole or len(t.row_ids) == int(self._weights[t.name].shape[0])
        }
        if self._missing - full or not samples:
            return None
        for t in tables:
            if t.whole:
                self._weights[t.name].zero_()
            self._weights[t.name].index_copy_(
                0, torch.from_numpy(t.row_ids), torch.from_numpy(t.values)
            )
            self._overlaid.add(t.name)
        # An overlay left by a version not measured is harmless: `apply_table` replaces it.
        carried = None if len(full) == len(self._weights) else self._carried(tables)
        kept, logits = self.rule.score_carried(self.served, samples, carried)
        if not kept:
            return None
        return Fp32Scores(kept, logits)

    def _check_tables(self, tables: Sequence[VersionRows]) -> None:
        """The version's tables must be the served copy's, of the same width."""
        names = {t.name for t in tables}
        if names != set(self._weights):
            raise ServedLossError(
                f"the version's tables {sorted(names)} are not those of the served copy "
                f"({type(self.served).__name__}: {sorted(self._weights)}); its model factory "
                "must build the trained architecture"
            )
        for t in tables:
            ours = tuple(self._weights[t.name].shape)
            theirs = (t.table_rows, *t.values.shape[1:])
            if theirs != ours:
                raise ServedLossError(
                    f"table {t.name!r} is {'x'.join(map(str, theirs))} in the version but "
                    f"{'x'.join(map(str, ours))} in the served copy"
                )

    def _carried(self, tables: Sequence[VersionRows]) -> dict[str, np.ndarray]:
        """Table -> a bool per row of it: whether this version carries the row."""
        carried = {}
        for t in tables:
            rows = np.zeros(int(self._weights[t.name].shape[0]), dtype=bool)
            rows[t.row_ids] = True
            carried[t.name] = rows
        return carried

    @torch.no_grad()
    def apply_table(
        self, table: str, row_ids: np.ndarray, served_rows: np.ndarray, whole: bool = False
    ) -> None:
        """Write one table's rows of a version as the version decodes them; `whole`: they are
        the table's whole state, every other row zero (docs/FORMAT.md 7.1)."""
        if table not in self._weights:
            return
        if whole:
            self._weights[table].zero_()
        self._weights[table].index_copy_(
            0, torch.from_numpy(row_ids), torch.from_numpy(served_rows)
        )
        self._overlaid.discard(table)
        if whole or len(row_ids) == int(self._weights[table].shape[0]):
            self._missing.discard(table)

    @torch.no_grad()
    def measure(self, fp32: Fp32Scores | None) -> ServedLoss | None:
        """The served copy scored on `fp32`'s samples against `fp32`'s logits; None when step 1
        measured nothing, the samples hold one class only or a side scores NaN or inf."""
        if fp32 is None:
            return None
        if self._overlaid:
            raise MeterOrderError(
                f"tables {sorted(self._overlaid)} still hold the fp32 overlay: apply_table first"
            )
        samples = fp32.samples
        scored = {"fp32": fp32.logits, "served": self.rule.score(self.served, samples)}
        labels = torch.from_numpy(np.concatenate([b.labels for b in samples]))
        if not all(bool(torch.isfinite(v).all()) for v in scored.values()):
            return None  # a diverged model: there is no loss to speak of
        aucs = {k: roc_auc(v.numpy(), labels.numpy()) for k, v in scored.items()}
        if aucs["fp32"] is None or aucs["served"] is None:
            return None
        loss = {k: float(F.binary_cross_entropy_with_logits(v, labels)) for k, v in scored.items()}
        # The same samples under both models: the paired interval of the AUC loss says how
        # much of it is the codec's and how much the window's noise (~75 positives at 0.5% CTR)
        paired = delong_auc_diff(labels.numpy(), scored["fp32"].numpy(), scored["served"].numpy())
        assert paired is not None  # both classes are present: the AUCs above exist
        interval = paired[2]
        return ServedLoss.of(
            int(labels.shape[0]),
            auc_fp32=aucs["fp32"],
            auc_served=aucs["served"],
            logloss_fp32=loss["fp32"],
            logloss_served=loss["served"],
            positives=int((labels > 0.5).sum()),
            auc_loss=(interval.low, interval.high),
        )
