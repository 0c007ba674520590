"""One rank's part of a live topic: the partitions it reads, the events it holds for the next step.

    part = RankTopicPart(stream, (0, 2))   # `stream` reads partitions 0 and 2 of the topic
    part.open(local_batch=256)
    n = part.poll(0.05)       # good events in hand (reads a batch if it holds none)
    batch = part.step_batch(plan, rank)   # once the ranks agreed (trainer/sharded/step_votes.py)

A rank holds at most one parsed batch (`RawEvents`) between the vote and the step; the stream's
position moves past it only when it is taken, so a job that stops with events in hand leaves
them unread and a resumed job reads them again. A batch of bad records only is taken as soon
as it arrives: it trains nothing, and its records are counted and passed.

The rank's reader position (`reader`) names its partitions only; rank 0 also carries, unchanged,
the partitions of a resumed position that no rank of this job reads (the union of the ranks'
readers, publisher/write/job_publishing.py `job_reader`, then keeps them).
"""

from __future__ import annotations

from collections.abc import Mapping

from publisher.dlrm import TABLE_PREFIX
from schemas.manifest import IDS_HELD_METRIC
from trainer.sharded.data import RankBatch, padded_batch
from trainer.sharded.step_votes import StepPlan
from trainer.streams.base import Batch
from trainer.streams.event_columns import RawEvents
from trainer.streams.kafka_events import KafkaEventStream

Reader = Mapping[str, int | str | dict[str, int]]


class RankTopicPart:
    """This rank's partitions of a topic (see the module docstring)."""

    def __init__(self, stream: KafkaEventStream, partitions: tuple[int, ...]) -> None:
        """`stream` reads exactly `partitions` (its address names them; none: it never opens)."""
        self.stream = stream
        self.partitions = partitions
        self._carried: dict[str, int] = {}
        self._held: RawEvents | None = None
        self._taken = 0  # samples of this run, the offset of the next batch

    def resume(self, job: Reader, job_partitions: tuple[int, ...], carry: bool) -> None:
        """Continue at a version's (job's) reader: this rank's partitions at their offsets;
        with `carry`, also the partitions no rank of this job reads. DataError (from the
        stream) for a position of another topic or feature spec."""
        offsets = job.get("offsets")
        given = offsets if isinstance(offsets, dict) else {}
        mine = {str(p) for p in self.partitions}
        self.stream.resume_offset({**job, "offsets": {p: o for p, o in given.items() if p in mine}})
        if carry:
            read = {str(p) for p in job_partitions}
            self._carried = {p: o for p, o in given.items() if p not in read}

    def open(self, local_batch: int) -> None:
        """Start reading (a rank without partitions reads nothing)."""
        if self.partitions:
            self.stream.open(local_batch)

    def close(self) -> None:
        self.stream.close()

    def poll(self, timeout_s: float) -> int:
        """Good events in hand: if none, wait up to `timeout_s` for the reader's next batch."""
        if self._held is None and self.partitions:
            raw = self.stream.next_raw(timeout_s)
            if raw is not None and raw.n == 0:
                self.stream.take(raw, self._taken)  # bad records only: counted and passed
            elif raw is not None:
                self._held = raw
        return 0 if self._held is None else self._held.n

    @property
    def at_end(self) -> bool:
        """Nothing in hand, and every partition read up to where it ended when reading began."""
        return self._held is None and (not self.partitions or self.stream.caught_up)

    def take(self, n: int) -> Batch | None:
        """The first `n` events in hand as a batch (the rest are dropped unread: only the last
        step of a job with a sample limit takes fewer than it holds); None when `n` is 0."""
        raw, self._held = self._held, None
        if raw is None or n == 0:
            self.stream.id_mapper.idle()  # a job's owners map ids at every step: its peers wait
            return None
        batch = self.stream.take(raw.head(n) if n < raw.n else raw, self._taken)
        self._taken += n
        return batch

    def step_batch(self, plan: StepPlan, rank: int) -> RankBatch:
        """This rank's events of the agreed step, padded to the step's local batch size."""
        features = [f.name for f in self.stream.features]
        batch = self.take(plan.take[rank])
        return padded_batch(
            batch, plan.local_size, plan.global_size, features, len(self.stream.dense_names)
        )

    @property
    def offset(self) -> int:
        """This rank's samples taken in this run."""
        return self._taken

    def reader(self) -> dict[str, int | str | dict[str, int]]:
        """Where this rank stops: the next untrained record of each of its partitions."""
        state = self.stream.reader_state(self._taken)
        offsets = state["offsets"]
        assert isinstance(offsets, dict)
        state["offsets"] = {**self._carried, **offsets}
        return state

    def metrics(self) -> dict[str, float]:
        """This rank's bad events by reason and consumer lag, and in a dynamic id space the
        counters of the ids it owns (trainer/sharded/owned_ids.py): the job's are their sums."""
        stream = self.stream
        if stream.spec.id_space == "hash":
            return {**stream.bad.metrics(), "consumer_lag": float(stream.lag)}
        held = {
            IDS_HELD_METRIC + TABLE_PREFIX + name: float(len(space.id_map))
            for name, space in stream.id_spaces.items()
        }
        return {**stream.metrics(), **held}
