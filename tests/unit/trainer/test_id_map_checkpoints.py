"""Id maps through the checkpointer (docs/FORMAT.md section 7): every version carries the
entries of the rows it writes, restore rebuilds each version's map exactly (full + deltas, every
policy, merged snapshots, the process publisher), and resume loads it into the trainer's own
IdMap objects."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from publisher.cli import main as store_main
from publisher.id_map import IdMap
from publisher.read.catalog import Catalog
from publisher.read.restore import restore
from publisher.read.retention import plan_gc, run_gc
from publisher.store import FileStore
from publisher.write.snapshot import Snapshot
from schemas.id_map_blob import decode_id_map_blob
from schemas.manifest import IDS_HELD_METRIC
from trainer.checkpointer import CheckpointError, IncrementalCheckpointer

ROWS = 24  # few rows for the ids drawn: admissions, evictions and reuse all happen
BATCH = 4


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


class Live(nn.Module):
    """A model over raw user ids: one table whose rows the id map hands out, a dense head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.users = nn.Embedding(ROWS, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.users(rows)).squeeze(1)
        return out


class Trainer:
    """Admission at first sight, least-recently-seen eviction when full (the evicted row is
    re-initialised and marked dirty), a count and last_seen per event: the rules part B's
    id space follows, small enough to read."""

    def __init__(self, store: str, seed: int = 0, hashed: bool = False, **kwargs: Any) -> None:
        self.model = Live(seed)
        self.optimizers = [
            torch.optim.SparseAdam([self.model.users.weight], lr=0.05),
            torch.optim.Adam(self.model.head.parameters(), lr=0.05),
        ]
        self.id_map = IdMap(ROWS, hashed=hashed)
        options: dict[str, Any] = {
            "policy": "consecutive",
            "codec": "fp32",
            "interval_samples": 3 * BATCH,
            **kwargs,
        }
        self.ckpt = IncrementalCheckpointer(
            self.model,
            self.optimizers,
            store=store,
            model_name="live",
            id_maps={"users": self.id_map},
            **options,
        )
        #: the map as each snapshot saw it, by record index (= snapshot sequence).
        self.expected: dict[int, IdMap] = {}

    def rows_of(self, keys: list[str], ts: float) -> list[int]:
        m = self.id_map
        rows = []
        for key in keys:
            if m.hashed:
                row = int(m.lookup([key])[0])
            elif (held := m.row_of(key)) is not None:
                row = held
            else:
                free = m.free_rows()
                if len(free):
                    row = int(free[0])
                else:
                    row = int(np.argmin(m.last_seen[1:])) + 1
                    m.release(row)
                    with torch.no_grad():
                        self.model.users.weight[row] = 0.0
                    self.ckpt.tracked.tracker.mark("users", np.array([row]))
                m.assign(key, row)
            m.counts[row] += 1
            m.last_seen[row] = ts
            rows.append(row)
        return rows

    def train(self, steps: range, *, flush: bool = True) -> None:
        for step in steps:
            rng = np.random.default_rng(step)
            keys = [f"user-{k}" for k in rng.integers(0, 40, BATCH)]
            rows = torch.tensor(self.rows_of(keys, 1.7e9 + step))
            loss = self.model(rows).sum()
            for o in self.optimizers:
                o.zero_grad()
            loss.backward()
            for o in self.optimizers:
                o.step()
            self.ckpt.step(BATCH)
            record = self.ckpt.maybe_checkpoint(reader={"offset": step + 1})
            if record is not None:
                self.expected[record.index] = self.id_map.copy()
                if flush:
                    self.ckpt.flush()

    def versions(self) -> dict[int, IdMap]:
        """The map each committed version must restore to."""
        self.ckpt.flush()
        return {
            r.version: self.expected[r.index] for r in self.ckpt.records if r.version is not None
        }


def same_map(a: IdMap, b: IdMap) -> bool:
    x, y = a.entries(), b.entries()
    return (
        (a.rows, a.hashed, len(a)) == (b.rows, b.hashed, len(b))
        and x.keys == y.keys
        and np.array_equal(x.assigned, y.assigned)
        and np.array_equal(x.counts, y.counts)
        and np.array_equal(x.last_seen, y.last_seen)
        and all(a.row_of(k) == b.row_of(k) for k in x.keys if k)
    )


