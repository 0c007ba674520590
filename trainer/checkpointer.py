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

A model trained from raw ids passes its id maps, `id_maps={"embeddings.user": user_map, ...}`
(publisher/id_map.py): every version then carries each map's entries of the rows it writes,
and `resume` loads the version's maps into those same objects.

What quantization costs each version as served is measured for any model
(publisher/served_loss.py, docs/SERVED_LOSS.md): give `score(module, inputs) -> logits (B,)`
and keep the batches it scores; `codec="auto"` then picks each version's bits from it:

    ckpt = IncrementalCheckpointer(model, opts, store=URL, model_name="ranker", codec="auto",
                                   score=ranker.score, model_factory=ranker.build)
    for batch in stream:
        logits = model(*batch.inputs)                # progressive validation, then training
        ...
        ckpt.keep_scored(batch.inputs, batch.labels)
        ckpt.step(len(batch)); ckpt.maybe_checkpoint(reader)
    ckpt.checkpoint_now(reader)                      # publish what was trained since the last
    ckpt.close()

A TorchRec model checkpoints like any other: unsharded, an EmbeddingBagCollection
(EmbeddingCollection) holds one `nn.EmbeddingBag` (`nn.Embedding`) per table, found under its
module path (`bags.embedding_bags.user`) and tracked by the lookup hooks, which read the ids
TorchRec passes as `input=`; train it with plain torch optimizers:

    bags = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="user", embedding_dim=16, num_embeddings=1_000_000, feature_names=["user"])])
    model = Ranker(bags)                      # forward(features: KeyedJaggedTensor)
    opts = [torch.optim.Adagrad(bags.parameters(), lr=0.05),
            torch.optim.Adam(model.head.parameters())]
    ckpt = IncrementalCheckpointer(model, opts, store=URL, model_name="ranker", codec="int4")

TorchRec's own ModelDeltaTracker cannot replace the hooks there: it wants a
DistributedModelParallel (`model.module`) and tracks only the sharded collections. A model
sharded by DistributedModelParallel checkpoints with trainer/sharded/checkpointing.py, which
uses it; its versions resume here into the same model unsharded.

This is the paper's first stage (decoupled checkpointing). At an interval boundary the training
thread stops only for the copies of trainer/snapshot_capture.py and hands them to a
`BackgroundPublisher`; a full baseline is copied in chunks, one per `maybe_checkpoint` call
(`Tunables.full_copy_chunk_bytes`), and published at the step its copy completes.
Quantization, encoding, upload, commit and announcement run on the
publisher's thread (or in a child process); if it falls behind, its merger thread folds the
waiting snapshots into one, so memory stays bounded and training never waits for storage or for
a merge.

This module wires the parts together:

