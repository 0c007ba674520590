"""Incremental checkpoints of a TorchRec model sharded over the ranks of a job.

    ckpt = ShardedCheckpointer(dmp, dense_opt, store=store, model_name="ranker",
                               policy="intermittent", codec="int4", interval_samples=50_000,
                               model_config=config, collective=TorchCollective.new(60.0),
                               sparse_hyper={"lr": 0.05, "eps": 1e-8})
    for batch in my_part_of_the_stream:
        ...forward, backward (the fused optimizer steps the tables), dense_opt.step()...
        ckpt.step(global_batch_size, len(batch))     # the job's samples, then this rank's
        ckpt.maybe_checkpoint(reader={"offset": n})  # every rank, after every step
    ckpt.close()

`dmp` may be any model DistributedModelParallel shards (the sharded DLRM of
trainer/sharded/model.py, or a user's own, with EmbeddingBagCollections and EmbeddingCollections
anywhere in it), its tables sharded table-wise or row-wise with the fused EXACT_ROWWISE_ADAGRAD.
Tables are named as the unsharded model names them (trainer/sharded/local_shards.py), so a
version resumes in one process with `IncrementalCheckpointer` on the unsharded model, the fused
optimizer's part going to a trainer/rowwise_adagrad.py `RowWiseAdagrad` over the tables in name
order (the version's; a DLRM's `model_config` gives its own order instead).

Every rank makes the same calls at the same steps: its clock counts the job's samples, the same
number on every rank, so the ranks are due together even when a last, short batch gives them
unequal slices; each rank's own samples go into its `position.ranks` entry, whose sum is the
version's `samples_seen`. The stall, on the training thread of each rank:

- trainer/sharded/dirty_rows.py: the rows of this rank's shards changed since the last
  checkpoint (TorchRec's ModelDeltaTracker) and, by one all_reduce, the job's; the policy
  (publisher/write/policies.py) plans from the job's rows, so every rank takes the same
  decision (full or delta, relative to what);
- copies of the planned rows of this rank's shards, weights and accumulator (the one aux
  column), into `TableRows` with `row_range` (None for a table held whole;
  trainer/sharded/host_copies.py); rank 0 also copies the dense parameters and the dense
  optimizer state (trainer/sharded/optimizer_state.py, the one-process trainer's layout);
- the `Snapshot` handed to the `BackgroundPublisher` (publisher/write/background.py),
  which writes every rank's blobs in parallel and commits one version for the job.

A full baseline copies every row of the rank's shards, seconds for a rank holding a few GB, and
the ranks meet at every step's collectives, so one rank's stop stalls the job. When some rank's
shards take more than one chunk of `Tunables.full_copy_chunk_bytes`, the full is copied in
chunks instead (as trainer/snapshot_capture.py does in one process): the stop that plans it
agrees on the job's chunk count K (one all_reduce MAX of the ranks' counts, on the training
group), allocates the host buffers and copies the first chunk; each of the next K - 1
`maybe_checkpoint` calls copies one more (a rank with fewer chunks has nothing left to copy);
the K-th is the last stop, at the same step on every rank: it copies the rows of the rank's
shards that the tracker recorded since the first chunk over their chunk copies, and those rows
are taken off it, plus the dense state on rank 0, and submits the full. The version is the model
at that last stop, exactly, and the next delta holds the rows changed after it. No collective
runs per chunk. Meanwhile no other checkpoint begins; `checkpoint_now` and `close` complete the
full at once. Each stop's pause is in the record (`pauses_ms`, "chunk_pauses",
"longest_chunk_pause"; `stall_ms` is the longest stop).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from publisher.model_factory import ModelFactory
from publisher.read.catalog import Catalog, NoVersionError
from publisher.release.gate import ReleaseGate
from publisher.release.rules import GateConfig
from publisher.served_loss import KeptBatch, Score, ServedModel
from publisher.state_dicts import module_tensors
from publisher.store import ObjectStore
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.background import BackgroundPublisher
from publisher.write.collective import Collective
from publisher.write.job_publishing import JobPublisher, table_order
from publisher.write.policies import Plan, Policy, make_policy
from publisher.write.publishing import NonFinitePolicy, PublishResult, encode_table
from publisher.write.served_codec import ServedCodec
from publisher.write.snapshot import Snapshot, TableRows
from publisher.write.tracker import RowIds
from schemas.announcement import Announcement
from schemas.codec_names import CODECS
from schemas.manifest import Position
from trainer.auto_codec import resolve_auto_codec
from trainer.checkpoint_clock import CheckpointClock
from trainer.checkpoint_records import CheckpointRecord, CheckpointRecords
from trainer.checkpointer import served_copy_mismatch
from trainer.errors import CheckpointError
from trainer.options import DEFAULT_SCORED_SAMPLES
from trainer.recent_samples import RecentSamples
from trainer.sharded.data import RankBatch, scored_batch
from trainer.sharded.dirty_rows import ShardDirtyRows
from trainer.sharded.host_copies import ChunkedShardFull, ShardRowCopier, chunk_plan
from trainer.sharded.local_shards import ShardedTable, local_shards
from trainer.sharded.optimizer_state import job_optimizer_state
from trainer.sharded.owned_ids import OwnedIds, ShardRowReset
from trainer.sharded.restore_shards import restore_sharded
from trainer.sharded.training_group import all_reduce_max

Reader = Mapping[str, int | str | dict[str, int]]
#: a version's metrics, or what gives them when a checkpoint is taken (a collective call for a
#: job's sums: every rank calls it at the same step).
Metrics = Mapping[str, float] | Callable[[], Mapping[str, float]]


@dataclass(frozen=True)
class _Planned:
    """What a checkpoint's first stop decided, and when it began."""

    plan: Plan
    #: the rows any rank changed in the interval, per table (what the plan came from).
    job_rows: dict[str, RowIds]
    #: `time.perf_counter()` and `time.thread_time()` when the stop began.
    started: float
    started_cpu: float
    #: seconds of the dirty rows' take, their all_reduce and the plan.
    plan_s: float


