"""Kafka records parsed into columns: what the reader process hands the training thread.

The reader process (trainer/streams/kafka_reader.py) parses each record with
`schemas.events.parse_event` and appends it here; the training thread then maps the ids of a
whole batch at once (trainer/id_space.py). Ids travel as each feature's distinct keys plus, per
occurrence, the index of its key (-1: no id), so the training thread looks up each distinct id
once per batch instead of once per occurrence, and the batch pickles small.

    RawEvents (one batch)
    +-----------------+--------------------------------------------------------------+
    | ts, labels      | float64 / float32 (n,): the good events, in consumption order |
    | singles[i]      | (keys, inverse int32 (n,))               per single feature  |
    | bags[j]         | (keys, inverse int32 (nnz,), splits int64 (n + 1,))  per bag  |
    | partitions,     | int32 / int64 (n,): where each good event sits in the topic   |
    | offsets         |                                                              |
    | ends            | partition -> offset after the batch's last record (good/bad) |
    | bad_records     | (reason, partition, offset) of each bad record               |
    | highwater       | partition -> end of the partition when the batch was cut     |
    +-----------------+--------------------------------------------------------------+
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from schemas.events import EventError, EventFields, parse_event

Keys = list[str]


@dataclass
class RawEvents:
    """One batch of parsed records (see the module docstring)."""

    ts: npt.NDArray[np.float64]
    labels: npt.NDArray[np.float32]
    singles: list[tuple[Keys, npt.NDArray[np.int32]]]
    bags: list[tuple[Keys, npt.NDArray[np.int32], npt.NDArray[np.int64]]]
    partitions: npt.NDArray[np.int32]
    offsets: npt.NDArray[np.int64]
    ends: dict[int, int]
    #: (reason, partition, offset) of each bad record (rare: kept one by one).
    bad_records: list[tuple[str, int, int]]
    highwater: dict[int, int] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """Good events."""
        return int(self.ts.shape[0])

    @property
    def records(self) -> int:
        """Records consumed, good and bad."""
        return self.n + len(self.bad_records)

    @property
    def bad(self) -> dict[str, int]:
        """Bad records by reason."""
        counts: dict[str, int] = {}
        for reason, _, _ in self.bad_records:
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    def head(self, n: int) -> RawEvents:
        """The first `n` good events, with the records before the (n+1)-th good event: each
        partition's end is the offset of its first good event left out, if any."""
        if n >= self.n:
            return self
        ends = dict(self.ends)
        for p, offset in zip(self.partitions[n:].tolist(), self.offsets[n:].tolist(), strict=True):
            ends[p] = min(ends[p], offset)
        bags = []
        for keys, inverse, splits in self.bags:
            bags.append((keys, inverse[: splits[n]], splits[: n + 1]))
        return RawEvents(
            ts=self.ts[:n],
            labels=self.labels[:n],
            singles=[(keys, inverse[:n]) for keys, inverse in self.singles],
            bags=bags,
            partitions=self.partitions[:n],
            offsets=self.offsets[:n],
            ends=ends,
            bad_records=[b for b in self.bad_records if b[2] < ends[b[1]]],
            highwater=self.highwater,
        )


class _Column:
    """One feature's distinct keys and per-occurrence key indices."""

    __slots__ = ("index", "inverse", "keys", "splits")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.keys: Keys = []
        self.inverse: list[int] = []
        self.splits: list[int] = [0]


class RawEventsBuilder:
    """Parses records into the next `RawEvents` (one per batch)."""

    def __init__(self, fields: EventFields) -> None:
        self.fields = fields
        self._reset()

    def _reset(self) -> None:
        self._ts: list[float] = []
        self._labels: list[float] = []
        self._singles = [_Column() for _ in self.fields.singles]
        self._bags = [_Column() for _ in self.fields.bags]
        self._partitions: list[int] = []
        self._offsets: list[int] = []
        self._ends: dict[int, int] = {}
        self._bad: list[tuple[str, int, int]] = []

    @property
    def n(self) -> int:
        """Good events so far."""
        return len(self._ts)

    @property
    def records(self) -> int:
        """Records added so far, good and bad."""
        return len(self._ts) + len(self._bad)

    def add(self, value: bytes | None, partition: int, offset: int) -> None:
        """Parse one record; a bad one is counted by reason (its offset is consumed all the
        same)."""
        self._ends[partition] = offset + 1
        try:
            event = parse_event(value, self.fields)
        except EventError as exc:
            self._bad.append((exc.reason, partition, offset))
            return
        self._ts.append(event.ts)
        self._labels.append(event.label)
        self._partitions.append(partition)
        self._offsets.append(offset)
        for column, key in zip(self._singles, event.ids, strict=True):
            if key is None:
                column.inverse.append(-1)
                continue
            slot = column.index.get(key)
            if slot is None:
                slot = column.index[key] = len(column.keys)
                column.keys.append(key)
            column.inverse.append(slot)
        for column, keys in zip(self._bags, event.bags, strict=True):
            for key in keys:
                slot = column.index.get(key)
                if slot is None:
                    slot = column.index[key] = len(column.keys)
                    column.keys.append(key)
                column.inverse.append(slot)
            column.splits.append(len(column.inverse))

    def take(self, highwater: dict[int, int] | None = None) -> RawEvents:
        """The records added since the last `take`, as one batch."""
        raw = RawEvents(
            ts=np.asarray(self._ts, dtype=np.float64),
            labels=np.asarray(self._labels, dtype=np.float32),
            singles=[(c.keys, np.asarray(c.inverse, dtype=np.int32)) for c in self._singles],
            bags=[
                (c.keys, np.asarray(c.inverse, dtype=np.int32), np.asarray(c.splits, np.int64))
                for c in self._bags
            ],
            partitions=np.asarray(self._partitions, dtype=np.int32),
            offsets=np.asarray(self._offsets, dtype=np.int64),
            ends=self._ends,
            bad_records=self._bad,
            highwater=dict(highwater or {}),
        )
        self._reset()
        return raw
