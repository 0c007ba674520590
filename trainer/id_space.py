"""Which row each raw id of a batch trains: admission, eviction and counting over an `IdMap`.

    space = IdSpace(IdMap(100_000), IdSpacePolicy(admit_after=2, evict_after_s=86_400),
                    reset_rows=row_reset)
    mapped = space.map(keys, inverse, ts)      # rows and prior counts, one per occurrence

A batch names each feature's ids as `keys` (its distinct raw ids) and `inverse` (per occurrence,
the index of its key, or -1 for no id); `ts` is each occurrence's event time. For each occurrence
`map` returns the row it trains and its prior count (the id's count before this occurrence: the
`*_prior_log` input, publisher/live_features.py), and counts the occurrence in the map.

Dynamic map (the default), docs/FORMAT.md section 7:
- an id gets a row at its `admit_after`-th occurrence (1: the first); until then, and for a
  missing id, the occurrence trains UNKNOWN_ROW with prior count 0. The occurrences counted
  towards admission are kept for at most `max_pending` ids (the oldest are forgotten) and are
  not part of a checkpoint: after a resume an id not yet admitted starts counting again.
- ids whose newest event is older than `evict_after_s` of EVENT time (the newest event time
  seen) are evicted, checked every eighth of that span; when an id needs a row and none is
  free, the least recently seen ids (by `last_seen`) that this batch does not use are evicted,
  1/64 of the table at a time so that a full table does not scan its rows on every batch.
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

log = logging.getLogger(__name__)

Rows = npt.NDArray[np.int64]
#: share of a full table evicted at once (its least recently seen ids).
EVICT_SHARE = 64
#: time-based eviction runs each time the newest event time moves by this share of the span.
SWEEP_SHARE = 8
#: distinct keys whose hashed row is cached in hash mode (the cache is dropped when full).
HASH_CACHE = 1 << 20


@dataclass(frozen=True)
class IdSpacePolicy:
    """When ids get rows and lose them (see the module docstring)."""

    admit_after: int = 1
    evict_after_s: float | None = None
    max_pending: int = 1_000_000

    def __post_init__(self) -> None:
        if self.admit_after < 1:
            raise ValueError(f"admit_after must be >= 1, got {self.admit_after}")
        if self.evict_after_s is not None and not self.evict_after_s > 0:
            raise ValueError(f"evict_after_s must be > 0, got {self.evict_after_s}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")


@dataclass(frozen=True)
class MappedIds:
    """Per occurrence: the row it trains and its prior count."""

    rows: Rows
    prior: npt.NDArray[np.int64]


class IdSpace:
    """One table's id space: its `IdMap` and the policy that fills and empties it."""

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
        self._hash_cache: dict[str, int] = {}
        self._owner: list[str | None] = [None] * id_map.rows if id_map.hashed else []
        self._collided = np.zeros(id_map.rows if id_map.hashed else 0, dtype=np.bool_)
        self._held = np.zeros(id_map.rows, dtype=np.bool_)
        self._free: list[int] = []
        self.sync()

    def sync(self) -> None:
        """Re-read which rows are held (after the map was loaded from a checkpoint)."""
        if self.id_map.hashed:
            return
        free = self.id_map.free_rows()
        self._held[:] = True
        self._held[UNKNOWN_ROW] = False
        self._held[free] = False
        self._free = free[::-1].tolist()  # a stack: the lowest row is handed out first
        self._pending.clear()

    @property
    def held(self) -> int:
        """Ids holding a row."""
        return len(self.id_map)

    def map(
        self, keys: Sequence[str], inverse: npt.NDArray[np.int32], ts: npt.NDArray[np.float64]
    ) -> MappedIds:
        """Rows and prior counts of the occurrences `inverse` (indices into `keys`, -1 for no
        id) at event times `ts`; counts them in the map (see the module docstring)."""
        if len(ts):
            self._watermark = max(self._watermark, float(ts.max()))
        if self.id_map.hashed:
            key_rows = self._hashed(keys)
        else:
            self._sweep()
            key_rows = self.id_map.lookup(keys)
        occurrences = len(inverse)
        present = inverse >= 0
        rows = np.full(occurrences, UNKNOWN_ROW, dtype=np.int64)
        rows[present] = key_rows[inverse[present]]
        if self.id_map.hashed:
            owner = self._owner
            foreign = np.fromiter(
                (owner[r] != k for k, r in zip(keys, key_rows.tolist(), strict=True)),
                dtype=np.bool_,
                count=len(keys),
            )
            self.collision_events += int(foreign[inverse[present]].sum())
        else:
            new = np.flatnonzero(key_rows == UNKNOWN_ROW)
            if len(new):
                self._admit(keys, new, key_rows, inverse, rows)
        return MappedIds(rows, self._count(rows, present, ts))

    # --- dynamic map ------------------------------------------------------------------------

    def _admit(
        self,
        keys: Sequence[str],
        new: npt.NDArray[np.int64],
        key_rows: Rows,
        inverse: npt.NDArray[np.int32],
        rows: Rows,
    ) -> None:
        """Give rows to the ids of `new` (indices into `keys`) that reach admission in this
        batch, and point their occurrences from that one on at their row."""
        need = self.policy.admit_after
        # Occurrence positions of each new key, in batch order (stable sort).
        is_new = np.zeros(len(keys), dtype=np.bool_)
        is_new[new] = True
        occ = np.flatnonzero((inverse >= 0) & is_new[np.maximum(inverse, 0)])
        occ = occ[np.argsort(inverse[occ], kind="stable")]
        owners = inverse[occ]
        starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
        ends = np.r_[starts[1:], len(occ)]
        in_use = np.zeros(self.id_map.rows, dtype=np.bool_)
        in_use[key_rows] = True
        for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
            index = int(owners[lo])
            key = keys[index]
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
        self._free.extend(rows[::-1].tolist())
        self.evicted += len(rows)
        if self.reset_rows is not None:
            self.reset_rows(rows)

    # --- hash mode --------------------------------------------------------------------------

    def _hashed(self, keys: Sequence[str]) -> Rows:
        cache = self._hash_cache
        missing = [k for k in keys if k not in cache]
        if missing:
            if len(cache) + len(missing) > HASH_CACHE:
                cache.clear()
            for key, row in zip(
                missing, hashed_rows(missing, self.id_map.rows).tolist(), strict=True
            ):
                cache[key] = row
                self._note_owner(key, row)
        return np.fromiter((cache[k] for k in keys), dtype=np.int64, count=len(keys))

    def _note_owner(self, key: str, row: int) -> None:
        owner = self._owner[row]
        if owner is None:
            self._owner[row] = key
        elif owner != key and not self._collided[row]:
            self._collided[row] = True
            self.collided_rows += 1

    # --- counts -----------------------------------------------------------------------------

    def _count(
        self, rows: Rows, present: npt.NDArray[np.bool_], ts: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.int64]:
        """Count each occurrence on its row; returns each one's prior count (0 on the unknown
        row of a dynamic map, which counts nothing)."""
        prior = np.zeros(len(rows), dtype=np.int64)
        counted = present if self.id_map.hashed else rows != UNKNOWN_ROW
        occ = np.flatnonzero(counted)
        if not len(occ):
            return prior
        order = occ[np.argsort(rows[occ], kind="stable")]
        sorted_rows = rows[order]
        starts = np.r_[True, sorted_rows[1:] != sorted_rows[:-1]]
        first = np.maximum.accumulate(np.where(starts, np.arange(len(order)), 0))
        counts, last_seen = self.id_map.counts, self.id_map.last_seen
        prior[order] = counts[sorted_rows] + (np.arange(len(order)) - first)
        np.add.at(counts, rows[occ], 1)
        np.maximum.at(last_seen, rows[occ], ts[occ])
        return prior
