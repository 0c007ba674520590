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
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, islice, repeat
from typing import Any

import numpy as np
import numpy.typing as npt

from schemas.events import (
    MAX_BAG_IDS,
    EventError,
    EventFields,
    event_bag,
    event_json,
    event_key,
    event_label,
    event_number,
    event_objects,
    event_time,
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
        #: rule get in, so a hit needs no check (`42` and `"42"` are two entries, one number);
        #: and None -> -1 (no id), so that a batch's absent ids look up with the rest.
        self.index: dict[str | int | None, int] = {None: -1}
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
        self.index = {None: -1}
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


#: the types of a single feature's value that look up in `_Column.index` as they are: not bool
#: or float (True == 1 == 1.0 as dict keys), nor an unhashable list; None is there, as -1.
_SINGLE_TYPES = frozenset({str, int, type(None)})
#: the same in a bag, where a null is a bad id.
_BAG_ID_TYPES = frozenset({str, int})
_BAG_TYPES = frozenset({list, type(None)})
_FLOAT = frozenset({float})


class _Rows:
    """The records of one `RawEventsBuilder.add_records` still good, and what the checks so far
    made of each: the columns stay aligned as the checks refuse records."""

    def __init__(self, objs: list[dict[str, Any]]) -> None:
        self.objs = objs
        #: the record (its index in the call) of each row.
        self.at = list(range(len(objs)))
        #: one value per row of each check so far: ts, labels, each single's numbers, each dense
        #: feature's values.
        self.columns: list[list[Any]] = []
        #: each bag's numbers, all rows' in a row, and how many each row has.
        self.bags: list[tuple[list[int], list[int]]] = []
        #: record -> the reason it was refused.
        self.refused: dict[int, str] = {}
        self._out: list[int] = []

    def get(self, name: str) -> list[Any]:
        """Each row's value of field `name` (None where absent)."""
        return list(map(dict.get, self.objs, repeat(name)))

    def refuse(self, row: int, exc: EventError) -> None:
        """Refuse `row` (dropped by the next `drop_refused`, so later checks never see it)."""
        self._out.append(row)
        self.refused[self.at[row]] = exc.reason

    def drop_refused(self) -> None:
        """Drop the rows refused since the last call from every column."""
        if not self._out:
            return
        keep = [True] * len(self.at)
        for row in self._out:
            keep[row] = False
        self._out = []
        self.at = list(compress(self.at, keep))
        self.objs = list(compress(self.objs, keep))
        self.columns = [list(compress(column, keep)) for column in self.columns]
        bags = []
        for numbers, lengths in self.bags:
            starts = list(accumulate(lengths, initial=0))
            kept = [numbers[starts[r] : starts[r + 1]] for r in compress(range(len(keep)), keep)]
            bags.append((list(chain.from_iterable(kept)), list(compress(lengths, keep))))
        self.bags = bags


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
        """Parse one record (`add_records` of one)."""
        self.add_records([value], [partition], [offset])

    def add_records(
        self,
        values: Sequence[bytes | None],
        partitions: Sequence[int],
        offsets: Sequence[int],
    ) -> None:
        """Parse records, in the order they were consumed; a bad one is counted by reason (its
        offset is consumed all the same).

        The outcome is that of taking each record through the rules of `schemas.events` one by
        one (`event_object`, `event_key`, `event_bag`, `event_number`): the same good events,
        numbers and reasons. But each check runs over the whole batch's column of that field
        at C speed (`map`, `set`, `min`, dict lookups), in the order of the rules, and only the
        values it does not pass (a new key, an int `ts`, a bad value) go through the rule one by
        one; a record refused by one check is dropped before the next, so no later check sees
        it, as no later rule sees a bad event. Measured on MovieLens events: 6.7 us an event
        one by one, ~1.8 us so (docs/BENCHMARKS.md, live training).
        """
        if not values:
            return
        self._ends.update(zip(partitions, [offset + 1 for offset in offsets], strict=True))
        objs = event_objects(values)
        rows = _Rows(objs)  # type: ignore[arg-type]  # the Nones are replaced just below
        if None in objs:  # a record the C decoder does not read: the strict rule's object or reason
            for r, obj in enumerate(objs):
                if obj is None:
                    try:
                        objs[r] = event_json(values[r])
                    except EventError as exc:
                        rows.refuse(r, exc)
            rows.drop_refused()
        self._time_and_label(rows)
        for column in self._singles:
            self._single(rows, column)
        for column in self._bags:
            self._bag_column(rows, column)
        for name in self.fields.dense:
            self._dense_column(rows, name)
        self._append(rows, partitions, offsets)

    def _time_and_label(self, rows: _Rows) -> None:
        ts = rows.get("ts")
        # JSON has no NaN (both decoders refuse it), so min and max bound every value.
        if ts and not (set(map(type, ts)) <= _FLOAT and min(ts) >= 0.0 and max(ts) < math.inf):
            for r, value in enumerate(ts):
                if type(value) is not float or not 0.0 <= value < math.inf:
                    try:
                        ts[r] = event_time(value)
                    except EventError as exc:
                        rows.refuse(r, exc)
        rows.columns.append(ts)
        rows.drop_refused()
        labels = rows.get("label")
        if labels and not (
            set(map(type, labels)) <= _FLOAT and min(labels) >= 0.0 and max(labels) <= 1.0
        ):
            threshold = self.fields.rating_threshold
            for r, value in enumerate(labels):
                if type(value) is not float or not 0.0 <= value <= 1.0:
                    try:
                        labels[r] = event_label(rows.objs[r], threshold)
                    except EventError as exc:
                        rows.refuse(r, exc)
        rows.columns.append(labels)
        rows.drop_refused()

    @staticmethod
    def _single(rows: _Rows, column: _Column) -> None:
        values = rows.get(column.name)
        find = column.index.get
        if set(map(type, values)) <= _SINGLE_TYPES:
            numbers = list(map(find, values, repeat(-2)))
        else:
            numbers = [find(v, -2) if type(v) in _SINGLE_TYPES else -2 for v in values]
        for r in _misses(numbers):  # a new key, or a value that is no id: by the key rule
            value = values[r]
            # A key new in this batch misses at each of its occurrences: numbered at the first.
            found = find(value, -2) if type(value) in _SINGLE_TYPES else -2
            if found != -2:
                numbers[r] = found
                continue
            try:
                numbers[r] = column.number(value)
            except EventError as exc:
                rows.refuse(r, exc)
        rows.columns.append(numbers)
        rows.drop_refused()

    def _bag_column(self, rows: _Rows, column: _Column) -> None:
        values = rows.get(column.name)
        numbers: list[int] = []
        lengths: list[int] = []
        kinds = set(map(type, values))
        known = kinds <= _BAG_TYPES
        if known:
            bags = [() if v is None else v for v in values] if type(None) in kinds else values
            lengths = list(map(len, bags))
            known = not lengths or max(lengths) <= MAX_BAG_IDS
        if known:
            ids = list(chain.from_iterable(bags))
            known = set(map(type, ids)) <= _BAG_ID_TYPES
        if known:
            numbers = list(map(column.index.get, ids, repeat(-2)))
            known = -2 not in numbers
        if not known:  # a new key or a bad value: each bag by the rule
            each: list[list[int]] = []
            for r, value in enumerate(values):
                try:
                    each.append(self._bag(column, value))
                except EventError as exc:
                    rows.refuse(r, exc)
                    each.append([])
            numbers = list(chain.from_iterable(each))
            lengths = list(map(len, each))
        rows.bags.append((numbers, lengths))
        rows.drop_refused()

    @staticmethod
    def _dense_column(rows: _Rows, name: str) -> None:
        values = rows.get(name)
        top = sys.float_info.max
        if values and not (
            set(map(type, values)) <= _FLOAT and -top <= min(values) and max(values) <= top
        ):
            for r, value in enumerate(values):
                try:
                    values[r] = _dense_value(value, name)
                except EventError as exc:
                    rows.refuse(r, exc)
        rows.columns.append(values)
        rows.drop_refused()

    def _append(self, rows: _Rows, partitions: Sequence[int], offsets: Sequence[int]) -> None:
        """The rows left (good events) onto the batch, and the refused records' reasons."""
        ts, labels, *rest = rows.columns
        singles, dense = rest[: len(self._singles)], rest[len(self._singles) :]
        self._ts.extend(ts)
        self._labels.extend(labels)
        if rows.refused:
            self._partitions.extend(map(partitions.__getitem__, rows.at))
            self._offsets.extend(map(offsets.__getitem__, rows.at))
            for record in sorted(rows.refused):
                self._bad.append((rows.refused[record], partitions[record], offsets[record]))
        else:
            self._partitions.extend(partitions)
            self._offsets.extend(offsets)
        for column, numbers in zip(self._singles, singles, strict=True):
            column.inverse.extend(numbers)
        for column, (numbers, lengths) in zip(self._bags, rows.bags, strict=True):
            column.inverse.extend(numbers)
            column.splits.extend(islice(accumulate(lengths, initial=column.splits[-1]), 1, None))
        if dense:
            self._dense.extend(chain.from_iterable(zip(*dense, strict=True)))

    @staticmethod
    def _bag(column: _Column, value: Any) -> list[int]:
        """One bag's numbers by the rule (event_bag's, the keys numbered as they come)."""
        if value is None:
            return []
        if type(value) is list and len(value) <= MAX_BAG_IDS:
            find = column.index.get
            numbers = [find(v, -2) if type(v) in _BAG_ID_TYPES else -2 for v in value]
            if -2 not in numbers:
                return numbers
            numbers = [column.number(v) for v in value]
            if -1 not in numbers:
                return numbers
        # Not a list, too long, or holding a null: event_bag raises the reason.
        return [column.number(v) for v in event_bag(value, column.name)]

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


def _misses(numbers: list[int]) -> Iterator[int]:
    """The positions of -2 (not found) in `numbers`, found at C speed (`list.index`); a miss
    replaced while iterating is not seen again, one left -2 (refused) is passed over."""
    at = -1
    while True:
        try:
            at = numbers.index(-2, at + 1)
        except ValueError:
            return
        yield at


def _dense_value(value: Any, name: str) -> float:
    """A dense feature's value, NaN when missing; EventError("bad_dense") (event_number)."""
    if type(value) is float and math.isfinite(value):  # the common case
        return value
    number = event_number(value, name)
    return math.nan if number is None else number
