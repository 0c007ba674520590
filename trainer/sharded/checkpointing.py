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
  column), into `TableRows` with `row_range` (None for a table held whole); rank 0 also copies
  the dense parameters and the dense optimizer state (trainer/sharded/optimizer_state.py, the
  one-process trainer's layout);
- the `Snapshot` handed to the `JobBackgroundPublisher` (publisher/write/job_publishing.py),
  which writes every rank's blobs in parallel and commits one version for the job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from publisher.read.catalog import Catalog, NoVersionError
from publisher.state_dicts import module_tensors
from publisher.store import ObjectStore
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.collective import Collective
from publisher.write.job_publishing import JobBackgroundPublisher, JobPublisher, table_order
from publisher.write.policies import Policy, make_policy
from publisher.write.publishing import PublishResult
from publisher.write.snapshot import Snapshot, TableRows
from publisher.write.tracker import RowIds
from schemas.announcement import Announcement
from schemas.codec_names import CODECS
from schemas.manifest import Position
from trainer.checkpoint_clock import CheckpointClock
from trainer.checkpoint_records import CheckpointRecord, CheckpointRecords
from trainer.errors import CheckpointError
from trainer.row_buffers import RowBufferPool
from trainer.sharded.dirty_rows import ShardDirtyRows
from trainer.sharded.local_shards import LocalShard, ShardedTable, local_shards
from trainer.sharded.optimizer_state import job_optimizer_state
from trainer.sharded.restore_shards import restore_sharded

Reader = Mapping[str, int | str | dict[str, int]]
#: a version's metrics, or what gives them when a checkpoint is taken (a collective call for a
#: job's sums: every rank calls it at the same step).
Metrics = Mapping[str, float] | Callable[[], Mapping[str, float]]


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
        interval_samples: int | None = None,
        model_config: Mapping[str, Any] | None = None,
        announce: Callable[[Announcement], None] | None = None,
        on_published: Callable[[PublishResult], None] | None = None,
        tunables: Tunables = DEFAULT_TUNABLES,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 60.0,
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
            policy, codec: as for `IncrementalCheckpointer`; one codec for every table.
            interval_samples: checkpoint after this many samples of the job (all ranks).
            model_config: what the serving side needs to rebuild the model.
            announce: called on rank 0 with each committed version's announcement.
            on_published: called (on the publishing thread) with each committed version.
            group: the training group the dirty bitmaps are reduced over (None: default).
            timeout_s: how long a rank's publisher waits for its own trainer's snapshot of
                the sequence rank 0 picked (JobPublisher); the collective has its own timeout.
        """
        if codec not in CODECS:
            raise CheckpointError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
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
        self.clock = CheckpointClock(interval_samples)
        #: this rank's samples (the clock counts the job's).
        self.rank_samples = 0
        self.policy: Policy = make_policy(policy, self.table_rows)
        self.dirty = ShardDirtyRows(model, self.tables, group)
        #: tables on a GPU: their rows are copied into pinned host buffers (`_to_host`).
        self._on_gpu = any(s.weight.is_cuda for t in self.tables.values() for s in t.shards)
        self._host_rows = RowBufferPool(pinned=self._on_gpu)
        self.ledger = CheckpointRecords()
        self._results: list[PublishResult] = []
        self._user_on_published = on_published
        self.publisher = JobPublisher(
            store,
            model_name,
            collective,
            announce=announce,
            tunables=tunables,
            timeout_s=timeout_s,
        )
        self.background = JobBackgroundPublisher(self.publisher, on_published=self._published)
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

    @property
    def records(self) -> list[CheckpointRecord]:
        """One record per checkpoint this rank took, oldest first."""
        return self.ledger.records

    def maybe_checkpoint(
        self, reader: Reader | None = None, metrics: Metrics | None = None
    ) -> CheckpointRecord | None:
        """Checkpoint when the interval has passed (a collective call); re-raises a publishing
        failure at once. `metrics` may be a callable (called only then, on every rank)."""
        self.background.raise_if_failed()
        if not self.clock.due():
            return None
        return self.checkpoint_now(reader, metrics)

    def checkpoint_now(
        self,
        reader: Reader | None = None,
        metrics: Metrics | None = None,
        *,
        force_full: bool = False,
    ) -> CheckpointRecord:
        """Snapshot this rank's part now and hand it to the publisher (a collective call);
        `metrics`: the version's (rank 0's are published), or a callable that gives them."""
        if self._closed:
            raise CheckpointError("checkpointer is closed")
        started, started_cpu = time.perf_counter(), time.thread_time()
        job_metrics = dict(metrics() if callable(metrics) else (metrics or {}))
        mine = self.dirty.take()
        job_rows = self.dirty.union(mine)
        if force_full:
            self.policy.force_full()
        plan = self.policy.plan(job_rows)
        planned = time.perf_counter()
        tables = tuple(
            rows
            for name, table in self.tables.items()
            if (rows := self._copy_rows(table, plan.rows[name])) is not None
        )
        if self._on_gpu:
            torch.cuda.synchronize()  # every table's device-to-host copy has landed
        dense: dict[str, np.ndarray] = {}
        optimizer: dict[str, np.ndarray] = {}
        optimizer_meta: dict[str, Any] = {}
        if self.rank == 0:
            dense = module_tensors(self.model, self.weight_keys)
            optimizer, optimizer_meta = job_optimizer_state(
                self.dense_optimizer, list(self.tables), self.sparse_hyper
            )
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
        )
        copied = time.perf_counter()
        record = CheckpointRecord.of(snapshot, job_rows, self.table_rows)
        self.ledger.add(record)
        self.background.submit(snapshot)
        done = time.perf_counter()
        record.stall_ms = (done - started) * 1e3
        record.stall_cpu_ms = (time.thread_time() - started_cpu) * 1e3
        record.stall_breakdown_ms = {
            "dirty_rows_and_plan": (planned - started) * 1e3,
            "copy": (copied - planned) * 1e3,
            "handoff": (done - copied) * 1e3,
        }
        self.clock.restart()
        self.ledger.settle(self._results)
        return record

    def _copy_rows(self, table: ShardedTable, planned: RowIds | None) -> TableRows | None:
        """Copies of this rank's planned rows of `table` (None: all of them) and their
        accumulators; None when this rank holds none of the table."""
        if not table.shards:
            return None
        (shard,) = table.shards  # one per rank and table (see dirty_rows.py)
        if planned is None:
            ids = np.arange(shard.row_start, shard.row_end, dtype=np.int64)
        else:
            lo, hi = np.searchsorted(planned, [shard.row_start, shard.row_end])
            ids = np.ascontiguousarray(planned[lo:hi], dtype=np.int64)
        local = torch.from_numpy(ids - shard.row_start)
        if shard.weight.is_cuda:
            values, aux = self._to_host(table.name, shard, local)
        else:
            values = shard.weight.detach().index_select(0, local).numpy()
            aux = shard.accumulator.detach().index_select(0, local).reshape(-1, 1).numpy()
        return TableRows(
            name=table.name,
            table_rows=table.rows,
            codec=self.codec,
            row_ids=ids,
            values=values,
            aux=aux,
            row_range=None if table.whole else (shard.row_start, shard.row_end),
        )

    def _to_host(
        self, name: str, shard: LocalShard, local: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows `local` of a GPU shard and their accumulators, gathered on the device and
        copied into pinned host buffers kept between snapshots (`RowBufferPool`). The copies
        are asynchronous: `checkpoint_now` synchronises once, after every table's."""
        on_device = local.to(shard.weight.device)
        n = int(local.numel())
        values = self._host_rows.take(f"{name}.weight", n, int(shard.weight.shape[1]))
        aux = self._host_rows.take(f"{name}.accumulator", n, 1)
        picked = shard.weight.detach().index_select(0, on_device)
        torch.from_numpy(values).copy_(picked, non_blocking=True)
        picked_acc = shard.accumulator.detach().index_select(0, on_device).reshape(-1, 1)
        torch.from_numpy(aux).copy_(picked_acc, non_blocking=True)
        return values, aux

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
        """Flush (optionally) and stop the publisher (rank 0 releases the job's lease)."""
        if self._closed:
            return
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
            self.model, self.dense_optimizer, self.store, self.model_name, version
        )
        self.resumed_from = version
        self.clock.resume_at(position.step, position.samples_seen)
        self.rank_samples = self._resumed_samples(position)
        self.dirty.take()  # loading is not training: nothing is dirty
        self.policy.force_full()
        return position

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
