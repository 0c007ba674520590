"""One "x smaller than fp32" (docs/FORMAT.md 3.1): `train`, `ls` and `inspect` report the same
figure for a version, and a `--policy full --codec fp32` run reports 1.0x less its container
overhead, also for a tiny model whose dense state outweighs its tables (`ls` once said 0.01x:
it counted the tables alone)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from publisher.cli import main as store_main
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.store import FileStore
from trainer.cli import main as train_main


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


def command_json(
    capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], int], *argv: str
) -> dict[str, Any]:
    """Run a command with --json; the one JSON document it printed."""
    assert main(list(argv)) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


@pytest.mark.parametrize(
    ("table_cap", "lowest"),
    [
        ("400", 0.97),  # 26 tables x 400 rows x (8 + 1): headers are ~1% of the state
        ("2", 0.9),  # 2 rows a table: the dense state dominates, 26 headers weigh more
    ],
)
def test_full_fp32_run_reports_one_x(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table_cap: str, lowest: float
) -> None:
    url = f"file://{tmp_path}"
    train = command_json(
        capsys,
        train_main,
        "train",
        "--data",
        "synthetic",
        "--table-cap",
        table_cap,
        "--embedding-dim",
        "8",
        "--batch-size",
        "256",
        "--interval-samples",
        "2000",
        "--max-samples",
        "4096",
        "--policy",
        "full",
        "--codec",
        "fp32",
        "--store",
        url,
        "--json",
    )
    listing = command_json(
        capsys, store_main, "ls", "--store", url, "--model", "synthetic", "--json"
    )
    listed = {v["version"]: v for v in listing["versions"]}
    records = [r for r in train["checkpoints"] if r["version"] is not None]
    assert records and sorted(r["version"] for r in records) == sorted(listed)

    store = FileStore(tmp_path)
    refs = {ref.version: ref for ref in Catalog(store, "synthetic").versions()}
    for record in records:
        version = record["version"]
        shown = command_json(
            capsys,
            store_main,
            "inspect",
            *("--store", url, "--model", "synthetic", "--version", str(version), "--json"),
        )
        # The same version, the same three numbers, whichever command shows them.
        for doc in (listed[version], shown):
            assert doc["bytes"] == record["bytes"]
            assert doc["full_fp32_bytes"] == record["full_fp32_bytes"]
            assert doc["ratio_vs_full_fp32"] == record["ratio"]
        assert lowest <= record["ratio"] <= 1.0

        # Written bytes: every object the version put in the store, manifest included.
        ref = refs[version]
        keys = [b.key for b in ref.manifest.blobs] + [ref.key]
        assert record["bytes"] == sum(len(store.get(k)) for k in keys)
        assert shown["bytes"] == (
            sum(t["bytes"] for t in shown["tables"])
            + shown["dense_bytes"]
            + shown["optimizer_bytes"]
            + shown["manifest_bytes"]
        )
        # Full fp32 bytes: the restored state itself, table rows, optimizer rows, dense state.
        state = restore(store, "synthetic", version)
        arrays = [a for t in state.tables.values() for a in (t.weights, t.aux)]
        arrays += [*state.dense.values(), *state.optimizer.values()]
        assert all(a.dtype.itemsize == 4 for a in arrays)
        assert record["full_fp32_bytes"] == sum(a.nbytes for a in arrays)

    summary = train["summary"]
    written = sum(r["bytes"] for r in records)
    assert summary["ratio"] == round(sum(r["full_fp32_bytes"] for r in records) / written, 3)
