"""A live model's id maps on the server, against versions the real IncrementalCheckpointer wrote
(bench/synthetic_live.py) into a FileStore, for both consistency schemes.

Covers: the maps are the trainer's at the served version (bootstrap, follow, rebuild); a new id
is served from the version that carries it; an evicted-and-reused row serves the new id's
re-initialised values and the old id becomes unknown; a bad id-map blob (bytes, hostile
content, another mode, a missing one) rejects the version and leaves both copies intact; no
prediction maps ids with one version and reads rows of another while versions apply.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.synthetic_live import SyntheticLiveRun
from publisher.dlrm import DLRMConfig, build_served_model
from publisher.id_map import IdMap, IdMapError
from publisher.live_features import LiveFeature, LiveSpec
from publisher.memory_budget import (
    ID_MAP_ROW_BYTES,
    MemoryBudget,
    MemoryBudgetError,
    served_id_maps_bytes,
)
from publisher.read import ApplyError, Catalog, ConsistencyScheme, ModelCopy, rejection_reason
from publisher.read.consistency import DoubleBufferSlot
from publisher.read.copy_builders import ModuleBuilder
from publisher.read.live_model import LiveModel
from publisher.read.restore import restore
from publisher.store import FileStore
from schemas.errors import BadDataError
from schemas.id_map_blob import IdEntries, decode_id_map_blob, encode_id_entries
from server.predictors import DLRMPredictor
from tests.support import dlrm_live

SCHEMES: list[ConsistencyScheme] = ["double-buffer", "rwlock"]
TS = 1_700_000_000.0


def events(users: list[str], *, item: int = 1, ts: float = TS) -> list[dict[str, Any]]:
    """One event per user, with a few items and genres and alternating labels."""
    return [
        {
            "user": u,
            "item": item + i % 3,
            "genres": ["a", "b"][: i % 3],
            "ts": ts + i,
            "label": i % 2,
        }
        for i, u in enumerate(users)
    ]


@dataclass
class LiveWorld:
    root: Path
    store: FileStore
    run: SyntheticLiveRun
    live: LiveModel

    def scores(self, examples: list[dict[str, Any]]) -> tuple[int, np.ndarray, dict[str, int]]:
        """What the server predicts, as the predict route does: map and forward under one
        reader. (version, scores, unknown ids)."""
        predictor = DLRMPredictor()
        with self.live.reader() as buffer:
            assert buffer.served is not None
            scored = predictor.score(predictor.check(examples, buffer, TS), buffer)
            assert scored.unknown_ids is not None
            return buffer.served.version, scored.scores.numpy(), scored.unknown_ids

    def manifest_path(self, version: int) -> Path:
        return self.root / Catalog(self.store, "m").find(version).key


def make_world(tmp_path: Path, scheme: ConsistencyScheme, **run: Any) -> LiveWorld:
    store = FileStore(tmp_path / "store")
    return LiveWorld(
        tmp_path / "store",
        store,
        SyntheticLiveRun(store, "m", **run),
        dlrm_live(store, "m", scheme),
    )


@pytest.fixture(params=SCHEMES)
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveWorld]:
    w = make_world(tmp_path, request.param)
    yield w
    w.live.close()
    w.run.close()


def map_state(id_map: IdMap) -> tuple[tuple[str, ...], list[int], list[float]]:
    e = id_map.entries()
    return e.keys, e.counts.tolist(), e.last_seen.tolist()


def assert_maps_match(buffer: ModelCopy, maps: dict[str, IdMap]) -> None:
    assert set(buffer.id_maps) == set(maps)
    for name, id_map in maps.items():
        assert map_state(buffer.id_maps[name]) == map_state(id_map), name


def assert_serves(w: LiveWorld, version: int) -> None:
    """The served rows and maps are bitwise those `restore()` rebuilds at `version`, in every
    copy the scheme holds (the double buffer's standby too)."""
    state = restore(w.store, "m", version)
    slot = w.live.sink.slot
    buffers = [slot.current()]
    if isinstance(slot, DoubleBufferSlot) and slot._standby is not None:
        buffers.append(slot._standby)  # the copy the next version is written into
    for buffer in buffers:
        assert buffer is not None and buffer.served is not None
        assert buffer.served.version == version
        assert_maps_match(buffer, state.id_maps)
        for name, table in state.tables.items():
            assert np.array_equal(buffer.values(name).numpy(), table.weights), name


def test_bootstrap_and_follow_serve_the_trainers_maps(world: LiveWorld) -> None:
    world.run.train(events([f"u{i}" for i in range(8)]))
    world.run.publish()
    world.run.train(events(["u1", "u9"], ts=TS + 100))
    v2 = world.run.publish()
    world.live.bootstrap()
    assert_serves(world, v2)
    assert_maps_match(world.live.sink.current(), world.run.id_maps)  # type: ignore[arg-type]
    world.run.train(events(["u2", "u10", "u11"], ts=TS + 200))
    v3 = world.run.publish()
    assert world.live.advance(Catalog(world.store, "m").find(v3)) == [v3]
    assert_serves(world, v3)
    # What the server predicts for raw ids is what the trainer's model predicts.
    asked = [{"user": u, "item": 2, "genres": ["a"], "ts": TS} for u in ("u1", "u10", "nobody")]
    version, served, unknown = world.scores(asked)
    assert version == v3
    np.testing.assert_allclose(served, world.run.scores(asked), rtol=0, atol=1e-6)
    assert unknown == {"user": 1, "item": 0, "genres": 0}


def test_a_new_id_is_served_from_the_version_that_carries_it(world: LiveWorld) -> None:
    world.run.train(events(["u1", "u2"]))
    world.run.publish()
    world.live.bootstrap()
    asked = [{"user": "fresh", "item": 1, "ts": TS}]
    _, before, unknown = world.scores(asked)
    assert unknown["user"] == 1
    world.run.train(events(["fresh"] * 3))
    v2 = world.run.publish()
    world.live.advance(Catalog(world.store, "m").find(v2))
    version, after, unknown = world.scores(asked)
    assert (version, unknown["user"]) == (v2, 0)
    np.testing.assert_allclose(after, world.run.scores(asked), rtol=0, atol=1e-6)
    assert not np.allclose(after, before)


def test_an_evicted_and_reused_row_serves_the_new_ids_values(world: LiveWorld) -> None:
    world.run.train(events(["old", "keep"]))
    world.run.train(events(["old"] * 4, ts=TS + 10))
    world.run.publish()
    world.live.bootstrap()
    row = world.run.id_map("user").row_of("old")
    assert row is not None
    old_values = world.live.sink.current().values("embeddings.user")[row].clone()  # type: ignore[union-attr]

    assert world.run.evict("user", "old") == row
    world.run.train(events(["new"], ts=TS + 20))  # admitted into the freed row
    assert world.run.id_map("user").row_of("new") == row
    v2 = world.run.publish()
    world.live.advance(Catalog(world.store, "m").find(v2))
    assert_serves(world, v2)

    buffer = world.live.sink.current()
    assert buffer is not None
    served_row = buffer.values("embeddings.user")[row]
    assert torch.equal(served_row, world.run.model.embeddings["user"].weight[row].detach())
    assert not torch.allclose(served_row, old_values)
    user_map = buffer.id_maps["embeddings.user"]
    assert user_map.row_of("new") == row and user_map.row_of("old") is None
    assert int(user_map.counts[row]) == 1  # the new id's count, not the old id's 5
    asked = [{"user": "new", "item": 1, "ts": TS}, {"user": "old", "item": 1, "ts": TS}]
    _, served, unknown = world.scores(asked)
    assert unknown["user"] == 1  # "old" is unknown now
    np.testing.assert_allclose(served, world.run.scores(asked), rtol=0, atol=1e-6)


# --- bad id maps ---------------------------------------------------------------------------


Change = Callable[[bytes, int], bytes]


def rewrite_id_map(w: LiveWorld, version: int, table: int, change: Change, *, seal: bool) -> None:
    """Replace the id-map blob of table `table` of `version` by `change(bytes, its rows)`;
    with `seal` also its manifest entry's size and sha256 (as a writer that published it would
    have: it passes every integrity check)."""
    path = w.manifest_path(version)
    doc = json.loads(path.read_bytes())
    ref = doc["tables"][table]["id_map"]
    blob = w.root / ref["key"]
    bad = change(blob.read_bytes(), doc["tables"][table]["rows_in_checkpoint"])
    blob.write_bytes(bad)
    if seal:
        ref["size"], ref["sha256"] = len(bad), hashlib.sha256(bad).hexdigest()
        path.write_text(json.dumps(doc))


def reencode(edit: Callable[[IdEntries, int], IdEntries], *, hashed: bool | None = None) -> Change:
    """A change that decodes the blob, edits its entries and encodes them again."""

    def change(data: bytes, n_rows: int) -> bytes:
        entries, was_hashed = decode_id_map_blob(data, n_rows=n_rows)
        mode = was_hashed if hashed is None else hashed
        return encode_id_entries(edit(entries, n_rows), hashed=mode)

    return change


def with_key(entries: IdEntries, position: int, key: str) -> IdEntries:
    assigned = entries.assigned.copy()
    assigned[position] = True
    keys = list(entries.keys)
    keys[position] = key
    return IdEntries(assigned, entries.counts, entries.last_seen, tuple(keys))


def without_keys(entries: IdEntries) -> IdEntries:
    """The entries as a hashed map's blob holds them: counts only."""
    n = entries.n
    return IdEntries(np.zeros(n, dtype=np.bool_), entries.counts, entries.last_seen, ("",) * n)


def clash_with_held_id(entries: IdEntries, n: int) -> IdEntries:
    # The delta's user rows: give the last one the id another (untouched) row holds.
    return with_key(entries, n - 1, "u0")


BAD_ID_MAPS: dict[str, tuple[str, Change, bool]] = {
    "bytes": ("integrity", lambda d, _: d[:-1] + bytes([d[-1] ^ 1]), False),
    "truncated": ("format", lambda d, _: d[:-7], True),
    "an id on two rows": ("id_map", reencode(clash_with_held_id), True),
    "another mode": ("layout", reencode(lambda e, n: without_keys(e), hashed=True), True),
}


@pytest.mark.parametrize("case", sorted(BAD_ID_MAPS))
def test_a_bad_id_map_rejects_the_version(world: LiveWorld, case: str) -> None:
    reason, change, seal = BAD_ID_MAPS[case]
    world.run.train(events([f"u{i}" for i in range(6)]))
    world.run.publish()
    world.live.bootstrap()
    world.run.train(events(["u1", "zz"], ts=TS + 50))
    v2 = world.run.publish()
    rewrite_id_map(world, v2, 0, change, seal=seal)  # the user table's
    with pytest.raises(BadDataError) as info:
        world.live.advance(Catalog(world.store, "m").find(v2))
    assert rejection_reason(info.value) == reason
    assert world.live.version == 1
    assert_serves(world, 1)


def test_a_failure_on_a_later_tables_map_repairs_the_earlier_ones(world: LiveWorld) -> None:
    world.run.train(events([f"u{i}" for i in range(6)]))
    world.run.publish()
    world.live.bootstrap()
    world.run.train(events(["u1", "zz"], item=7, ts=TS + 50))
    v2 = world.run.publish()
    # The item map (table 1) gives item 7's row the id "1", which an untouched row holds:
    # refused after table 0 (user) had its rows and map written into the copy being built.
    doc = json.loads(world.manifest_path(v2).read_bytes())
    assert doc["tables"][1]["rows_in_checkpoint"] > 0
    rewrite_id_map(world, v2, 1, reencode(lambda e, n: with_key(e, 0, "1")), seal=True)
    with pytest.raises(IdMapError, match="already holds row"):
        world.live.advance(Catalog(world.store, "m").find(v2))
    assert_serves(world, 1)
    world.run.train(events(["zz"], ts=TS + 60))
    v3 = world.run.publish(full=True)
    world.live.advance(Catalog(world.store, "m").find(v3))
    assert_serves(world, v3)


def test_a_version_without_its_id_maps_is_refused(world: LiveWorld) -> None:
    world.run.train(events(["u1"]))
    world.run.publish()
    world.live.bootstrap()
    world.run.train(events(["u2"]))
    v2 = world.run.publish()
    path = world.manifest_path(v2)
    doc = json.loads(path.read_bytes())
    doc["tables"][2]["id_map"] = None
    path.write_text(json.dumps(doc))
    with pytest.raises(ApplyError, match="must each carry an id-map blob"):
        world.live.advance(Catalog(world.store, "m").find(v2))
    assert world.live.version == 1


def test_a_hashed_space_serves_every_id(tmp_path: Path) -> None:
    spec = LiveSpec(
        features=(LiveFeature("user"), LiveFeature("item"), LiveFeature("genres", bag=True)),
        id_space="hash",
        count_features=("user",),
    )
    w = make_world(tmp_path, "double-buffer", spec=spec, rows=8)
    try:
        w.run.train(events([f"u{i}" for i in range(20)]))
        v1 = w.run.publish()
        w.live.bootstrap()
        assert_serves(w, v1)
        asked = [{"user": u, "item": 1, "ts": TS} for u in ("u3", "never-seen")]
        _, served, unknown = w.scores(asked)
        assert unknown == {"user": 0, "item": 0, "genres": 0}
        np.testing.assert_allclose(served, w.run.scores(asked), rtol=0, atol=1e-6)
    finally:
        w.live.close()
        w.run.close()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_ids_and_rows_come_from_one_version_while_versions_apply(
    tmp_path: Path, scheme: ConsistencyScheme
) -> None:
    """Each version moves one id: the id of version k is admitted into row 1 (the previous one
    evicted). A prediction that mapped ids with one version and read rows of another would
    know the wrong id, or score it with another row."""
    w = make_world(tmp_path, scheme, rows=4)
    try:
        ids = [f"id{k}" for k in range(8)]
        asked = [{"user": key, "item": 1, "ts": TS} for key in ids]
        expected: dict[int, tuple[str, np.ndarray]] = {}

        def publish_next(k: int) -> None:
            if k:
                w.run.evict("user", ids[k - 1])
            w.run.train(events([ids[k]] * 2, ts=TS + k))
            version = w.run.publish(full=k == 0)
            expected[version] = (ids[k], w.run.scores(asked))

        publish_next(0)
        w.live.bootstrap()
        stop = threading.Event()
        seen: list[tuple[int, np.ndarray, dict[str, int]]] = []
        errors: list[BaseException] = []

        def read() -> None:
            try:
                while not stop.is_set():
                    seen.append(w.scores(asked))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        for k in range(1, len(ids)):
            publish_next(k)
            w.live.catch_up()
        stop.set()
        for t in readers:
            t.join()
        assert not errors
        assert len({v for v, _, _ in seen}) >= 3
        for version, scores, unknown in seen:
            _, want = expected[version]
            assert unknown["user"] == len(ids) - 1
            np.testing.assert_allclose(scores, want, rtol=0, atol=1e-6)
    finally:
        w.live.close()
        w.run.close()


def test_the_memory_budget_counts_the_id_maps_of_every_copy(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    run = SyntheticLiveRun(store, "m", rows=64)
    try:
        run.train(events(["u1"]))
        v1 = run.publish()
        manifest = Catalog(store, "m").find(v1).manifest
        maps = served_id_maps_bytes(manifest)
        assert maps == ID_MAP_ROW_BYTES * 3 * 64  # counted full: later versions fill them
        model_bytes = DLRMConfig.from_json(manifest.model_config_).nbytes
        # A user's factory is measured on the meta device: its parameters, nothing allocated.
        model = build_served_model(manifest.model_config_)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert ModuleBuilder(factory=build_served_model).copy_bytes(manifest) == params
        needed = 2 * (model_bytes + maps)
        short = dlrm_live(store, "m", memory_budget=MemoryBudget(needed - 1))
        with pytest.raises(MemoryBudgetError, match="2 model copies"):
            short.bootstrap()
        short.close()
        enough = dlrm_live(store, "m", memory_budget=MemoryBudget(needed))
        assert enough.bootstrap() is not None
        enough.close()
    finally:
        run.close()


def test_the_digest_covers_the_id_maps(tmp_path: Path) -> None:
    w = make_world(tmp_path, "double-buffer")
    try:
        w.run.train(events(["u1", "u2"]))
        w.run.publish()
        w.live.bootstrap()
        w.run.train(events(["u3"], ts=TS + 9))
        w.live.advance(Catalog(w.store, "m").find(w.run.publish()))
        slot = w.live.sink.slot
        live, standby = slot.current(), slot._standby  # type: ignore[attr-defined]
        assert live is not None and standby is not None
        digest = live.digest()
        assert digest == standby.digest()  # both copies, maps included
        assert {f"embeddings.{f}.id_map" for f in ("user", "item", "genres")} <= set(digest)
        row = standby.id_maps["embeddings.user"].row_of("u3")
        assert row is not None
        standby.id_maps["embeddings.user"].counts[row] += 1
        changed = {k for k, v in standby.digest().items() if v != digest[k]}
        assert changed == {"embeddings.user.id_map"}
    finally:
        w.live.close()
        w.run.close()


def test_a_full_of_the_held_rows_is_served_with_every_other_row_zero(world: LiveWorld) -> None:
    """docs/FORMAT.md 7.1: a full carries the rows its ids hold; a server building it zeroes
    the rest (here a row an earlier version served to an id since evicted)."""
    world.run.train(events(["a", "b", "c"]))
    world.run.publish()
    world.live.bootstrap()
    gone = world.run.evict("user", "a")
    world.run.train(events(["b", "c"], ts=TS + 10))
    v2 = world.run.publish(full=True)
    entry = Catalog(world.store, "m").find(v2).manifest.table("embeddings.user")
    user_map = world.run.id_map("user")
    assert entry.rows_in_checkpoint == len(user_map) + 1 < 32
    assert world.live.advance(Catalog(world.store, "m").find(v2)) == [v2]
    assert_serves(world, v2)
    served = world.live.sink.current()
    assert served is not None
    values = served.values("embeddings.user").numpy()
    free = [r for r in range(32) if r and user_map.key_of(r) is None]
    assert gone in free and not values[free].any() and values[0].any()
    asked = [{"user": u, "item": 1, "ts": TS} for u in ("b", "c", "a")]
    version, scores, unknown = world.scores(asked)
    assert version == v2 and unknown["user"] == 1
    np.testing.assert_allclose(scores, world.run.scores(asked), rtol=0, atol=1e-6)
