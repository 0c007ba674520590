"""Part `idmap`: what an open id space's id map adds to a checkpoint.

    checknrun bench idmap [--rows 1000000] [--dirty 50000] [--dim 64] [--codec int4]
                          [--repeats 15] [--quick] [--json OUT]

One table of `--rows` rows, every row but the unknown row held by an id (`user-NNNNNNN`), and
row-wise Adagrad's one optimizer column per row. Measured side by side in one run:

- stall: each interval marks `--dirty` random rows dirty and counts an event for each; two
  `SnapshotCapture`s of the same model take the same stall, alternating which goes first, one
  with the id map and one without. Medians over `--repeats`; the difference is what the id map
  adds to the training thread (also its own share, the breakdown's "id_maps"). The same for a
  full snapshot (every row), over fewer repeats. Beside it, the id-map part alone: what the
  stall does (`IdMap.capture`: counts and last_seen copied, keys gathered later off the
  training thread) against copying the keys too (`IdMap.entries`), alternating, same rows.
- bytes: the id-map blob of the dirty rows (zstd-framed, as stored) next to their table blob
  (`--codec`), per row.
- encode / decode: the id-map blob of the dirty rows (the publisher's and a reader's cost).
- restore: rebuilding the whole map from a full's entries (`NewestIdEntries.build`: one
  checked `IdMap.apply`), next to `IdEntries` of the same rows taken off a live map.
- a full of a sparsely held table (docs/FORMAT.md 7.1): a table of the default `--id-capacity`
  (100,000 rows) holding 382 to 99,999 ids; its full's table and id-map blobs as written now
  (the held rows and the unknown row, `TableRows.held_rows`) next to every row (before), and
  the encode time of each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from bench.machine import describe_machine, log
from publisher.cli import positive_int
from publisher.id_map import IdCapture, IdMap
from publisher.read.id_map_rows import NewestIdEntries
from publisher.write.policies import make_policy
from publisher.write.publishing import encode_table
from publisher.write.snapshot import TableRows
from publisher.write.tracker import DirtyRowTracker, find_embedding_tables
from schemas.codec_names import CODECS
from schemas.id_map_blob import decode_id_entries, encode_id_entries
from schemas.manifest import Position
from trainer.rowwise_adagrad import RowWiseAdagrad
from trainer.snapshot_capture import SnapshotCapture

#: option -> (default, --quick). Given options win.
SIZES: dict[str, tuple[int, int]] = {
    "rows": (1_000_000, 20_000),
    "dirty": (50_000, 1_000),
    "repeats": (15, 3),
}
#: full snapshots copy every row: fewer of them.
FULL_REPEATS = (5, 2)
#: the sparsely held table: rows (the default --id-capacity; --quick), and the ids it holds.
SPARSE_CAPACITY = (100_000, 5_000)
SPARSE_HELD = (382, 1_000, 10_000, 50_000, 99_999)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The table, the interval's dirty rows, the codec and the repeats."""
    for name, (default, quick) in SIZES.items():
        parser.add_argument(
            f"--{name}", type=positive_int, help=f"default {default:,}; --quick {quick:,}"
        )
    parser.add_argument("--dim", type=positive_int, default=64, help="elements per row")
    parser.add_argument("--codec", choices=CODECS, default="int4", help="the table blob's codec")


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def _timed(action: Callable[[], object], repeats: int) -> tuple[list[float], object]:
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = action()
        seconds.append(time.perf_counter() - started)
    return seconds, result