@pytest.mark.parametrize("policy", ["consecutive", "intermittent", "one-shot", "full"])
def test_every_version_restores_the_map_it_was_taken_with(tmp_path: Path, policy: str) -> None:
    t = Trainer(f"file://{tmp_path}", policy=policy)
    with t.ckpt:
        t.train(range(60))
        expected = t.versions()
    assert len(expected) == 20 and len(t.id_map) == ROWS - 1  # full: evictions happened
    store = FileStore(tmp_path)
    kinds = {v.manifest.kind for v in Catalog(store, "live").versions()}
    assert kinds == ({"full"} if policy == "full" else {"full", "delta"})
    for version, id_map in expected.items():
        state = restore(store, "live", version)
        assert same_map(state.id_maps["users"], id_map), version
        entry = state.manifest.table("users")
        assert entry.id_map is not None and entry.id_map.key.endswith(".idmap")
        assert state.manifest.metrics[f"{IDS_HELD_METRIC}users"] == len(id_map)


def test_a_delta_carries_the_entries_of_its_rows_only(tmp_path: Path) -> None:
    t = Trainer(f"file://{tmp_path}")
    with t.ckpt:
        t.train(range(9))
    versions = Catalog(FileStore(tmp_path), "live").versions()
    delta = versions[-1].manifest.table("users")
    full = versions[0].manifest.table("users")
    assert delta.id_map is not None and full.id_map is not None
    assert 0 < delta.rows_in_checkpoint < ROWS
    # Each blob holds the entries of its table blob's rows, no more.
    store = FileStore(tmp_path)
    for entry in (delta, full):
        assert entry.id_map is not None
        decoded, hashed = decode_id_map_blob(
            store.get(entry.id_map.key), n_rows=entry.rows_in_checkpoint
        )
        assert decoded.n == entry.rows_in_checkpoint and not hashed
    # What a version wrote counts its id-map blobs.
    manifest = versions[-1].manifest
    assert delta.id_map in manifest.blobs
    assert manifest.written_bytes == sum(b.size for b in manifest.blobs) + len(manifest.to_json())


def test_merged_snapshots_restore_the_newest_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slow store: snapshots queue behind the publisher and are folded into one.
    put = FileStore.put

    def slow_put(self: FileStore, key: str, data: bytes) -> str:
        time.sleep(0.05)
        return put(self, key, data)

    merges = []
    merge = Snapshot.merge

    def counting_merge(self: Snapshot, newer: Snapshot) -> Snapshot:
        merges.append(newer.sequence)
        return merge(self, newer)

    monkeypatch.setattr(FileStore, "put", slow_put)
    monkeypatch.setattr(Snapshot, "merge", counting_merge)
    t = Trainer(f"file://{tmp_path}")
    with t.ckpt:
        t.train(range(45), flush=False)
        expected = t.versions()
    assert merges and len(expected) < 15
    for version, id_map in expected.items():
        assert same_map(restore(FileStore(tmp_path), "live", version).id_maps["users"], id_map)


@pytest.mark.multiprocess  # the publisher runs in a child process
def test_the_process_publisher_carries_the_maps(tmp_path: Path) -> None:
    t = Trainer(f"file://{tmp_path}", publish_in="process")
    with t.ckpt:
        t.train(range(30))
        expected = t.versions()
    for version, id_map in expected.items():
        assert same_map(restore(FileStore(tmp_path), "live", version).id_maps["users"], id_map)


def test_a_hashed_map_round_trips_its_counts(tmp_path: Path) -> None:
    t = Trainer(f"file://{tmp_path}", hashed=True)
    with t.ckpt:
        t.train(range(15))
        expected = t.versions()
    for version, id_map in expected.items():
        state = restore(FileStore(tmp_path), "live", version)
        assert same_map(state.id_maps["users"], id_map) and state.id_maps["users"].hashed
        assert not any(k.startswith(IDS_HELD_METRIC) for k in state.manifest.metrics)
    assert int(t.id_map.counts.sum()) == 15 * BATCH


