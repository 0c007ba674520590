"""Incremental checkpoints of any PyTorch model with embedding tables: the user-facing API.

    ckpt = IncrementalCheckpointer(model, [sparse_opt, dense_opt], store="file:///ckpts",
                                   model_name="ranker", policy="intermittent", codec="int4",
                                   interval_samples=50_000)
    for batch in stream:
        loss = loss_fn(model(batch), batch.labels)
        ...backward, every optimizer's step()...
        ckpt.step(len(batch))                       # after the optimizer steps
        ckpt.maybe_checkpoint(reader={"offset": n}) # returns a record when it checkpointed
    ckpt.close()                                    # flushes the publisher

This is the paper's first stage (decoupled checkpointing). At an interval boundary the training
thread stops only to: swap the dirty-row bitmaps, ask the policy which rows to write, copy those
rows (weights and per-row optimizer state) plus the dense parameters and dense optimizer state
into CPU buffers, and hand the copy to a `BackgroundPublisher`. Quantization, encoding, upload,
commit and announcement run on the publisher's thread; if it falls behind, its merger thread
folds the waiting snapshots into one, so memory stays bounded and training never waits for
storage or for a merge.

Per-row optimizer state: every tensor an optimizer keeps for an embedding weight whose first
dimension equals the table's rows (row-wise Adagrad's accumulator, Adagrad's `sum`, SparseAdam's
moments) travels with its row, reshaped to (rows, -1), as the blob's `aux` columns. Anything
else the optimizers hold (Adam moments of the MLPs, step counters) goes in the dense optimizer
blob. The layout of the aux columns is recorded in the optimizer metadata so `resume` can put
every column back where it came from.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import nn

from publisher.read.restore import RestoredState, restore
from publisher.state_dicts import flatten_optimizer_state, unflatten_optimizer_state
from publisher.store import ObjectStore, open_store
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.policies import Plan, Policy, make_policy
from publisher.write.process_publisher import ProcessPublisher, ProcessPublisherConfig
from publisher.write.publishing import BackgroundPublisher, CheckpointPublisher, PublishResult
from publisher.write.snapshot import Snapshot, TableRows
from publisher.write.tracker import (
    EmbeddingModule,
    TrackedEmbeddings,
    attach,
    check_optimizers,
    find_embedding_tables,
)
from schemas.announcement import Announcement
from schemas.codec_names import CODECS
from schemas.manifest import Position, ratio_to_full_fp32
from trainer.row_buffers import RowBufferPool

log = logging.getLogger(__name__)

Metrics = Mapping[str, float] | Callable[[], Mapping[str, float]]
PublishIn = Literal["thread", "process"]
Reader = Mapping[str, int | str]

#: key prefix of optimizer i's tensors in the dense optimizer blob.
_OPT_PREFIX = "optimizers.{}."


class CheckpointError(Exception):
    """The checkpointer was misused or a checkpoint does not fit the model it is loaded into."""


@dataclass
class CheckpointRecord:
    """What one snapshot cost the trainer and, once published, what it wrote."""

    index: int
    kind: str
    step: int
    samples_seen: int
    #: how long the training thread was stopped (bitmaps, plan, copies, hand-off).
    stall_ms: float
    #: rows modified in the interval / table rows, per table.
    dirty_fraction: dict[str, float]
    #: rows modified in the interval / rows of all tables.
    dirty_fraction_total: float
    rows_copied: int
    snapshot_bytes: int
    taken_at: float
    metrics: dict[str, float] = field(default_factory=dict)
    #: where the stall went: dirty bitmaps + policy, copies, hand-off to the publisher.
    stall_breakdown_ms: dict[str, float] = field(default_factory=dict)
    #: set when published; None until then or when merged into a later snapshot.
    version: int | None = None
    published_kind: str | None = None
    bytes: int | None = None
    full_fp32_bytes: int | None = None
    #: the version that carried this snapshot's rows after it merged into a later one.
    merged_into: int | None = None
    publish_s: float | None = None

    @property
    def published(self) -> bool:
        return self.version is not None or self.merged_into is not None

    @property
    def ratio(self) -> float | None:
        """Full fp32 checkpoint bytes / bytes written (None until published)."""
        if self.bytes is None or self.full_fp32_bytes is None:
            return None
        return ratio_to_full_fp32(self.full_fp32_bytes, self.bytes)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the `train --json` per-checkpoint record)."""
        return {
            "index": self.index,
            "version": self.version,
            "kind": self.published_kind or self.kind,
            "merged_into": self.merged_into,
            "step": self.step,
            "samples_seen": self.samples_seen,
            "stall_ms": round(self.stall_ms, 3),
            "stall_breakdown_ms": {k: round(v, 3) for k, v in self.stall_breakdown_ms.items()},
            "dirty_fraction": {k: round(v, 6) for k, v in self.dirty_fraction.items()},
            "dirty_fraction_total": round(self.dirty_fraction_total, 6),
            "rows_copied": self.rows_copied,
            "bytes": self.bytes,
            "full_fp32_bytes": self.full_fp32_bytes,
            "ratio": None if self.ratio is None else round(self.ratio, 3),
            "publish_s": None if self.publish_s is None else round(self.publish_s, 4),
            "metrics": {k: round(v, 6) for k, v in self.metrics.items()},
        }