- trainer/checkpoint_clock.py: when a checkpoint is due (samples or seconds);
- trainer/snapshot_capture.py: the stall (dirty bitmaps, plan, copies, the `Snapshot`);
- publisher/state_dicts.py: which optimizer tensors travel as per-row columns, which as dense;
- trainer/checkpoint_records.py: what each checkpoint cost and wrote, by sequence number;
- trainer/resume.py: a committed version loaded back into the model and optimizers.
"""

from __future__ import annotations

import copy
import logging
import math
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn

from publisher.dlrm import DLRM, SparseBatch, build_model
from publisher.id_map import IdMap
from publisher.memory_budget import MemoryBudget
from publisher.model_factory import ModelFactory
from publisher.read.restore import RestoredState, restore
from publisher.release.rules import GateConfig
from publisher.served_loss import KeptBatch, Score, ScoredBatch, ServedModel
from publisher.store import ObjectStore, open_store
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.background import BackgroundPublisher
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.policies import (
    Policy,
    ServedLossCodecRule,
    make_policy,
)
from publisher.write.process_publisher import ProcessPublisher, ProcessPublisherConfig
from publisher.write.publishing import (
    NonFinitePolicy,
    PublishResult,
    SnapshotPublisher,
)
from publisher.write.tracker import (
    EmbeddingModule,
    RowIds,
    TrackedEmbeddings,
    attach,
    check_optimizers,
    find_embedding_tables,
)
from schemas.announcement import Announcement
from schemas.codec_names import CODECS
from schemas.manifest import IDS_HELD_METRIC, Position
from trainer.auto_codec import resolve_auto_codec
from trainer.checkpoint_clock import CheckpointClock
from trainer.checkpoint_records import CheckpointRecord, CheckpointRecords
from trainer.errors import CheckpointError
from trainer.options import DEFAULT_SCORED_SAMPLES
from trainer.recent_samples import RecentSamples
from trainer.resume import load_restored
from trainer.snapshot_capture import SnapshotCapture

__all__ = ["CheckpointError", "CheckpointRecord", "IncrementalCheckpointer"]

log = logging.getLogger(__name__)

Metrics = Mapping[str, float] | Callable[[], Mapping[str, float]]
PublishIn = Literal["thread", "process"]
Reader = Mapping[str, int | str | dict[str, int]]


class IncrementalCheckpointer:
    """Tracks modified embedding rows and publishes incremental, quantized checkpoints.

    Call `step(samples)` after every optimizer step and `maybe_checkpoint()` right after it (a
    snapshot must be taken between an optimizer step and the next forward). `close()` flushes
    the checkpoints taken; `checkpoint_now(reader)` before it publishes what was trained since
    the last one.
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
        on_non_finite: NonFinitePolicy = "stop",
        id_maps: Mapping[str, IdMap] | None = None,
        served_loss_samples: int | None = None,
        score: Score | None = None,
        model_factory: ModelFactory | None = None,
        served_loss_budget: float | None = None,
        served_loss_judge: Literal["sure", "estimate"] = "sure",
        expected_restores: float | None = None,
        codec_rule: ServedLossCodecRule | None = None,
        gate: GateConfig | None = None,
    ) -> None:
        """
        Args:
            model: any module; its `nn.Embedding` / `nn.EmbeddingBag` modules are the tables.
            optimizers: every optimizer that updates the model (sparse and dense).
            store: an open store, or a URL (`file:///PATH`, `s3://BUCKET/PREFIX`).
            model_name: the name versions are published under.
            policy: `full`, `one-shot`, `consecutive` or `intermittent` (or a Policy).
            codec: one codec for every table, or a table -> codec mapping, or "auto": each
                version's codec from the served loss measured on it (publisher/write/
                policies.py `ServedLossCodecRule`), from the floor the measured bit rule gives
                `expected_restores` (default 2: int4) with `served_loss_budget` (default
                0.01% relative AUC); it measures (`served_loss_samples` defaults to
                16,384 then), so no version commits over the budget while more bits can help.
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
            on_non_finite: a snapshot holding NaN or inf is never published; "stop" re-raises
                its NonFiniteSnapshotError on the training thread at the next batch, "skip"
                counts it (`non_finite_skipped`) and folds its rows into the next snapshot,
                published once the values are finite again.
            id_maps: table name -> its id map, for the tables whose rows raw ids are mapped to
                (an open id space). Each snapshot copies the maps' entries of the rows it
                copies, so every change to a map must touch a row marked dirty (docs/FORMAT.md
                section 7: admissions and counts come with a lookup of the row, an eviction
                re-initialises the row and `tracked.tracker.mark`s it), and the maps must be
                at the state of the samples counted when `maybe_checkpoint` runs (map the next
                batch's ids after it). `resume` and `load_state` load the restored maps into
                these objects, in place.
            served_loss_samples: keep the latest N samples given to `keep_scored` and record in
                every manifest what quantization costs the version as a server holds it,
                scored on them (publisher/served_loss.py); 0 (the default unless
                `codec="auto"`) measures nothing.
            score: `score(module, inputs) -> logits (B,)`, the logits of a batch kept by
                `keep_scored` on the publisher's served copy of the model; required to measure
                any model but the built-in DLRM (scored by its own forward). Given, the
                samples a version carries are chosen per batch (every row the batch looks up
                carried), not per sample as for the DLRM.
            model_factory: `model_factory(model_config) -> module`: builds that served copy.
                Default: a deep copy of `model` taken now, before the tracking hooks are
                attached (thread mode; the publisher moves it to the CPU: give a factory for a
                model too big to copy on its device), or the DLRM `model_config` describes.
                `publish_in="process"` builds the copy in the publisher process: then
                `model_factory` (for any model but the DLRM) and `score` must be module-level
                functions, pickled by reference.
            served_loss_budget / expected_restores: `codec="auto"`'s budget and floor.
            served_loss_judge: what the budget is judged against: "sure" (the loss beyond the
                window's noise, its 95% interval's low end) or "estimate" (the point estimate).
            codec_rule: a rule of your own instead of the one `codec="auto"` builds (the
                capture then starts from `codec`).
            gate: the release gate's rules (docs/RELEASE.md): each version is scored, as
                served, on the samples `keep_scored` gets after it (it never trained on them)
                next to the released version, and released (RELEASED moves), held with its
                reason, or a released one rolled back. It scores the served-loss copy, so it
                measures the served loss too (`served_loss_samples` defaults to 16,384).
        """
        self.clock = CheckpointClock(interval_samples, interval_seconds)
        self.model = model
        self.optimizers = list(optimizers)
        self.model_name = model_name
        self.model_config = dict(model_config) if model_config is not None else _config_of(model)

        self.tables: dict[str, EmbeddingModule] = find_embedding_tables(model)
        if not self.tables:
            raise CheckpointError(f"{type(model).__name__} has no nn.Embedding / nn.EmbeddingBag")
        self.table_rows = {name: int(t.num_embeddings) for name, t in self.tables.items()}
        if codec == "auto" and codec_rule is not None:
            raise CheckpointError("codec='auto' builds its own codec_rule: give one of them")
        codec, auto_rule, served_loss_samples = resolve_auto_codec(
            codec, served_loss_samples, served_loss_budget, expected_restores, served_loss_judge
        )
        codec_rule = auto_rule or codec_rule
        if gate is not None and served_loss_samples is None:
            served_loss_samples = DEFAULT_SCORED_SAMPLES
        if gate is not None and not served_loss_samples:
            raise CheckpointError(
                "the release gate scores the samples kept for the served loss: give "
                "served_loss_samples > 0"
            )
        self.gate = gate
        self.codecs = _codecs(codec, self.tables)
        if isinstance(policy, Policy):
            self.policy = policy
        else:
            self.policy = make_policy(policy, self.table_rows, **dict(policy_params or {}))
        if self.policy.name != "full":
            # Only the full policy writes rows it was not told about; the others trust the bits.
            check_optimizers(model, self.optimizers, self.tables)
        #: table -> the caller's id map (the same objects: resume loads into them).
        self.id_maps: dict[str, IdMap] = dict(id_maps or {})
        self.capture = SnapshotCapture(
            model, self.tables, self.optimizers, self.codecs, self.model_config, self.id_maps
        )
        self.ledger = CheckpointRecords()
        if codec_rule is not None and not served_loss_samples:
            raise CheckpointError(
                "codec='auto' (a codec_rule) chooses from the served loss it measures: give "
                "served_loss_samples > 0, or a codec"
            )
        if served_loss_samples is not None and served_loss_samples < 0:
            raise CheckpointError(f"served_loss_samples must be >= 0, got {served_loss_samples}")
        self.recent_samples = RecentSamples(served_loss_samples or 0)
        self.codec_rule = codec_rule
        #: how `keep_scored` keeps a batch: as the DLRM's numpy views, or any model's copies.
        self._keeps_dlrm_batches = score is None
        # Before the tracking hooks: a copy made after them would mark the trainer's rows.
        self._served_model = self._served_model_of(score, model_factory, publish_in)
        #: (steps, samples) counted when the latest checkpoint was taken (or resumed).
        self._checkpointed_at = (0, 0)
        self.memory_budget = MemoryBudget.from_setting(tunables.memory_budget_bytes)
        self._closed = False
        self._chunk_bytes = tunables.full_copy_chunk_bytes
        #: while a full is copied in chunks: the step count, reader and metrics of the latest
        #: `maybe_checkpoint` call, with which `close` completes it.
        self._pending_at: tuple[int, Reader | None, Metrics | None] | None = None
        #: the rows the interval before the latest checkpoint changed, per table (sorted ids):
        #: what `UntrackedRowVerifier.after` checks against.
        self.last_dirty: dict[str, RowIds] = {}
        #: the version `resume` loaded, if any.
        self.last_restored_version: int | None = None

        if on_non_finite not in ("stop", "skip"):
            raise CheckpointError(f"on_non_finite must be 'stop' or 'skip', got {on_non_finite!r}")
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
        try:
            self.publisher = self._open_publisher(store, bus, announce, publish_in, tunables)
        except BaseException:
            if self._announcer is not None:
                self._announcer.close()
            if self._owns_store:
                self.store.close()
            raise
        self.publish_in = publish_in
        self.background = BackgroundPublisher(
            self.publisher,
            on_published=self._on_published,
            on_non_finite=on_non_finite,
            nice=tunables.publisher_nice,
        )
        # Marked at the optimizer step where the tables allow it: the sparse gradients hold the
        # rows already, so no hook runs per lookup (publisher/write/tracker.py).
        self.tracked: TrackedEmbeddings = attach(model, optimizers=self.optimizers)
        if preallocate:
            try:
                self.capture.preallocate()
            except BaseException:
                self.close(flush=False)
                raise

    def _open_publisher(
        self,
        store: ObjectStore | str,
        bus: str | None,
        announce: Callable[[Announcement], None] | None,
        publish_in: PublishIn,
        tunables: Tunables,
    ) -> SnapshotPublisher:
        """The publisher `publish_in` names; in a thread, with `bus`'s announcer if given."""
        if publish_in == "process":
            assert isinstance(store, str)
            config = ProcessPublisherConfig(
                store,
                self.model_name,
                bus,
                tunables,
                threads=torch.get_num_threads(),
                measure_served_loss=self.recent_samples.capacity > 0,
                codec_rule=self.codec_rule,
                served_model=self._served_model,
                gate=self.gate,
            )
            return ProcessPublisher(config)
        if bus is not None:
            from publisher.bus import open_announcer

            self._announcer = open_announcer(bus, self.model_name)
            announce = self._announcer.announce
        return CheckpointPublisher(
            self.store,
            self.model_name,
            announce=announce,
            tunables=tunables,
            measure_served_loss=self.recent_samples.capacity > 0,
            codec_rule=self.codec_rule,
            served_model=self._served_model,
            gate=self.gate,
        )

    def _served_model_of(
        self, score: Score | None, factory: ModelFactory | None, publish_in: PublishIn
    ) -> ServedModel | None:
        """What the publisher measures the served loss with (None: not measuring, or the
        DLRM rebuilt from its config there); CheckpointError for what cannot be measured."""
        if self.recent_samples.capacity == 0:
            return None
        dlrm = isinstance(self.model, DLRM)
        if score is None and not dlrm:
            raise CheckpointError(
                f"measuring the served loss of a {type(self.model).__name__} needs "
                "score=fn(module, inputs) -> logits (B,) to score the batches given to "
                "keep_scored (only the built-in DLRM is scored by its own forward); or "
                "served_loss_samples=0 and a codec other than 'auto'"
            )
        if publish_in == "process":
            if factory is None and score is not None:
                if not dlrm:
                    raise CheckpointError(
                        "publish_in='process' builds the served copy in the publisher "
                        "process: give model_factory=fn(model_config) -> module, a "
                        "module-level function"
                    )
                factory = build_model
            for fn, what in ((score, "score"), (factory, "model_factory")):
                if fn is not None:
                    _check_by_reference(fn, what)
            return None if score is None and factory is None else ServedModel(score, factory)
        if score is None and factory is None:
            return None  # the DLRM, rebuilt from its config in the publisher
        if factory is None:
            served = copy.deepcopy(self.model)
            for p in served.parameters():
                p.grad = None  # never trained: gradients copied with it would only take memory
        else:
            served = factory(self.model_config)
            _check_served_copy(served, self.model, self.tables)
        return ServedModel(score, copy=served)

    # --- the training loop's calls ---------------------------------------------------------

    @property
    def step_count(self) -> int:
        """Optimizer steps counted so far (continued from a resumed version)."""
        return self.clock.step_count

    @property
    def samples_seen(self) -> int:
        """Samples counted so far (continued from a resumed version)."""
        return self.clock.samples_seen

    @property
    def records(self) -> list[CheckpointRecord]:
        """One record per checkpoint taken, oldest first (filled in as versions publish)."""
        return self.ledger.records

    def step(self, samples: int) -> None:
        """Count one optimizer step over `samples` samples (call after every optimizer step)."""
        self.clock.step(samples)

    def keep_scored(self, inputs: Any, labels: torch.Tensor) -> None:
        """Keep a batch just scored by progressive validation in the window the served loss is
        measured on (`served_loss_samples`; nothing to do without it): `inputs` as `score`
        takes them (the forward's arguments: a tuple of tensors, a KeyedJaggedTensor...),
        copied to the CPU; for the built-in DLRM without `score`, `(dense, sparse)` as its
        forward takes them (kept as numpy views). Call it before the `maybe_checkpoint` of
        the step that trained on the batch."""
        if self.recent_samples.capacity == 0:
            return
        if not isinstance(labels, torch.Tensor):
            raise CheckpointError(f"labels must be a tensor (B,), got {type(labels).__name__}")
        if not self._keeps_dlrm_batches:
            self.recent_samples.add(KeptBatch.of(inputs, labels))
            return
        if not (isinstance(inputs, tuple | list) and len(inputs) == 2):
            raise CheckpointError(
                "a DLRM's kept batch is (dense, sparse) as DLRM.forward takes them, got "
                f"{type(inputs).__name__}"
            )
        dense, sparse = inputs
        if not (
            isinstance(dense, torch.Tensor)
            and isinstance(sparse, Mapping)
            and all(isinstance(b, SparseBatch) for b in sparse.values())
        ):
            raise CheckpointError("a DLRM's kept batch is (dense tensor, {feature: SparseBatch})")
        self.recent_samples.add(ScoredBatch.of(dense, sparse, labels))

    def due(self) -> bool:
        """Whether the interval since the last checkpoint has passed."""
        return self.clock.due()

    def maybe_checkpoint(
        self, reader: Reader | None = None, metrics: Metrics | None = None
    ) -> CheckpointRecord | None:
        """Checkpoint if the interval has passed; `metrics` may be a callable (called only then).

        Re-raises a publishing failure (a lost lease, a refused snapshot) at once, so training
        stops at the batch after it rather than at the next interval.
        """
        self.background.raise_if_failed()
        if self.capture.in_progress:
            # A full baseline copied in chunks: one per step, then the version, at the step
            # after the last chunk (so no stop holds both).
            self._pending_at = (self.clock.step_count, reader, metrics)
            if self.capture.copying_full:
                self.capture.copy_chunk()
                return None
            return self._finish(reader, metrics)
        if not self.due():
            return None
        if self._closed:
            raise CheckpointError("checkpointer is closed")
        self.capture.begin(self.tracked.tracker, self.policy, chunk_bytes=self._chunk_bytes)
        if self.capture.copying_full:
            self._pending_at = (self.clock.step_count, reader, metrics)
            return None
        return self._finish(reader, metrics)

    def checkpoint_now(
        self,
        reader: Reader | None = None,
        metrics: Metrics | None = None,
        *,
        force_full: bool = False,
    ) -> CheckpointRecord:
        """Snapshot now and hand the copy to the background publisher; returns its record.

        `reader` is stored as the manifest's `position.reader` (where the data resumes). A full
        baseline being copied in chunks is completed now (in one stop) and is this snapshot.
        Call it before `close()` to publish what was trained since the last checkpoint:
        `close()` publishes only the checkpoints already taken.
        """
        if self._closed:
            raise CheckpointError("checkpointer is closed")
        if not self.capture.in_progress:
            self.capture.begin(self.tracked.tracker, self.policy, force_full=force_full)
        return self._finish(reader, metrics)

    def _finish(self, reader: Reader | None, metrics: Metrics | None) -> CheckpointRecord:
        """The last stop of the capture in progress: its snapshot, record and hand-off."""
        self._pending_at = None
        raw = metrics() if callable(metrics) else (metrics or {})
        # The manifest holds finite floats only (an AUC is NaN while one class is missing).
        values = {k: float(v) for k, v in raw.items() if math.isfinite(v)}
        # What `checknrun inspect` shows of each dynamic map (docs/FORMAT.md section 7).
        values.update(
            {
                f"{IDS_HELD_METRIC}{name}": float(len(m))
                for name, m in self.id_maps.items()
                if not m.hashed
            }
        )
        position = Position(
            step=self.clock.step_count,
            samples_seen=self.clock.samples_seen,
            reader=dict(reader or {}),
        )
        taken = self.capture.finish(
            self.tracked.tracker, position, values, sequence=self.ledger.next_index
        )
        record = CheckpointRecord.of(taken.snapshot, taken.dirty, self.table_rows)
        self.last_dirty = taken.dirty
        self._checkpointed_at = (self.clock.step_count, self.clock.samples_seen)
        self.ledger.add(record)
        handoff = time.perf_counter()
        window = self.recent_samples.take()
        self.background.submit(replace(taken.snapshot, scored=window.batches, fresh=window.fresh))
        started, started_cpu, pauses = taken.started, taken.started_cpu, taken.pauses_ms
        breakdown = {**taken.breakdown_ms, "handoff": (time.perf_counter() - handoff) * 1e3}
        del taken  # the publisher owns the copies now (buffers recycle on release)
        record.stopped(started, started_cpu, breakdown, pauses)
        self.clock.restart()
        self.ledger.settle(self.background.results)
        return record

    # --- publishing results ------------------------------------------------------------------

    def _on_published(self, result: PublishResult) -> None:
        self.ledger.settle(self.background.results)
        record = self.ledger.get(result.sequence)
        if record is not None and self._user_on_published is not None:
            self._user_on_published(record)

    @property
    def last_version(self) -> int | None:
        """The newest version this checkpointer has committed, if any."""
        results = self.background.results
        self.ledger.settle(results)
        return results[-1].ref.version if results else None

    @property
    def versions_committed(self) -> int:
        """How many versions this checkpointer has committed."""
        return len(self.background.results)

    @property
    def non_finite_skipped(self) -> int:
        """Snapshots not published because they held NaN or inf (`on_non_finite="skip"`)."""
        return self.background.non_finite_skipped

    @property
    def bytes_written(self) -> int:
        """Bytes committed so far by this checkpointer."""
        return sum(r.bytes_written for r in list(self.background.results))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every snapshot taken so far is committed (re-raises a publish failure)."""
        self.background.wait(timeout)
        self.ledger.settle(self.background.results)

    def commit_now(
        self,
        reader: Reader | None = None,
        metrics: Metrics | None = None,
        *,
        force_full: bool = False,
        timeout: float | None = None,
    ) -> int:
        """`checkpoint_now`, then wait until it is committed (`flush`); returns the newest
        committed version, which holds it. CheckpointError when nothing got committed (a
        snapshot holding NaN or inf skipped with `on_non_finite="skip"`)."""
        self.checkpoint_now(reader, metrics, force_full=force_full)
        self.flush(timeout)
        version = self.last_version
        if version is None:
            raise CheckpointError("the checkpoint was not committed (a non-finite snapshot?)")
        return version

    def close(self, flush: bool = True) -> None:
        """Flush (optionally), stop the publisher, release the lease and detach the hooks.

        Flushing publishes every checkpoint taken so far, not the state trained since the
        latest one: that has no reader position to resume from, which only the caller knows.
        So with steps trained since, it logs a WARNING saying how many steps and samples are
        not published; call `checkpoint_now(reader)` before `close()` to publish them.
        """
        if self._closed:
            return
        pending = self._pending_at
        if flush and pending is not None and pending[0] == self.clock.step_count:
            # A full copied in chunks since the last checkpoint call, no step since: publish it
            # as that call would have. (After further steps its reader no longer matches.)
            self.checkpoint_now(pending[1], pending[2])
        if flush:
            self._warn_unpublished()
        self._closed = True
        try:
            self.background.close(flush=flush)
            self.ledger.settle(self.background.results)
        finally:
            self.tracked.detach()
            self.capture.close()
            if self._announcer is not None:
                self._announcer.close()
            if self._owns_store:
                self.store.close()

    def _warn_unpublished(self) -> None:
        steps = self.clock.step_count - self._checkpointed_at[0]
        if steps == 0:
            return
        samples = self.clock.samples_seen - self._checkpointed_at[1]
        log.warning(
            "closing %s with %d step(s) (%d samples) trained since the last checkpoint: they "
            "are not published; call checkpoint_now(reader) before close() to publish them",
            self.model_name,
            steps,
            samples,
        )

    def __enter__(self) -> IncrementalCheckpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(flush=exc_type is None)

    # --- resume ------------------------------------------------------------------------------

    def resume(self, version: int | None = None, *, progress: bool = False) -> Position:
        """Load a committed version (the latest when None) into the model and optimizers.

        Returns its position; the step and sample counters continue from it. The next
        checkpoint is a full baseline: the restored version need not be HEAD's.
        Raises `publisher.read.catalog.NoVersionError` when there is nothing to resume from,
        and `RestoreError` (before allocating) when its manifest declares more than
        `Tunables.memory_budget_bytes`.
        """
        state = restore(
            self.store, self.model_name, version, progress=progress, budget=self.memory_budget
        )
        self.load_state(state)
        self.last_restored_version = state.version
        return state.position

    def load_state(self, state: RestoredState) -> None:
        """Put a restored state into the model and the optimizers (see `resume`)."""
        load_restored(
            state,
            self.model,
            self.optimizers,
            tables=self.tables,
            model_config=self.model_config,
            id_maps=self.id_maps,
        )
        self.clock.resume_at(state.position.step, state.position.samples_seen)
        self._checkpointed_at = (state.position.step, state.position.samples_seen)
        self.capture.abandon()  # a full being copied in chunks was of the state replaced here
        self._pending_at = None
        self.tracked.tracker.snapshot_and_reset()  # loading is not training: nothing is dirty
        self.policy.force_full()


def _codecs(
    codec: str | Mapping[str, str], tables: Mapping[str, EmbeddingModule]
) -> dict[str, str]:
    """Table -> codec, checked: every table named once, every codec known."""
    chosen = {name: codec for name in tables} if isinstance(codec, str) else dict(codec)
    if set(chosen) != set(tables):
        raise CheckpointError(
            f"codec mapping must name exactly the tables {sorted(tables)}, got {sorted(chosen)}"
        )
    for name, c in chosen.items():
        if c not in CODECS:
            raise CheckpointError(
                f"table {name!r}: unknown codec {c!r}; expected one of {', '.join(CODECS)}"
            )
    return chosen


def _check_by_reference(fn: Callable[..., Any], what: str) -> None:
    """CheckpointError unless `fn` pickles by reference to an importable module-level function
    (what a publisher process can import: not a lambda, a closure, nor `__main__`'s)."""
    qualname = getattr(fn, "__qualname__", "")
    why = None
    if getattr(fn, "__name__", "") == "<lambda>":
        why = "is a lambda"
    elif "<locals>" in qualname:
        why = "is defined inside another function"
    elif getattr(fn, "__module__", None) == "__main__":
        why = "is defined in __main__, which the publisher process does not import"
    else:
        try:
            pickle.dumps(fn)
        except Exception as exc:  # any pickling failure means the same to the caller
            why = f"does not pickle ({type(exc).__name__}: {exc})"
    if why is not None:
        raise CheckpointError(
            f"publish_in='process': {what} {fn!r} {why}; give a module-level function of an "
            "importable module (the publisher process imports it by name)"
        )


def served_copy_mismatch(served: object, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why the module `model_factory` built is not of the trained architecture, whose tables
    have `shapes` (None: it is); one process's check and a sharded job's rank 0's."""
    if not isinstance(served, nn.Module):
        return f"model_factory returned a {type(served).__name__}, not a module"
    theirs = {name: tuple(t.weight.shape) for name, t in find_embedding_tables(served).items()}
    if theirs != dict(shapes):
        return (
            f"model_factory built tables {theirs}, the trained model has {dict(shapes)}: it "
            "must build the trained architecture"
        )
    return None


def _check_served_copy(
    served: object, model: nn.Module, tables: Mapping[str, EmbeddingModule]
) -> None:
    """The module `model_factory` built must be a new module of the trained architecture."""
    wrong = served_copy_mismatch(
        served, {name: tuple(t.weight.shape) for name, t in tables.items()}
    )
    if wrong is not None:
        raise CheckpointError(wrong)
    assert isinstance(served, nn.Module)
    trained = {id(p) for p in model.parameters()}
    if any(id(p) in trained for p in served.parameters()):
        raise CheckpointError(
            "model_factory returned a module sharing parameters with the trained model: the "
            "publisher writes its copy's rows, so it must build a new one"
        )


def _config_of(model: nn.Module) -> dict[str, Any]:
    """The model's own config when it has one (DLRM), else its class name."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json", None)
    if callable(to_json):
        result = to_json()
        if isinstance(result, dict):
            return result
    return {"architecture": "custom", "class": f"{type(model).__module__}.{type(model).__name__}"}