@dataclass
class _Chunked:
    """A full baseline being copied in chunks, one per `maybe_checkpoint` call."""

    planned: _Planned
    full: ChunkedShardFull
    #: calls before the last stop: the job's most chunks of any rank (counted from the first
    #: stop, which copies one), the same on every rank.
    calls_left: int
    #: the step, reader and metrics of the latest call, which `close` completes the full with.
    latest: tuple[int, Reader | None, Metrics | None]
    #: milliseconds of each stop before the last.
    pauses_ms: list[float]


class ShardedCheckpointer:
    """Each rank's part of a sharded job's incremental checkpoints (see the module docstring).

    `maybe_checkpoint` and `close` are collective calls: every rank makes them at the same step.
    """

    def __init__(
        self,
        model: nn.Module,
        dense_optimizer: torch.optim.Optimizer,
        *,
        store: ObjectStore,
        model_name: str,
        collective: Collective,
        sparse_hyper: Mapping[str, float],
        policy: str = "intermittent",
        codec: str = "int4",
        served_loss_samples: int | None = None,
        served_loss_budget: float | None = None,
        served_loss_judge: Literal["sure", "estimate"] = "sure",
        expected_restores: float | None = None,
        interval_samples: int | None = None,
        interval_seconds: float | None = None,
        model_config: Mapping[str, Any] | None = None,
        announce: Callable[[Announcement], None] | None = None,
        on_published: Callable[[PublishResult], None] | None = None,
        tunables: Tunables = DEFAULT_TUNABLES,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 60.0,
        preallocate: bool = True,
        on_non_finite: NonFinitePolicy = "stop",
        score: Score | None = None,
        model_factory: ModelFactory | None = None,
        gate: GateConfig | None = None,
    ) -> None:
        """
        Args:
            model: the DistributedModelParallel, tables trained by a fused row-wise Adagrad.
            dense_optimizer: the optimizer of every other parameter.
            store: where versions go (every rank writes its blobs there).
            model_name: the name versions are published under.
            collective: the publishing thread's collective (trainer/sharded/collective.py).
            sparse_hyper: the fused optimizer's `lr` and `eps` (recorded in the optimizer
                blob, so the one-process trainer resumes with them).
            policy, codec: as for `IncrementalCheckpointer`; one codec for every table, or
                "auto": each version's codec from the served loss rank 0 measures on it
                (publisher/write/served_codec.py), from the bit rule's floor for
                `expected_restores`, within `served_loss_budget`.
            served_loss_samples: rank 0 keeps the latest N samples of its slices
                (`keep_scored`) and records in every manifest what the version loses as
                served, scored on them on the rows every rank sends it; 0 (the default unless
                `codec="auto"`) measures nothing.
            interval_samples: checkpoint after this many samples of the job (all ranks).
            interval_seconds: checkpoint after this many seconds; each rank's clock is its
                own, so the training loop's vote says when (`time_due`, then
                `maybe_checkpoint(due=True)` on every rank at the same step).
            model_config: what the serving side needs to rebuild the model.
            announce: called on rank 0 with each committed version's announcement.
            on_published: called (on the publishing thread) with each committed version.
            group: the training group the dirty bitmaps are reduced over (None: default).
            timeout_s: how long a rank's publisher waits for its own trainer's snapshot of
                the sequence rank 0 picked (JobPublisher); the collective has its own timeout.
            on_non_finite: a version some rank's part of holds NaN or inf is never
                published: "stop" re-raises the error at the next `maybe_checkpoint`, "skip"
                holds it back on every rank and folds it into the next version.
            preallocate: allocate and touch the host buffers of one full copy of this rank's
                shards now, so no stop of a full copied in chunks pays page faults (or pinning,
                on a GPU) for them (the first full would allocate them; the pool keeps them).
            score, model_factory: how rank 0 measures the served loss of a model other than
                the built-in DLRM (which is rebuilt from `model_config`), as for
                `IncrementalCheckpointer`: `model_factory(model_config)` builds an unsharded
                module of the trained architecture (rank 0's served copy: a sharded model
                cannot be copied), `score(module, inputs)` gives the logits (B,) of the
                batches given to `keep_scored(inputs, labels)`.
            gate: the release gate's rules, as for `IncrementalCheckpointer`: rank 0 judges
                each version on the samples of its slices after it.
        """
        resolved, codec_rule, served_loss_samples = resolve_auto_codec(
            codec, served_loss_samples, served_loss_budget, expected_restores, served_loss_judge
        )
        if gate is not None and served_loss_samples is None:
            served_loss_samples = DEFAULT_SCORED_SAMPLES
        codec = str(resolved)  # one codec for every table
        if codec_rule is not None and not served_loss_samples:
            raise CheckpointError(
                "codec='auto' chooses from the served loss it measures: give "
                "served_loss_samples > 0, or a codec"
            )
        if codec not in CODECS:
            raise CheckpointError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
        if served_loss_samples is not None and served_loss_samples < 0:
            raise CheckpointError(f"served_loss_samples must be >= 0, got {served_loss_samples}")
        self.model = model
        self.dense_optimizer = dense_optimizer
        self.store = store
        self.model_name = model_name
        self.rank = collective.rank
        self.world_size = collective.world_size
        self.codec = codec
        self.sparse_hyper = dict(sparse_hyper)
        self.model_config = dict(model_config or {})
        shards = local_shards(model)
        # The model's table order (the manifest's, and the one-process sparse optimizer's
        # parameter order, which the optimizer blob records).
        order = table_order(self.model_config) or tuple(sorted(shards))
        if set(order) != set(shards):
            raise CheckpointError(
                f"model_config names tables {sorted(order)}, the model has {sorted(shards)}"
            )
        self.tables: dict[str, ShardedTable] = {name: shards[name] for name in order}
        self.table_rows = {name: t.rows for name, t in self.tables.items()}
        self.weight_keys = {k for k, v in model.state_dict().items() if hasattr(v, "local_shards")}
        self.clock = CheckpointClock(interval_samples, interval_seconds)
        #: this rank's samples (the clock counts the job's).
        self.rank_samples = 0
        self.policy: Policy = make_policy(policy, self.table_rows)
        self.dirty = ShardDirtyRows(model, self.tables, group)
        self._copier = ShardRowCopier(self.tables, codec)
        self._chunk_bytes = tunables.full_copy_chunk_bytes
        chunked_here = (
            self._chunk_bytes is not None and len(chunk_plan(self.tables, self._chunk_bytes)) > 1
        )
        if preallocate and chunked_here:  # else a full's first chunk pays its faults, no more
            self._copier.reserve_full()
        #: a full baseline being copied in chunks, from its first stop to its last.
        self._chunked: _Chunked | None = None
        #: this rank's part of a dynamic id space (`attach_ids`), None: the tables have no map.
        self.ids: OwnedIds | None = None
        self.ledger = CheckpointRecords()
        self._results: list[PublishResult] = []
        self._user_on_published = on_published
        #: rank 0's window of its recent samples, scored as served at every version.
        self.recent_samples = RecentSamples((served_loss_samples or 0) if self.rank == 0 else 0)
        self.codec_rule = codec_rule
        #: a user's model: its batches are kept as `score` takes them, not as RankBatches.
        self._keeps_inputs = score is not None
        served = ServedCodec(
            encode_table,
            measure_served_loss=bool(served_loss_samples),
            codec_rule=codec_rule,
            served_model=self._served_model(
                score, model_factory, bool(served_loss_samples), collective
            ),
            tunables=tunables,
            gate=None
            if gate is None or self.rank != 0
            else ReleaseGate(store, model_name, gate, announce=announce),
        )
        self.publisher = JobPublisher(
            store,
            model_name,
            collective,
            announce=announce,
            tunables=tunables,
            timeout_s=timeout_s,
            served=served,
        )
        self.background = BackgroundPublisher(
            self.publisher, on_published=self._published, on_non_finite=on_non_finite
        )
        self._closed = False
        #: the version `resume` loaded, None before.
        self.resumed_from: int | None = None

    # --- the training loop's calls ---------------------------------------------------------

    def step(self, samples: int, rank_samples: int | None = None) -> None:
        """Count one optimizer step over `samples` samples of the job, `rank_samples` of them
        this rank's (None: an even share, the remainder on rank 0)."""
        self.clock.step(samples)
        if rank_samples is None:
            share, extra = divmod(samples, self.world_size)
            rank_samples = share + (extra if self.rank == 0 else 0)
        self.rank_samples += rank_samples

    def keep_scored(self, batch: RankBatch | Any, labels: torch.Tensor | None = None) -> None:
        """Keep this rank's samples of a step just scored (rank 0's, with `served_loss_samples`)
        in the window every version's served loss is measured on; call it before the step's
        `maybe_checkpoint`. The built-in DLRM's: the step's `RankBatch`; a user's model's:
        `(inputs, labels)` as `score` takes the inputs (copied to the CPU)."""
        if not self.recent_samples.capacity:
            return
        if not self._keeps_inputs:
            if labels is not None or not isinstance(batch, RankBatch):
                raise CheckpointError(
                    "keep_scored(inputs, labels) needs score= (a model other than the DLRM); "
                    "the DLRM's kept batch is its RankBatch"
                )
            self.recent_samples.add(scored_batch(batch))
            return
        if not isinstance(labels, torch.Tensor):
            raise CheckpointError("keep_scored(inputs, labels): labels must be a tensor (B,)")
        self.recent_samples.add(KeptBatch.of(batch, labels))

    def _served_model(
        self,
        score: Score | None,
        factory: ModelFactory | None,
        measuring: bool,
        collective: Collective,
    ) -> ServedModel | None:
        """Rank 0's served copy and score of a user's model (None: the DLRM, rebuilt from its
        config; or not measuring, or not rank 0); CheckpointError for what cannot be measured,
        on every rank alike."""
        if not measuring:
            return None
        if score is None and factory is None:
            if table_order(self.model_config) is None:
                raise CheckpointError(
                    "measuring the served loss of a model other than the built-in DLRM needs "
                    "score=fn(module, inputs) -> logits (B,) and model_factory=fn(model_config)"
                    " -> an unsharded module of the trained architecture; or "
                    "served_loss_samples=0 and a codec other than 'auto'"
                )
            return None
        if score is None or factory is None:
            raise CheckpointError(
                "a sharded model's served loss needs both score= and model_factory= (rank 0 "
                "scores an unsharded copy: a sharded model cannot be copied)"
            )
        # Rank 0 builds the copy and says whether it is the trained architecture: every rank
        # learns it (one broadcast), so a refusal is every rank's, not a hang of the others.
        served: nn.Module | None = None
        wrong: str | None = None
        if self.rank == 0:
            try:
                built: object = factory(self.model_config)
            except Exception as exc:
                built = exc
            if isinstance(built, Exception):
                wrong = f"model_factory failed: {type(built).__name__}: {built}"
            else:
                shapes = {n: (t.rows, t.dim) for n, t in self.tables.items()}
                wrong = served_copy_mismatch(built, shapes)
                if wrong is None:
                    assert isinstance(built, nn.Module)
                    served = built
        told = collective.broadcast(wrong)
        if told is not None:
            raise CheckpointError(str(told))
        if served is None:
            return None
        return ServedModel(score, copy=served)

    @property
    def records(self) -> list[CheckpointRecord]:
        """One record per checkpoint this rank took, oldest first."""
        return self.ledger.records

    @property
    def non_finite_skipped(self) -> int:
        """Snapshots not published because the job's version held NaN or inf ("skip")."""
        return self.background.non_finite_skipped

    @property
    def copying_full(self) -> bool:
        """Whether a full baseline is being copied in chunks (its last stop is still to come)."""
        return self._chunked is not None

    @property
    def time_due(self) -> bool:
        """Whether this rank's clock says `interval_seconds` have passed (its vote)."""
        return self.clock.due_by_time()

    def maybe_checkpoint(
        self, reader: Reader | None = None, metrics: Metrics | None = None, *, due: bool = False
    ) -> CheckpointRecord | None:
        """Checkpoint when the job's samples reach the interval, or when `due` (the ranks
        voted: some rank's `time_due`); a collective call; re-raises a publishing failure at
        once. `metrics` may be a callable (called only then, on every rank).

        A full baseline larger than `Tunables.full_copy_chunk_bytes` on some rank is copied in
        chunks, one per call, and published by the call after the job's last chunk (None until
        then): every rank makes the same calls, so every rank finishes at the same step."""
        self.background.raise_if_failed()
        chunked = self._chunked
        if chunked is not None:
            chunked.latest = (self.clock.step_count, reader, metrics)
            chunked.calls_left -= 1
            if chunked.calls_left > 0:
                started = time.perf_counter()
                chunked.full.copy_chunk()  # nothing left on a rank holding fewer chunks
                self._copier.synchronize()
                chunked.pauses_ms.append((time.perf_counter() - started) * 1e3)
                return None
            return self._finish_chunked(reader, metrics)
        if not (due or self.clock.due_by_samples()):
            return None
        if self._closed:
            raise CheckpointError("checkpointer is closed")
        planned = self._plan(force_full=False)
        if self._begin_chunked(planned, reader, metrics):
            return None
        return self._one_stop(planned, reader, metrics)

    def checkpoint_now(
        self,
        reader: Reader | None = None,
        metrics: Metrics | None = None,
        *,
        force_full: bool = False,
    ) -> CheckpointRecord:
        """Snapshot this rank's part now and hand it to the publisher (a collective call);
        `metrics`: the version's (rank 0's are published), or a callable that gives them.
        A full baseline being copied in chunks is completed now (in one stop) and is this
        snapshot, a full whatever `force_full` says."""
        if self._closed:
            raise CheckpointError("checkpointer is closed")
        if self._chunked is not None:
            return self._finish_chunked(reader, metrics)
        return self._one_stop(self._plan(force_full=force_full), reader, metrics)

    def _plan(self, *, force_full: bool) -> _Planned:
        """The start of a stop: this rank's dirty rows, the job's (an all_reduce), the plan."""
        started, started_cpu = time.perf_counter(), time.thread_time()
        job_rows = self.dirty.union(self.dirty.take())
        if force_full:
            self.policy.force_full()
        plan = self.policy.plan(job_rows)
        return _Planned(plan, job_rows, started, started_cpu, time.perf_counter() - started)

    def _one_stop(
        self, planned: _Planned, reader: Reader | None, metrics: Metrics | None
    ) -> CheckpointRecord:
        """Copy the planned rows and hand the snapshot over, in this one stop."""
        plan = planned.plan
        tables = tuple(
            rows
            for name, table in self.tables.items()
            if (rows := self._copier.rows(table, plan.rows[name])) is not None
        )
        self._copier.synchronize()  # every table's device-to-host copy has landed
        stop = (planned.started, planned.started_cpu)
        return self._submit(planned, tables, reader, metrics, stop, stop[0] + planned.plan_s)

    def _begin_chunked(
        self, planned: _Planned, reader: Reader | None, metrics: Metrics | None
    ) -> bool:
        """Begin copying a full plan in chunks when some rank's shards take more than one
        (one all_reduce of the ranks' chunk counts, the same decision on every rank): allocate
        the host buffers and copy the first chunk. False: take it in one stop."""
        if planned.plan.kind != "full" or self._chunk_bytes is None:
            return False
        chunks = chunk_plan(self.tables, self._chunk_bytes)
        counts = all_reduce_max(
            torch.tensor([len(chunks)], dtype=torch.int64), self.dirty.group, self.dirty.device
        )
        job_chunks = int(counts.item())
        if job_chunks <= 1:
            return False
        full = ChunkedShardFull(self.tables, chunks, self._copier)
        full.copy_chunk()
        self._copier.synchronize()
        self._chunked = _Chunked(
            planned,
            full,
            calls_left=job_chunks,
            latest=(self.clock.step_count, reader, metrics),
            pauses_ms=[(time.perf_counter() - planned.started) * 1e3],
        )
        return True

    def _finish_chunked(self, reader: Reader | None, metrics: Metrics | None) -> CheckpointRecord:
        """The last stop of a full copied in chunks: the chunks left, then the rows of this
        rank's shards changed since the first one (taken: the next delta holds only rows
        changed after this stop) copied again, then the snapshot of the model now."""
        chunked = self._chunked
        assert chunked is not None
        self._chunked = None
        started, started_cpu = time.perf_counter(), time.thread_time()
        # The policy planned the full at its first stop and never sees the rows taken here: it
        # counts the next interval from this baseline, which holds their values now.
        chunked.full.refresh(self.dirty.take())
        return self._submit(
            chunked.planned,
            chunked.full.table_rows(),
            reader,
            metrics,
            (started, started_cpu),
            started,
            chunked.pauses_ms,
        )

    def _submit(
        self,
        planned: _Planned,
        tables: tuple[TableRows, ...],
        reader: Reader | None,
        metrics: Metrics | None,
        stop: tuple[float, float],
        copy_started: float,
        pauses_ms: Sequence[float] = (),
    ) -> CheckpointRecord:
        """The snapshot of `tables` (copied), the dense state and optimizer now (rank 0), and
        the version's metrics, handed to the publisher; its record. `stop`: when this stop
        began (`perf_counter`, `thread_time`); `pauses_ms`: the stops before it (a chunked
        full's)."""
        job_metrics = dict(metrics() if callable(metrics) else (metrics or {}))
        dense: dict[str, np.ndarray] = {}
        optimizer: dict[str, np.ndarray] = {}
        optimizer_meta: dict[str, Any] = {}
        if self.rank == 0:
            dense = module_tensors(self.model, self.weight_keys)
            optimizer, optimizer_meta = job_optimizer_state(
                self.dense_optimizer, list(self.tables), self.sparse_hyper
            )
        plan = planned.plan
        window = self.recent_samples.take()
        snapshot = Snapshot(
            kind=plan.kind,
            relative_to=plan.relative_to,
            policy=self.policy.name,
            tables=tables,
            position=Position(
                step=self.clock.step_count,
                samples_seen=self.rank_samples,
                reader=dict(reader or {}),
            ),
            dense=dense,
            optimizer=optimizer,
            optimizer_meta=optimizer_meta,
            model_config=self.model_config,
            metrics=job_metrics,
            sequence=self.ledger.next_index,
            scored=window.batches,
            fresh=window.fresh,
        )
        copied = time.perf_counter()
        record = CheckpointRecord.of(snapshot, planned.job_rows, self.table_rows)
        self.ledger.add(record)
        self.background.submit(snapshot)
        breakdown = {
            "dirty_rows_and_plan": planned.plan_s * 1e3,  # a chunked full's: at its first stop
            "copy": (copied - copy_started) * 1e3,
            "handoff": (time.perf_counter() - copied) * 1e3,
        }
        record.stopped(*stop, breakdown, pauses_ms)
        self.clock.restart()
        self.ledger.settle(self._results)
        return record

    # --- publishing results ------------------------------------------------------------------

    def _published(self, result: PublishResult) -> None:
        self._results.append(result)
        self.ledger.settle(self._results)
        if self._user_on_published is not None:
            self._user_on_published(result)

    @property
    def last_version(self) -> int | None:
        """The newest version committed with this rank's part, if any."""
        return self._results[-1].ref.version if self._results else None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every snapshot taken so far is committed (re-raises a failure)."""
        self.background.wait(timeout)
        self.ledger.settle(self._results)

    def close(self, flush: bool = True) -> None:
        """Flush (optionally) and stop the publisher (rank 0 releases the job's lease); a
        collective call. With `flush`, a full being copied in chunks since the last
        `maybe_checkpoint`, with no step since, is completed now and published as that call
        would have (after further steps its reader no longer matches the model)."""
        if self._closed:
            return
        chunked = self._chunked
        if flush and chunked is not None and chunked.latest[0] == self.clock.step_count:
            self._finish_chunked(chunked.latest[1], chunked.latest[2])
        self._chunked = None
        self._closed = True
        self.background.close(flush=flush)
        self.ledger.settle(self._results)

    def __enter__(self) -> ShardedCheckpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(flush=exc_type is None)

    # --- resume ------------------------------------------------------------------------------

    def resume(self, version: int | None = None) -> Position:
        """Load a committed version (the latest when None) into this rank's shards, the dense
        state and the dense optimizer (every rank calls it); the step and sample counters continue
        from its position (the job's samples for the clock, this rank's part of them for its
        position, so the next version's sum is right), and the next checkpoint is a full
        baseline. `resumed_from` is then the version loaded."""
        if version is None:
            version = self._agreed_latest()
        position = restore_sharded(
            self.model, self.dense_optimizer, self.store, self.model_name, version, ids=self.ids
        )
        self.resumed_from = version
        self.clock.resume_at(position.step, position.samples_seen)
        self.rank_samples = self._resumed_samples(position)
        self.dirty.take()  # loading is not training: nothing is dirty
        self._chunked = None  # a full being copied in chunks was of the state replaced here
        self.policy.force_full()
        return position

    def attach_ids(self, ids: OwnedIds) -> None:
        """Checkpoint (and resume) the id maps of this rank's part of a dynamic id space with
        the rows of its shards (docs/FORMAT.md 7.2): each shard's id-map entries are the map
        of its owner, this rank; the rows its owners re-initialise or give are marked dirty."""
        self.ids = ids
        maps = {}
        for feature, space in ids.spaces.items():
            table = ids.tables[feature]
            (shard,) = self.tables[table].shards
            reset = ShardRowReset(table, shard, self.dirty.mark)
            space.reset_rows, space.mark_rows = reset, reset.mark
            maps[table] = space.id_map
        self._copier.id_maps = maps

    def _agreed_latest(self) -> int:
        """The latest committed version, as rank 0 reads it, on every rank: read by each rank,
        "latest" could differ while another writer (the job being replaced) still commits, and
        ranks would load different versions. NoVersionError on every rank if there is none."""
        latest = Catalog(self.store, self.model_name).latest() if self.rank == 0 else None
        agreed = self.publisher.collective.broadcast(None if latest is None else latest.version)
        if not isinstance(agreed, int):
            raise NoVersionError(f"model {self.model_name!r} has no committed version")
        return agreed

    def _resumed_samples(self, position: Position) -> int:
        """This rank's samples at `position`: its own when the job that wrote it had as many
        ranks, else an even share of the job's (the remainder on rank 0)."""
        ranks = position.ranks
        if ranks is not None and len(ranks) == self.world_size:
            return ranks[self.rank].samples_seen
        share, extra = divmod(position.samples_seen, self.world_size)
        return share + (extra if self.rank == 0 else 0)
