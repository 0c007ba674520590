"""Part `rejections`: what refusing a hostile store object costs a reader, time and memory.

    checknrun bench rejections [--repeats 3] [--json OUT]

Three objects that anyone who can write to the store can plant (docs/RELIABILITY.md, issue 11),
each refused by the path every reader shares:

- a 1 KiB forged manifest whose `model_config` declares one 2^20 x 256 table (1 GiB of fp32),
  met by a server serving an earlier version (`LiveModel.catch_up`, memory budget 256 MiB);
- a zstd blob of a few KiB that inflates to 1 GiB, named by a 1000 x 8 table's manifest entry
  with its size and sha256 made to agree (`read_blob`: fetch, verify, decode, cross-check);
- a 300 MB HEAD (`Catalog.head`).

For each: the median wall time of one rejection, the peak of Python-visible allocations
(tracemalloc, a separate run) and the growth of the process's peak RSS (torch allocates outside
tracemalloc's view; the peak is reset through /proc/self/clear_refs before each rejection).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import struct
import tempfile
import time
import tracemalloc
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from bench.machine import describe_machine
from bench.synthetic_run import SyntheticRun, small_config
from publisher.memory_budget import MemoryBudget
from publisher.read.catalog import Catalog
from publisher.read.live_model import LiveModel
from publisher.read.restore import read_blob
from publisher.read.sinks import dlrm_sink
from publisher.store import FileStore
from schemas.errors import CheckNRunError
from schemas.store_keys import head_key

MiB = 1024 * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rss_peak_growth(action: Callable[[], object]) -> int:
    """Bytes the peak RSS rose above the current RSS while `action` ran (and raised)."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    _refused(action)
    return (_status_kib("VmHWM") - before) * 1024


def _refused(action: Callable[[], object]) -> str:
    try:
        action()
    except CheckNRunError as exc:
        return type(exc).__name__
    raise RuntimeError("the hostile object was accepted")


@dataclass(frozen=True)
class Cost:
    """What one rejection of a hostile object cost."""

    case: str
    error: str
    seconds: float
    traced_peak_bytes: int
    rss_peak_growth_bytes: int

    def row(self) -> str:
        traced, rss = self.traced_peak_bytes / MiB, self.rss_peak_growth_bytes / MiB
        return (
            f"| {self.case} | {self.error} | {self.seconds * 1000:.3f} ms | {traced:.2f} MiB | "
            f"{rss:.1f} MiB |"
        )


def measure(case: str, action: Callable[[], object], repeats: int) -> Cost:
    error = _refused(action)  # warm: imports, caches, the catalog's manifests
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        _refused(action)
        seconds.append(time.perf_counter() - started)
    rss = max(_rss_peak_growth(action) for _ in range(repeats))
    tracemalloc.start()
    try:
        _refused(action)
        traced = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return Cost(case, error, statistics.median(seconds), traced, rss)


def _published(root: Path, stack: ExitStack, *kinds: str) -> tuple[FileStore, SyntheticRun]:
    store = FileStore(root)
    run = SyntheticRun(store, "m", small_config(), codec="fp32")
    stack.callback(run.close)
    for kind in kinds:
        run.train(2)
        run.publish(kind)  # type: ignore[arg-type]
    return store, run


def _rewrite_manifest(
    store: FileStore, version: int, change: Callable[[dict[str, object]], None]
) -> None:
    key = Catalog(store, "m").find(version).key
    path = store.root / key
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_text(json.dumps(doc))


def forged_model_config(root: Path, stack: ExitStack) -> Callable[[], object]:
    store, run = _published(root, stack, "full")
    live = LiveModel(store, "m", dlrm_sink(memory_budget=MemoryBudget(256 * MiB)))
    stack.callback(live.close)
    live.bootstrap()
    run.train(2)
    run.publish("full")

    def huge(doc: dict[str, object]) -> None:
        config = doc["model_config"]
        assert isinstance(config, dict)
        config["sparse"][0]["rows"] = 2**20
        config["embedding_dim"] = 256

    _rewrite_manifest(store, 2, huge)
    return live.catch_up


def zstd_bomb(table: str, inflated: int, dim: int = 64) -> bytes:
    """A valid fp32 blob of every row of a table holding `inflated` bytes of zeros."""
    rows = inflated // (4 * dim)
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=inflated)
    zeros = bytes(MiB)
    codes = b"".join(compressor.compress(zeros) for _ in range(inflated // MiB))
    codes += compressor.flush()
    empty = {"compression": "none", "stored_len": 0, "raw_len": 0}
    header = {
        "table": table,
        "codec": "fp32",
        "dim": dim,
        "table_rows": rows,
        "n_rows": rows,
        "aux_dim": 0,
        "row_encoding": "all",
        "sections": [
            {"name": "rows", **empty},
            {"name": "codes", "compression": "zstd", "stored_len": len(codes), "raw_len": inflated},
            {"name": "scale_bias", **empty},
            {"name": "aux", **empty},
        ],
    }
    raw = json.dumps(header).encode()
    body = b"CNRDELTA" + struct.pack("<HHI", 1, 0, len(raw)) + raw + codes
    return body + struct.pack("<I", zlib.crc32(body))


def blob_bomb(root: Path, stack: ExitStack) -> Callable[[], object]:
    store, _ = _published(root, stack, "full", "delta")
    entry = Catalog(store, "m").find(2).manifest.tables[0]
    bomb = zstd_bomb(entry.name, 1024 * MiB)
    (store.root / entry.parts[0].blob.key).write_bytes(bomb)

    def agree(doc: dict[str, object]) -> None:
        tables = doc["tables"]
        assert isinstance(tables, list)
        tables[0]["blob"].update(size=len(bomb), sha256=hashlib.sha256(bomb).hexdigest())

    _rewrite_manifest(store, 2, agree)
    forged = Catalog(store, "m").find(2).manifest.tables[0]
    print(f"zstd bomb: {len(bomb):,} bytes inflating to {1024 * MiB:,}")
    return lambda: read_blob(store, forged)


def huge_head(root: Path, stack: ExitStack) -> Callable[[], object]:
    store, _ = _published(root, stack, "full")
    with open(store.root / head_key("m"), "wb") as f:
        f.truncate(300 * 1000 * 1000)
    return Catalog(store, "m").head


CASES: dict[str, Callable[[Path, ExitStack], Callable[[], object]]] = {
    "1: forged model_config, one 2^20 x 256 table": forged_model_config,
    "2: zstd blob inflating to 1 GiB": blob_bomb,
    "7: 300 MB HEAD": huge_head,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """How many timed rejections per object (the median is reported)."""
    parser.add_argument("--repeats", type=int, help="timed rejections per object (default 3)")


def run(quick: bool, *, repeats: int | None = None) -> dict[str, Any]:
    """Refuse each hostile object; print the table and return the part's document."""
    repeats = repeats or (1 if quick else 3)
    print("| item: hostile object | error | time per rejection | tracemalloc peak | RSS growth |")
    print("| --- | --- | ---: | ---: | ---: |")
    costs = []
    for name, build in CASES.items():
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            cost = measure(name, build(Path(tmp), stack), repeats)
        print(cost.row(), flush=True)
        costs.append(dataclasses.asdict(cost))
    return {
        "part": "rejections",
        "quick": quick,
        "repeats": repeats,
        "machine": describe_machine(),
        "rejections": costs,
    }
