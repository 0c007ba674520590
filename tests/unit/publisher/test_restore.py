"""Publish a simulated training run, restore every version: bitwise for fp32, bounded if lossy."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.sharded_run import job_publishers, publish_step, row_wise
from bench.synthetic_run import SyntheticRun, small_config
from publisher.cli import main
from publisher.codecs import QuantizedRows, decode_rows, encode_rows, max_abs_error_bound
from publisher.memory_budget import MemoryBudget
from publisher.read import blob_rows
from publisher.read.blob_rows import write_blob
from publisher.read.catalog import Catalog, VersionRef
from publisher.read.planner import restore_plan
from publisher.read.restore import (
    RestoredState,
    RestoreError,
    RowRange,
    read_blob,
    restore,
    restore_chain,
)
from publisher.store import FileStore, IntegrityError
from publisher.write.background import BackgroundPublisher
from publisher.write.job_publishing import CheckpointPublisher
from publisher.write.policies import make_policy
from publisher.write.snapshot import Snapshot, TableRows
from schemas.codec_names import CODECS
from schemas.delta_blob import round_to_bfloat16
from schemas.manifest import Position

TABLES = {"emb.a": (500, 8), "emb.b": (64, 4)}


class FakeTraining:
    """Tables that change a few rows per interval, like sparse training does."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.weights = {
            n: self.rng.normal(size=(r, d)).astype(np.float32) for n, (r, d) in TABLES.items()
        }
        self.aux = {n: np.zeros((r, 1), dtype=np.float32) for n, (r, _) in TABLES.items()}
        self.dense = {"mlp.w": self.rng.normal(size=(3, 3)).astype(np.float32)}
        self.step = 0

    def interval(self, fraction: float = 0.1) -> dict[str, np.ndarray]:
        """Change about `fraction` of each table's rows (every row at 1, none at 0)."""
        self.step += 1
        dirty = {}
        for name, (rows, dim) in TABLES.items():
            if fraction >= 1:
                ids = np.arange(rows, dtype=np.int64)
            else:
                draws = self.rng.integers(0, rows, size=int(rows * fraction))
                ids = np.unique(draws).astype(np.int64)
            self.weights[name][ids] += self.rng.normal(size=(len(ids), dim)).astype(np.float32)
            self.aux[name][ids] += 1.0
            dirty[name] = ids
        self.dense["mlp.w"] += 0.1
        return dirty

    def snapshot(
        self, plan_rows: dict[str, np.ndarray | None], kind: str, rel: str | None, codec: str
    ) -> Snapshot:
        tables = []
        for name, (rows, _) in TABLES.items():
            ids = plan_rows[name]
            ids = np.arange(rows, dtype=np.int64) if ids is None else ids
            tables.append(
                TableRows(
                    name,
                    rows,
                    codec,
                    ids.copy(),
                    self.weights[name][ids].copy(),
                    self.aux[name][ids].copy(),
                )
            )
        return Snapshot(
            kind=kind,
            relative_to=rel,
            policy="test",  # type: ignore[arg-type]
            tables=tuple(tables),
            position=Position(
                step=self.step, samples_seen=self.step * 100, reader={"offset": self.step * 100}
            ),
            dense={k: v.copy() for k, v in self.dense.items()},
            model_config={"arch": "fake"},
            metrics={"auc": 0.5},
        )

    def state(self) -> dict[str, np.ndarray]:
        return {
            **{n: w.copy() for n, w in self.weights.items()},
            **{n + ".aux": a.copy() for n, a in self.aux.items()},
            **{k: v.copy() for k, v in self.dense.items()},
        }


