"""Which raw id owns which row of an embedding table: the id map of an open id space.

A live event stream names users, items and category values by raw ids (JSON strings or
integers) that appear while training. With `--id-space dynamic` each table has an `IdMap`: an id
gets a row of its own when the trainer admits it (trainer/id_space.py decides when, and which
rows are evicted and reused); with `--id-space hash` rows are `hashed_rows(keys, rows)` and the map
holds per-row counts only (no keys). Either way the map is part of the model: every version
carries the id-map entries of exactly the rows its table blob carries (docs/FORMAT.md section 7),
so restore, resume and servers rebuild the map version-consistently with the rows.

Rules:
- A key is the id's text: a JSON integer is its decimal form, so `42` and `"42"` are one id.
  At most `MAX_KEY_BYTES` of UTF-8, not empty (`canonical_key`).
- In a dynamic map, row `UNKNOWN_ROW` (0) is never assigned: ids not (yet) admitted train it and
  are served by it. Rows 1 .. rows-1 hold admitted ids.
- Per row the map keeps `counts` (events seen for the row's id since it was assigned: the
  "prior count" feature) and `last_seen` (event time, unix seconds, of its newest event).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from schemas.errors import BadDataError
from schemas.id_map_blob import IdEntries, IdKeyError, id_key

UNKNOWN_ROW = 0
ID_SPACES = ("dynamic", "hash")


class IdMapError(BadDataError, ValueError):
    """An id, or id-map entries, that break the map's rules; the message says which."""


def canonical_key(value: object) -> str:
    """The map key of a raw id: a str as is, an int as its decimal text; IdMapError otherwise
    (the rule is schemas.id_map_blob.id_key's)."""
    try:
        return id_key(value)
    except IdKeyError as exc:
        raise IdMapError(str(exc)) from exc


def hashed_rows(keys: Iterable[str], rows: int) -> npt.NDArray[np.int64]:
    """Rows of `keys` in a hashed table of `rows` rows: blake2b-64 of the UTF-8 key, mod rows.

    Stable across processes and Python versions (unlike `hash()`), so trainer and servers agree.
    """
    out = [
        int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little") % rows
        for k in keys
    ]
    return np.asarray(out, dtype=np.int64)


