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
import itertools
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from schemas.errors import BadDataError
from schemas.id_map_blob import MAX_KEY_BYTES, IdEntries, IdKeyError, id_key

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


def key_hashes(keys: Iterable[str]) -> npt.NDArray[np.uint64]:
    """blake2b-64 of each UTF-8 key (the digest read as a little-endian u64).

    Stable across processes and Python versions (unlike `hash()`), so trainer and servers agree.
    """
    out = [
        int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little") for k in keys
    ]
    return np.asarray(out, dtype=np.uint64)


def hashed_rows(keys: Iterable[str], rows: int) -> npt.NDArray[np.int64]:
    """Rows of `keys` in a hashed table of `rows` rows: `key_hashes` mod rows."""
    return (key_hashes(keys) % np.uint64(rows)).astype(np.int64)


@dataclass(frozen=True)
class IdMapWrite:
    """A checked `IdMap.apply`: the rows it sets, the ids they take, their counts and last-seen
    times. `IdMap.check` makes one; `IdMap.write` makes the write without checking it again."""

    rows: npt.NDArray[np.int64]
    #: the rows whose id changes (their current id, if any, lets go of them).
    released: npt.NDArray[np.int64]
    #: id -> the row it takes, for the ids that change rows (new ids included).
    moved: Mapping[str, int]
    counts: npt.NDArray[np.int64]  # of every row of `rows`
    last_seen: npt.NDArray[np.float64]


