"""Part `rawids`: what serving raw ids costs, side by side with the same model taking encoded ids.

    checknrun bench rawids [--rows N] [--dim D] [--delta-sizes 1000,10000] [--batches 1,64,1024]

- predict: the server's work for one request (check the examples, map the raw ids with the
  served version's id maps, derive the dense inputs, forward) on a model trained from raw
  events whose user map holds `rows - 1` ids, next to the same weights taking encoded ids and
  client-computed dense inputs (today's path: check, forward); and the mapping alone with that
  full map against a map of 1,000 ids, which says whether a request's work depends on the map.
- apply: fetch + sha256 + decode + write of a delta of N user rows with its id-map blob, next
  to the same delta of a model of encoded ids (no id map), per consistency scheme; with the
  double buffer's swap pause and the rwlock's write-lock hold, and the model's memory.

Versions are written by the real publisher (`CheckpointPublisher`, a file store); a delta's id
map increments its rows' counts and gives 1% of them to new ids (an eviction and a reuse).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.machine import describe_machine, log
from publisher.dlrm import (
    DLRM,
    TABLE_PREFIX,
    DLRMConfig,
    SparseBatch,
    SparseFeature,
    table_weight_names,
)
from publisher.id_map import IdMap
from publisher.live_features import LiveFeature, LiveSpec, new_id_maps
from publisher.read import ModelCopy
from publisher.read.catalog import Catalog
from publisher.read.live_model import LiveModel
from publisher.read.sinks import dlrm_sink
from publisher.state_dicts import module_tensors
from publisher.store import FileStore
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.snapshot import Snapshot, TableRows
from schemas.id_map_blob import IdEntries
from schemas.manifest import Position
from server.feature_batch import build_batch
from server.raw_ids import parse_raw_examples

SPEC = LiveSpec(
    features=(LiveFeature("user"), LiveFeature("item"), LiveFeature("genres", bag=True)),
    count_features=("user", "item"),
)
#: full and --quick sizes of every option that has one.
SIZES: dict[str, tuple[Any, Any]] = {
    "rows": (200_000, 5_000),
    "delta_sizes": ("1000,10000,50000", "100,1000"),
    "batches": ("1,64,1024", "1,64"),
    "repeats": (15, 3),
}
TS = 1_700_000_000.0
SMALL_MAP_IDS = 1_000


def configs(rows: int, dim: int) -> tuple[DLRMConfig, DLRMConfig]:
    """(raw-id model, the same architecture taking encoded ids): a user table of `rows` rows,
    items of rows / 10, a bag of 32 genres."""
    sizes = {"user": rows, "item": max(rows // 10, 2), "genres": 32}
    sparse = tuple(SparseFeature(f.name, sizes[f.name], f.bag) for f in SPEC.features)
    encoded = DLRMConfig(sparse=sparse, dense=SPEC.dense_names, embedding_dim=dim)
    return DLRMConfig(**{**vars(encoded), "extra": {"live": SPEC.to_json()}}), encoded


def _median_ms(values: Sequence[float]) -> float:
    return round(1000 * statistics.median(values), 3)


def _timed(action: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of `action` over `repeats` runs (after one warm-up)."""
    action()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return _median_ms(times)


# --- writing versions through the real publisher ------------------------------------------------


