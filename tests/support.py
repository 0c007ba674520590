"""What the test suites share: polling for a condition, reading scripts/services.sh's env file,
the memory a refused input cost, a delta blob as a reader gets it, a small ratings file, and the
built-in DLRM served as `checknrun serve` serves it.

(Child `checknrun serve` processes come from bench/child_server.py, which the demo and the
benchmarks use too.)
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import torch
from pyarrow import csv
from torch import nn

from publisher.codecs import encode_rows
from publisher.dlrm import DLRMConfig
from publisher.read import ConsistencyScheme, ModelCopy, ModuleSink, sinks
from publisher.read.live_model import LiveModel
from publisher.state_dicts import module_tensors, weight_key
from publisher.store import ObjectStore
from publisher.write.snapshot import Snapshot, TableRows
from publisher.write.tracker import find_embedding_tables
from schemas.delta_blob import DeltaBlob, decode_delta_blob, encode_delta_blob
from schemas.manifest import Position
from server.feature_batch import build_batch

T = TypeVar("T")


def wait_for(
    probe: Callable[[], T | None],
    timeout_s: float = 30.0,
    what: str | Callable[[], str] = "condition",
    *,
    poll_s: float = 0.05,
) -> T:
    """Call `probe` every `poll_s` until it returns something truthy, and return that.

    After `timeout_s` raises AssertionError naming `what`: a string, or a function called then
    to describe the state the wait gave up in. An AssertionError `probe` raises goes through.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() >= deadline:
            waited_for = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s} s waiting for {waited_for}")
        time.sleep(poll_s)


def parse_env_file(text: str) -> dict[str, str]:
    """The `export NAME=value` lines of scripts/services.sh's env file as a dict."""
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.removeprefix("export ").partition("=")
        if not sep:
            raise ValueError(f"env file line {raw!r}: expected 'export NAME=value'")
        values[name.strip()] = value.strip().strip("'\"")
    return values


def peak_of_refusal(action: Callable[[], object], error: type[BaseException]) -> int:
    """The peak bytes Python allocated while `action` failed with `error` (AssertionError if it
    did not): what refusing a hostile input cost."""
    tracemalloc.start()
    try:
        try:
            action()
        except error:
            return tracemalloc.get_traced_memory()[1]
        raise AssertionError(f"{action!r} did not raise {error.__name__}")
    finally:
        tracemalloc.stop()


def delta_blob_of(
    ids: np.ndarray, codec: str, *, table_rows: int, dim: int, aux_dim: int, seed: int = 0
) -> DeltaBlob:
    """A blob of random rows `ids` of table "t" as the store returns it: encoded, then decoded
    (read-only views)."""
    rng = np.random.default_rng(seed)
    q = encode_rows(codec, rng.normal(size=(len(ids), dim)).astype(np.float32))
    blob = DeltaBlob(
        table="t",
        codec=codec,
        dim=dim,
        table_rows=table_rows,
        row_ids=ids.astype(np.int64),
        codes=q.codes,
        scale=q.scale,
        bias=q.bias,
        aux=rng.normal(size=(len(ids), aux_dim)).astype(np.float32),
    )
    return decode_delta_blob(encode_delta_blob(blob))


def write_ratings(path: Path, n: int = 3000) -> None:
    """A ratings CSV (uid, movie, stars 1-5, ts) whose ratings depend on user and item."""
    rng = np.random.default_rng(0)
    users = rng.integers(0, 80, n)
    items = rng.integers(0, 60, n)
    # Ratings that depend on the user and the item: there is something to learn.
    rating = np.clip(np.round(3 + (users % 3) - (items % 3) + rng.normal(0, 1, n)), 1, 5)
    table = pa.table(
        {
            "uid": [f"u{u}" for u in users],
            "movie": [f"m{i}" for i in items],
            "stars": rating,
            "ts": np.arange(n) * 60,
        }
    )
    csv.write_csv(table, path)


def dlrm_sink(scheme: ConsistencyScheme = "double-buffer", **options: Any) -> ModuleSink:
    """A sink of the built-in DLRM, as `checknrun serve` builds it (`ModuleSink` options)."""
    return sinks.dlrm_sink(scheme=scheme, **options)


def dlrm_live(
    store: ObjectStore, model: str, scheme: ConsistencyScheme = "double-buffer", **options: Any
) -> LiveModel:
    """The live model of `model`'s DLRM versions (no follow loop: tests move it by hand)."""
    return LiveModel(store, model, dlrm_sink(scheme, **options))


def dlrm_scores(copy: ModelCopy, examples: list[dict[str, Any]]) -> np.ndarray:
    """Probabilities the DLRM `copy` holds gives `examples` of encoded ids (call it under the
    sink's reader)."""
    batch = build_batch(examples, DLRMConfig.from_json(copy.model_config))
    assert copy.module is not None
    with torch.inference_mode():
        logits = copy.module(batch.dense, batch.sparse)
    return np.asarray(torch.sigmoid(logits).numpy())


def snapshot_of(
    model: nn.Module,
    codec: str,
    model_config: Mapping[str, Any],
    rows: Mapping[str, np.ndarray] | None = None,
    scored: tuple[Any, ...] = (),
) -> Snapshot:
    """A full snapshot of any `model` (every row of every table) or a delta of `rows` (table
    -> ids), as the checkpointer takes it (no optimizer state), with `scored` samples."""
    state = model.state_dict()
    tables = []
    for name in find_embedding_tables(model):
        w = state[weight_key(name)].numpy()
        ids = np.arange(len(w)) if rows is None else rows[name]
        tables.append(
            TableRows(
                name=name,
                table_rows=len(w),
                codec=codec,
                row_ids=ids.astype(np.int64),
                values=w[ids].copy(),
                aux=np.zeros((len(ids), 0), dtype=np.float32),
            )
        )
    weights = {weight_key(name) for name in find_embedding_tables(model)}
    return Snapshot(
        kind="full" if rows is None else "delta",
        relative_to=None if rows is None else "parent",
        policy="consecutive",
        tables=tuple(tables),
        position=Position(step=1, samples_seen=1),
        dense=module_tensors(model, weights),
        model_config=dict(model_config),
        scored=scored,
    )


def unwritten_like(module: nn.Module, source: nn.Module, restored: Any) -> dict[str, torch.Tensor]:
    """`module`'s state_dict with the rows no version of `restored`'s chain carried (the free
    rows a full of a dynamic table leaves out, docs/FORMAT.md 7.1) taken from `source`: what
    remains to tell them apart is what the version holds."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    theirs = source.state_dict()
    for name, table in restored.tables.items():
        key = weight_key(name)
        if key in state and len(table.unwritten):
            rows = torch.from_numpy(table.unwritten)
            state[key][rows] = theirs[key][rows]
    return state
