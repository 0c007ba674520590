"""The one path from a manifest's id-map blobs to id maps: restore, resume and serving.

A table entry with an `id_map` (or a sharded table whose shards have one each) carries the
map's state of exactly the rows its table blob(s) carry, in the same order (docs/FORMAT.md
sections 7, 3.3). `read_id_entries` fetches, verifies and
decodes one such blob, refusing an entry that declares more bytes than its rows can take before
anything is fetched. `NewestIdEntries` rebuilds a map from a chain read newest version first,
by the rule that rebuilds the rows (blob_rows.NewestRows): each row's entry comes from the
newest blob that holds the row. The rebuilt map is applied in one checked `IdMap.apply`, so a
chain whose entries put one id on two rows, or an id on the unknown row, is refused whole.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from publisher.id_map import IdMap
from publisher.store import ObjectStore
from schemas.id_map_blob import (
    IdEntries,
    IdMapBlobError,
    decode_id_map_blob,
    max_id_map_blob_bytes,
)
from schemas.manifest import TableEntry


def read_id_entries(store: ObjectStore, entry: TableEntry) -> tuple[IdEntries, bool]:
    """The id-map entries of `entry`'s rows and whether its map is hashed: each part's blob
    (one, or one per shard: docs/FORMAT.md 3.3) fetched, checked against the sha256 and size in
    the manifest, decoded with the part's `rows_in_checkpoint` rows; a sharded table's entries
    concatenated in shard order, the order its rows are read in.

    IdMapBlobError (before any fetch) when the entry has no id map or a part declares a blob
    larger than `max_id_map_blob_bytes` of its rows, or when the shards disagree on the map's
    mode; the store's error on a sha256 or size mismatch; the decoder's FormatError on
    malformed bytes.
    """
    if not entry.has_id_map:
        raise IdMapBlobError(f"table {entry.name!r} has no id map in this version")
    for part in entry.parts:
        assert part.id_map is not None  # the manifest's rule: every shard or none
        cap = max_id_map_blob_bytes(part.rows_in_checkpoint)
        if part.id_map.size > cap:
            raise IdMapBlobError(
                f"{part.id_map.key}: an id map of {part.rows_in_checkpoint} rows is at most "
                f"{cap} bytes, the manifest says {part.id_map.size}"
            )
    decoded = []
    for part in entry.parts:
        ref = part.id_map
        assert ref is not None
        data = store.get_verified(ref.key, ref.size, ref.sha256)
        decoded.append(decode_id_map_blob(data, n_rows=part.rows_in_checkpoint))
    modes = {hashed for _, hashed in decoded}
    if len(modes) > 1:
        raise IdMapBlobError(
            f"the shards of table {entry.name!r} disagree on whether its map is hashed"
        )
    return IdEntries.concat([entries for entries, _ in decoded]), decoded[0][1]


class NewestIdEntries:
    """One table's id map rebuilt from the id-map entries of a chain given newest version
    first: each row's entry from the newest blob that holds it.

    `add` each version's entries with its table blob's row ids, newest first, then `build`.
    Every blob must agree on the map's mode (hashed or dynamic), and the chain must give every
    row (its baseline is a full), else IdMapBlobError; but for a dynamic map, whose full may
    carry only the rows its ids hold (docs/FORMAT.md 7.1), a row no blob gives is free.
    """

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._filled = np.zeros(rows, dtype=np.bool_)
        self._assigned = np.zeros(rows, dtype=np.bool_)
        self._counts = np.zeros(rows, dtype=np.int64)
        self._last_seen = np.zeros(rows, dtype=np.float64)
        self._keys = np.full(rows, "", dtype=object)
        self._hashed: bool | None = None

    def add(self, row_ids: npt.NDArray[np.int64], entries: IdEntries, *, hashed: bool) -> int:
        """Keep the entries of the rows no blob added before held; how many it gave.

        `row_ids` are the table blob's (strictly increasing, below `rows`: the blob decoder's
        guarantee), `entries` the id-map blob's for the same rows."""
        if self._hashed is not None and hashed != self._hashed:
            raise IdMapBlobError("the versions of one table disagree on whether its map is hashed")
        self._hashed = hashed
        if len(row_ids) != entries.n:
            raise IdMapBlobError(f"{entries.n} id-map entries for {len(row_ids)} table rows")
        positions = np.flatnonzero(~self._filled[row_ids])
        ids = row_ids[positions]
        self._assigned[ids] = entries.assigned[positions]
        self._counts[ids] = entries.counts[positions]
        self._last_seen[ids] = entries.last_seen[positions]
        self._keys[ids] = np.asarray(entries.keys, dtype=object)[positions]
        self._filled[ids] = True
        return len(ids)

    def build(self) -> IdMap:
        """The map: IdMapBlobError if a row was never given, IdMapError (from `IdMap.apply`)
        if the entries break the map's rules."""
        if self._hashed is None or (self._hashed and not self._filled.all()):
            missing = int((~self._filled).sum())
            raise IdMapBlobError(f"the chain gives no id-map entry for {missing} rows")
        id_map = IdMap(self.rows, hashed=self._hashed)
        keys = tuple(self._keys.tolist())
        entries = IdEntries(self._assigned, self._counts, self._last_seen, keys)
        id_map.apply(np.arange(self.rows, dtype=np.int64), entries)
        return id_map
