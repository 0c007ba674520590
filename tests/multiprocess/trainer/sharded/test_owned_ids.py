"""`OwnedIds` on two real gloo ranks (docs/FORMAT.md 7.2): every id is mapped by its owner, the
rank holding its hashed row; both ranks see one row per id, in its owner's shard, and one count
per occurrence of either rank, in rank order; a rank with no events takes part idle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.sharded_job import run_ranks
from publisher.id_map import UNKNOWN_ROW, IdMap, hashed_rows
from trainer.id_space import IdRequest, IdSpace
from trainer.sharded.collective import GlooGroup
from trainer.sharded.owned_ids import IdOwners, OwnedIds

ROWS = 40
SHARDS = ((0, 20, 0), (20, 40, 1))
#: per step, per rank: the user keys of its events ([] : no events, the rank is idle).
STEPS = [
    [["a", "b", "a", "c"], ["c", "d"]],
    [["e"], []],
    [[], ["a", "f", "f"]],
]


def _rank(rank: int, world: int, root: str) -> None:
    group = GlooGroup.new(60.0)
    owners = IdOwners({"embeddings.user": SHARDS})
    own = owners.own_rows("embeddings.user", rank)
    assert own is not None
    space = IdSpace(IdMap(ROWS), own_rows=own)
    # a payload room smaller than the first step's: it is sent again in a larger one
    ids = OwnedIds(owners, {"user": space}, {"user": "embeddings.user"}, group, room=16)
    out: list[dict[str, Any]] = []
    for step, keys in enumerate(STEPS):
        mine = keys[rank]
        if not mine:
            ids.idle()
            out.append({"rows": [], "prior": []})
            continue
        ids.renumber()
        unique = sorted(set(mine))
        ids.learn("user", unique)
        numbers = np.asarray([unique.index(k) for k in mine] + [-1], dtype=np.int32)
        ts = np.full(len(numbers), 1000.0 + step)
        (mapped,) = ids.map([IdRequest("user", numbers, ts, prior=True)], 1000.0 + step)
        out.append({"rows": mapped.rows.tolist(), "prior": mapped.prior.tolist()})
    held = {space.id_map.key_of(r): int(space.id_map.counts[r]) for r in range(*own)}
    held.pop(None, None)
    (Path(root) / f"rank{rank}.json").write_text(json.dumps({"steps": out, "held": held}))


def test_two_ranks_map_each_id_at_its_owner_once(tmp_path: Path) -> None:
    run_ranks(_rank, 2, str(tmp_path), timeout_s=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    row_of: dict[str, int] = {}
    for step, keys in enumerate(STEPS):
        for rank in range(2):
            got = results[rank]["steps"][step]
            if not keys[rank]:
                continue
            assert got["rows"][-1] == UNKNOWN_ROW  # the missing id
            for key, row in zip(keys[rank], got["rows"], strict=False):
                if row == UNKNOWN_ROW:  # cold start: the admitting occurrence trains row 0
                    continue
                assert row_of.setdefault(key, row) == row, key
    owner = {k: int(hashed_rows([k], ROWS)[0] >= 20) for k in "abcdef"}
    for key, row in row_of.items():
        assert (row >= 20) == bool(owner[key]), (key, row)
    # prior counts: every occurrence before, of either rank, rank 0's first within a step
    assert results[0]["steps"][0]["prior"] == [0, 0, 1, 0, 0]
    assert results[1]["steps"][0]["prior"] == [1, 0, 0]
    assert results[1]["steps"][2]["prior"] == [2, 0, 1, 0]
    held = {**results[0]["held"], **results[1]["held"]}
    assert held == {"a": 3, "b": 1, "c": 2, "d": 1, "e": 1, "f": 2}
    for rank in range(2):
        assert all(owner[k] == rank for k in results[rank]["held"])