class IdMap:
    """One table's id map (see the module docstring). Not thread-safe: one writer at a time;
    a server applies a version to a `copy()` and swaps it in with the rows."""

    def __init__(self, rows: int, *, hashed: bool = False) -> None:
        if rows < 1 or (not hashed and rows < 2):
            raise IdMapError(f"an id map needs at least {1 if hashed else 2} rows, got {rows}")
        self.rows = rows
        self.hashed = hashed
        self.counts = np.zeros(rows, dtype=np.int64)
        self.last_seen = np.zeros(rows, dtype=np.float64)
        self._row_of: dict[str, int] = {}
        self._key_of: list[str | None] = [None] * rows

    def __len__(self) -> int:
        """Ids that hold a row (0 in a hashed map)."""
        return len(self._row_of)

    @property
    def capacity(self) -> int:
        """How many ids can hold a row at once (every row but UNKNOWN_ROW)."""
        return 0 if self.hashed else self.rows - 1

    def row_of(self, key: str) -> int | None:
        """The row `key` holds, or None (a hashed map: its hashed row)."""
        if self.hashed:
            return int(hashed_rows([key], self.rows)[0])
        return self._row_of.get(key)

    def key_of(self, row: int) -> str | None:
        """The id holding `row`, or None when the row is free (always None when hashed)."""
        return self._key_of[row]

    def lookup(self, keys: Sequence[str]) -> npt.NDArray[np.int64]:
        """Rows of `keys`; in a dynamic map an id without a row gets UNKNOWN_ROW."""
        if self.hashed:
            return hashed_rows(keys, self.rows)
        get = self._row_of.get
        return np.fromiter((get(k, UNKNOWN_ROW) for k in keys), dtype=np.int64, count=len(keys))

    def free_rows(self) -> npt.NDArray[np.int64]:
        """Rows no id holds (UNKNOWN_ROW excluded), ascending."""
        if self.hashed:
            return np.zeros(0, dtype=np.int64)
        free = [r for r in range(1, self.rows) if self._key_of[r] is None]
        return np.asarray(free, dtype=np.int64)

    def assign(self, key: str, row: int) -> None:
        """Give the free `row` to the id `key` (which holds no row); counts start at 0."""
        if self.hashed:
            raise IdMapError("a hashed id map assigns no rows")
        if not 1 <= row < self.rows:
            raise IdMapError(f"row {row} is outside 1..{self.rows - 1}")
        if self._key_of[row] is not None:
            raise IdMapError(f"row {row} is held by another id")
        if key in self._row_of:
            raise IdMapError(f"id {key!r} already holds row {self._row_of[key]}")
        self._row_of[key] = row
        self._key_of[row] = key
        self.counts[row] = 0
        self.last_seen[row] = 0.0

    def release(self, row: int) -> str | None:
        """Free `row` (its id is evicted); returns the id that held it. Counts reset to 0."""
        key = self._key_of[row]
        if key is not None:
            del self._row_of[key]
            self._key_of[row] = None
        self.counts[row] = 0
        self.last_seen[row] = 0.0
        return key

    def entries(self, row_ids: npt.NDArray[np.int64]) -> IdEntries:
        """A copy of the state of `row_ids` (what a snapshot carries)."""
        keys = tuple(self._key_of[int(r)] or "" for r in row_ids)
        return IdEntries(
            np.fromiter((bool(k) for k in keys), dtype=np.bool_, count=len(keys)),
            self.counts[row_ids].copy(),
            self.last_seen[row_ids].copy(),
            keys,
        )

    def apply(self, row_ids: npt.NDArray[np.int64], entries: IdEntries) -> None:
        """Set the state of `row_ids` to `entries` (restore, follow). Checked first, so on
        IdMapError the map is unchanged: rows in range and unique, keys canonical, no key on
        two rows, nothing assigned in a hashed map or to UNKNOWN_ROW."""
        rows = [int(r) for r in row_ids]
        if len(rows) != entries.n or len(entries.keys) != entries.n:
            raise IdMapError(f"{len(rows)} rows but {entries.n} id-map entries")
        if len(set(rows)) != len(rows) or any(not 0 <= r < self.rows for r in rows):
            raise IdMapError(f"id-map rows must be unique and within [0, {self.rows})")
        if bool(np.any(entries.counts < 0)) or not bool(np.all(np.isfinite(entries.last_seen))):
            raise IdMapError("id-map counts must be >= 0 and last_seen finite")
        changed = set(rows)
        incoming: dict[str, int] = {}
        for row, on, key in zip(rows, entries.assigned.tolist(), entries.keys, strict=True):
            if not on:
                if key:
                    raise IdMapError(f"row {row} is not assigned but names id {key!r}")
                continue
            if self.hashed or row == UNKNOWN_ROW:
                raise IdMapError(f"row {row} cannot be assigned an id in this map")
            if canonical_key(key) in incoming:
                raise IdMapError(f"id {key!r} is assigned to rows {incoming[key]} and {row}")
            held = self._row_of.get(key)
            if held is not None and held not in changed:
                raise IdMapError(f"id {key!r} already holds row {held}")
            incoming[key] = row
        for row in rows:
            old = self._key_of[row]
            if old is not None and self._row_of.get(old) == row:
                del self._row_of[old]
            self._key_of[row] = None
        for key, row in incoming.items():
            self._row_of[key] = row
            self._key_of[row] = key
        index = np.asarray(rows, dtype=np.int64)
        self.counts[index] = entries.counts
        self.last_seen[index] = entries.last_seen

    def copy(self) -> IdMap:
        clone = IdMap(self.rows, hashed=self.hashed)
        clone.counts = self.counts.copy()
        clone.last_seen = self.last_seen.copy()
        clone._row_of = dict(self._row_of)
        clone._key_of = list(self._key_of)
        return clone

    @property
    def nbytes(self) -> int:
        """Approximate memory: the arrays plus ~100 bytes per held id (dict slot + str)."""
        return int(self.counts.nbytes + self.last_seen.nbytes + 8 * self.rows + 100 * len(self))