def test_resume_loads_the_map_into_the_trainers_own_objects(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    first = Trainer(url)
    with first.ckpt:
        first.train(range(30))
    second = Trainer(url, seed=1)
    id_map, counts = second.id_map, second.id_map.counts
    with second.ckpt:
        position = second.ckpt.resume()
        assert position.reader == {"offset": 30}
        assert second.id_map is id_map and id_map.counts is counts  # in place
        assert same_map(id_map, first.id_map)
        assert second.ckpt.capture.id_maps["users"] is id_map
        # Training on from the resumed map is training on from where the first run stopped.
        second.train(range(30, 45))
    reference = Trainer(f"file://{tmp_path}/reference")
    reference.model.load_state_dict(first.model.state_dict())
    reference.id_map.load_from(first.id_map)
    for mine, theirs in zip(reference.optimizers, first.optimizers, strict=True):
        mine.load_state_dict(theirs.state_dict())
    with reference.ckpt:
        reference.train(range(30, 45))
    assert same_map(second.id_map, reference.id_map)
    assert same_map(restore(FileStore(tmp_path), "live").id_maps["users"], second.id_map)


def test_resume_refuses_maps_that_do_not_fit_before_loading_anything(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    first = Trainer(url)
    with first.ckpt:
        first.train(range(12))

    model = Live(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizers = [
        torch.optim.SparseAdam([model.users.weight]),
        torch.optim.Adam(model.head.parameters()),
    ]
    cases: list[dict[str, IdMap]] = [{}, {"users": IdMap(ROWS, hashed=True)}]
    for id_maps in cases:
        ckpt = IncrementalCheckpointer(
            model, optimizers, store=url, model_name="live", id_maps=id_maps, preallocate=False
        )
        with ckpt, pytest.raises(CheckpointError, match="id map"):
            ckpt.resume()
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key
        for id_map in id_maps.values():
            assert int(id_map.counts.sum()) == 0


@pytest.mark.parametrize(
    ("id_maps", "message"),
    [
        ({"items": IdMap(ROWS)}, "not a table"),
        ({"users": IdMap(ROWS + 1)}, f"has {ROWS} rows, its id map {ROWS + 1}"),
    ],
)
def test_id_maps_must_match_the_tables(id_maps: dict[str, IdMap], message: str) -> None:
    model = Live(0)
    optimizers = [torch.optim.SparseAdam([model.users.weight])]
    with pytest.raises(CheckpointError, match=message):
        IncrementalCheckpointer(
            model, optimizers, store="file:///nonexistent-unused", model_name="m", id_maps=id_maps
        )


def test_inspect_and_ls_show_the_id_maps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = Trainer(f"file://{tmp_path}")
    with t.ckpt:
        t.train(range(9))
    url = f"file://{tmp_path}"
    versions = Catalog(FileStore(tmp_path), "live").versions()
    assert store_main(["inspect", "--store", url, "--model", "live", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    entry = versions[-1].manifest.table("users")
    assert entry.id_map is not None
    (table,) = doc["tables"]
    assert table["id_map_bytes"] == entry.id_map.size == doc["id_map_bytes"]
    assert table["id_map_keys"] == [entry.id_map.key]
    assert table["ids_held"] == len(t.id_map) > 0
    assert store_main(["inspect", "--store", url, "--model", "live"]) == 0
    text = capsys.readouterr().out
    assert f"({entry.id_map.size:,} in id maps)" in text
    assert "ids held" in text and f" {len(t.id_map):>10}" in text.splitlines()[-2]
    assert store_main(["ls", "--store", url, "--model", "live", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)["versions"]
    assert [v["id_map_bytes"] for v in listing] == [
        v.manifest.table("users").id_map.size  # type: ignore[union-attr]
        for v in versions
    ]
    assert store_main(["ls", "--store", url, "--model", "live"]) == 0
    assert "id maps" in capsys.readouterr().out.splitlines()[0]


def test_gc_deletes_the_id_maps_of_dropped_versions_and_keeps_the_others(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path)
    t = Trainer(f"file://{tmp_path}")
    with t.ckpt:
        t.train(range(9))
        t.ckpt.checkpoint_now(reader={"offset": 9}, force_full=True)
        t.expected[t.ckpt.records[-1].index] = t.id_map.copy()
        t.train(range(9, 15))
        expected = t.versions()
    versions = Catalog(store, "live").versions()
    assert [v.manifest.kind for v in versions] == [
        "full",
        "delta",
        "delta",
        "full",
        "delta",
        "delta",
    ]
    # A crashed publish's leftover id-map blob.
    orphan = versions[0].manifest.table("users").id_map.key.replace("0000-", "0009-")  # type: ignore[union-attr]
    store.put(orphan, b"left over")
    plan = plan_gc(store, "live", keep_baselines=1, grace_s=0.0, now=time.time() + 10)
    assert plan.deleted_versions == [1, 2, 3] and orphan in plan.orphan_keys
    dropped = [v.manifest.table("users").id_map.key for v in versions[:3]]  # type: ignore[union-attr]
    assert set(dropped) <= set(plan.delete_keys)
    run_gc(store, plan)
    keys = {info.key for info in store.list("live/")}
    assert not set(dropped) & keys and orphan not in keys
    for v in versions[3:]:
        assert v.manifest.table("users").id_map.key in keys  # type: ignore[union-attr]
        assert same_map(restore(store, "live", v.version).id_maps["users"], expected[v.version])


def test_a_version_without_id_maps_resumes_into_hashed_maps_only(tmp_path: Path) -> None:
    """A sharded job's version (its tables carry no id map) continues in a hashed id space,
    whose maps hold nothing but counts: they start empty; a dynamic map is refused."""
    url = f"file://{tmp_path}"

    def checkpointer(seed: int, id_maps: dict[str, IdMap] | None) -> IncrementalCheckpointer:
        model = Live(seed)
        optimizers = [
            torch.optim.SparseAdam([model.users.weight]),
            torch.optim.Adam(model.head.parameters()),
        ]
        return IncrementalCheckpointer(
            model, optimizers, store=url, model_name="live", id_maps=id_maps
        )

    with checkpointer(1, None) as ckpt:
        ckpt.checkpoint_now(reader={"offset": 0})
    hashed = IdMap(ROWS, hashed=True)
    with checkpointer(2, {"users": hashed}) as ckpt:
        ckpt.resume()
    assert int(hashed.counts.sum()) == 0
    with (
        checkpointer(2, {"users": IdMap(ROWS)}) as ckpt,
        pytest.raises(CheckpointError, match="id map"),
    ):
        ckpt.resume()


def test_a_full_carries_the_rows_its_ids_hold_restores_the_rest_as_zero_and_resumes_them_fresh(
    tmp_path: Path,
) -> None:
    """docs/FORMAT.md 7.1: a full's bytes follow the ids held, not the table's capacity."""
    url = f"file://{tmp_path}"
    first = Trainer(url)
    with first.ckpt:
        first.train(range(2))  # 8 events: at most 8 of the 24 rows hold an id
        first.ckpt.checkpoint_now(reader={"offset": 2}, force_full=True)
    held = np.flatnonzero([first.id_map.key_of(r) is not None for r in range(ROWS)])
    carried = np.concatenate([[0], held])
    manifest = Catalog(FileStore(tmp_path), "live").versions()[-1].manifest
    entry = manifest.table("users")
    assert manifest.kind == "full" and entry.rows_in_checkpoint == len(carried) < ROWS
    dense = manifest.full_fp32_bytes - entry.full_fp32_bytes(manifest.metrics)
    assert entry.full_fp32_bytes(manifest.metrics) == len(carried) * (4 + entry.aux_dim) * 4
    assert manifest.restored_fp32_bytes == ROWS * (4 + entry.aux_dim) * 4 + dense

    state = restore(FileStore(tmp_path), "live")
    table = state.tables["users"]
    weights = first.model.users.weight.detach().numpy()
    np.testing.assert_array_equal(table.weights[carried], weights[carried])  # fp32: bitwise
    free = np.setdiff1d(np.arange(ROWS), carried)
    assert table.unwritten.tolist() == free.tolist()
    assert not table.weights[free].any() and not table.aux[free].any()
    assert same_map(state.id_maps["users"], first.id_map)

    second = Trainer(url, seed=1)
    built = second.model.users.weight.detach().numpy().copy()
    with second.ckpt:
        second.ckpt.resume()
        resumed = second.model.users.weight.detach().numpy()
        np.testing.assert_array_equal(resumed[carried], weights[carried])
        # the rows no version carried keep the new model's own initial values, not zeros
        np.testing.assert_array_equal(resumed[free], built[free])
        assert same_map(second.id_map, first.id_map)
