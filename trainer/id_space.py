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
  missing id, the occurrence trains UNKNOWN_ROW with prior count 0. The occurrences counted
  towards admission are kept for at most `max_pending` ids (the oldest are forgotten) and are
  not part of a checkpoint: after a resume an id not yet admitted starts counting again.
- ids whose newest event is older than `evict_after_s` of EVENT time (the stream clock, never
  moved by one event: trainer/event_clock.py) are evicted, checked every eighth of that span;
  when an id needs a row and none is free, the least recently seen ids (by `last_seen`) that
  this batch does not use are evicted, 1/64 of the table at a time so that a full table does
  not scan its rows on every batch.
- an evicted row is freed in the map and handed to `reset_rows` (trainer/row_reset.py: the
  row's weights and optimizer state are re-initialised and the row is marked dirty), so its
  old values never leak into the id that gets it next and the next version carries it.
Hash mode: an id's row is `hashed_rows` (no admission, no eviction); `collided_rows` counts the
rows that more than one id has landed on, `collision_events` the occurrences of an id other
than its row's first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from publisher.id_map import UNKNOWN_ROW, IdMap, hashed_rows
from trainer.event_clock import DEFAULT_MAX_LEAD_S

log = logging.getLogger(__name__)

Rows = npt.NDArray[np.int64]
#: share of a full table evicted at once (its least recently seen ids).
EVICT_SHARE = 64
#: time-based eviction runs each time the stream clock moves by this share of the span.
SWEEP_SHARE = 8


@dataclass(frozen=True)
class IdSpacePolicy:
    """When ids get rows and lose them (see the module docstring)."""

    admit_after: int = 1
    evict_after_s: float | None = None
    max_pending: int = 1_000_000
    #: how far an event's time may run ahead of the reader's and the stream's clocks
    #: (docs/FORMAT.md section 8.1).
    max_event_lead_s: float = DEFAULT_MAX_LEAD_S

    def __post_init__(self) -> None:
        if self.admit_after < 1:
            raise ValueError(f"admit_after must be >= 1, got {self.admit_after}")
        if self.evict_after_s is not None and not self.evict_after_s > 0:
            raise ValueError(f"evict_after_s must be > 0, got {self.evict_after_s}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if not self.max_event_lead_s >= 0:
            raise ValueError(f"max_event_lead_s must be >= 0, got {self.max_event_lead_s}")


@dataclass(frozen=True)
class MappedIds:
    """Per occurrence: the row it trains and its prior count."""

    rows: Rows
    prior: npt.NDArray[np.int64]


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
    ) -> None:
        self.id_map = id_map
        self.policy = policy
        self.reset_rows = reset_rows
        self.admitted = 0
        self.evicted = 0
        self.collided_rows = 0
        self.collision_events = 0
        self._pending: dict[str, int] = {}
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
            self._free = free[::-1].tolist()  # a stack: the lowest row is handed out first
            self._pending.clear()
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
                    self._admit(numbers, new, rows)
        return MappedIds(rows, self._count(rows, present, ts, prior))

    # --- dynamic map ------------------------------------------------------------------------

    def _admit(self, numbers: npt.NDArray[np.int32], new: Rows, rows: Rows) -> None:
        """Give rows to the ids of the occurrences `new` that reach admission in this batch,
        and point their occurrences from that one on at their row."""
        need = self.policy.admit_after
        occ = new[np.argsort(numbers[new], kind="stable")]  # grouped by id, in batch order
        owners = numbers[occ]
        starts = np.flatnonzero(_group_starts(owners))
        ends = np.append(starts[1:], len(occ))
        in_use = np.zeros(self.id_map.rows, dtype=np.bool_)
        in_use[rows] = True
        for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
            number = int(owners[lo])
            key = self._keys[number]
            seen_before = self._pending.get(key, 0)
            first = max(0, need - 1 - seen_before)  # the occurrence that is admitted
            if first >= hi - lo:
                self._remember(key, seen_before + hi - lo)
                continue
            row = self._take_row(in_use)
            if row is None:  # every row is used by this batch: stay pending
                self._remember(key, seen_before + hi - lo)
                continue
            self._pending.pop(key, None)
            self.id_map.assign(key, row)
            self._held[row] = True
            self._number_rows[number] = row
            self._row_numbers[row] = number
            in_use[row] = True
            self.admitted += 1
            rows[occ[lo + first : hi]] = row

    def _remember(self, key: str, seen: int) -> None:
        pending = self._pending
        pending.pop(key, None)
        pending[key] = seen  # newest last: the oldest is forgotten first
        while len(pending) > self.policy.max_pending:
            del pending[next(iter(pending))]

    def _take_row(self, in_use: npt.NDArray[np.bool_]) -> int | None:
        if not self._free:
            self._evict_least_recent(in_use)
        return self._free.pop() if self._free else None

    def _evict_least_recent(self, in_use: npt.NDArray[np.bool_]) -> None:
        candidates = np.flatnonzero(self._held & ~in_use)
        if not len(candidates):
            return
        n = min(len(candidates), max(1, self.id_map.capacity // EVICT_SHARE))
        if n < len(candidates):
            candidates = candidates[np.argpartition(self.id_map.last_seen[candidates], n - 1)[:n]]
        self._evict(candidates)

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
        for row in rows.tolist():
            self.id_map.release(row)
        self._held[rows] = False
        numbered = self._row_numbers[rows]
        self._number_rows[numbered[numbered >= 0]] = UNKNOWN_ROW
        self._row_numbers[rows] = -1
        self._free.extend(rows[::-1].tolist())
        self.evicted += len(rows)
        if self.reset_rows is not None:
            self.reset_rows(rows)

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
        np.maximum.at(self.id_map.last_seen, r, t)
        return prior


def _group_starts(values: npt.NDArray[np.integer]) -> npt.NDArray[np.bool_]:
    """True where a run of equal values starts (`values` grouped, e.g. sorted)."""
    starts = np.empty(len(values), dtype=np.bool_)
    if len(values):
        starts[0] = True
        np.not_equal(values[1:], values[:-1], out=starts[1:])
    return starts