class Writer:
    """Publishes a model's versions: a full, then deltas of N user rows (with id maps when the
    model is trained from raw events)."""

    def __init__(self, store: FileStore, name: str, config: DLRMConfig, seed: int) -> None:
        self.config = config
        self.live = "live" in config.extra
        torch.manual_seed(seed)
        self.model = DLRM(config)
        self.rng = np.random.default_rng(seed)
        self.publisher = CheckpointPublisher(store, name)
        self.weights = {n: self._table(n) for n in table_weight_names(self.model)}
        self.maps = new_id_maps(config, SPEC) if self.live else {}
        for table, id_map in self.maps.items():
            prefix = table.removeprefix(TABLE_PREFIX)[0]
            entries = _held_entries(id_map.rows, prefix, self.rng)
            id_map.apply(np.arange(id_map.rows, dtype=np.int64), entries)
        self.step = 0

    def _table(self, name: str) -> np.ndarray:
        key = table_weight_names(self.model)[name]
        weight: np.ndarray = self.model.state_dict()[key].numpy()
        return weight

    def publish(self, rows: dict[str, np.ndarray] | None, codec: str) -> int:
        """A full (rows None) or a delta of `rows` per table; the version committed."""
        self.step += 1
        tables = []
        for name, weight in self.weights.items():
            ids = np.arange(weight.shape[0], dtype=np.int64) if rows is None else rows[name]
            if rows is not None and ids.size:
                weight[ids] += self.rng.normal(0, 0.01, (ids.size, weight.shape[1])).astype(
                    np.float32
                )
                self._touch_map(name, ids)
            tables.append(
                TableRows(
                    name=name,
                    table_rows=weight.shape[0],
                    codec=codec,
                    row_ids=ids,
                    values=weight[ids].copy(),
                    aux=np.zeros((ids.size, 0), dtype=np.float32),
                    id_entries=self.maps[name].entries(ids) if self.live else None,
                )
            )
        snapshot = Snapshot(
            kind="full" if rows is None else "delta",
            relative_to=None if rows is None else "parent",
            policy="consecutive",
            tables=tuple(tables),
            position=Position(step=self.step, samples_seen=self.step),
            dense=module_tensors(self.model, set(table_weight_names(self.model).values())),
            model_config=self.config.to_json(),
            taken_at=time.time(),
        )
        return self.publisher.publish(snapshot).ref.version

    def _touch_map(self, name: str, ids: np.ndarray) -> None:
        """Count an event on each row; give 1% of the rows to new ids (evict + admit)."""
        id_map = self.maps.get(name)
        if id_map is None:
            return
        id_map.counts[ids] += 1
        for row in ids[ids > 0][::100].tolist():
            id_map.release(row)
            id_map.assign(f"new-{self.step}-{row}", row)

    def close(self) -> None:
        self.publisher.close()


def _held_entries(rows: int, prefix: str, rng: np.random.Generator) -> IdEntries:
    """Every row but the unknown row 0 held by an id `<prefix><row>`."""
    assigned = np.ones(rows, dtype=np.bool_)
    assigned[0] = False
    keys = ("", *(f"{prefix}{r}" for r in range(1, rows)))
    counts = rng.integers(0, 200, rows).astype(np.int64)
    counts[0] = 0
    return IdEntries(assigned, counts, np.full(rows, TS), keys)


# --- predict: one request's work ----------------------------------------------------------------


