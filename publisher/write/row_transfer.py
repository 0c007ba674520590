"""A rank's snapshot rows sent to rank 0, and a job's rows put back together there.

    data = rows_to_bytes(snapshot.tables)              # on every rank
    parts = collective.gather_bytes(data)              # rank 0: one per rank
    job_rows = merge_rank_rows([rows_from_bytes(d) for d in parts])

What rank 0 judges a version's served loss on (publisher/write/served_codec.py) is every row the
job's version carries: each rank holds only its shards'. The bytes are an `.npz` archive
(numpy's, read with `allow_pickle=False`: arrays and JSON text only, never a pickle) of each
table's row ids and fp32 values, with a JSON list of the tables' names, sizes, codecs and shard
ranges. Optimizer columns and id maps stay on their rank: the served copy needs the weights.
Merged, a table's rows from several ranks (row-wise shards) become one `TableRows` over the
whole table, ids sorted.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence

import numpy as np

from publisher.write.snapshot import TableRows
from schemas.errors import BadDataError


class RowTransferError(BadDataError):
    """Rows sent between ranks that do not read back, or that overlap when merged."""


def rows_to_bytes(tables: Sequence[TableRows]) -> bytes:
    """`tables`' names, sizes, codecs, shard ranges, `whole` flags, row ids and fp32 values as
    bytes."""
    meta = [
        {
            "name": t.name,
            "table_rows": t.table_rows,
            "codec": t.codec,
            "row_range": t.row_range,
            "whole": t.whole,
        }
        for t in tables
    ]
    arrays: dict[str, np.ndarray] = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    for i, t in enumerate(tables):
        arrays[f"ids{i}"] = np.ascontiguousarray(t.row_ids, dtype=np.int64)
        arrays[f"values{i}"] = np.ascontiguousarray(t.values, dtype=np.float32)
    out = io.BytesIO()
    np.savez(out, **arrays)  # type: ignore[arg-type]
    return out.getvalue()


def rows_from_bytes(data: bytes) -> list[TableRows]:
    """The tables `rows_to_bytes` wrote (no optimizer columns); RowTransferError otherwise."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            meta = json.loads(archive["meta"].tobytes())
            tables = []
            for i, m in enumerate(meta):
                values = archive[f"values{i}"]
                ids = archive[f"ids{i}"]
                row_range = m["row_range"]
                tables.append(
                    TableRows(
                        name=str(m["name"]),
                        table_rows=int(m["table_rows"]),
                        codec=str(m["codec"]),
                        row_ids=ids,
                        values=values,
                        aux=np.zeros((len(ids), 0), dtype=np.float32),
                        row_range=None if row_range is None else (row_range[0], row_range[1]),
                        whole=bool(m["whole"]),
                    )
                )
    except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        raise RowTransferError(f"rows sent by a rank do not read back: {exc}") from exc
    return tables


def merge_rank_rows(ranks: Sequence[Sequence[TableRows]]) -> tuple[TableRows, ...]:
    """Each table once, its rows from every rank that holds some (ids sorted, whole-table
    `row_range`), in the order tables first appear; `whole` (the rows not given are free and
    zero, docs/FORMAT.md 7.1) when every rank's part is."""
    by_name: dict[str, list[TableRows]] = {}
    for tables in ranks:
        for t in tables:
            by_name.setdefault(t.name, []).append(t)
    merged = []
    for name, parts in by_name.items():
        ids = np.concatenate([p.row_ids for p in parts])
        values = np.concatenate([p.values for p in parts])
        order = np.argsort(ids, kind="stable")
        ids, values = ids[order], values[order]
        if ids.size > 1 and not bool((np.diff(ids) > 0).all()):
            raise RowTransferError(f"table {name!r}: two ranks sent the same row")
        first = parts[0]
        merged.append(
            TableRows(
                name=name,
                table_rows=first.table_rows,
                codec=first.codec,
                row_ids=ids,
                values=values,
                aux=np.zeros((len(ids), 0), dtype=np.float32),
                whole=all(p.whole for p in parts),
            )
        )
    return tuple(merged)


def largest_magnitudes(tables: Sequence[TableRows]) -> dict[str, float]:
    """Each table's largest weight magnitude (the rows are finite: every rank checked its own)."""
    return {t.name: float(np.abs(t.values).max()) if t.values.size else 0.0 for t in tables}