def run(
    store: FileStore,
    policy_name: str,
    codec: str,
    intervals: int,
    fractions: Sequence[float] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Publish `intervals` versions, each changing `fractions[i]` of the rows (default 0.1)."""
    training = FakeTraining()
    policy = make_policy(policy_name, {n: r for n, (r, _) in TABLES.items()})
    publisher = CheckpointPublisher(store, "m")
    states = []
    try:
        for i in range(intervals):
            plan = policy.plan(training.interval(0.1 if fractions is None else fractions[i]))
            publisher.publish(training.snapshot(plan.rows, plan.kind, plan.relative_to, codec))
            states.append(training.state())
    finally:
        publisher.close()
    return states


@pytest.mark.parametrize("policy", ["consecutive", "one-shot", "intermittent", "full"])
def test_fp32_restore_is_bitwise_exact_at_every_version(tmp_path: Path, policy: str) -> None:
    store = FileStore(tmp_path)
    states = run(store, policy, "fp32", intervals=8)  # 1 full + 7 deltas for consecutive
    chains = [len(restore_plan(Catalog(store, "m"), v)) for v in range(1, 9)]
    if policy == "consecutive":
        assert chains == list(range(1, 9))  # the longest chain: baseline + 7 deltas
    for version, expected in enumerate(states, start=1):
        got = restore(store, "m", version)
        assert got.position.step == version and got.position.reader == {"offset": version * 100}
        for name in TABLES:
            np.testing.assert_array_equal(got.tables[name].weights, expected[name], strict=True)
            np.testing.assert_array_equal(got.tables[name].aux, expected[name + ".aux"])
        np.testing.assert_array_equal(got.dense["mlp.w"], expected["mlp.w"])


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "int2", "int4-adaptive"])
def test_lossy_restore_is_within_codec_bound(tmp_path: Path, codec: str) -> None:
    store = FileStore(tmp_path)
    states = run(store, "consecutive", codec, intervals=6)
    got = restore(store, "m")
    for name in TABLES:
        expected = states[-1][name]
        bound = max_abs_error_bound(encode_rows(codec, expected))
        err = np.abs(got.tables[name].weights - expected).max(axis=1)
        assert np.all(err <= bound + 1e-6)
        # optimizer rows are stored as bfloat16, which holds these small counts exactly
        np.testing.assert_array_equal(got.tables[name].aux, states[-1][name + ".aux"])


@pytest.mark.parametrize("codec", ["fp32", "int4", "fp16"])
def test_optimizer_columns_restore_as_the_codec_stores_them(tmp_path: Path, codec: str) -> None:
    """A lossy codec's optimizer columns come back bfloat16-rounded, bit for bit, at every
    version of the chain (what a resumed trainer loads); fp32 ones come back exact."""
    store = FileStore(tmp_path)
    training = FakeTraining()
    training.aux = {
        n: training.rng.random(a.shape).astype(np.float32) for n, a in training.aux.items()
    }
    policy = make_policy("consecutive", {n: r for n, (r, _) in TABLES.items()})
    publisher = CheckpointPublisher(store, "m")
    states = []
    try:
        for _ in range(3):
            dirty = training.interval()
            for name, ids in dirty.items():
                training.aux[name][ids] += np.float32(1 / 3)
            plan = policy.plan(dirty)
            publisher.publish(training.snapshot(plan.rows, plan.kind, plan.relative_to, codec))
            states.append(training.state())
    finally:
        publisher.close()
    for version, state in enumerate(states, start=1):
        got = restore(store, "m", version)
        for name in TABLES:
            exact = state[name + ".aux"]
            expected = exact if codec == "fp32" else round_to_bfloat16(exact)
            np.testing.assert_array_equal(got.tables[name].aux, expected, strict=True)
            if codec != "fp32":
                assert not np.array_equal(expected, exact)  # the rounding did happen
                assert np.all(np.abs(got.tables[name].aux - exact) <= exact * 2**-8)


def replay_oldest_first(store: FileStore, chain: list[VersionRef]) -> dict[str, np.ndarray]:
    """Each table as applying its chain in order makes it: every blob written whole, the
    baseline first (what restore did before it read chains newest first)."""
    out = {}
    for entry in chain[-1].manifest.tables:
        weights = np.empty((entry.rows, entry.dim), dtype=np.float32)
        aux = np.empty((entry.rows, entry.aux_dim), dtype=np.float32)
        for ref in chain:
            write_blob(read_blob(store, ref.manifest.table(entry.name)), weights, aux)
        out[entry.name], out[entry.name + ".aux"] = weights, aux
    return out


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("policy", ["consecutive", "one-shot", "intermittent"])
def test_newest_first_restore_is_bitwise_the_oldest_first_replay(
    tmp_path: Path, policy: str, codec: str
) -> None:
    # Random chains: deltas of no row, a few, most and every row, in a random order.
    seed = CODECS.index(codec) * 3 + ["consecutive", "one-shot", "intermittent"].index(policy)
    fractions = np.random.default_rng(seed).choice([0.0, 0.02, 0.1, 0.5, 1.0], size=12)
    store = FileStore(tmp_path)
    run(store, policy, codec, intervals=12, fractions=[1.0, *fractions[1:]])
    catalog = Catalog(store, "m")
    lengths = set()
    for version in range(1, 13):
        chain = restore_plan(catalog, version)
        lengths.add(len(chain))
        expected = replay_oldest_first(store, chain)
        got = restore(store, "m", version)
        for name, table in got.tables.items():
            for key, array in ((name, table.weights), (name + ".aux", table.aux)):
                assert array.shape == expected[key].shape, key
                np.testing.assert_array_equal(array.view(np.uint32), expected[key].view(np.uint32))
    assert max(lengths) > (2 if policy == "consecutive" else 1)  # deltas over a baseline


def test_restore_decodes_each_row_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path)
    run(store, "consecutive", "int4", intervals=8, fractions=[1.0, 0.5, 0.9, 1.0, *[0.3] * 4])
    chain = restore_plan(Catalog(store, "m"))
    in_blobs = sum(e.rows_in_checkpoint for ref in chain for e in ref.manifest.tables)
    decoded: list[int] = []

    def counting(q: QuantizedRows, out: Any = None) -> np.ndarray:
        decoded.append(q.n_rows)
        return decode_rows(q, out=out)

    monkeypatch.setattr(blob_rows, "decode_rows", counting)
    got = restore_chain(store, chain)
    table_rows = sum(rows for rows, _ in TABLES.values())
    assert len(chain) == 8 and in_blobs > 3 * table_rows
    assert sum(decoded) == table_rows  # each row once, from the newest version holding it
    expected = replay_oldest_first(store, chain)
    for name, table in got.tables.items():
        np.testing.assert_array_equal(table.weights, expected[name], strict=True)


class CountingStore(FileStore):
    """A file store that records the key of every read (`fetched`)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fetched: list[str] = []

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.fetched.append(key)
        return super().get_range(key, start, length)

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        self.fetched.append(key)
        return super().get(key, max_bytes)


def test_a_restore_of_some_tables_fetches_only_their_blobs(tmp_path: Path) -> None:
    store = CountingStore(tmp_path)
    fetched = store.fetched
    run(store, "consecutive", "fp32", intervals=4)
    whole = restore(store, "m")
    one, other = sorted(TABLES)[:2]
    fetched.clear()
    part = restore(store, "m", tables={one})
    assert sorted(part.tables) == [one]
    np.testing.assert_array_equal(part.tables[one].weights, whole.tables[one].weights)
    np.testing.assert_array_equal(part.tables[one].aux, whole.tables[one].aux)
    np.testing.assert_array_equal(part.dense["mlp.w"], whole.dense["mlp.w"])
    chain = restore_plan(Catalog(store, "m"))
    blobs = {
        name: {part.blob.key for r in chain for part in r.manifest.table(name).parts}
        for name in (one, other)
    }
    assert blobs[one] <= set(fetched) and not blobs[other] & set(fetched)
    with pytest.raises(RestoreError, match="has no table 'nope'"):
        restore(store, "m", tables={one, "nope"})


def assert_rows_of(part: RestoredState, whole: RestoredState, rows: dict[str, RowRange]) -> None:
    """Each table of `part` is bit for bit the rows `rows` names (every row if unnamed) of the
    same table in `whole`, its weights and optimizer columns."""
    for name, table in part.tables.items():
        start, end = rows.get(name, (0, len(whole.tables[name].weights)))
        assert table.row_start == start and table.weights.shape[0] == end - start, name
        for got, full in (
            (table.weights, whole.tables[name].weights),
            (table.aux, whole.tables[name].aux),
        ):
            np.testing.assert_array_equal(got.view(np.uint32), full[start:end].view(np.uint32))


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_row_range_restores_bitwise_the_rows_of_a_full_restore(
    tmp_path: Path, codec: str
) -> None:
    """One-process versions (one blob per table): each blob is fetched and only the rows in
    range kept, at every version of a chain of deltas of few, most and every row."""
    store = CountingStore(tmp_path)
    run(
        store,
        "consecutive",
        codec,
        intervals=8,
        fractions=[1.0, 0.1, 0.5, 0.02, 1.0, 0.1, 0.3, 0.0],
    )
    rows: dict[str, RowRange] = {"emb.a": (123, 401), "emb.b": (63, 64)}
    for version in range(1, 9):
        whole = restore(store, "m", version)
        store.fetched.clear()
        part = restore(store, "m", version, rows=rows)
        assert_rows_of(part, whole, rows)
        np.testing.assert_array_equal(part.dense["mlp.w"], whole.dense["mlp.w"])
        chain = restore_plan(Catalog(store, "m"), version)
        blobs = {t.blob.key for ref in chain for t in ref.manifest.tables if t.blob is not None}
        assert blobs <= set(store.fetched) and part.bytes_read == whole.bytes_read
    assert len(restore_plan(Catalog(store, "m"))) == 8  # a baseline and 7 deltas
    some = restore(store, "m", tables={"emb.a"}, rows={"emb.a": (0, 1)})
    assert list(some.tables) == ["emb.a"] and some.tables["emb.a"].weights.shape == (1, 8)


def job_versions(root: Path, codec: str, ranks: int, versions: int) -> tuple[FileStore, FileStore]:
    """`versions` versions (a full, then deltas) of one state, published by a job of `ranks`
    row-wise ranks (one shard blob per rank of every table) into root/job, which counts its
    fetches, and by one writer into root/single."""
    config = small_config(rows=(300, 101), bag_rows=20, dim=8)
    single = SyntheticRun(FileStore(root / "single"), "m", config, codec=codec)
    store = CountingStore(root / "job")
    publishers = job_publishers(store, "m", ranks)
    layout = row_wise({"embeddings." + f.name: f.rows for f in config.sparse}, ranks)
    for i in range(versions):
        publish_step(single, publishers, layout, i)
    for publisher in publishers:
        publisher.close()
    single.close()
    return store, single.store  # type: ignore[return-value]


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_row_range_of_a_job_version_fetches_only_the_shards_it_overlaps(
    tmp_path: Path, codec: str
) -> None:
    store, single = job_versions(tmp_path, codec, ranks=4, versions=4)
    assert isinstance(store, CountingStore)
    f0 = Catalog(store, "m").find(4).manifest.table("embeddings.f0")
    assert f0.shards is not None
    assert [(s.row_start, s.row_end) for s in f0.shards] == [
        (0, 75),
        (75, 150),
        (150, 225),
        (225, 300),
    ]
    rows: dict[str, RowRange] = {"embeddings.f0": (80, 160), "embeddings.tags": (0, 5)}
    for version in range(1, 5):
        whole = restore(store, "m", version)
        one_writer = restore(single, "m", version)
        store.fetched.clear()
        part = restore(store, "m", version, rows=rows)
        assert_rows_of(part, whole, rows)
        assert_rows_of(restore(single, "m", version, rows=rows), one_writer, rows)
        assert_rows_of(part, one_writer, rows)
        chain = restore_plan(Catalog(store, "m"), version)
        shards = [ref.manifest.table("embeddings.f0").shards or () for ref in chain]
        overlapping = {s.blob.key for parts in shards for s in parts[1:3]}
        outside = {s.blob.key for parts in shards for s in (parts[0], parts[3])}
        assert overlapping <= set(store.fetched) and not outside & set(store.fetched)
        tags = {s.blob.key for ref in chain for s in ref.manifest.table("embeddings.tags").parts}
        assert len(tags & set(store.fetched)) == len(chain)  # rows 0-4: rank 0's shard only
        assert part.bytes_read < whole.bytes_read


def test_the_memory_budget_counts_the_rows_restored(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    run(store, "consecutive", "fp32", intervals=3)
    manifest = Catalog(store, "m").find(3).manifest
    a, b = manifest.table("emb.a"), manifest.table("emb.b")
    rows: dict[str, RowRange] = {"emb.a": (100, 200)}
    row_bytes = (a.dim + a.aux_dim) * 4
    fits_range = manifest.full_fp32_bytes - (a.rows - 100) * row_bytes
    assert restore(store, "m", budget=MemoryBudget(fits_range), rows=rows).version == 3
    with pytest.raises(RestoreError, match="over the memory budget"):
        restore(store, "m", budget=MemoryBudget(fits_range))  # the whole table does not fit
    with pytest.raises(RestoreError, match="over the memory budget"):
        restore(store, "m", budget=MemoryBudget(fits_range - 1), rows=rows)
    fits_one = fits_range - b.full_fp32_bytes(manifest.metrics)  # only the tables restored
    some = restore(store, "m", budget=MemoryBudget(fits_one), tables={"emb.a"}, rows=rows)
    assert list(some.tables) == ["emb.a"]
    with pytest.raises(RestoreError, match="over the memory budget"):
        restore(store, "m", budget=MemoryBudget(fits_one - 1), tables={"emb.a"}, rows=rows)


@pytest.mark.parametrize(
    ("tables", "rows", "error"),
    [
        (
            None,
            {"emb.a": (0, 0)},
            r"rows \[0, 0\) are not a non-empty range of its rows \[0, 500\)",
        ),
        (None, {"emb.a": (7, 3)}, r"rows \[7, 3\) are not"),
        (None, {"emb.a": (-1, 10)}, r"rows \[-1, 10\) are not"),
        (
            None,
            {"emb.b": (10, 65)},
            r"rows \[10, 65\) are not a non-empty range of its rows \[0, 64\)",
        ),
        (
            {"emb.b"},
            {"emb.a": (0, 10)},
            r"rows asked of tables \['emb.a'\] that version 2 does not",
        ),
        (None, {"nope": (0, 1)}, r"rows asked of tables \['nope'\]"),
    ],
)
def test_a_bad_row_range_is_refused_before_any_blob_is_fetched(
    tmp_path: Path, tables: set[str] | None, rows: dict[str, RowRange], error: str
) -> None:
    store = CountingStore(tmp_path)
    run(store, "consecutive", "fp32", intervals=2)
    blobs = set(Catalog(store, "m").find(2).manifest.blobs)
    store.fetched.clear()
    with pytest.raises(RestoreError, match=error):
        restore(store, "m", tables=tables, rows=rows)
    assert not {b.key for b in blobs} & set(store.fetched)


def test_a_chain_not_starting_with_a_full_table_is_refused_before_any_fetch(
    tmp_path: Path,
) -> None:
    store = CountingStore(tmp_path)
    fetched = store.fetched
    run(store, "consecutive", "int4", intervals=3)
    chain = restore_plan(Catalog(store, "m"))
    fetched.clear()
    with pytest.raises(RestoreError, match="must start with a full table"):
        restore_chain(store, chain[1:])
    assert fetched == []


def test_corrupt_blob_is_rejected(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    run(store, "consecutive", "int4", intervals=3)
    key = Catalog(store, "m").find(2).manifest.tables[0].blob.key
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x10
    store.put(key, bytes(data))
    with pytest.raises(IntegrityError):
        restore(store, "m", 3)
    restore(store, "m", 1)  # versions that do not need the blob are unaffected


def test_blob_disagreeing_with_manifest_is_rejected(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    run(store, "consecutive", "int4", intervals=2)
    catalog = Catalog(store, "m")
    m = catalog.find(2).manifest
    # Swap table a's blob bytes for table b's: sha256 then fails; forge the manifest too.
    a, b = m.tables[0].blob, m.tables[1].blob
    store.put(a.key, store.get(b.key))
    forged = m.model_copy(
        update={
            "tables": (
                m.tables[0].model_copy(update={"blob": b.model_copy(update={"key": a.key})}),
                m.tables[1],
            )
        }
    )
    store.put(catalog.find(2).key, forged.to_json())
    with pytest.raises(RestoreError, match="manifest says"):
        restore(store, "m", 2)


def test_background_publisher_merges_on_backlog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    gate = threading.Event()
    merged_on: set[str] = set()
    original_merge = Snapshot.merge

    def recording_merge(self: Snapshot, newer: Snapshot) -> Snapshot:
        merged_on.add(threading.current_thread().name)
        return original_merge(self, newer)

    monkeypatch.setattr(Snapshot, "merge", recording_merge)

    class SlowStore(FileStore):
        def put(self, key: str, data: bytes) -> str:
            if "/blobs/" in key:  # uploads hang until the gate opens; the lease works
                assert gate.wait(30)
            return super().put(key, data)

    store = SlowStore(tmp_path)
    training = FakeTraining()
    policy = make_policy("consecutive", {n: r for n, (r, _) in TABLES.items()})
    bg = BackgroundPublisher(CheckpointPublisher(store, "m"))
    for _ in range(6):
        plan = policy.plan(training.interval())
        bg.submit(training.snapshot(plan.rows, plan.kind, plan.relative_to, "fp32"))
    gate.set()
    bg.close()
    versions = Catalog(store, "m").versions()
    # Everything queued behind the blocked upload was folded into one version.
    assert len(versions) <= 2
    assert bg.merges == 6 - len(versions)
    # Folding happened on the publisher's threads, never on the submitting (training) thread.
    assert merged_on and threading.current_thread().name not in merged_on
    got = restore(store, "m")
    for name in TABLES:
        np.testing.assert_array_equal(got.tables[name].weights, training.weights[name])


def test_cli_ls_inspect_restore(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store_dir = tmp_path / "store"
    run(FileStore(store_dir), "intermittent", "int4", intervals=4)
    url = f"file://{store_dir}"
    assert main(["ls", "--store", url, "--model", "m", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [v["version"] for v in listing["versions"]] == [1, 2, 3, 4]
    assert listing["versions"][0]["kind"] == "full"
    assert main(["inspect", "--store", url, "--model", "m", "--version", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 2 and {t["name"] for t in doc["tables"]} == set(TABLES)
    assert all(t["ratio_vs_full_fp32"] > 1 for t in doc["tables"])
    out = tmp_path / "state.pt"
    assert main(["restore", "--store", url, "--model", "m", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 4
    payload = torch.load(out, weights_only=True)  # our own local file
    assert payload["state_dict"]["emb.a.weight"].shape == (500, 8)
    # A model the store holds nothing of is an error (issue 11.13), --json or not.
    assert main(["ls", "--store", url, "--model", "nothing", "--json"]) == 1
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]  # with --json, the error document (issue 11.8)
    assert error["type"] == "ModelNotFoundError" and error["exit_status"] == 1
    assert "holds nothing of it" in error["message"] and "holds nothing of it" in captured.err
    assert main(["inspect", "--store", url, "--model", "nothing"]) == 1
    assert "no committed version" in capsys.readouterr().err
