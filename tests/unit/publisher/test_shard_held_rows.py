"""A full of a job's shard of a dynamic table carries the shard's held rows (docs/FORMAT.md 7.1,
7.2), and rank 0's served-loss copy learns from the rows sent to it that the rest are free."""

from __future__ import annotations

import numpy as np

from publisher.id_map import IdMap
from publisher.write.row_transfer import merge_rank_rows, rows_from_bytes, rows_to_bytes
from publisher.write.snapshot import TableRows

ROWS = 12


def _shard(id_map: IdMap, start: int, end: int) -> TableRows:
    ids = np.arange(start, end, dtype=np.int64)
    return TableRows(
        name="embeddings.user",
        table_rows=ROWS,
        codec="fp32",
        row_ids=ids,
        values=np.repeat(ids.astype(np.float32)[:, None], 2, axis=1),
        aux=np.zeros((len(ids), 1), dtype=np.float32),
        id_entries=id_map.entries(ids),
        row_range=(start, end),
    )


def test_each_shard_of_a_full_keeps_its_held_rows_and_the_first_the_unknown_row() -> None:
    first, second = IdMap(ROWS), IdMap(ROWS)  # each owner's map holds its own rows' ids
    first.assign("a", 2)
    second.assign("b", 7)
    second.assign("c", 9)
    low, high = _shard(first, 0, 6).held_rows(), _shard(second, 6, ROWS).held_rows()
    assert low.row_ids.tolist() == [0, 2] and low.whole and low.row_range == (0, 6)
    assert high.row_ids.tolist() == [7, 9] and high.whole
    assert high.values[:, 0].tolist() == [7.0, 9.0]
    entries = high.id_map_entries()
    assert entries is not None and entries.keys == ("b", "c")
    # a delta's rows (not every row of the shard) are kept as they are
    delta = _shard(second, 6, ROWS)
    cut = TableRows(
        **{
            **vars(delta),
            "row_ids": delta.row_ids[:2],
            "values": delta.values[:2],
            "aux": delta.aux[:2],
            "id_entries": second.entries(delta.row_ids[:2]),
        }
    )
    assert cut.held_rows() is cut

    sent = [rows_from_bytes(rows_to_bytes([t])) for t in (low, high)]
    (merged,) = merge_rank_rows(sent)
    assert merged.whole and merged.row_ids.tolist() == [0, 2, 7, 9]
    (partial,) = merge_rank_rows([sent[0], [delta]])
    assert not partial.whole
