"""Kafka records parsed into columns: what the reader process hands the training thread.

The reader process (trainer/streams/kafka_reader.py) parses each record by the rules of
`schemas.events` (`event_object`, `event_key`, `event_bag`) and appends it here; the training
thread then maps the ids of a whole batch at once (trainer/id_space.py). The reader numbers each
feature's distinct keys in order of first appearance (a key's *number*) and sends a key's text
once, in the batch where it first appears; afterwards only its number travels. The training
thread keeps number -> row in an array, so a batch of known ids maps with numpy alone: no string
crosses the pipe or is looked up in a dict (measured on MovieLens events: sending each batch's
distinct keys as text cost the training thread ~2.7 us an event to unpickle and look up,
numbers ~1.8 us all told). When a feature has numbered MAX_KEYS keys, or keys of MAX_KEY_CHARS
characters in all, the numbering starts over (`epoch` + 1), which bounds the memory both sides
spend on ids, however many never-seen ids a stream sends (`checknrun bench admission`: about
680 B per 250-byte id on both sides together, so at most ~90 MiB a feature); the ids that
hold rows are sent again as they next appear.

    RawEvents (one batch)
    +-----------------+--------------------------------------------------------------+
    | ts, labels      | float64 / float32 (n,): the good events, in consumption order |
    | singles[i]      | (new keys, numbers int32 (n,), -1: no id)  per single feature |
    | bags[j]         | (new keys, numbers int32 (nnz,), splits int64 (n + 1,)) a bag |
    | dense           | float64 (n, dense features): the values, NaN where missing    |
    | epoch           | the numbering the numbers belong to                          |
    | partitions,     | int32 / int64 (n,): where each good event sits in the topic   |
    | offsets         |                                                              |
    | ends            | partition -> offset after the batch's last record (good/bad) |
    | bad_records     | (reason, partition, offset) of each bad record               |
    | highwater       | partition -> end of the partition when the batch was cut     |
    +-----------------+--------------------------------------------------------------+
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from schemas.events import (
    MAX_BAG_IDS,
    EventError,
    EventFields,
    event_bag,
    event_key,
    event_number,
    event_object,
)

Keys = list[str]
#: keys a feature numbers before its numbering starts over.
MAX_KEYS = 1 << 20
MAX_KEY_CHARS = 1 << 25


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
    epoch: int
    #: (reason, partition, offset) of each bad record (rare: kept one by one).
    bad_records: list[tuple[str, int, int]]
    highwater: dict[int, int] = field(default_factory=dict)
    #: (n, dense features) float64, NaN where an event has no value (docs/FORMAT.md 8.4).
    dense: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((0, 0)))
    #: CPU seconds the reader process had spent reading (since its builder was made) when it
    #: sent the batch.
    reader_cpu_s: float = 0.0

    @property
    def n(self) -> int:
        """Good events."""
        return int(self.ts.shape[0])

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
            epoch=self.epoch,
            bad_records=[b for b in self.bad_records if b[2] < ends[b[1]]],
            highwater=self.highwater,
            dense=self.dense[:n],
            reader_cpu_s=self.reader_cpu_s,
        )


class _Column:
    """One feature's key numbering, its keys new in this batch and its occurrences."""

    __slots__ = ("chars", "index", "inverse", "keys", "name", "numbered", "splits")

    def __init__(self, name: str) -> None:
        self.name = name
        #: raw id (a str or an int as the JSON has it) -> number. Only ids that passed the key
        #: rule get in, so a hit needs no check (`42` and `"42"` are two entries, one number).
        self.index: dict[str | int, int] = {}
        self.numbered = 0
        #: characters of the keys numbered (the other budget of a numbering).
        self.chars = 0
        self.keys: Keys = []
        self.inverse: list[int] = []
        self.splits: list[int] = [0]

    def next_batch(self) -> None:
        self.keys = []
        self.inverse = []
        self.splits = [0]

    def renumber(self) -> None:
        self.index = {}
        self.numbered = 0
        self.chars = 0

    def number(self, value: Any) -> int:
        """The number of a raw id (-1 for None); EventError for a value that is not an id."""
        kind = type(value)
        if kind is str or kind is int:  # not bool or float: True == 1 == 1.0 as dict keys
            found = self.index.get(value)
            if found is not None:
                return found
        key = event_key(value, self.name)
        if key is None:
            return -1
        found = self.index.get(key)
        if found is None:
            # Numbered before the rest of the event is checked: a bad event may leave a key
            # numbered and never used, which costs a number and nothing else.
            found = self.index[key] = self.numbered
            self.numbered += 1
            self.chars += len(key)
            self.keys.append(key)
        self.index[value] = found
        return found


