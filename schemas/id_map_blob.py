"""The id-map blob: which raw id owns each row a table blob carries (docs/FORMAT.md section 7).

One zstd frame (content size declared) holding a tensor blob (section 5) with five tensors, one
entry per row of the table blob it sits beside, in that blob's row order: `assigned` u8 (n,) 0
or 1; `counts` i64 (n,) >= 0; `last_seen` f64 (n,) finite; `key_ends` i64 (n,) the end offset
of each row's key in `key_bytes`, non-decreasing; `key_bytes` u8 (m,) the UTF-8 keys
concatenated. An unassigned row has an empty key. Metadata:
`{"format": "checknrun-idmap", "version": 1, "hashed": bool}`.

The decoder treats the bytes as hostile: a size cap from n (`max_id_map_blob_bytes`, checked
on the stored bytes and on the frame's declared content size before anything is inflated or
parsed), exactly one frame, the tensor blob's own checks, then exact names, dtypes
and shapes, n equal to what the manifest entry says (`rows_in_checkpoint`), offsets in range,
every key valid UTF-8 of at most MAX_KEY_BYTES, assigned keys non-empty and unassigned ones empty.
Whether the keys are consistent with the map they are applied to is `publisher.id_map.IdMap`'s
check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import zstandard

from schemas.errors import FormatError
from schemas.tensor_blob import decode_tensors, encode_tensors

ID_MAP_FORMAT = "checknrun-idmap"
ID_MAP_VERSION = 1
#: the most UTF-8 bytes of one id (publisher/id_map.py canonical keys).
MAX_KEY_BYTES = 256
#: the most bytes the tensor blob's length prefix and JSON header may take (an encoder writes
#: about 600: five tensor entries and the metadata).
MAX_ID_MAP_HEADER_BYTES = 4096
#: the most bytes one row may take: assigned, counts, last_seen, key_ends and a longest key.
MAX_ID_MAP_ROW_BYTES = 1 + 8 + 8 + 8 + MAX_KEY_BYTES
ZSTD_LEVEL = 3
_NAMES: dict[str, type[np.generic]] = {
    "assigned": np.uint8,
    "counts": np.int64,
    "last_seen": np.float64,
    "key_ends": np.int64,
    "key_bytes": np.uint8,
}


class IdMapBlobError(FormatError):
    """Id-map blob bytes that break section 7's rules; the message says which."""


class IdKeyError(FormatError):
    """A raw id that breaks section 7's key rule; the message says how."""


#: an int below this in magnitude has at most MAX_KEY_BYTES - 1 digits (room for a sign).
_INT_LIMIT = 10 ** (MAX_KEY_BYTES - 1)


def id_key(value: object) -> str:
    """The key of a raw id (section 7): a str as is, an int as its decimal text, 1 to
    MAX_KEY_BYTES bytes of UTF-8; IdKeyError otherwise (a bool is not an id)."""
    kind = type(value)
    if kind is str:
        key: str = value  # type: ignore[assignment]
        if key.isascii() and 0 < len(key) <= MAX_KEY_BYTES:  # O(1) check: no encoding needed
            return key
    elif kind is int or (isinstance(value, int) and not isinstance(value, bool)):
        number = int(value)  # type: ignore[call-overload]
        if abs(number) >= _INT_LIMIT:  # str() of a huge int is slow or refused
            raise IdKeyError(f"an id is at most {MAX_KEY_BYTES} bytes of UTF-8")
        return str(number)
    elif isinstance(value, str):
        key = str(value)
    else:
        raise IdKeyError(f"an id is a string or an integer, got {kind.__name__}")
    if not key:
        raise IdKeyError("an id is not empty")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:  # a lone surrogate from a JSON escape
        raise IdKeyError(f"id is not valid UTF-8 text: {exc.reason}") from exc
    if size > MAX_KEY_BYTES:
        raise IdKeyError(f"an id is at most {MAX_KEY_BYTES} bytes of UTF-8, got {size}")
    return key


