"""Who owns an id in a job of N ranks, and how a restored map is re-partitioned for another
world size (docs/FORMAT.md 7.2)."""

from __future__ import annotations

import numpy as np

from publisher.id_map import UNKNOWN_ROW, IdMap, hashed_rows
from publisher.read.restore import TableState
from trainer.id_space import IdSpace
from trainer.sharded.owned_ids import IdOwners

ROWS = 16
TWO = IdOwners({"t": ((0, 8, 0), (8, 16, 1))})


def _keys(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


def test_the_owner_is_the_rank_holding_the_hashed_row() -> None:
    keys = _keys(50)
    owners = TWO.owner_of("t", keys)
    assert (owners == (hashed_rows(keys, ROWS) >= 8)).all()
    assert set(owners.tolist()) == {0, 1}
    whole = IdOwners({"t": ((0, ROWS, 1),)})  # a table held whole by rank 1
    assert (whole.owner_of("t", keys) == 1).all()
    assert TWO.own_rows("t", 1) == (8, 16) and whole.own_rows("t", 0) is None


def test_a_space_with_own_rows_gives_rows_of_its_range_only() -> None:
    space = IdSpace(IdMap(ROWS), own_rows=(8, 16))
    assert space.capacity == 8
    keys = _keys(30)
    space.learn(keys)
    numbers = np.arange(30, dtype=np.int32)
    for _ in range(3):  # seen again and again: admitted, then evicting each other
        rows = space.map(numbers, np.full(30, 1.0)).rows
        assert ((rows == UNKNOWN_ROW) | ((rows >= 8) & (rows < 16))).all()
    held = [space.id_map.key_of(r) for r in range(ROWS)]
    assert all(k is None for k in held[:8]) and all(k is not None for k in held[8:])
    first = IdSpace(IdMap(ROWS), own_rows=(0, 8))
    assert first.capacity == 7  # the unknown row is in the first shard, never given


def _state(weights: np.ndarray) -> TableState:
    return TableState("t", weights, np.arange(ROWS, dtype=np.float32).reshape(-1, 1) + 100)


def test_repartition_moves_stray_ids_with_their_rows_and_keeps_the_rest() -> None:
    # one process gave rows 1.. in arrival order; at two ranks an id belongs in its owner's shard
    keys = _keys(10)
    id_map = IdMap(ROWS)
    for row, key in enumerate(keys, start=1):
        id_map.assign(key, row)
        id_map.counts[row], id_map.last_seen[row] = row * 10, float(row)
    weights = np.repeat(np.arange(ROWS, dtype=np.float32)[:, None], 4, axis=1)
    state = _state(weights.copy())
    before = {k: (id_map.row_of(k), int(id_map.counts[id_map.row_of(k) or 0])) for k in keys}
    moved, dropped = TWO.repartition("t", id_map, state)
    owners = TWO.owner_of("t", keys)
    stray = [k for k, o in zip(keys, owners, strict=True) if (before[k][0] or 0) // 8 != o]
    assert moved == len(stray) > 0 and dropped == 0
    for key, owner in zip(keys, owners, strict=True):
        row = id_map.row_of(key)
        assert row is not None and row // 8 == owner
        old_row, count = before[key]
        assert id_map.counts[row] == count and id_map.last_seen[row] == float(old_row or 0)
        # the row's weights and accumulator went with the id
        assert (state.weights[row] == old_row).all() and state.aux[row, 0] == 100 + (old_row or 0)
    left = [row for k in stray if id_map.key_of(row := before[k][0] or 0) is None]
    assert left  # a row left and not another mover's room
    for row in left:
        assert state.aux[row, 0] == 0.0  # re-initialised: nothing of the old id stays
        assert not (state.weights[row] == row).all()
    # the same map and layout give the same moves: every rank computes them alike
    again = IdMap(ROWS)
    for row, key in enumerate(keys, start=1):
        again.assign(key, row)
    TWO.repartition("t", again, _state(weights.copy()))
    assert [again.row_of(k) for k in keys] == [id_map.row_of(k) for k in keys]


def test_repartition_drops_the_ids_a_full_shard_cannot_take() -> None:
    small = IdOwners({"t": ((0, 2, 0), (2, 4, 1))})
    id_map = IdMap(4)
    keys = [k for k in _keys(200) if int(hashed_rows([k], 4)[0]) >= 2][:3]
    for row, key in enumerate(keys, start=1):
        id_map.assign(key, row)
    weights = np.zeros((4, 2), dtype=np.float32)
    moved, dropped = small.repartition(
        "t", id_map, TableState("t", weights, np.zeros((4, 1), np.float32))
    )
    # keys[0] on row 1 (shard 0) moves to row 2 or 3 (one is held by another owned key)
    assert len(id_map) + dropped == 3 and dropped >= 1 and moved + dropped >= 1
    for key in keys:
        row = id_map.row_of(key)
        assert row is None or row >= 2