def run(
    quick: bool,
    *,
    rows: int | None = None,
    dirty: int | None = None,
    repeats: int | None = None,
    dim: int = 64,
    codec: str = "int4",
) -> dict[str, Any]:
    """Measure (see the module docstring); progress to stderr, the table to stdout."""
    n_rows = rows if rows is not None else SIZES["rows"][quick]
    n_dirty = min(dirty if dirty is not None else SIZES["dirty"][quick], n_rows - 1)
    n_repeats = repeats if repeats is not None else SIZES["repeats"][quick]
    full_repeats = FULL_REPEATS[quick]

    torch.manual_seed(0)
    table = nn.Embedding(n_rows, dim, sparse=True)
    model = nn.ModuleDict({"users": table})
    optimizer = RowWiseAdagrad([table.weight], lr=0.05)
    tables = find_embedding_tables(model)
    id_map = IdMap(n_rows)
    log(f"idmap: {n_rows:,} rows x {dim}, admitting {n_rows - 1:,} ids")
    for row in range(1, n_rows):
        id_map.assign(f"user-{row:07d}", row)
    captures = {
        "with_id_map": SnapshotCapture(
            model, tables, [optimizer], {"users": codec}, {}, {"users": id_map}
        ),
        "without": SnapshotCapture(model, tables, [optimizer], {"users": codec}, {}),
    }
    policies = {arm: make_policy("consecutive", {"users": n_rows}) for arm in captures}
    tracker = DirtyRowTracker({"users": n_rows})
    for capture in captures.values():
        capture.preallocate()
    position = Position(step=0, samples_seen=0)
    stall: dict[str, dict[str, list[float]]] = {
        kind: {arm: [] for arm in captures} for kind in ("delta", "full")
    }
    id_map_share: dict[str, list[float]] = {"delta": [], "full": []}
    map_part: dict[str, list[float]] = {"capture": [], "entries": []}
    rng = np.random.default_rng(0)
    try:
        for arm, capture in captures.items():  # the baselines: every later stall is a delta
            capture.take(tracker, policies[arm], position, {}, sequence=0)
        last_ids = np.zeros(0, dtype=np.int64)
        for kind, count in (("delta", n_repeats), ("full", full_repeats)):
            for r in range(count):
                ids = np.sort(rng.choice(np.arange(1, n_rows), n_dirty, replace=False))
                id_map.counts[ids] += 1
                id_map.last_seen[ids] = 1.7e9 + r
                order = list(captures) if r % 2 == 0 else list(reversed(captures))
                for arm in order:
                    tracker.mark("users", ids)
                    started = time.perf_counter()
                    taken = captures[arm].take(
                        tracker,
                        policies[arm],
                        position,
                        {},
                        sequence=r + 1,
                        force_full=kind == "full",
                    )
                    stall[kind][arm].append(time.perf_counter() - started)
                    if arm == "with_id_map":
                        id_map_share[kind].append(taken.breakdown_ms["id_maps"] / 1e3)
                    del taken  # its buffers go back to the pool
                if kind == "delta":
                    _time_map_part(id_map, ids, map_part, first="capture" if r % 2 else "entries")
                last_ids = ids
            log(f"idmap: {count} {kind} stalls per arm done")
    finally:
        for capture in captures.values():
            capture.close()

    entries = id_map.entries(last_ids)
    encode_s, blob = _timed(lambda: encode_id_entries(entries, hashed=False), n_repeats)
    assert isinstance(blob, bytes)
    decode_s, _ = _timed(lambda: decode_id_entries(blob, n_rows=n_dirty, hashed=False), n_repeats)
    rows_copy = captures["without"].rows("users", last_ids)
    table_blob = encode_table(rows_copy).data
    whole = id_map.entries()
    restore_s, rebuilt = _timed(lambda: _rebuild(n_rows, whole), min(n_repeats, 3))
    assert isinstance(rebuilt, IdMap) and len(rebuilt) == len(id_map)

    map_part_ms = {
        "capture_ms_median": _median_ms(map_part["capture"]),
        "entries_ms_median": _median_ms(map_part["entries"]),
        "entries_over_capture": round(
            statistics.median(map_part["entries"]) / statistics.median(map_part["capture"]), 2
        ),
    }
    results: dict[str, dict[str, Any]] = {
        arm_kind: {
            "stall_ms_median_with_id_map": _median_ms(stall[arm_kind]["with_id_map"]),
            "stall_ms_median_without": _median_ms(stall[arm_kind]["without"]),
            "added_ms_median": round(
                _median_ms(stall[arm_kind]["with_id_map"]) - _median_ms(stall[arm_kind]["without"]),
                3,
            ),
            "id_maps_share_ms_median": _median_ms(id_map_share[arm_kind]),
            "ratio_with_over_without": round(
                statistics.median(stall[arm_kind]["with_id_map"])
                / statistics.median(stall[arm_kind]["without"]),
                3,
            ),
            "stalls": len(stall[arm_kind]["without"]),
        }
        for arm_kind in ("delta", "full")
    }
    sizes = {
        "rows": n_dirty,
        "id_map_blob_bytes": len(blob),
        "id_map_bytes_per_row": round(len(blob) / n_dirty, 2),
        "table_blob_bytes": len(table_blob),
        "table_bytes_per_row": round(len(table_blob) / n_dirty, 2),
        "id_map_over_table": round(len(blob) / len(table_blob), 3),
    }
    timings = {
        "encode_ms_median": _median_ms(encode_s),
        "decode_ms_median": _median_ms(decode_s),
        "rebuild_whole_map_s_median": round(statistics.median(restore_s), 3),
    }
    _print_table(n_rows, n_dirty, dim, codec, results, map_part_ms, sizes, timings)
    sparse = _sparse_fulls(SPARSE_CAPACITY[quick], dim, codec)
    _print_sparse(sparse, dim, codec)
    return {
        "part": "idmap",
        "quick": quick,
        "machine": describe_machine(),
        "config": {
            "rows": n_rows,
            "dirty": n_dirty,
            "dim": dim,
            "codec": codec,
            "repeats": n_repeats,
            "full_repeats": full_repeats,
            "optimizer": "row-wise Adagrad (1 column per row)",
        },
        "stall": results,
        "id_map_part_of_a_delta_stall": map_part_ms,
        "bytes": sizes,
        "times": timings,
        "sparse_full": sparse,
    }