def _requests(
    rows: int, batch: int, rng: np.random.Generator, live: ModelCopy
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(raw examples, the same examples encoded): 10% of the users unknown."""
    users = rng.integers(1, rows, batch)
    items = rng.integers(1, max(rows // 10, 2), batch)
    genres = [rng.integers(1, 32, 2) for _ in range(batch)]
    raw = [
        {
            "user": f"u{u}" if i % 10 else f"stranger-{i}",
            "item": f"i{it}",
            "genres": [f"g{g}" for g in gs],
            "ts": TS + i,
        }
        for i, (u, it, gs) in enumerate(zip(users.tolist(), items.tolist(), genres, strict=True))
    ]
    mapped = parse_raw_examples(raw, SPEC, now=TS).to_batch(live.id_maps)
    dense = mapped.batch.dense.numpy()
    encoded = []
    for i in range(batch):
        example: dict[str, Any] = {n: float(dense[i, j]) for j, n in enumerate(SPEC.dense_names)}
        for name, ids in mapped.batch.sparse.items():
            start = int(ids.offsets[i])
            end = int(ids.offsets[i + 1]) if i + 1 < batch else int(ids.values.shape[0])
            values = ids.values[start:end].tolist()
            example[name] = values if name == "genres" else values[0]
        encoded.append(example)
    return raw, encoded


def _forward(copy: ModelCopy, dense: torch.Tensor, sparse: Mapping[str, SparseBatch]) -> None:
    assert copy.module is not None
    with torch.inference_mode():
        copy.module(dense, sparse)


def _measure_batch(
    raw: list[dict[str, Any]],
    enc: list[dict[str, Any]],
    raw_buffer: ModelCopy,
    enc_buffer: ModelCopy,
    small: dict[str, IdMap],
    repeats: int,
) -> dict[str, Any]:
    checked = parse_raw_examples(raw, SPEC, now=TS)

    def raw_request() -> None:
        mapped = parse_raw_examples(raw, SPEC, now=TS).to_batch(raw_buffer.id_maps)
        _forward(raw_buffer, mapped.batch.dense, mapped.batch.sparse)

    def encoded_request() -> None:
        features = build_batch(enc, DLRMConfig.from_json(enc_buffer.model_config))
        _forward(enc_buffer, features.dense, features.sparse)

    times = {
        "raw_ms": _timed(raw_request, repeats),
        "encoded_ms": _timed(encoded_request, repeats),
        "map_full_ms": _timed(lambda: checked.to_batch(raw_buffer.id_maps), repeats),
        "map_small_ms": _timed(lambda: checked.to_batch(small), repeats),
    }
    return {
        "batch": len(raw),
        **times,
        "raw_over_encoded": round(times["raw_ms"] / times["encoded_ms"], 2),
        "map_full_over_small": round(times["map_full_ms"] / times["map_small_ms"], 2),
    }


def measure_predict(
    live: LiveModel, encoded: LiveModel, rows: int, batches: list[int], repeats: int
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    out = []
    with live.reader() as raw_buffer, encoded.reader() as enc_buffer:
        small = new_id_maps(DLRMConfig.from_json(raw_buffer.model_config), SPEC)
        for table, id_map in small.items():
            prefix = table.removeprefix(TABLE_PREFIX)[0]
            for r in range(1, min(SMALL_MAP_IDS, id_map.rows - 1) + 1):
                id_map.assign(f"{prefix}{r}", r)
        for batch in batches:
            raw, enc = _requests(rows, batch, rng, raw_buffer)
            out.append(_measure_batch(raw, enc, raw_buffer, enc_buffer, small, repeats))
    return out


# --- apply: a delta with and without its id map --------------------------------------------------


def measure_apply(
    store: FileStore,
    versions: dict[str, list[tuple[int, int]]],
    scheme: str,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Apply every delta of both models on servers of `scheme`: (per size, model bytes)."""
    served = {name: LiveModel(store, name, dlrm_sink(scheme=scheme)) for name in versions}  # type: ignore[arg-type]
    try:
        for model in served.values():
            model.pin(1)  # build v1 (the deltas are committed already)
            model.unpin()
        per: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for name, plan in versions.items():
            catalog = Catalog(store, name)
            for size, version in plan:
                started = time.perf_counter()
                served[name].advance(catalog.find(version))
                seconds = time.perf_counter() - started
                last = served[name].last_apply
                assert last is not None
                per.setdefault((name, size), []).append((seconds, last.pause_s))
        sizes = sorted({size for _, size in per})
        rows = []
        for size in sizes:
            raw, enc = per[("raw", size)], per[("encoded", size)]
            rows.append(
                {
                    "delta_rows": size,
                    "raw_apply_ms": _median_ms([s for s, _ in raw]),
                    "encoded_apply_ms": _median_ms([s for s, _ in enc]),
                    "raw_pause_ms_max": round(1000 * max(p for _, p in raw), 3),
                    "encoded_pause_ms_max": round(1000 * max(p for _, p in enc), 3),
                }
            )
            rows[-1]["raw_over_encoded"] = round(
                rows[-1]["raw_apply_ms"] / rows[-1]["encoded_apply_ms"], 2
            )
        return rows, {name: model.nbytes() for name, model in served.items()}
    finally:
        for model in served.values():
            model.close()


def run(
    quick: bool,
    *,
    rows: int | None = None,
    dim: int = 32,
    codec: str = "int8",
    delta_sizes: str | None = None,
    batches: str | None = None,
    repeats: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Both measurements; prints the tables and returns the document."""
    options = {"rows": rows, "delta_sizes": delta_sizes, "batches": batches, "repeats": repeats}
    size = {k: (v if v is not None else SIZES[k][1 if quick else 0]) for k, v in options.items()}
    n_rows, n_repeats = int(size["rows"]), int(size["repeats"])
    deltas = [int(s) for s in str(size["delta_sizes"]).split(",")]
    batch_sizes = [int(b) for b in str(size["batches"]).split(",")]
    torch.set_num_threads(1)  # as a server does (settings.torch_threads)
    workdir = Path(tempfile.mkdtemp(prefix="cnr-rawids-"))
    try:
        store = FileStore(workdir / "store")
        raw_config, encoded_config = configs(n_rows, dim)
        versions: dict[str, list[tuple[int, int]]] = {}
        for name, config in (("raw", raw_config), ("encoded", encoded_config)):
            log(f"rawids: publishing {name} ({n_rows:,} user rows, {len(deltas)} delta sizes)")
            writer = Writer(store, name, config, seed)
            writer.publish(None, codec)
            rng = np.random.default_rng(seed + 1)
            plan = []
            for delta in deltas:
                for _ in range(n_repeats):
                    ids = {n: np.zeros(0, dtype=np.int64) for n in writer.weights}
                    ids["embeddings.user"] = np.sort(rng.choice(n_rows, delta, replace=False))
                    plan.append((delta, writer.publish(ids, codec)))
            versions[name] = plan
            writer.close()
        apply_rows: dict[str, list[dict[str, Any]]] = {}
        memory: dict[str, dict[str, int]] = {}
        for scheme in ("double-buffer", "rwlock"):
            log(f"rawids: applying on {scheme}")
            apply_rows[scheme], memory[scheme] = measure_apply(store, versions, scheme)
        log("rawids: predict")
        live = LiveModel(store, "raw", dlrm_sink())
        encoded = LiveModel(store, "encoded", dlrm_sink())
        try:
            live.pin(1)
            encoded.pin(1)
            predict = measure_predict(live, encoded, n_rows, batch_sizes, n_repeats * 4)
        finally:
            live.close()
            encoded.close()
        doc = {
            "part": "rawids",
            "config": {"rows": n_rows, "dim": dim, "codec": codec, "repeats": n_repeats},
            "predict": predict,
            "apply": apply_rows,
            "model_memory_bytes": memory,
            "quick": quick,
            "machine": describe_machine(),
        }
        _print(doc)
        return doc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _print(doc: dict[str, Any]) -> None:
    c = doc["config"]
    print(f"\npredict, one request (median ms; user map of {c['rows'] - 1:,} ids, dim {c['dim']})")
    print(f"{'batch':>6} {'raw ids':>9} {'encoded':>9} {'ratio':>6} {'map full':>9} {'map 1k':>8}")
    for r in doc["predict"]:
        print(
            f"{r['batch']:>6} {r['raw_ms']:>9} {r['encoded_ms']:>9} {r['raw_over_encoded']:>6} "
            f"{r['map_full_ms']:>9} {r['map_small_ms']:>8}"
        )
    for scheme, rows in doc["apply"].items():
        memory = doc["model_memory_bytes"][scheme]
        print(
            f"\napply, {scheme} (median ms; pause = swap or write-lock hold, max ms); memory: "
            f"raw {memory['raw'] / 2**20:.1f} MiB, encoded {memory['encoded'] / 2**20:.1f} MiB"
        )
        print(f"{'rows':>7} {'raw':>9} {'encoded':>9} {'ratio':>6} {'pause raw':>10} {'enc':>8}")
        for r in rows:
            print(
                f"{r['delta_rows']:>7,} {r['raw_apply_ms']:>9} {r['encoded_apply_ms']:>9} "
                f"{r['raw_over_encoded']:>6} {r['raw_pause_ms_max']:>10} "
                f"{r['encoded_pause_ms_max']:>8}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The part's options (sizes left unset take SIZES' full or --quick value)."""
    parser.add_argument("--rows", type=int, help="user table rows (default 200000; quick 5000)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--delta-sizes", help="user rows per delta, comma separated")
    parser.add_argument("--batches", help="examples per request, comma separated")
    parser.add_argument("--repeats", type=int, help="deltas per size (predict: x4 requests)")
    parser.add_argument("--seed", type=int, default=0)
