"""Training batches from a live Kafka event topic, ids mapped through an open id space.

    stream = KafkaEventStream(EventSource.parse("kafka://localhost:9092/events"), spec,
                              table_rows={"user": 100_000, ...}, policy=IdSpacePolicy())
    stream.attach(model, optimizers, tracker)     # evicted rows are re-initialised, dirty
    for batch in stream.batches(512): ...

The reader process (trainer/streams/kafka_reader.py) consumes and parses the records; here, on
the training thread, each batch's ids go through each table's `IdSpace` (trainer/id_space.py)
and the dense inputs are computed by `LiveSpec.dense` (publisher/live_features.py), the rule
servers apply to raw-id requests.

Position. The stream keeps, per partition it reads, the offset of the next record not yet
trained: updated when a batch is handed out (the loop trains it before it asks for the reader
state), and for bad records that formed no batch as soon as they are read. `reader_state`
is that map (docs/FORMAT.md section 8.3); `resume_offset` seeks there. Offsets of partitions
named in a resumed position but not read by this run are carried on unchanged. The sample
`offset` of a `Batch` counts the samples of this run, from 0: a stream of several partitions
has no single offset.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from publisher.dlrm import TABLE_PREFIX, SparseBatch, SparseFeature
from publisher.id_map import IdMap
from publisher.live_features import LiveSpec
from publisher.state_dicts import OptimizerStateLayout
from publisher.write.tracker import DirtyRowTracker, EmbeddingModule
from schemas.events import BadEventCounts, EventFields
from trainer.event_clock import EventClock
from trainer.id_space import IdMapper, IdRequest, IdSpace, IdSpacePolicy, LocalIds
from trainer.row_reset import RowReset
from trainer.streams.base import Batch, DataError, InteractionStream, fingerprint_of
from trainer.streams.event_columns import RawEvents
from trainer.streams.kafka_reader import (
    MAX_BATCH_WAIT_S,
    EventSource,
    KafkaReader,
    ReaderConfig,
    topic_id,
)

log = logging.getLogger(__name__)

Reader = Mapping[str, int | str | dict[str, int]]
#: how often a stream waiting for records checks whether it should stop.
POLL_S = 0.2


class TopicRecreatedError(DataError):
    """A resume on a topic deleted and created again since the checkpoint (or
    `--from-topic-start` on the same one): its offsets name records the topic no longer has."""


class KafkaEventStream(InteractionStream):
    """A never-ending stream of training batches from a Kafka topic (module docstring)."""

    source = "kafka"

    def __init__(
        self,
        address: EventSource,
        spec: LiveSpec,
        table_rows: Mapping[str, int],
        policy: IdSpacePolicy | None = None,
        *,
        stop_event: threading.Event | None = None,
        stop_at_end: bool = False,
        from_topic_start: bool = False,
        max_batch_wait_s: float = MAX_BATCH_WAIT_S,
    ) -> None:
        """`table_rows`: rows of each feature's table; `stop_event` ends the batches while
        they wait for records; `stop_at_end`: end once every partition is read up to where it
        ended when reading started (a catch-up run)."""
        self.address = address
        self.spec = spec
        self.table_rows = {f.name: int(table_rows[f.name]) for f in spec.features}
        self.stop_event = stop_event
        self.stop_at_end = stop_at_end
        hashed = spec.id_space == "hash"
        #: table (module) name -> its id map: what the checkpointer publishes with the rows.
        self.id_maps = {
            TABLE_PREFIX + name: IdMap(rows, hashed=hashed)
            for name, rows in self.table_rows.items()
        }
        policy = policy or IdSpacePolicy()
        #: each event's time bounded, and the stream clock (docs/FORMAT.md section 8.1).
        self.clock = EventClock(policy.max_event_lead_s)
        self.policy = policy
        self.id_spaces = {
            f.name: IdSpace(self.id_maps[TABLE_PREFIX + f.name], policy) for f in spec.features
        }
        #: maps each batch's ids: this process's spaces, or a job's owners (`use_mapper`).
        self.id_mapper: IdMapper = LocalIds(self.id_spaces)
        self.fields = EventFields(
            singles=tuple(f.name for f in spec.features if not f.bag),
            bags=tuple(f.name for f in spec.features if f.bag),
            rating_threshold=spec.rating_threshold,
            dense=spec.dense_feature_names,
        )
        self.bad = BadEventCounts()
        self._resumed_admissions = 0
        self._resumed_evictions = 0
        self._resumed_refused = 0
        self.lag = 0
        #: CPU seconds the current reader process has used (as of its latest batch).
        self.reader_cpu_s = 0.0
        self._position: dict[int, int] = {}
        self._highwater: dict[int, int] = {}
        self._reader: KafkaReader | None = None
        self._batch_size = 0
        self._epoch = 0
        self._counted = frozenset(spec.count_features)
        #: `--from-topic-start`: a resume on a recreated topic reads the new one from its start.
        self.from_topic_start = from_topic_start
        #: a partial batch is trained only once its first event waited this long.
        self.max_batch_wait_s = max_batch_wait_s
        self._topic_id: str | None = None
        self._topic_id_read = False
        self._fingerprint = fingerprint_of(
            "kafka", address.topic, spec.to_json(), sorted(self.table_rows.items())
        )

    # --- InteractionStream -------------------------------------------------------------------

    @property
    def features(self) -> tuple[SparseFeature, ...]:
        rows = self.table_rows
        return tuple(SparseFeature(f.name, rows[f.name], f.bag) for f in self.spec.features)

    @property
    def dense_names(self) -> tuple[str, ...]:
        return self.spec.dense_names

    @property
    def num_samples(self) -> None:
        return None

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def reader_state(self, offset: int) -> dict[str, int | str | dict[str, int]]:
        """Where the model stops in the topic: the next record not trained, per partition (and
        the topic's id, when the broker gives it: docs/FORMAT.md section 8.3)."""
        state: dict[str, int | str | dict[str, int]] = {
            "source": self.source,
            "topic": self.address.topic,
            "fingerprint": self.fingerprint,
            "offsets": {str(p): o for p, o in sorted(self._position.items())},
        }
        if self._topic_id is not None:
            state["topic_id"] = self._topic_id
        return state

    def _read_topic_id(self) -> None:
        """Ask the broker for the topic's id once (before the reader starts, or a resume)."""
        if not self._topic_id_read:
            self._topic_id = topic_id(self.address)
            self._topic_id_read = True

    def resume_offset(self, reader: Reader) -> int:
        """Continue at a checkpoint's per-partition offsets; the samples of this run count
        from 0 (returned). DataError for a position of another topic or feature spec."""
        if (reader.get("source"), reader.get("fingerprint")) != (self.source, self.fingerprint):
            raise DataError(
                f"the checkpoint was trained on source={reader.get('source')!r} "
                f"topic={reader.get('topic')!r} fingerprint={reader.get('fingerprint')!r}, but "
                f"this stream is source={self.source!r} topic={self.address.topic!r} "
                f"fingerprint={self.fingerprint!r}: resume on the same topic with the same "
                "--features, --id-space and --id-capacity"
            )
        offsets = reader.get("offsets")
        if not isinstance(offsets, dict) or not all(
            isinstance(o, int) and o >= 0 and p.isdigit() for p, o in offsets.items()
        ):
            raise DataError(f"checkpoint reader offsets {offsets!r} are not partition -> int >= 0")
        was = reader.get("topic_id")
        if was is not None or self.from_topic_start:
            self._read_topic_id()
        recreated = was is not None and self._topic_id is not None and was != self._topic_id
        if recreated and not self.from_topic_start:
            raise TopicRecreatedError(
                f"topic {self.address.topic!r} was deleted and created again since the "
                f"checkpoint (its id was {was}, now {self._topic_id}): the checkpoint's offsets "
                "name records of the old topic. To go on training from the checkpoint on the "
                "new topic's records from its start, pass --from-topic-start"
            )
        if self.from_topic_start and not recreated:
            unknown = was is None or self._topic_id is None
            raise TopicRecreatedError(
                f"--from-topic-start: topic {self.address.topic!r} is the one the checkpoint "
                f"read{' (or its id is unknown)' if unknown else ''}: reading it from its start "
                "would train its records twice"
            )
        if recreated:
            log.warning(
                "topic %r was recreated since the checkpoint: reading the new one from its start",
                self.address.topic,
            )
            self._position = {}
            return 0
        self._position = {int(p): int(o) for p, o in offsets.items()}
        return 0

    @property
    def admissions(self) -> int:
        """Ids given a row (cumulative)."""
        return self._resumed_admissions + sum(s.admitted for s in self.id_spaces.values())

    @property
    def evictions(self) -> int:
        """Ids evicted from their row (cumulative)."""
        return self._resumed_evictions + sum(s.evicted for s in self.id_spaces.values())

    @property
    def refused(self) -> int:
        """Occurrences refused a row by a full table (cumulative; trainer/id_space.py)."""
        return self._resumed_refused + sum(s.refused for s in self.id_spaces.values())

    def metrics(self) -> dict[str, float]:
        """Bad events by reason, consumer lag and id-space counters (cumulative across resumes
        where a manifest carries them: see `restore_metrics`)."""
        held = sum(len(m) for m in self.id_maps.values())
        out = {
            **self.bad.metrics(),
            "consumer_lag": float(self.lag),
            "ids_held": float(held),
            "id_admissions": float(self.admissions),
            "id_evictions": float(self.evictions),
            "id_refused": float(self.refused),
            "event_time_clamped": float(self.clock.clamped),
        }
        if self.spec.id_space == "hash":
            out["hash_collided_rows"] = float(sum(s.collided_rows for s in self.id_spaces.values()))
            out["hash_collision_events"] = float(
                sum(s.collision_events for s in self.id_spaces.values())
            )
        return out

    def restore_metrics(self, metrics: Mapping[str, float]) -> None:
        """Continue the cumulative counters of a resumed version's manifest `metrics`, and
        re-read which rows the (restored) id maps hold."""
        self.bad = BadEventCounts.from_metrics(metrics)
        self._resumed_admissions = int(metrics.get("id_admissions", 0.0))
        self._resumed_evictions = int(metrics.get("id_evictions", 0.0))
        self._resumed_refused = int(metrics.get("id_refused", 0.0))
        self.clock.clamped = int(metrics.get("event_time_clamped", 0.0))
        for space in self.id_spaces.values():
            space.sync()

    # --- wiring ------------------------------------------------------------------------------

    def attach(
        self,
        tables: Mapping[str, EmbeddingModule],
        optimizers: list[torch.optim.Optimizer],
        tracker: DirtyRowTracker | None,
    ) -> None:
        """Re-initialise evicted rows in these tables (by module name) and their optimizers'
        state, and mark them dirty in `tracker` (trainer/row_reset.py)."""
        weights = {name: tables[name].weight for name in self.id_maps}
        layout = OptimizerStateLayout(optimizers, weights)
        for feature, space in self.id_spaces.items():
            table = TABLE_PREFIX + feature
            reset = RowReset(table, weights[table], layout, tracker)
            space.reset_rows, space.mark_rows = reset, reset.mark

    # --- batches -----------------------------------------------------------------------------

    def open(self, batch_size: int) -> None:
        """Start the reader process now (connect, check the topic and the offsets), so that a
        bad topic fails before training starts and start-up is not training time. `batches`
        opens it if this was not called; it closes it when it ends."""
        if self._reader is not None:
            return
        self._read_topic_id()
        config = ReaderConfig(
            self.address,
            self.fields,
            batch_size,
            starts=dict(self._position),
            max_batch_wait_s=self.max_batch_wait_s,
        )
        self._reader = KafkaReader(config)
        self._batch_size = batch_size
        self._epoch = 0
        self.id_mapper.renumber()  # a new reader numbers the keys afresh
        for p, first in self._reader.starts.items():
            self._position[p] = first
        self._highwater.update(self._reader.ends_at_start)
        self._update_lag()

    def close(self) -> None:
        """Stop the reader process (if open)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def batches(self, batch_size: int, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        """Batches of at most `batch_size` events as they arrive (fewer when the topic has no
        more yet), until `stop` samples of this run, the stop event, or (`stop_at_end`) the
        end of the topic as it was when reading started."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._reader is not None and self._batch_size != batch_size:
            self.close()
        self.open(batch_size)
        try:
            offset = start
            while stop is None or offset < stop:
                if self.stop_event is not None and self.stop_event.is_set():
                    return
                if self.stop_at_end and self.caught_up:
                    return
                raw = self.next_raw(POLL_S)
                if raw is None:
                    if self.on_idle is not None:
                        self.on_idle()
                    continue
                if stop is not None and offset + raw.n > stop:
                    raw = raw.head(stop - offset)
                batch = self.take(raw, offset)
                if batch is None:
                    continue
                offset += batch.size
                yield batch
        finally:
            self.close()

    @property
    def caught_up(self) -> bool:
        """Whether every partition is read up to where it ended when the reader started (the
        end of a `stop_at_end` run); False while no reader is open."""
        reader = self._reader
        return reader is not None and all(
            self._position[p] >= end for p, end in reader.ends_at_start.items()
        )

    def next_raw(self, timeout_s: float) -> RawEvents | None:
        """The reader's next parsed batch (None if none came within `timeout_s`), not yet
        trained: `take` trains it. The stream must be open."""
        reader = self._reader
        if reader is None:
            raise RuntimeError("the stream is not open: call open(batch_size) first")
        raw = reader.next(timeout_s)
        if raw is not None:
            self.reader_cpu_s = raw.reader_cpu_s
            self._highwater.update(raw.highwater)
        return raw

    def take(self, raw: RawEvents, offset: int) -> Batch | None:
        """`raw` (from `next_raw`, perhaps cut by `head`) as the batch at sample `offset` of
        this run, its bad records counted and the position moved past it: the caller trains it
        before it asks for the reader state. None when it holds only bad records."""
        self.bad.update(raw.bad)
        if raw.n == 0:  # only bad records: consumed, nothing to train
            self._advance(raw)
            return None
        batch = self._batch(raw, offset)
        self._advance(raw)
        return batch

    def _advance(self, raw: RawEvents) -> None:
        self._position.update(raw.ends)
        self._update_lag()

    def _update_lag(self) -> None:
        self.lag = sum(
            max(0, high - self._position.get(p, high)) for p, high in self._highwater.items()
        )

    def _batch(self, raw: RawEvents, offset: int) -> Batch:
        """Map the raw ids (counting them) and compute the dense inputs (the derived ones and
        the dense features')."""
        n = raw.n
        ts = self.clock.bound(raw.ts)
        now = self.clock.now
        if raw.epoch != self._epoch:  # the reader's numbering started over
            self._epoch = raw.epoch
            self.id_mapper.renumber()
        mapper = self.id_mapper
        requests: list[IdRequest] = []
        for name, (keys, numbers) in zip(self.fields.singles, raw.singles, strict=True):
            mapper.learn(name, keys)
            requests.append(IdRequest(name, numbers, ts, prior=name in self._counted))
        for name, (keys, numbers, splits) in zip(self.fields.bags, raw.bags, strict=True):
            mapper.learn(name, keys)
            requests.append(IdRequest(name, numbers, np.repeat(ts, np.diff(splits)), False))
        names = self.fields.singles + self.fields.bags
        mapped = dict(zip(names, mapper.map(requests, now), strict=True))
        sparse: dict[str, SparseBatch] = {}
        prior: dict[str, np.ndarray] = {}
        single_offsets = torch.arange(n)
        for name in self.fields.singles:
            sparse[name] = SparseBatch(torch.from_numpy(mapped[name].rows), single_offsets)
            prior[name] = mapped[name].prior
        for name, (_, _, splits) in zip(self.fields.bags, raw.bags, strict=True):
            sparse[name] = SparseBatch(
                torch.from_numpy(mapped[name].rows), torch.from_numpy(splits[:-1].copy())
            )
        dense = self.spec.dense(ts, prior, raw.dense)
        return Batch(
            dense=torch.from_numpy(dense),
            sparse=sparse,
            labels=torch.from_numpy(raw.labels),
            offset=offset,
        )


def live_model_extra(spec: LiveSpec) -> dict[str, Any]:
    """The `model_config.extra` of a model trained from events: what servers read."""
    return {"source": KafkaEventStream.source, "live": spec.to_json()}