def _sparse_fulls(capacity: int, dim: int, codec: str) -> dict[str, Any]:
    """The full of a table of `capacity` rows holding each of SPARSE_HELD ids (fewer when the
    table is smaller): bytes and encode time of every row (before) and of the held rows."""
    rng = np.random.default_rng(1)
    values = rng.uniform(-0.25, 0.25, (capacity, dim)).astype(np.float32)
    aux = rng.uniform(0.0, 1.0, (capacity, 1)).astype(np.float32)
    arms = []
    for held in sorted({min(h, capacity - 1) for h in SPARSE_HELD}):
        log(f"idmap: a full of {capacity:,} rows holding {held:,} ids")
        id_map = IdMap(capacity)
        for row in np.sort(rng.choice(np.arange(1, capacity), held, replace=False)).tolist():
            id_map.assign(f"user-{row:07d}", row)
        whole = TableRows(
            name="users",
            table_rows=capacity,
            codec=codec,
            row_ids=np.arange(capacity, dtype=np.int64),
            values=values,
            aux=aux,
            id_entries=id_map.entries(),
        )
        out: dict[str, Any] = {"ids_held": held}
        for arm in ("every_row", "held_rows"):
            started = time.perf_counter()  # the cut is part of what a full costs now
            rows = whole if arm == "every_row" else whole.held_rows()
            blob = encode_table(rows)
            seconds = time.perf_counter() - started
            out[arm] = {
                "rows": rows.n_rows,
                "table_bytes": len(blob.data),
                "id_map_bytes": len(blob.id_map or b""),
                "encode_ms": round(seconds * 1e3, 1),
            }
        before, after = (
            out[a]["table_bytes"] + out[a]["id_map_bytes"] for a in ("every_row", "held_rows")
        )
        out["smaller"] = round(before / after, 1)
        arms.append(out)
    return {"capacity": capacity, "dim": dim, "codec": codec, "arms": arms}


def _print_sparse(sparse: dict[str, Any], dim: int, codec: str) -> None:
    print(
        f"\na full of a table of {sparse['capacity']:,} rows x {dim} ({codec}, one optimizer "
        "column), blobs written: every row (before) / the held rows and row 0 (now)"
    )
    print(f"{'ids held':>9} {'before B':>11} {'now B':>10} {'smaller':>8} {'encode ms':>16}")
    for a in sparse["arms"]:
        b, n = a["every_row"], a["held_rows"]
        print(
            f"{a['ids_held']:>9,} {b['table_bytes'] + b['id_map_bytes']:>11,} "
            f"{n['table_bytes'] + n['id_map_bytes']:>10,} {a['smaller']:>7}x "
            f"{b['encode_ms']:>7} / {n['encode_ms']:<7}"
        )


def _time_map_part(
    id_map: IdMap, ids: np.ndarray, samples: dict[str, list[float]], *, first: str
) -> None:
    """One sample each of the stall's id-map part as it is (capture) and copying keys too."""
    for arm in (first, "entries" if first == "capture" else "capture"):
        started = time.perf_counter()
        taken = id_map.capture(ids) if arm == "capture" else id_map.entries(ids)
        samples[arm].append(time.perf_counter() - started)
        if isinstance(taken, IdCapture):
            taken.entries()  # the publisher's part, not timed: off the training thread


def _rebuild(rows: int, entries: Any) -> IdMap:
    newest = NewestIdEntries(rows)
    newest.add(np.arange(rows, dtype=np.int64), entries, hashed=False)
    return newest.build()


def _print_table(
    rows: int,
    dirty: int,
    dim: int,
    codec: str,
    results: dict[str, dict[str, Any]],
    map_part: dict[str, Any],
    sizes: dict[str, Any],
    timings: dict[str, Any],
) -> None:
    print(f"id map of {rows:,} rows x {dim}, {dirty:,} dirty rows per interval, {codec}")
    print(
        f"{'stall':<8} {'with map ms':>12} {'without ms':>11} {'added ms':>9} {'map part ms':>12}"
    )
    for kind, r in results.items():
        print(
            f"{kind:<8} {r['stall_ms_median_with_id_map']:>12.2f} "
            f"{r['stall_ms_median_without']:>11.2f} {r['added_ms_median']:>9.2f} "
            f"{r['id_maps_share_ms_median']:>12.2f}"
        )
    print(
        f"id-map part of a {dirty:,}-row stall: capture {map_part['capture_ms_median']} ms, "
        f"copying the keys too {map_part['entries_ms_median']} ms "
        f"({map_part['entries_over_capture']}x)"
    )
    print(
        f"bytes per dirty row: id map {sizes['id_map_bytes_per_row']}, table "
        f"{sizes['table_bytes_per_row']} ({codec}); id map {sizes['id_map_blob_bytes']:,} B"
    )
    print(
        f"id-map blob of {dirty:,} rows: encode {timings['encode_ms_median']} ms, decode "
        f"{timings['decode_ms_median']} ms; whole map rebuilt in "
        f"{timings['rebuild_whole_map_s_median']} s"
    )