class RawEventsBuilder:
    """Parses records into the next `RawEvents` (one per batch)."""

    def __init__(self, fields: EventFields) -> None:
        self.fields = fields
        self.epoch = 0
        self._cpu_start = time.process_time()
        self._singles = [_Column(name) for name in self.fields.singles]
        self._bags = [_Column(name) for name in self.fields.bags]
        self._reset()

    def _reset(self) -> None:
        #: the single features' numbers, event after event (n x features, row-major).
        self._numbers: list[int] = []
        self._finds: list[Callable[[Any, int], int]] = [c.index.get for c in self._singles]
        self._ts: list[float] = []
        self._labels: list[float] = []
        #: the dense features' values, event after event (n x dense features, row-major).
        self._dense: list[float] = []
        for column in (*self._singles, *self._bags):
            column.next_batch()
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

    def start_partition(self, partition: int, offset: int) -> None:
        """A partition read from `offset` on (added to the topic while reading): the next batch
        says where it stands even before a record of it arrives."""
        self._ends.setdefault(partition, offset)

    def add(self, value: bytes | None, partition: int, offset: int) -> None:
        """Parse one record; a bad one is counted by reason (its offset is consumed all the
        same)."""
        self._ends[partition] = offset + 1
        try:
            obj, ts, label = event_object(value, self.fields)
            values: list[Any] = list(map(obj.get, self.fields.singles))
            # Ids numbered before (a str or int seen as it is now) in one pass; -2 marks any
            # other value, and then each goes through the key rule (`_Column.number`).
            singles = [
                find(v, -2) if (kind := type(v)) is str or kind is int else -2
                for find, v in zip(self._finds, values, strict=True)
            ]
            if -2 in singles:
                singles = [c.number(v) for c, v in zip(self._singles, values, strict=True)]
            bags = [self._bag(column, obj.get(column.name)) for column in self._bags]
            dense = [_dense_value(obj.get(name), name) for name in self.fields.dense]
        except EventError as exc:
            self._bad.append((exc.reason, partition, offset))
            return
        self._ts.append(ts)
        self._labels.append(label)
        self._partitions.append(partition)
        self._offsets.append(offset)
        self._numbers.extend(singles)
        self._dense.extend(dense)
        for column, numbers in zip(self._bags, bags, strict=True):
            column.inverse.extend(numbers)
            column.splits.append(len(column.inverse))

    @staticmethod
    def _bag(column: _Column, value: Any) -> list[int]:
        if value is None:
            return []
        if type(value) is list and len(value) <= MAX_BAG_IDS:
            find = column.index.get
            numbers = [
                find(v, -2) if (kind := type(v)) is str or kind is int else -2 for v in value
            ]
            if -2 not in numbers:
                return numbers
            numbers = [column.number(v) for v in value]
            if -1 not in numbers:
                return numbers
        # Not a list, too long, or holding a null: event_bag raises the reason.
        return [column.number(v) for v in event_bag(value, column.name)]

    def take(self, highwater: dict[int, int] | None = None) -> RawEvents:
        """The records added since the last `take`, as one batch."""
        shape = (len(self._ts), len(self._singles))
        numbers = np.asarray(self._numbers, dtype=np.int32).reshape(shape)
        raw = RawEvents(
            ts=np.asarray(self._ts, dtype=np.float64),
            labels=np.asarray(self._labels, dtype=np.float32),
            singles=[
                (c.keys, np.ascontiguousarray(numbers[:, i])) for i, c in enumerate(self._singles)
            ],
            bags=[
                (c.keys, np.asarray(c.inverse, dtype=np.int32), np.asarray(c.splits, np.int64))
                for c in self._bags
            ],
            partitions=np.asarray(self._partitions, dtype=np.int32),
            offsets=np.asarray(self._offsets, dtype=np.int64),
            ends=self._ends,
            epoch=self.epoch,
            bad_records=self._bad,
            highwater=dict(highwater or {}),
            dense=np.asarray(self._dense, dtype=np.float64).reshape(
                len(self._ts), len(self.fields.dense)
            ),
            reader_cpu_s=time.process_time() - self._cpu_start,
        )
        if any(
            c.numbered >= MAX_KEYS or c.chars >= MAX_KEY_CHARS
            for c in (*self._singles, *self._bags)
        ):
            self.epoch += 1
            for column in (*self._singles, *self._bags):
                column.renumber()
        self._reset()
        return raw


def _dense_value(value: Any, name: str) -> float:
    """A dense feature's value, NaN when missing; EventError("bad_dense") (event_number)."""
    if type(value) is float and math.isfinite(value):  # the common case
        return value
    number = event_number(value, name)
    return math.nan if number is None else number
