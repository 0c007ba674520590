"""Which row each raw id of a batch trains: admission, eviction and counting over an `IdMap`.

    space = IdSpace(IdMap(100_000), IdSpacePolicy(admit_after=2, evict_after_s=86_400),
                    reset_rows=row_reset)
    space.learn(["u1", "u2"])                  # numbers 0 and 1 name these ids
    mapped = space.map(numbers, ts)            # rows and prior counts, one per occurrence

A batch names each occurrence of a feature's ids by a number (-1 for no id; the reader numbers
the keys, trainer/streams/event_columns.py); `ts` is each occurrence's event time. For each
occurrence `map` returns the row it trains and its prior count (the id's count before this
occurrence: the `*_prior_log` input, publisher/live_features.py), and counts the occurrence.

Dynamic map (the default), docs/FORMAT.md section 7:
- an id gets a row at its `admit_after`-th occurrence (1: the first); until then, and for a
  missing id, the occurrence trains UNKNOWN_ROW with prior count 0. The occurrences of ids
  without a row are counted in a `FrequencySketch` (trainer/admission.py: a count-min sketch of
  fixed memory, `nbytes`, however many ids a stream invents), not part of a checkpoint:
  after a resume an id not yet admitted starts counting again.
- cold start (`cold_start`, the default): the occurrence at which an id is admitted still
  trains UNKNOWN_ROW (and counts on the id's new row, so the next one has prior count 1), so
  the unknown row is trained by exactly the events a server scores with it: those of an id
  seen for the first time. The id's own row trains from its next occurrence.
- ids whose newest event is older than `evict_after_s` of EVENT time (the stream clock, never
  moved by one event: trainer/event_clock.py) are evicted, checked every eighth of that span.
- a full table admits an id only if it is seen more often than the row it would take (TinyLFU
  admission): the victim is, of the 1/64 of the table least recently seen (by `last_seen`) and
  not used by this batch, the id with the fewest recent occurrences (counted per row, halved
  with the sketch); the new id is admitted if its sketch estimate beats that count and 1 (an
  id seen once lately never takes a held row), else its occurrences train UNKNOWN_ROW and
  count as `refused`. So a flood of one-off ids cannot take the rows of ids seen again and
  again, and a new id seen repeatedly still gets in. The recent
  counts are not checkpointed either: a resume starts them at the rows' counts (capped at 255),
  so a resumed run may admit differently from an uninterrupted one once its table is full.
- an evicted row is freed in the map and handed to `reset_rows` (trainer/row_reset.py: the
  row's weights and optimizer state are re-initialised and the row is marked dirty), so its
  old values never leak into the id that gets it next and the next version carries it.
Hash mode: an id's row is `hashed_rows` (no admission, no eviction); `collided_rows` counts the
rows that more than one id has landed on, `collision_events` the occurrences of an id other
than its row's first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from publisher.id_map import UNKNOWN_ROW, IdMap, hashed_rows, key_hashes
from trainer.admission import FrequencySketch
from trainer.event_clock import DEFAULT_MAX_LEAD_S

log = logging.getLogger(__name__)

Rows = npt.NDArray[np.int64]
#: share of a full table evicted at once (its least recently seen ids).
EVICT_SHARE = 64
#: time-based eviction runs each time the stream clock moves by this share of the span.
SWEEP_SHARE = 8
ADMISSIONS = ("frequency", "recency")


@dataclass(frozen=True)
class IdSpacePolicy:
    """When ids get rows and lose them (see the module docstring)."""

    admit_after: int = 1
    evict_after_s: float | None = None
    #: the admitting occurrence trains the unknown row (the module docstring).
    cold_start: bool = True
    #: who gets a full table's row: "frequency" (an id seen more often than the victim, the
    #: module docstring) or "recency" (any new id: the least recently seen id makes way).
    admission: str = "frequency"
    #: how far an event's time may run ahead of the reader's and the stream's clocks
    #: (docs/FORMAT.md section 8.1).
    max_event_lead_s: float = DEFAULT_MAX_LEAD_S

    def __post_init__(self) -> None:
        if self.admit_after < 1:
            raise ValueError(f"admit_after must be >= 1, got {self.admit_after}")
        if self.evict_after_s is not None and not self.evict_after_s > 0:
            raise ValueError(f"evict_after_s must be > 0, got {self.evict_after_s}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if not self.max_event_lead_s >= 0:
            raise ValueError(f"max_event_lead_s must be >= 0, got {self.max_event_lead_s}")


@dataclass(frozen=True)
class MappedIds:
    """Per occurrence: the row it trains and its prior count."""

    rows: Rows
    prior: npt.NDArray[np.int64]


@dataclass(frozen=True)
class IdRequest:
    """One feature's occurrences of a batch: numbers of the keys its id space (or
    `LocalIds`) was told by `learn` (-1: no id), their event times, and whether their prior
    counts are wanted."""

    feature: str
    numbers: npt.NDArray[np.int32]
    ts: npt.NDArray[np.float64]
    prior: bool


class LocalIds:
    """A batch's features mapped by this process's id spaces: the one-process `IdMapper`
    (a job of N ranks maps with trainer/sharded/owned_ids.py's `OwnedIds`)."""

    def __init__(self, spaces: Mapping[str, IdSpace]) -> None:
        self.spaces = spaces

    def learn(self, feature: str, keys: Sequence[str]) -> None:
        self.spaces[feature].learn(keys)

    def renumber(self) -> None:
        for space in self.spaces.values():
            space.renumber()

    def map(self, requests: Sequence[IdRequest], now: float | None) -> list[MappedIds]:
        return [
            self.spaces[r.feature].map(r.numbers, r.ts, prior=r.prior, now=now) for r in requests
        ]

    def idle(self) -> None:
        """A step without events (nothing to do in one process)."""


class IdMapper(Protocol):
    """How a stream maps its batches' ids: `LocalIds`, or a job's `OwnedIds`."""

    def learn(self, feature: str, keys: Sequence[str]) -> None: ...

    def renumber(self) -> None: ...

    def map(self, requests: Sequence[IdRequest], now: float | None) -> list[MappedIds]: ...

    def idle(self) -> None: ...


class IdSpace:
    """One table's id space: its `IdMap` and the policy that fills and empties it.

    Ids arrive as numbers (trainer/streams/event_columns.py): `learn(keys)` says which keys
    the next numbers name, `map(numbers, ts)` maps occurrences, `renumber()` forgets the
    numbering (a new reader process, or a numbering that started over). Number -> row is kept
    in an array that admissions and evictions update, so known ids map without a dict lookup.
    """

    def __init__(
        self,
        id_map: IdMap,
        policy: IdSpacePolicy = IdSpacePolicy(),
        *,
        reset_rows: Callable[[Rows], None] | None = None,
        mark_rows: Callable[[Rows], None] | None = None,
        own_rows: tuple[int, int] | None = None,
    ) -> None:
        """`own_rows`: the rows [start, end) this space may give (a rank's shard of the
        table in a job of N ranks, docs/FORMAT.md 7.2; its map holds only the ids it owns);
        None: every row."""
        self.id_map = id_map
        start, end = own_rows if own_rows is not None else (0, id_map.rows)
        if not 0 <= start < end <= id_map.rows:
            raise ValueError(f"own_rows [{start}, {end}) is not within {id_map.rows} rows")
        self.own_rows = (start, end)
        #: ids this space can hold at once: its rows but the unknown row.
        self.capacity = 0 if id_map.hashed else end - start - int(start <= UNKNOWN_ROW)
        self.policy = policy
        self.reset_rows = reset_rows
        #: marks rows dirty: those given to an id (its map entry changed; with cold start the
        #: batch may not look the row up).
        self.mark_rows = mark_rows
        self.admitted = 0
        self.evicted = 0
        self.collided_rows = 0
        self.collision_events = 0
        #: occurrences that found the table full and lost to its victim (trained UNKNOWN_ROW).
        self.refused = 0
        #: occurrences of ids without a row; None in hash mode.
        self.sketch = None if id_map.hashed else FrequencySketch.for_capacity(max(1, self.capacity))
        #: per row: occurrences of its id lately (halved with the sketch).
        self._recent = np.zeros(0 if id_map.hashed else id_map.rows, dtype=np.int64)
        #: the next victims of a full table (lowest recent count last) and their last_seen then.
        self._victims: list[int] = []
        self._victim_seen: dict[int, float] = {}
        self._watermark = 0.0
        self._next_sweep = 0.0
        hashed = id_map.hashed
        self._owner: list[str | None] = [None] * id_map.rows if hashed else []
        self._collided = np.zeros(id_map.rows if hashed else 0, dtype=np.bool_)
        self._held = np.zeros(id_map.rows, dtype=np.bool_)
        self._free: list[int] = []
        # number -> key, number -> row (UNKNOWN_ROW: none), row -> number (-1: none known),
        # number -> not its hashed row's first id.
        self._keys: list[str] = []
        self._number_rows = np.zeros(0, dtype=np.int64)
        self._foreign = np.zeros(0, dtype=np.bool_)
        self._row_numbers = np.full(id_map.rows, -1, dtype=np.int64)
        self.sync()

    def sync(self) -> None:
        """Re-read the map (after it was loaded from a checkpoint): which rows are held, and
        the rows of the numbered keys."""
        if not self.id_map.hashed:
            free = self.id_map.free_rows()
            self._held[:] = True
            self._held[UNKNOWN_ROW] = False
            self._held[free] = False
            start, end = self.own_rows
            if (start, end) != (0, self.id_map.rows):  # the rows this space may give
                free = free[(free >= start) & (free < end)]
            self._free = free[::-1].tolist()  # a stack: the lowest row is handed out first
            self._recent[:] = np.where(self._held, np.minimum(self.id_map.counts, 255), 0)
            self._victims, self._victim_seen = [], {}
        keys = self._keys
        self.renumber()
        self.learn(keys)

    @property
    def held(self) -> int:
        """Ids holding a row."""
        return len(self.id_map)

    def renumber(self) -> None:
        """Forget which keys the numbers name."""
        self._keys = []
        self._number_rows = np.zeros(0, dtype=np.int64)
        self._foreign = np.zeros(0, dtype=np.bool_)
        self._row_numbers[:] = -1

    def learn(self, keys: Sequence[str]) -> None:
        """The next numbers (counting on from the last) name `keys`."""
        if not keys:
            return
        first = len(self._keys)
        self._keys.extend(keys)
        if self.id_map.hashed:
            rows = hashed_rows(keys, self.id_map.rows)
            foreign = np.fromiter(
                (self._note_owner(k, r) for k, r in zip(keys, rows.tolist(), strict=True)),
                dtype=np.bool_,
                count=len(keys),
            )
            self._foreign = np.concatenate([self._foreign, foreign])
        else:
            rows = self.id_map.lookup(keys)
            known = np.flatnonzero(rows != UNKNOWN_ROW)
            self._row_numbers[rows[known]] = first + known
        self._number_rows = np.concatenate([self._number_rows, rows])

    def map(
        self,
        numbers: npt.NDArray[np.int32],
        ts: npt.NDArray[np.float64],
        *,
        prior: bool = True,
        now: float | None = None,
    ) -> MappedIds:
        """Rows (and, with `prior`, prior counts) of the occurrences `numbers` (-1: no id) at
        event times `ts`; counts them in the map (see the module docstring). `now`: the stream
        clock eviction is judged against (trainer/event_clock.py; None: the batch's median
        event time), never the newest event's, which one hostile event could set."""
        if now is None and len(ts):
            now = float(np.median(ts))
        if now is not None:
            self._watermark = max(self._watermark, now)
        hashed = self.id_map.hashed
        if not hashed and self.policy.evict_after_s is not None:
            self._sweep()
        present = numbers >= 0
        every = bool(present.all())
        if every:  # the common case: fewer array passes
            rows = self._number_rows[numbers]
        else:
            rows = np.full(len(numbers), UNKNOWN_ROW, dtype=np.int64)
            rows[present] = self._number_rows[numbers[present]]
        if hashed:
            seen = numbers if every else numbers[present]
            self.collision_events += int(np.count_nonzero(self._foreign[seen]))
        else:
            unknown = rows == UNKNOWN_ROW
            if unknown.any():
                new = np.flatnonzero(unknown & present)
                if len(new):
                    self._admit(numbers, new, rows, ts)
        mapped = MappedIds(rows, self._count(rows, present, ts, prior))
        if self.sketch is not None and self.sketch.tick(int(np.count_nonzero(present))):
            self._recent >>= 1
        return mapped

    # --- dynamic map ------------------------------------------------------------------------

    def _admit(
        self, numbers: npt.NDArray[np.int32], new: Rows, rows: Rows, ts: npt.NDArray[np.float64]
    ) -> None:
        """Give rows to the ids of the occurrences `new` that reach admission in this batch
        (and win their row, if the table is full), and point their occurrences at their row:
        from the admitting one on, or with `cold_start` from the one after it."""
        assert self.sketch is not None
        need = self.policy.admit_after
        cold = self.policy.cold_start
        occ = new[np.argsort(numbers[new], kind="stable")]  # grouped by id, in batch order
        owners = numbers[occ]
        starts = np.flatnonzero(_group_starts(owners))
        ends = np.append(starts[1:], len(occ))
        # Only ids without a row are hashed: one key per id of the batch, repeated per occurrence.
        hashes = key_hashes([self._keys[n] for n in owners[starts].tolist()])
        estimates = self.sketch.add(np.repeat(hashes, ends - starts))  # after this batch
        in_use = np.zeros(self.id_map.rows, dtype=np.bool_)
        in_use[rows] = True
        reset: list[int] = []
        given: list[int] = []
        counts, last_seen = self.id_map.counts, self.id_map.last_seen
        for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
            estimate = int(estimates[lo])
            seen_before = max(0, estimate - (hi - lo))
            first = max(0, need - 1 - seen_before)  # the occurrence that is admitted
            if first >= hi - lo:
                continue
            row = self._take_row(in_use, estimate, reset)
            if row is None:  # every row is used by this batch, or the victim won
                self.refused += hi - lo - first
                continue
            number = int(owners[lo])
            self.id_map.assign(self._keys[number], row)
            self._held[row] = True
            self._number_rows[number] = row
            self._row_numbers[row] = number
            in_use[row] = True
            self.admitted += 1
            given.append(row)
            # Occurrences until now; without cold start `_count` counts the admitting one.
            self._recent[row] = seen_before + first + int(cold)
            if cold:  # the admitting occurrence trains the unknown row, but counts here
                admitting = int(occ[lo + first])
                counts[row], last_seen[row] = 1, ts[admitting]
                first += 1
            rows[occ[lo + first : hi]] = row
        if reset and self.reset_rows is not None:
            self.reset_rows(np.sort(np.asarray(reset, dtype=np.int64)))
        if given and self.mark_rows is not None:
            self.mark_rows(np.sort(np.asarray(given, dtype=np.int64)))

    def _take_row(
        self, in_use: npt.NDArray[np.bool_], estimate: int, reset: list[int]
    ) -> int | None:
        """A row for an id seen `estimate` times lately: a free one, or the victim's if the id
        beats it (the victim is released, its row appended to `reset`); None if none."""
        if self._free:
            return self._free.pop()
        victim = self._victim(in_use)
        if victim is None:
            return None
        if self.policy.admission == "frequency" and estimate <= max(1, self._recent[victim]):
            return None
        self._victims.pop()
        self._release(np.asarray([victim], dtype=np.int64))
        self._free.pop()
        reset.append(victim)
        return victim

    def _victim(self, in_use: npt.NDArray[np.bool_]) -> int | None:
        """The row a full table gives up next (the module docstring), not used by this batch
        and not seen since it was chosen; None if every held row is in use."""
        held, last_seen = self._held, self.id_map.last_seen
        for attempt in range(2):
            victims, seen = self._victims, self._victim_seen
            while victims:
                row = victims[-1]
                if held[row] and not in_use[row] and last_seen[row] == seen[row]:
                    return row
                victims.pop()
            if attempt:
                return None
            candidates = np.flatnonzero(held & ~in_use)
            if not len(candidates):
                return None
            n = min(len(candidates), max(1, self.capacity // EVICT_SHARE))
            if n < len(candidates):
                candidates = candidates[np.argpartition(last_seen[candidates], n - 1)[:n]]
            # Popped from the end: the fewest recent occurrences, then the least recently seen
            # (by recency alone under "recency" admission).
            if self.policy.admission == "frequency":
                order = np.lexsort((last_seen[candidates], self._recent[candidates]))[::-1]
            else:
                order = np.argsort(last_seen[candidates], kind="stable")[::-1]
            chosen = candidates[order]
            self._victims = chosen.tolist()
            self._victim_seen = dict(zip(self._victims, last_seen[chosen].tolist(), strict=True))
        return None

    def _sweep(self) -> None:
        """Evict the ids unseen for `evict_after_s` of event time (every eighth of it)."""
        span = self.policy.evict_after_s
        if span is None or self._watermark < self._next_sweep:
            return
        self._next_sweep = self._watermark + span / SWEEP_SHARE
        stale = np.flatnonzero(self._held & (self.id_map.last_seen < self._watermark - span))
        if len(stale):
            self._evict(stale)

    def _evict(self, rows: Rows) -> None:
        rows = np.sort(rows)
        self._release(rows)
        if self.reset_rows is not None:
            self.reset_rows(rows)

    def _release(self, rows: Rows) -> None:
        """Free `rows` in the map and the numbering (sorted rows; their reset is the caller's)."""
        for row in rows.tolist():
            self.id_map.release(row)
        self._held[rows] = False
        self._recent[rows] = 0
        numbered = self._row_numbers[rows]
        self._number_rows[numbered[numbered >= 0]] = UNKNOWN_ROW
        self._row_numbers[rows] = -1
        self._free.extend(rows[::-1].tolist())
        self.evicted += len(rows)

    # --- hash mode --------------------------------------------------------------------------

    def _note_owner(self, key: str, row: int) -> bool:
        """Whether `key` is not the first id seen on its hashed `row` (a collision)."""
        owner = self._owner[row]
        if owner is None:
            self._owner[row] = key
            return False
        if owner == key:
            return False
        if not self._collided[row]:
            self._collided[row] = True
            self.collided_rows += 1
        return True

    # --- counts -----------------------------------------------------------------------------

    def _count(
        self,
        rows: Rows,
        present: npt.NDArray[np.bool_],
        ts: npt.NDArray[np.float64],
        want_prior: bool,
    ) -> npt.NDArray[np.int64]:
        """Count each occurrence on its row; returns each one's prior count (0 on the unknown
        row of a dynamic map, which counts nothing; all 0 without `want_prior`)."""
        prior = np.zeros(len(rows), dtype=np.int64)
        counted = present if self.id_map.hashed else rows != UNKNOWN_ROW
        every = bool(counted.all())
        r, t = (rows, ts) if every else (rows[counted], ts[counted])
        if not len(r):
            return prior
        counts = self.id_map.counts
        if want_prior:
            # The prior count of an occurrence: its row's count before the batch plus the
            # occurrences of the row earlier in the batch (a stable sort keeps batch order).
            order = np.argsort(r, kind="stable")
            sorted_rows = r[order]
            starts = np.flatnonzero(_group_starts(sorted_rows))
            sizes = np.diff(np.append(starts, len(r)))
            rank = np.empty(len(r), dtype=np.int64)
            rank[order] = np.arange(len(r)) - np.repeat(starts, sizes)
            if every:
                prior = counts[r] + rank
            else:
                prior[counted] = counts[r] + rank
        np.add.at(counts, r, 1)  # numpy >= 2: as fast as a bincount for a batch
        if not self.id_map.hashed:
            np.add.at(self._recent, r, 1)
        np.maximum.at(self.id_map.last_seen, r, t)
        return prior


def _group_starts(values: npt.NDArray[np.integer]) -> npt.NDArray[np.bool_]:
    """True where a run of equal values starts (`values` grouped, e.g. sorted)."""
    starts = np.empty(len(values), dtype=np.bool_)
    if len(values):
        starts[0] = True
        np.not_equal(values[1:], values[:-1], out=starts[1:])
    return starts