class IdMap:
    """One table's id map (see the module docstring). Not thread-safe: one writer at a time;
    a server applies a version to a `copy()` and swaps it in with the rows. The one exception
    is `capture`: what it returns may be resolved on another thread while the writer goes on.
    The arrays are only ever written in place (never rebound), which that relies on."""

    def __init__(self, rows: int, *, hashed: bool = False) -> None:
        if rows < 1 or (not hashed and rows < 2):
            raise IdMapError(f"an id map needs at least {1 if hashed else 2} rows, got {rows}")
        self.rows = rows
        self.hashed = hashed
        self.counts = np.zeros(rows, dtype=np.int64)
        self.last_seen = np.zeros(rows, dtype=np.float64)
        self._row_of: dict[str, int] = {}
        # Row -> key ("" when free) and row -> held, as arrays rather than a list: a snapshot
        # gathers the entries of its rows on the training thread, and a numpy gather of 50k
        # keys out of 1M takes ~3 ms where a Python loop over the rows took ~30 ms.
        self._key_of = np.full(rows, "", dtype=object)
        self._held = np.zeros(rows, dtype=np.bool_)
        #: the undo logs of the captures not resolved yet, by capture number: row -> its key
        #: when the capture was taken, for each row whose key changed since (see IdCapture).
        self._capture_logs: dict[int, dict[int, str]] = {}

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
        key: str = self._key_of[self._checked_row(row)]
        return key or None

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
        return np.flatnonzero(~self._held[1:]).astype(np.int64) + 1

    def assign(self, key: str, row: int) -> None:
        """Give the free `row` to the id `key` (which holds no row); counts start at 0."""
        if self.hashed:
            raise IdMapError("a hashed id map assigns no rows")
        if not 1 <= row < self.rows:
            raise IdMapError(f"row {row} is outside 1..{self.rows - 1}")
        if self._held[row]:
            raise IdMapError(f"row {row} is held by another id")
        if key in self._row_of:
            raise IdMapError(f"id {key!r} already holds row {self._row_of[key]}")
        self._log_keys((row,))
        self._row_of[key] = row
        self._key_of[row] = key
        self._held[row] = True
        self.counts[row] = 0
        self.last_seen[row] = 0.0

    def release(self, row: int) -> str | None:
        """Free `row` (its id is evicted); returns the id that held it. Counts reset to 0."""
        row = self._checked_row(row)
        key: str = self._key_of[row]
        if key:
            self._log_keys((row,))
            del self._row_of[key]
            self._key_of[row] = ""
            self._held[row] = False
        self.counts[row] = 0
        self.last_seen[row] = 0.0
        return key or None

    def _checked_row(self, row: int) -> int:
        # A negative row would index from the end and release or name another row.
        if not 0 <= row < self.rows:
            raise IdMapError(f"row {row} is outside 0..{self.rows - 1}")
        return row

    def _log_keys(self, rows: Iterable[int]) -> None:
        """Before the keys of `rows` change: keep their current keys in every pending capture's
        log (the first change of a row after a capture is the one it needs)."""
        while True:
            try:
                logs = tuple(self._capture_logs.values())
                break
            except RuntimeError:
                # "dictionary changed size during iteration": a log was dropped mid-copy (by a
                # resolver on another thread, or a capture's finalizer run by a garbage
                # collection the copy's allocation started); a dropped log needs nothing.
                continue
        if not logs:
            return
        rows = [int(row) for row in rows]
        for log in logs:
            for row in rows:
                log.setdefault(row, self._key_of[row])

    def capture(self, row_ids: npt.NDArray[np.int64] | None = None) -> IdCapture:
        """The entries of `row_ids` (None: every row) as of now, for a snapshot taken on the
        training thread: counts and last_seen are copied now, the keys when the capture is
        resolved (`IdCapture.entries()`, on any thread), with those changed since put back from
        its log. ~0.5 ms for 50k rows of a 1M-row map where copying the keys too (`entries`)
        takes ~5 ms: the keys are Python objects, each gathered one by one
        (`checknrun bench idmap`)."""
        return IdCapture(self, row_ids)

    def entries(self, row_ids: npt.NDArray[np.int64] | None = None) -> IdEntries:
        """A copy of the state of `row_ids` (None: every row, in order): what a snapshot
        carries. Vectorised gathers, no Python loop over the rows (it runs in the stall)."""
        if row_ids is None:
            keys, held = self._key_of, self._held
            return IdEntries(
                held.copy(), self.counts.copy(), self.last_seen.copy(), tuple(keys.tolist())
            )
        return IdEntries(
            self._held[row_ids],
            self.counts[row_ids],
            self.last_seen[row_ids],
            tuple(self._key_of[row_ids].tolist()),
        )

    def apply(self, row_ids: npt.NDArray[np.int64], entries: IdEntries) -> None:
        """Set the state of `row_ids` to `entries` (restore, follow). Checked first (`check`),
        so on IdMapError the map is unchanged."""
        self.write(self.check(row_ids, entries))

    def check(self, row_ids: npt.NDArray[np.int64], entries: IdEntries) -> IdMapWrite:
        """The write `apply(row_ids, entries)` makes, checked (IdMapError otherwise): rows in
        range and unique, keys canonical, no key on two rows, nothing assigned in a hashed map
        or to UNKNOWN_ROW. It only reads the map: a server checks a version's entries while
        predictions still read the map, then `write`s them under its write lock.

        The checks run over whole arrays and sets, not a Python loop over the rows: a restore
        applies every row of a table at once (1M rows: 1.6-2.0 s on a loaded 2-core machine,
        against 2.8-3.3 s for the loop; most of what is left is building the key dict)."""
        index = np.array(row_ids, dtype=np.int64).reshape(-1)  # a copy: the write keeps it
        n = len(index)
        shapes = {np.shape(a) for a in (entries.assigned, entries.counts, entries.last_seen)}
        keys = entries.keys
        if shapes != {(n,)} or len(keys) != n:
            raise IdMapError(f"{n} rows but {entries.n} id-map entries")
        if n and (index.min() < 0 or index.max() >= self.rows or _repeats(index, self.rows)):
            raise IdMapError(f"id-map rows must be unique and within [0, {self.rows})")
        if bool(np.any(entries.counts < 0)) or not bool(np.all(np.isfinite(entries.last_seen))):
            raise IdMapError("id-map counts must be >= 0 and last_seen finite")
        on = np.asarray(entries.assigned, dtype=np.bool_)
        self._incoming(index, on, keys)
        # The rows whose id changes (freed, or given to another id) and the ids that take a
        # row they do not hold: a version mostly moves counts, so the rest is done for these
        # only, and `write` touches the dict for these only.
        key_array = np.empty(n, dtype=object)
        key_array[:] = keys
        differs = key_array != self._key_of[index]
        moving = np.flatnonzero(differs & on)
        moved = dict(zip(key_array[moving].tolist(), index[moving].tolist(), strict=True))
        # An id that stays on its row holds a row that changes; one that moves must leave a
        # row that changes too, or it would hold two.
        clash = moved.keys() & self._row_of.keys()
        if clash:
            changed = set(index.tolist())
            for key in sorted(clash, key=moved.__getitem__):
                held = self._row_of[key]
                if held not in changed:
                    raise IdMapError(f"id {key!r} already holds row {held}")
        return IdMapWrite(
            index,
            index[differs],
            moved,
            np.array(entries.counts, dtype=np.int64),
            np.array(entries.last_seen, dtype=np.float64),
        )

    def write(self, checked: IdMapWrite) -> None:
        """Make a write `check` returned, without checking again: only on the map it checked,
        or a copy equal to it, with nothing written to either since (a server replays a
        version's writes on its second copy of the model). Costs O(rows) array work plus a
        dict operation per id that changes row."""
        row_of = self._row_of
        released = checked.released
        self._log_keys(released.tolist())
        for row, old in zip(released.tolist(), self._key_of[released].tolist(), strict=True):
            if old and row_of.get(old) == row:
                del row_of[old]
        self._key_of[released] = ""
        self._held[released] = False
        if checked.moved:
            rows = np.fromiter(checked.moved.values(), dtype=np.int64, count=len(checked.moved))
            row_of.update(checked.moved)
            self._key_of[rows] = np.fromiter(checked.moved, dtype=object, count=len(rows))
            self._held[rows] = True
        self.counts[checked.rows] = checked.counts
        self.last_seen[checked.rows] = checked.last_seen

    def _incoming(
        self, index: npt.NDArray[np.int64], on: npt.NDArray[np.bool_], keys: Sequence[str]
    ) -> dict[str, int]:
        """key -> row of the entries `check` is given, checked (see `check`)."""
        if set(map(type, keys)) - {str}:
            row, key = next(
                (r, k) for r, k in zip(index.tolist(), keys, strict=True) if type(k) is not str
            )
            raise IdMapError(f"row {row}: id {key!r} is not a key (a str)")
        key_array = np.empty(len(keys), dtype=object)
        key_array[:] = keys
        named = key_array.astype(np.bool_)  # "" is no id
        if bool(np.any(named & ~on)):
            at = int(np.flatnonzero(named & ~on)[0])
            raise IdMapError(f"row {int(index[at])} is not assigned but names id {keys[at]!r}")
        assigned = np.flatnonzero(on)
        if not len(assigned):
            return {}
        wrong = assigned if self.hashed else assigned[index[assigned] == UNKNOWN_ROW]
        if len(wrong):
            raise IdMapError(f"row {int(index[wrong[0]])} cannot be assigned an id in this map")
        new_keys: list[str] = key_array[assigned].tolist()
        new_rows: list[int] = index[assigned].tolist()
        # Canonical: not empty, at most MAX_KEY_BYTES of valid UTF-8. Short ASCII keys (the
        # usual ones) pass at C speed; the others are checked one by one.
        if not (all(map(str.isascii, new_keys)) and max(map(len, new_keys)) <= MAX_KEY_BYTES):
            for key in new_keys:
                if not (key.isascii() and len(key) <= MAX_KEY_BYTES):
                    canonical_key(key)
        if not bool(np.all(named[assigned])):
            canonical_key("")  # raises: an assigned row names no id
        incoming = dict(zip(new_keys, new_rows, strict=True))
        if len(incoming) != len(new_keys):
            first: dict[str, int] = {}
            for key, row in zip(new_keys, new_rows, strict=True):
                if key in first:
                    raise IdMapError(f"id {key!r} is assigned to rows {first[key]} and {row}")
                first[key] = row
        return incoming

    def state(self) -> dict[str, Any]:
        """The map as plain data, what a torch file holds and `torch.load(path,
        weights_only=True)` reads back (`checknrun restore`): `keys`, a str per row ("" for a
        free row, every row of a hashed map), `counts` (int64) and `last_seen` (float64)
        tensors of one entry per row, copies, and `hashed`. `from_state` is the inverse."""
        import torch  # only the torch-file form needs it: `checknrun ls`/`inspect` do without

        return {
            "keys": self._key_of.tolist(),
            "counts": torch.from_numpy(self.counts.copy()),
            "last_seen": torch.from_numpy(self.last_seen.copy()),
            "hashed": self.hashed,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> IdMap:
        """The map `state()` gave. Its content is checked as hostile (a file's): exactly those
        four entries of those types, one per row, then every rule `apply` checks (canonical
        keys, no key on two rows, nothing on UNKNOWN_ROW nor in a hashed map); IdMapError
        naming the first thing wrong."""
        if not isinstance(state, Mapping) or set(state) != _STATE_FIELDS:
            got = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            raise IdMapError(
                f"an id map's state has the entries {sorted(_STATE_FIELDS)}, got {got}"
            )
        keys, hashed = state["keys"], state["hashed"]
        if not isinstance(hashed, bool):
            raise IdMapError(f"an id map's 'hashed' is a bool, got {type(hashed).__name__}")
        if not isinstance(keys, list | tuple) or not all(type(k) is str for k in keys):
            raise IdMapError("an id map's 'keys' is a list of str, one per row")
        counts = _state_array(state["counts"], "counts", len(keys), "iu")
        last_seen = _state_array(state["last_seen"], "last_seen", len(keys), "f")
        id_map = cls(len(keys), hashed=hashed)
        entries = IdEntries(
            np.array([bool(k) for k in keys], dtype=np.bool_),
            counts.astype(np.int64),
            last_seen.astype(np.float64),
            tuple(keys),
        )
        id_map.apply(np.arange(len(keys), dtype=np.int64), entries)
        return id_map

    def copy(self) -> IdMap:
        clone = IdMap(self.rows, hashed=self.hashed)
        clone.load_from(self)
        return clone

    def load_from(self, other: IdMap) -> None:
        """Make this map a copy of `other` (same rows and mode, else IdMapError), in place: the
        arrays keep their identity, so whoever holds this map or its `counts` sees the new state
        (a trainer resuming into the maps its id space already holds)."""
        if (other.rows, other.hashed) != (self.rows, self.hashed):
            raise IdMapError(
                f"an id map of {other.rows} rows (hashed={other.hashed}) cannot be loaded into "
                f"one of {self.rows} rows (hashed={self.hashed})"
            )
        if other is self:
            return
        self._log_keys(range(self.rows))
        self.counts[:] = other.counts
        self.last_seen[:] = other.last_seen
        self._key_of[:] = other._key_of
        self._held[:] = other._held
        self._row_of = dict(other._row_of)

    @property
    def nbytes(self) -> int:
        """Approximate memory: the arrays plus ~130 bytes per held id (a dict slot, the str,
        a row int: 131 measured with tracemalloc for 12-byte keys)."""
        arrays = (self.counts, self.last_seen, self._key_of, self._held)
        return int(sum(a.nbytes for a in arrays) + 130 * len(self))


#: the entries of `IdMap.state()`.
_STATE_FIELDS = {"keys", "counts", "last_seen", "hashed"}


def _state_array(value: object, name: str, rows: int, kinds: str) -> np.ndarray:
    """One of a state's arrays (a tensor or a numpy array) as numpy, checked: one dimension of
    `rows` entries, of a dtype kind in `kinds`."""
    import torch  # a state read from a torch file: see `IdMap.state`

    if isinstance(value, torch.Tensor):
        try:
            array = value.detach().cpu().numpy()
        except TypeError as exc:  # a dtype numpy has not (bfloat16)
            raise IdMapError(f"an id map's {name!r} is of dtype {value.dtype}") from exc
    elif isinstance(value, np.ndarray):
        array = value
    else:
        raise IdMapError(f"an id map's {name!r} is a tensor, got {type(value).__name__}")
    if array.shape != (rows,) or array.dtype.kind not in kinds:
        raise IdMapError(
            f"an id map's {name!r} holds one {'integer' if 'i' in kinds else 'float'} per row "
            f"({rows}), got {array.dtype} of shape {array.shape}"
        )
    return array


def _repeats(index: npt.NDArray[np.int64], rows: int) -> bool:
    """Whether `index` (within [0, rows)) repeats a row: a bitmap, ~10x faster than np.unique."""
    seen = np.zeros(rows, dtype=np.bool_)
    seen[index] = True
    return int(np.count_nonzero(seen)) != len(index)


_capture_numbers = itertools.count()


class IdCapture:
    """The id-map entries of some rows at one instant, whose keys are gathered when it is
    resolved (`IdMap.capture`): a snapshot's, resolved off the training thread by the
    publisher (merge, encode, or pickling for the publisher process).

    Why: the keys are Python objects, and gathering 50k of them out of a 1M-row map costs ~5 ms
    of the training thread's stall. The map's keys change only on admission and eviction, so the
    map keeps, for each pending capture, the keys of the rows it changes (an undo log), and
    resolving reads the current keys and puts those back. Thread-safe: `entries()` may run on
    any thread while the map's writer goes on (each read of a key and each log write is atomic
    under the GIL, and a key is logged before it changes); the first call resolves and stops
    the logging, later calls return the same entries. Pickles as its `IdEntries`.
    """

    def __init__(self, id_map: IdMap, row_ids: npt.NDArray[np.int64] | None) -> None:
        self._rows = None if row_ids is None else np.array(row_ids, dtype=np.int64)
        if self._rows is None:
            self._counts, self._last_seen = id_map.counts.copy(), id_map.last_seen.copy()
        else:
            self._counts, self._last_seen = id_map.counts[self._rows], id_map.last_seen[self._rows]
        self.n = id_map.rows if self._rows is None else len(self._rows)
        self._map: IdMap | None = id_map
        self._log: dict[int, str] = {}
        self._entries: IdEntries | None = None
        self._lock = threading.Lock()
        number = next(_capture_numbers)
        id_map._capture_logs[number] = self._log
        # A capture dropped unresolved (a snapshot superseded by a full) stops the logging too.
        self._stop_logging = weakref.finalize(self, _drop_log, id_map._capture_logs, number)

    @property
    def nbytes(self) -> int:
        """Memory it holds now: the copied arrays and one key slot per row once resolved."""
        return int(self._counts.nbytes + self._last_seen.nbytes + 9 * self.n)

    def entries(self) -> IdEntries:
        """The entries as they were when the capture was taken."""
        with self._lock:
            if self._entries is None:
                self._entries = self._resolve()
            return self._entries

    def _resolve(self) -> IdEntries:
        id_map = self._map
        assert id_map is not None  # set until resolved, and resolved once
        keys = id_map._key_of.copy() if self._rows is None else id_map._key_of[self._rows]
        changed = dict(self._log)  # after the keys were read: see the class docstring
        self._stop_logging()
        self._map = None
        if changed:
            logged = np.fromiter(changed, dtype=np.int64, count=len(changed))
            if self._rows is None:
                positions = logged
            else:
                positions = np.flatnonzero(np.isin(self._rows, logged))
            rows = logged if self._rows is None else self._rows[positions]
            for position, row in zip(positions.tolist(), rows.tolist(), strict=True):
                keys[position] = changed[row]
        held = keys.astype(np.bool_)  # "" is a free row
        return IdEntries(held, self._counts, self._last_seen, tuple(keys.tolist()))

    def __reduce__(self) -> tuple[type[IdEntries], tuple[object, ...]]:
        e = self.entries()
        return IdEntries, (e.assigned, e.counts, e.last_seen, e.keys)


def _drop_log(logs: dict[int, dict[int, str]], number: int) -> None:
    logs.pop(number, None)