@dataclass(frozen=True)
class _RowState:
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
    def from_json(cls, value: Sequence[Any]) -> _RowState:
        return cls(int(value[0]), int(value[1]), str(value[2]), tuple(int(x) for x in value[3]))


class IncrementalCheckpointer:
    """Tracks modified embedding rows and publishes incremental, quantized checkpoints.

    Call `step(samples)` after every optimizer step and `maybe_checkpoint()` right after it (a
    snapshot must be taken between an optimizer step and the next forward). `close()` flushes.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        store: ObjectStore | str,
        model_name: str,
        policy: str | Policy = "intermittent",
        codec: str | Mapping[str, str] = "int4",
        interval_samples: int | None = None,
        interval_seconds: float | None = None,
        model_config: Mapping[str, Any] | None = None,
        announce: Callable[[Announcement], None] | None = None,
        bus: str | None = None,
        on_published: Callable[[CheckpointRecord], None] | None = None,
        publish_in: PublishIn = "thread",
        preallocate: bool = True,
        tunables: Tunables = DEFAULT_TUNABLES,
        policy_params: Mapping[str, float] | None = None,
    ) -> None:
        """
        Args:
            model: any module; its `nn.Embedding` / `nn.EmbeddingBag` modules are the tables.
            optimizers: every optimizer that updates the model (sparse and dense).
            store: an open store, or a URL (`file:///PATH`, `s3://BUCKET/PREFIX`).
            model_name: the name versions are published under.
            policy: `full`, `one-shot`, `consecutive` or `intermittent` (or a Policy).
            codec: one codec for every table, or a table -> codec mapping.
            interval_samples / interval_seconds: checkpoint when either is reached.
            model_config: what the serving side needs to rebuild the model (DLRM: its config).
            announce: called with each committed version's announcement (thread mode only).
            bus: announce on this bus URL instead (`file:///PATH`, `kafka://HOST:PORT/TOPIC`).
            on_published: called (on a publisher thread) with each published record.
            publish_in: "thread" runs encode + commit on a thread of this process, "process"
                in a child process (needs `store` as a URL), which keeps that work off the
                GIL the training thread needs; see publisher/write/process_publisher.py.
            preallocate: allocate and touch one full copy of every table (rows and optimizer
                columns) now, so no snapshot stalls on page faults (one model copy of memory).
        """
        if interval_samples is not None and interval_samples < 1:
            raise CheckpointError(f"interval_samples must be >= 1, got {interval_samples}")
        if interval_seconds is not None and interval_seconds <= 0:
            raise CheckpointError(f"interval_seconds must be > 0, got {interval_seconds}")
        self.model = model
        self.optimizers = list(optimizers)
        self.model_name = model_name
        self.interval_samples = interval_samples
        self.interval_seconds = interval_seconds
        self.model_config = dict(model_config) if model_config is not None else _config_of(model)

        self.tables: dict[str, EmbeddingModule] = find_embedding_tables(model)
        if not self.tables:
            raise CheckpointError(f"{type(model).__name__} has no nn.Embedding / nn.EmbeddingBag")
        self.table_rows = {name: int(t.num_embeddings) for name, t in self.tables.items()}
        self.codecs = self._codecs(codec)
        if isinstance(policy, Policy):
            self.policy = policy
        else:
            self.policy = make_policy(policy, self.table_rows, **dict(policy_params or {}))
        if self.policy.name != "full":
            # Only the full policy writes rows it was not told about; the others trust the bits.
            check_optimizers(model, self.optimizers, self.tables)
        self._weight_keys = self._table_weight_keys()

        self.step_count = 0
        self.samples_seen = 0
        self._since_samples = 0
        self._since_time = time.monotonic()
        self.records: list[CheckpointRecord] = []
        self._by_taken_at: dict[float, CheckpointRecord] = {}
        self._results_seen = 0
        self._records_lock = threading.Lock()
        self._closed = False
        #: the version `resume` loaded, if any.
        self.last_restored_version: int | None = None

        if publish_in not in ("thread", "process"):
            raise CheckpointError(f"publish_in must be 'thread' or 'process', got {publish_in!r}")
        if announce is not None and (bus is not None or publish_in == "process"):
            raise CheckpointError(
                "an announce callable works with publish_in='thread' and no bus; "
                "give bus=URL to announce from the publisher process"
            )
        if publish_in == "process" and not isinstance(store, str):
            raise CheckpointError("publish_in='process' needs the store as a URL, not an object")
        self._owns_store = isinstance(store, str)
        self.store: ObjectStore = open_store(store) if isinstance(store, str) else store
        self._user_on_published = on_published
        self._announcer: Any = None
        publisher: CheckpointPublisher
        try:
            if publish_in == "process":
                assert isinstance(store, str)
                config = ProcessPublisherConfig(
                    store, model_name, bus, tunables, threads=torch.get_num_threads()
                )
                # BackgroundPublisher only calls publish() and close(), which this provides.
                publisher = cast(CheckpointPublisher, ProcessPublisher(config))
            else:
                if bus is not None:
                    from publisher.bus import open_announcer

                    self._announcer = open_announcer(bus, model_name)
                    announce = self._announcer.announce
                publisher = CheckpointPublisher(
                    self.store, model_name, announce=announce, tunables=tunables
                )
        except BaseException:
            if self._announcer is not None:
                self._announcer.close()
            if self._owns_store:
                self.store.close()
            raise
        self.publisher = publisher
        self.publish_in = publish_in
        self.background = BackgroundPublisher(self.publisher, on_published=self._on_published)
        self.tracked: TrackedEmbeddings = attach(model)
        self._buffers = RowBufferPool()
        self._all_rows: dict[str, np.ndarray] = {}
        if preallocate:
            try:
                self._preallocate()
            except BaseException:
                self.close(flush=False)
                raise

    # --- the training loop's calls ---------------------------------------------------------

    def step(self, samples: int) -> None:
        """Count one optimizer step over `samples` samples (call after every optimizer step)."""
        self.step_count += 1
        self.samples_seen += samples
        self._since_samples += samples

    def due(self) -> bool:
        """Whether the interval since the last checkpoint has passed."""
        if self.interval_samples is not None and self._since_samples >= self.interval_samples:
            return True
        return (
            self.interval_seconds is not None
            and time.monotonic() - self._since_time >= self.interval_seconds
        )

    def maybe_checkpoint(
        self, reader: Reader | None = None, metrics: Metrics | None = None
    ) -> CheckpointRecord | None:
        """Checkpoint if the interval has passed; `metrics` may be a callable (called only then)."""
        if not self.due():
            return None
        return self.checkpoint_now(reader, metrics)

    def checkpoint_now(
        self,
        reader: Reader | None = None,
        metrics: Metrics | None = None,
        *,
        force_full: bool = False,
    ) -> CheckpointRecord:
        """Snapshot now and hand the copy to the background publisher; returns its record.

        `reader` is stored as the manifest's `position.reader` (where the data resumes).
        """
        if self._closed:
            raise CheckpointError("checkpointer is closed")
        raw = metrics() if callable(metrics) else (metrics or {})
        # The manifest holds finite floats only (an AUC is NaN while one class is missing).
        values = {k: float(v) for k, v in raw.items() if math.isfinite(v)}
        started = time.perf_counter()
        dirty = self.tracked.tracker.snapshot_and_reset()
        if force_full:
            self.policy.force_full()
        plan = self.policy.plan(dirty)
        planned = time.perf_counter()
        tables = tuple(self._copy_table(name, plan) for name in self.tables)
        dense, optimizer, optimizer_meta = self._copy_dense()
        copied = time.perf_counter()
        taken_at = time.time()
        snapshot = Snapshot(
            kind=plan.kind,
            relative_to=plan.relative_to,
            policy=self.policy.name,
            tables=tables,
            position=Position(
                step=self.step_count, samples_seen=self.samples_seen, reader=dict(reader or {})
            ),
            dense=dense,
            optimizer=optimizer,
            optimizer_meta=optimizer_meta,
            model_config=self.model_config,
            metrics=values,
            taken_at=taken_at,
        )
        record = CheckpointRecord(
            index=len(self.records) + 1,
            kind=plan.kind,
            step=self.step_count,
            samples_seen=self.samples_seen,
            stall_ms=0.0,
            dirty_fraction={
                name: len(dirty[name]) / max(rows, 1) for name, rows in self.table_rows.items()
            },
            dirty_fraction_total=sum(len(ids) for ids in dirty.values())
            / max(sum(self.table_rows.values()), 1),
            rows_copied=sum(t.n_rows for t in tables),
            snapshot_bytes=snapshot.nbytes,
            taken_at=taken_at,
            metrics=values,
        )
        with self._records_lock:
            self.records.append(record)
            self._by_taken_at[taken_at] = record
        handoff = time.perf_counter()
        self.background.submit(snapshot)
        del snapshot, tables  # the publisher owns the copies now (buffers recycle on release)
        done = time.perf_counter()
        record.stall_ms = (done - started) * 1e3
        record.stall_breakdown_ms = {
            "bitmaps_and_plan": (planned - started) * 1e3,
            "copy": (copied - planned) * 1e3,
            "handoff": (done - handoff) * 1e3,  # includes merging into a pending snapshot
        }
        self._since_samples = 0
        self._since_time = time.monotonic()
        self._reconcile()
        return record

    def _preallocate(self) -> None:
        for name, rows in self.table_rows.items():
            dim = int(self.tables[name].weight.shape[1])
            aux_dim = sum(s.width for s in self._row_state_layout(name))
            self._buffers.reserve(f"{name}/w", rows, dim)
            self._buffers.reserve(f"{name}/aux", rows, aux_dim)
            self._all_rows[name] = np.arange(rows, dtype=np.int64)

    # --- snapshot copies ---------------------------------------------------------------------

    def _copy_table(self, name: str, plan: Plan) -> TableRows:
        weight = self.tables[name].weight.detach()
        rows = self.table_rows[name]
        ids = plan.rows[name]
        layout = self._row_state_layout(name)
        aux_dim = sum(s.width for s in layout)
        if ids is None:
            values = self._buffers.take(f"{name}/w", rows, weight.shape[1], exact=True)
            torch.from_numpy(values).copy_(weight)
            aux = self._buffers.take(f"{name}/aux", rows, aux_dim, exact=True)
            self._copy_aux(name, layout, None, aux)
            row_ids = self._all_rows.get(name)
            if row_ids is None:
                row_ids = self._all_rows[name] = np.arange(rows, dtype=np.int64)
        else:
            row_ids = np.ascontiguousarray(ids, dtype=np.int64)
            index = torch.from_numpy(row_ids)
            values = self._buffers.take(f"{name}/w", len(row_ids), weight.shape[1])
            torch.index_select(weight, 0, index, out=torch.from_numpy(values))
            aux = self._buffers.take(f"{name}/aux", len(row_ids), aux_dim)
            self._copy_aux(name, layout, index, aux)
        return TableRows(
            name=name,
            table_rows=rows,
            codec=self.codecs[name],
            row_ids=row_ids,
            values=values,
            aux=aux,
        )

    def _copy_aux(
        self, name: str, layout: Sequence[_RowState], index: torch.Tensor | None, out: np.ndarray
    ) -> None:
        """Copy the per-row optimizer columns of rows `index` (None: all rows) into `out`."""
        target = torch.from_numpy(out)
        col = 0
        for entry in layout:
            source = self._state_tensor(entry).detach().reshape(self.table_rows[name], -1)
            width = entry.width
            if len(layout) == 1:  # the common case: straight into the contiguous buffer
                if index is None:
                    target.copy_(source)
                else:
                    torch.index_select(source, 0, index, out=target)
            else:
                rows = source if index is None else source.index_select(0, index)
                target[:, col : col + width] = rows
            col += width

    def _copy_dense(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
        dense = {
            key: value.detach().to("cpu", copy=True).numpy()
            for key, value in self.model.state_dict().items()
            if key not in self._weight_keys.values()
        }
        tensors: dict[str, np.ndarray] = {}
        metas: list[dict[str, Any]] = []
        row_states = self._row_state_names()
        for i, optimizer in enumerate(self.optimizers):
            state = optimizer.state_dict()
            skip = row_states.get(i, {})
            filtered = {
                "state": {
                    j: {k: v for k, v in per.items() if k not in skip.get(j, ())}
                    for j, per in state["state"].items()
                },
                "param_groups": state["param_groups"],
            }
            flat, meta = flatten_optimizer_state(filtered)
            # The tensor blob stores 0-d arrays (Adam's `step`) as shape (1,): keep the shapes
            # so a resume puts back exactly what the optimizer had.
            meta["shapes"] = {k: list(v.shape) for k, v in flat.items()}
            tensors.update({_OPT_PREFIX.format(i) + k: v for k, v in flat.items()})
            metas.append(meta)
        layout = {name: [s.to_json() for s in self._row_state_layout(name)] for name in self.tables}
        return dense, tensors, {"optimizers": metas, "row_state": layout}

    # --- optimizer state layout --------------------------------------------------------------

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

    def _row_state_layout(self, name: str) -> list[_RowState]:
        """The per-row optimizer tensors of table `name`, in aux column order."""
        weight = self.tables[name].weight
        rows = self.table_rows[name]
        where = self._param_index().get(id(weight))
        if where is None:
            return []
        i, j = where
        state = self.optimizers[i].state.get(weight, {})
        return [
            _RowState(i, j, key, tuple(int(x) for x in value.shape[1:]))
            for key, value in sorted(state.items())
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows
        ]

    def _row_state_names(self) -> dict[int, dict[int, set[str]]]:
        names: dict[int, dict[int, set[str]]] = {}
        for table in self.tables:
            for s in self._row_state_layout(table):
                names.setdefault(s.optimizer, {}).setdefault(s.param_index, set()).add(s.name)
        return names

    def _state_tensor(self, entry: _RowState) -> torch.Tensor:
        optimizer = self.optimizers[entry.optimizer]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        value = optimizer.state[params[entry.param_index]][entry.name]
        assert isinstance(value, torch.Tensor)
        return value

    # --- publishing results ------------------------------------------------------------------

    def _on_published(self, result: PublishResult) -> None:
        self._reconcile()
        record = self._by_taken_at.get(result.taken_at)
        if record is not None and self._user_on_published is not None:
            self._user_on_published(record)

    def _reconcile(self) -> None:
        """Fill records from results the publisher has produced (idempotent, any thread)."""
        with self._records_lock:
            results = self.background.results
            for result in results[self._results_seen :]:
                record = self._by_taken_at.get(result.taken_at)
                if record is None:
                    continue
                record.version = result.ref.version
                record.published_kind = result.manifest.kind
                record.bytes = result.bytes_written
                record.full_fp32_bytes = result.full_fp32_bytes
                record.publish_s = result.encode_s + result.commit_s
                # Every earlier unpublished snapshot was merged into this one.
                for earlier in self.records[: record.index - 1]:
                    if not earlier.published:
                        earlier.merged_into = record.version
            self._results_seen = len(results)

    @property
    def last_version(self) -> int | None:
        """The newest version this checkpointer has committed, if any."""
        self._reconcile()
        results = self.background.results
        return results[-1].ref.version if results else None

    @property
    def bytes_written(self) -> int:
        """Bytes committed so far by this checkpointer."""
        return sum(r.bytes_written for r in list(self.background.results))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every snapshot taken so far is committed (re-raises a publish failure)."""
        self.background.wait(timeout)
        self._reconcile()

    def close(self, flush: bool = True) -> None:
        """Flush (optionally), stop the publisher, release the lease and detach the hooks."""
        if self._closed:
            return
        self._closed = True
        try:
            self.background.close(flush=flush)
            self._reconcile()
        finally:
            self.tracked.detach()
            self._buffers.clear()
            if self._announcer is not None:
                self._announcer.close()
            if self._owns_store:
                self.store.close()

    def __enter__(self) -> IncrementalCheckpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(flush=exc_type is None)

    # --- resume ------------------------------------------------------------------------------

    def resume(self, version: int | None = None, *, progress: bool = False) -> Position:
        """Load a committed version (the latest when None) into the model and optimizers.

        Returns its position; the step and sample counters continue from it. The next
        checkpoint is a full baseline: the restored version need not be HEAD's.
        Raises `publisher.read.catalog.NoVersionError` when there is nothing to resume from.
        """
        state = restore(self.store, self.model_name, version, progress=progress)
        self.load_state(state)
        self.last_restored_version = state.version
        return state.position

    def load_state(self, state: RestoredState) -> None:
        """Put a restored state into the model and the optimizers (see `resume`)."""
        stored_config = state.manifest.model_config_
        if self.model_config and stored_config and stored_config != self.model_config:
            raise CheckpointError(
                f"version {state.version} was trained with model_config {stored_config}, "
                f"this model has {self.model_config}"
            )
        missing = sorted(set(self.tables) - set(state.tables))
        if missing:
            raise CheckpointError(f"version {state.version} lacks tables {missing}")
        with torch.no_grad():
            weights: dict[str, torch.Tensor] = {}
            for name, table in self.tables.items():
                restored = state.tables[name]
                if restored.weights.shape != tuple(table.weight.shape):
                    raise CheckpointError(
                        f"table {name!r} is {tuple(table.weight.shape)} here but "
                        f"{restored.weights.shape} in version {state.version}"
                    )
                weights[self._weight_keys[name]] = torch.from_numpy(restored.weights)
            dense = {k: torch.from_numpy(v) for k, v in state.dense.items()}
            try:
                self.model.load_state_dict({**dense, **weights}, strict=True)
            except RuntimeError as exc:
                raise CheckpointError(
                    f"version {state.version} does not fit this model: {exc}"
                ) from exc
        self._load_optimizers(state)
        self.step_count = state.position.step
        self.samples_seen = state.position.samples_seen
        self._since_samples = 0
        self._since_time = time.monotonic()
        self.tracked.tracker.snapshot_and_reset()  # loading is not training: nothing is dirty
        self.policy.force_full()

    def _load_optimizers(self, state: RestoredState) -> None:
        metas = state.optimizer_meta.get("optimizers", [])
        if len(metas) != len(self.optimizers):
            raise CheckpointError(
                f"version {state.version} holds state of {len(metas)} optimizer(s), "
                f"this trainer has {len(self.optimizers)}"
            )
        layout = {
            table: [_RowState.from_json(v) for v in entries]
            for table, entries in state.optimizer_meta.get("row_state", {}).items()
        }
        dicts = []
        for i, meta in enumerate(metas):
            prefix = _OPT_PREFIX.format(i)
            tensors = {
                k.removeprefix(prefix): v
                for k, v in state.optimizer.items()
                if k.startswith(prefix)
            }
            shapes = meta.get("shapes", {})
            tensors = {k: v.reshape(shapes.get(k, v.shape)) for k, v in tensors.items()}
            dicts.append(unflatten_optimizer_state(tensors, meta))
        for table, entries in layout.items():
            aux = state.tables[table].aux
            rows = aux.shape[0]
            col = 0
            for entry in entries:
                columns = aux[:, col : col + entry.width]
                value = torch.from_numpy(np.ascontiguousarray(columns).copy())
                per_param = dicts[entry.optimizer]["state"].setdefault(entry.param_index, {})
                per_param[entry.name] = value.reshape(rows, *entry.trailing)
                col += entry.width
        for optimizer, sd in zip(self.optimizers, dicts, strict=True):
            try:
                optimizer.load_state_dict(sd)
            except (ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"optimizer state does not fit: {exc}") from exc

    # --- setup helpers -----------------------------------------------------------------------

    def _codecs(self, codec: str | Mapping[str, str]) -> dict[str, str]:
        chosen = {name: codec for name in self.tables} if isinstance(codec, str) else dict(codec)
        unknown_tables = sorted(set(chosen) - set(self.tables))
        if unknown_tables or set(chosen) != set(self.tables):
            raise CheckpointError(
                f"codec mapping must name exactly the tables {sorted(self.tables)}, "
                f"got {sorted(chosen)}"
            )
        for name, c in chosen.items():
            if c not in CODECS:
                raise CheckpointError(
                    f"table {name!r}: unknown codec {c!r}; expected one of {', '.join(CODECS)}"
                )
        return chosen

    def _table_weight_keys(self) -> dict[str, str]:
        keys: dict[str, str] = {}
        state_keys = set(self.model.state_dict())
        for name in self.tables:
            key = f"{name}.weight" if name else "weight"
            if key not in state_keys:
                raise CheckpointError(f"table {name!r}: state_dict has no {key!r}")
            keys[name] = key
        return keys


def _config_of(model: nn.Module) -> dict[str, Any]:
    """The model's own config when it has one (DLRM), else its class name."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json", None)
    if callable(to_json):
        result = to_json()
        if isinstance(result, dict):
            return result
    return {"architecture": "custom", "class": f"{type(model).__module__}.{type(model).__name__}"}
