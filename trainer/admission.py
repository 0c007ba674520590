"""How often the ids that hold no row have been seen lately: a count-min sketch, in bounded memory.

    sketch = FrequencySketch.for_capacity(100_000)   # 3 MiB, however many ids arrive
    estimates = sketch.add(key_hashes(["u1", "u1", "u9"]))   # [2, 2, 1] (or more: see below)

The admission half of TinyLFU (Einziger et al., "TinyLFU: A Highly Efficient Cache Admission
Policy", 2017), which Monolith's collision-free tables also use to keep one-off ids out: an id
that holds no row is counted here, not in a per-key dictionary, so a flood of never-seen ids
costs the same memory as none (`nbytes`, fixed at construction). trainer/id_space.py admits
such an id into a full table only if its estimate beats the victim's recent count.

Two parts, as in TinyLFU: a *doorkeeper* (a Bloom filter, 3 bits an id) takes an id's first
occurrence, and only the occurrences after it reach the count-min sketch (`DEPTH` rows of
one-byte counters). So one-off ids, the bulk of a flood, fill only the doorkeeper and leave the
sketch's counters to the ids that come back; an estimate is 1 (doorkeeper) + the sketch's.
Neither ever under-counts an id; both over-count when other ids share all of its bits or
counters: a one-off id reads 2 or more with the doorkeeper's false-positive rate (2.7% once
`capacity x 10` distinct ids have passed, measured at 100,000 rows). Sketch updates are
conservative (only the counters at an id's minimum move). Counters saturate at 255; every
`sample_size` occurrences (`tick`) the doorkeeper is cleared and the counters halved, the id
space's recent counts with them, so the estimates are of recent frequency: an id popular last
week does not keep its claim forever.

Hashes are blake2b-64 of the key (publisher/id_map.py `key_hashes`), never Python's `hash()`,
which is seeded per process: admission, and so training, must not depend on the process.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Hashes = npt.NDArray[np.uint64]

#: rows of the sketch (independent hash functions).
DEPTH = 4
#: counters per sketch row for each row of table capacity (rounded up to a power of two).
WIDTH_PER_ROW = 4
#: doorkeeper bits per sketch counter (an id sets one bit per `_DOOR_MULTIPLIERS`).
DOOR_BITS_PER_COUNTER = 16
MIN_WIDTH_LOG2 = 10
MAX_WIDTH_LOG2 = 24
#: odd 64-bit multipliers, one per sketch row (multiplicative hashing of the key's hash).
_MULTIPLIERS = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
    dtype=np.uint64,
)
_DOOR_MULTIPLIERS = np.array(
    [0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB], dtype=np.uint64
)
_SATURATED = 255


class FrequencySketch:
    """Recent occurrence counts of hashed keys, in `depth x 2**width_log2` one-byte counters."""

    def __init__(self, width_log2: int, *, sample_size: int) -> None:
        if not MIN_WIDTH_LOG2 <= width_log2 <= MAX_WIDTH_LOG2:
            raise ValueError(
                f"width_log2 must be in {MIN_WIDTH_LOG2}..{MAX_WIDTH_LOG2}, got {width_log2}"
            )
        if sample_size < 1:
            raise ValueError(f"sample_size must be >= 1, got {sample_size}")
        self.width_log2 = width_log2
        self.sample_size = sample_size
        self._shift = np.uint64(64 - width_log2)
        self._counters = np.zeros((DEPTH, 1 << width_log2), dtype=np.uint8)
        self._rows = np.arange(DEPTH)[:, None]
        door_log2 = width_log2 + DOOR_BITS_PER_COUNTER.bit_length() - 1
        self._door_shift = np.uint64(64 - door_log2)
        self._door = np.zeros(1 << (door_log2 - 3), dtype=np.uint8)  # a bit per slot
        #: occurrences since the last halving (`tick`).
        self.since_aging = 0
        self.agings = 0

    @classmethod
    def for_capacity(cls, capacity: int) -> FrequencySketch:
        """The sketch of a table of `capacity` rows: WIDTH_PER_ROW counters a row per sketch
        row (a power of two, 2**10 to 2**24), aged every `capacity * 10` occurrences."""
        want = max(1, capacity * WIDTH_PER_ROW)
        width_log2 = min(MAX_WIDTH_LOG2, max(MIN_WIDTH_LOG2, (want - 1).bit_length()))
        return cls(width_log2, sample_size=max(1, capacity * 10))

    @property
    def nbytes(self) -> int:
        """Memory the counters and the doorkeeper take (all of it: fixed at construction)."""
        return int(self._counters.nbytes + self._door.nbytes)

    def _slots(self, hashes: Hashes) -> npt.NDArray[np.int64]:
        """(DEPTH, n) counter index of each hash in each sketch row."""
        with np.errstate(over="ignore"):  # multiplicative hashing wraps on purpose
            mixed = hashes[None, :] * _MULTIPLIERS[:, None]
        return (mixed >> self._shift).astype(np.int64)

    def _door_slots(self, hashes: Hashes) -> npt.NDArray[np.int64]:
        with np.errstate(over="ignore"):
            mixed = hashes[None, :] * _DOOR_MULTIPLIERS[:, None]
        return (mixed >> self._door_shift).astype(np.int64)

    def _in_door(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        bits = (self._door[slots >> 3] >> (slots & 7).astype(np.uint8)) & 1
        return np.asarray(bits.all(axis=0), dtype=np.bool_)

    def _open_door(self, slots: npt.NDArray[np.int64]) -> None:
        flat = slots.reshape(-1)
        np.bitwise_or.at(self._door, flat >> 3, np.left_shift(1, flat & 7).astype(np.uint8))

    def estimate(self, hashes: Hashes) -> npt.NDArray[np.int64]:
        """Each hash's estimated recent count (never below its true count since the last
        halving, halved with it)."""
        if not len(hashes):
            return np.zeros(0, dtype=np.int64)
        counted: npt.NDArray[np.int64] = self._counters[self._rows, self._slots(hashes)].min(axis=0)
        door = self._in_door(self._door_slots(hashes))
        return door.astype(np.int64) + counted.astype(np.int64)

    def add(self, hashes: Hashes) -> npt.NDArray[np.int64]:
        """Count one occurrence of each hash (repeats count several times); returns each one's
        estimate after the update. Does not age: the caller `tick`s with every occurrence."""
        if not len(hashes):
            return np.zeros(0, dtype=np.int64)
        unique, inverse, times = np.unique(hashes, return_inverse=True, return_counts=True)
        door_slots = self._door_slots(unique)
        door = self._in_door(door_slots)
        self._open_door(door_slots[:, ~door])  # the first occurrence of the others
        times = times - ~door  # what reaches the sketch
        slots = self._slots(unique)
        before = self._counters[self._rows, slots].min(axis=0).astype(np.int64)
        after = np.minimum(before + times, _SATURATED)
        # Conservative update: raise each of an id's counters to its new minimum, no further
        # (maximum.at: two ids may share a counter; it keeps the larger claim).
        target = np.broadcast_to(after.astype(np.uint8), slots.shape)
        for row in range(DEPTH):
            np.maximum.at(self._counters[row], slots[row], target[row])
        out: npt.NDArray[np.int64] = 1 + after[inverse.reshape(-1)]
        return out

    def tick(self, occurrences: int) -> bool:
        """Note `occurrences` more events; halve every counter once `sample_size` have passed
        since the last halving. Returns whether it halved."""
        self.since_aging += occurrences
        if self.since_aging < self.sample_size:
            return False
        self.since_aging = 0
        self.agings += 1
        self._counters >>= 1
        self._door[:] = 0
        return True