@dataclass(frozen=True)
class IdEntries:
    """The id-map state of a set of rows (the rows of one table blob, in its order)."""

    assigned: npt.NDArray[np.bool_]  # (n,)
    counts: npt.NDArray[np.int64]  # (n,)
    last_seen: npt.NDArray[np.float64]  # (n,)
    keys: tuple[str, ...]  # (n,), "" where not assigned

    @property
    def n(self) -> int:
        return int(self.assigned.shape[0])

    def take(self, positions: npt.NDArray[np.int64]) -> IdEntries:
        """The entries at `positions` (indices into these entries)."""
        return IdEntries(
            self.assigned[positions].copy(),
            self.counts[positions].copy(),
            self.last_seen[positions].copy(),
            tuple(self.keys[int(i)] for i in positions),
        )

    @staticmethod
    def concat(parts: Sequence[IdEntries]) -> IdEntries:
        """The entries of `parts` one after the other (a sharded table's, in shard order)."""
        if len(parts) == 1:
            return parts[0]
        return IdEntries(
            np.concatenate([p.assigned for p in parts]).astype(np.bool_, copy=False),
            np.concatenate([p.counts for p in parts]).astype(np.int64, copy=False),
            np.concatenate([p.last_seen for p in parts]).astype(np.float64, copy=False),
            tuple(key for p in parts for key in p.keys),
        )

    @staticmethod
    def merge(
        ids: npt.NDArray[np.int64],
        older: IdEntries,
        older_ids: npt.NDArray[np.int64],
        newer: IdEntries,
        newer_ids: npt.NDArray[np.int64],
    ) -> IdEntries:
        """Entries of the sorted row set `ids` (the union of both): rows in `newer` take its
        entries (what `TableRows.merge` does with the values)."""
        n = len(ids)
        assigned = np.zeros(n, dtype=np.bool_)
        counts = np.zeros(n, dtype=np.int64)
        last_seen = np.zeros(n, dtype=np.float64)
        keys = [""] * n
        for entries, rows in ((older, older_ids), (newer, newer_ids)):
            pos = np.searchsorted(ids, rows)
            assigned[pos] = entries.assigned
            counts[pos] = entries.counts
            last_seen[pos] = entries.last_seen
            for p, key in zip(pos.tolist(), entries.keys, strict=True):
                keys[p] = key
        return IdEntries(assigned, counts, last_seen, tuple(keys))


def encode_id_entries(entries: IdEntries, *, hashed: bool) -> bytes:
    """The id-map blob of `entries`."""
    encoded = [k.encode("utf-8") for k in entries.keys]
    ends = np.cumsum(np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded)))
    tensors: dict[str, np.ndarray] = {
        "assigned": entries.assigned.astype(np.uint8),
        "counts": np.ascontiguousarray(entries.counts, dtype=np.int64),
        "last_seen": np.ascontiguousarray(entries.last_seen, dtype=np.float64),
        "key_ends": ends.astype(np.int64),
        "key_bytes": np.frombuffer(b"".join(encoded), dtype=np.uint8),
    }
    meta = {"format": ID_MAP_FORMAT, "version": ID_MAP_VERSION, "hashed": hashed}
    # Counts, times and key offsets of neighbouring rows share their high bytes: zstd takes
    # the blob from ~37 to ~15 bytes a row on MovieLens (the int4 row itself is ~12).
    raw = encode_tensors(tensors, meta)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)


def max_id_map_blob_bytes(n_rows: int) -> int:
    """The largest id-map blob of `n_rows` rows: a reader refuses a bigger one (or a manifest
    entry declaring one) before reading or allocating it."""
    return MAX_ID_MAP_HEADER_BYTES + n_rows * MAX_ID_MAP_ROW_BYTES


def decode_id_entries(data: bytes, *, n_rows: int, hashed: bool) -> IdEntries:
    """Entries from an id-map blob that must hold `n_rows` rows of a map that is (not)
    `hashed`; IdMapBlobError (or the tensor blob's error) on anything else."""
    entries, declared = decode_id_map_blob(data, n_rows=n_rows)
    if declared != hashed:
        raise IdMapBlobError(
            f"id-map blob is of a {'hashed' if declared else 'dynamic'} map, expected a "
            f"{'hashed' if hashed else 'dynamic'} one"
        )
    return entries


def decode_id_map_blob(data: bytes, *, n_rows: int) -> tuple[IdEntries, bool]:
    """Entries from an id-map blob that must hold `n_rows` rows, and whether it says its map is
    hashed (a reader that does not know the mode beforehand: restore, which then requires every
    blob of a table's chain to say the same); IdMapBlobError (or the tensor blob's error) on
    anything else."""
    if len(data) > max_id_map_blob_bytes(n_rows):
        raise IdMapBlobError(
            f"id-map blob of {n_rows} rows is {len(data)} bytes; the cap is "
            f"{max_id_map_blob_bytes(n_rows)}"
        )
    tensors, meta = decode_tensors(_inflate(data, max_id_map_blob_bytes(n_rows)))
    if set(meta) != {"format", "version", "hashed"} or (
        meta["format"] != ID_MAP_FORMAT
        or type(meta["version"]) is not int
        or meta["version"] != ID_MAP_VERSION
        or not isinstance(meta["hashed"], bool)
    ):
        raise IdMapBlobError(
            f"id-map blob metadata {meta!r} is not {{'format': {ID_MAP_FORMAT!r}, "
            f"'version': {ID_MAP_VERSION}, 'hashed': true or false}}"
        )
    hashed: bool = meta["hashed"]
    if set(tensors) != set(_NAMES):
        raise IdMapBlobError(
            f"id-map blob tensors are {sorted(tensors)}, expected {sorted(_NAMES)}"
        )
    for name, dtype in _NAMES.items():
        array = tensors[name]
        if array.dtype != dtype or array.ndim != 1:
            raise IdMapBlobError(f"id-map tensor {name!r} is {array.dtype}{array.shape}")
        if name != "key_bytes" and array.shape[0] != n_rows:
            raise IdMapBlobError(f"id-map tensor {name!r} has {array.shape[0]} rows, not {n_rows}")
    assigned_u8, counts, last_seen = tensors["assigned"], tensors["counts"], tensors["last_seen"]
    ends, key_bytes = tensors["key_ends"], tensors["key_bytes"]
    if bool(np.any(assigned_u8 > 1)):
        raise IdMapBlobError("id-map `assigned` holds a value other than 0 or 1")
    if bool(np.any(counts < 0)) or not bool(np.all(np.isfinite(last_seen))):
        raise IdMapBlobError("id-map counts must be >= 0 and last_seen finite")
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]]) if n_rows else ends
    lengths = ends - starts
    if n_rows and (
        bool(np.any(lengths < 0)) or bool(np.any(lengths > MAX_KEY_BYTES)) or starts[0] != 0
    ):
        raise IdMapBlobError(
            f"id-map key offsets are not non-decreasing steps of <= {MAX_KEY_BYTES}"
        )
    if (int(ends[-1]) if n_rows else 0) != key_bytes.shape[0]:
        raise IdMapBlobError("id-map key offsets do not end at the key bytes' length")
    assigned = assigned_u8.astype(np.bool_)
    if bool(np.any(assigned != (lengths > 0))):
        raise IdMapBlobError("an assigned row needs a key and an unassigned row must have none")
    if hashed and bool(np.any(assigned)):
        raise IdMapBlobError("a hashed id map assigns no keys")
    raw = key_bytes.tobytes()
    try:
        keys = tuple(
            raw[s:e].decode("utf-8") for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
        )
    except UnicodeDecodeError as exc:
        raise IdMapBlobError(f"an id-map key is not valid UTF-8: {exc.reason}") from exc
    return IdEntries(assigned, counts.copy(), last_seen.copy(), keys), hashed


def _inflate(data: bytes, cap: int) -> bytes:
    """The tensor blob inside the zstd frame, refusing (before allocating) a frame that does
    not declare its content size or declares more than `cap`, and anything after the frame."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise IdMapBlobError(f"id-map blob is not a zstd frame: {exc}") from exc
    if declared < 0:
        raise IdMapBlobError("id-map blob's zstd frame does not declare its content size")
    if declared > cap:
        raise IdMapBlobError(f"id-map blob inflates to {declared} bytes; the cap is {cap}")
    if declared == 0:
        raise IdMapBlobError("id-map blob's zstd frame is empty (a tensor blob is never empty)")
    try:
        out = zstandard.ZstdDecompressor().decompress(
            data, max_output_size=declared, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise IdMapBlobError(f"id-map blob holds invalid zstd data: {exc}") from exc
    if len(out) != declared:
        raise IdMapBlobError(f"id-map blob inflated to {len(out)} bytes, declared {declared}")
    return out
