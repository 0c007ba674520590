"""The id space: which row each occurrence trains, its prior count, admission after N
occurrences, cold start (the admitting occurrence trains the unknown row), eviction by event
time and, when full, of a victim a new id must out-count (TinyLFU: evicted rows handed to
reset_rows, never a row this batch uses; a flood of one-off ids refused), and hash mode with its
collision counts. Most tests pin the row mechanics with cold start off (`ROWS`)."""

from __future__ import annotations

import numpy as np
import pytest

from publisher.id_map import UNKNOWN_ROW, IdMap, hashed_rows
from trainer.id_space import IdSpace, IdSpacePolicy

#: the row mechanics without cold start: an id trains its row from its admitting occurrence.
ROWS = IdSpacePolicy(cold_start=False)


class Feed:
    """Numbers keys as the reader does and maps batches given as one key (or None) per
    occurrence."""

    def __init__(self, space: IdSpace) -> None:
        self.space = space
        self.numbers: dict[str, int] = {}

    def __call__(
        self, keys: list[str | None], ts: float | list[float] = 100.0
    ) -> tuple[list[int], list[int]]:
        new = [k for k in dict.fromkeys(keys) if k is not None and k not in self.numbers]
        for key in new:
            self.numbers[key] = len(self.numbers)
        self.space.learn(new)
        numbers = np.asarray([-1 if k is None else self.numbers[k] for k in keys], np.int32)
        times = np.full(len(keys), ts) if isinstance(ts, float) else np.asarray(ts, np.float64)
        mapped = self.space.map(numbers, times)
        return mapped.rows.tolist(), mapped.prior.tolist()


def test_first_occurrences_get_rows_and_priors_count_within_the_batch() -> None:
    space = IdSpace(IdMap(10), ROWS)
    feed = Feed(space)
    rows, prior = feed(["a", "b", "a", None, "a"], ts=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert rows == [1, 2, 1, UNKNOWN_ROW, 1]
    assert prior == [0, 0, 1, 0, 2]
    m = space.id_map
    assert m.row_of("a") == 1 and m.row_of("b") == 2
    assert m.counts[1] == 3 and m.counts[2] == 1 and m.counts[UNKNOWN_ROW] == 0
    assert m.last_seen[1] == 5.0 and m.last_seen[2] == 2.0
    rows, prior = feed(["b", "a"], ts=9.0)
    assert rows == [2, 1] and prior == [1, 3]
    assert space.admitted == 2


def test_admission_after_n_occurrences_across_batches() -> None:
    space = IdSpace(IdMap(10), IdSpacePolicy(admit_after=3, cold_start=False))
    feed = Feed(space)
    assert feed(["a", "b"]) == ([0, 0], [0, 0])
    rows, prior = feed(["a", "a", "a"])
    assert rows == [0, 1, 1]  # the third occurrence of `a` is admitted, and those after it
    assert prior == [0, 0, 1]
    assert space.id_map.counts[1] == 2
    assert feed(["b", "b"])[0] == [0, 1 + 1]
    assert space.id_map.key_of(2) == "b"


def test_cold_start_trains_the_unknown_row_with_each_ids_first_occurrence() -> None:
    space = IdSpace(IdMap(10))
    feed = Feed(space)
    rows, prior = feed(["a", "b", "a", None, "a"], ts=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert rows == [UNKNOWN_ROW, UNKNOWN_ROW, 1, UNKNOWN_ROW, 1]
    assert prior == [0, 0, 1, 0, 2]  # the admitting occurrence counts on the new row
    m = space.id_map
    assert m.counts[1] == 3 and m.counts[2] == 1 and m.last_seen[2] == 2.0
    assert feed(["b"], ts=6.0) == ([2], [1])
    # admission after 2: the second occurrence admits and still trains the unknown row
    space = IdSpace(IdMap(10), IdSpacePolicy(admit_after=2))
    feed = Feed(space)
    assert feed(["a"])[0] == [UNKNOWN_ROW]
    assert feed(["a", "a"]) == ([UNKNOWN_ROW, 1], [0, 1])


def test_pending_ids_cost_the_sketch_only() -> None:
    space = IdSpace(IdMap(1000), IdSpacePolicy(admit_after=3))
    assert space.sketch is not None
    before = space.sketch.nbytes
    feed = Feed(space)
    feed([f"x{i}" for i in range(5000)])  # 5,000 one-off ids: none admitted
    assert space.held == 0 and space.sketch.nbytes == before == 6 * 4096


def test_full_table_evicts_the_least_recently_seen_not_in_this_batch() -> None:
    reset: list[list[int]] = []
    space = IdSpace(IdMap(4), ROWS, reset_rows=lambda rows: reset.append(rows.tolist()))
    feed = Feed(space)
    feed(["a"], ts=1.0)
    feed(["b"], ts=2.0)
    feed(["c"], ts=3.0)  # rows 1..3 held: a (1), b (2), c (3), each seen once
    rows, _ = feed(["a", "d", "d"], ts=4.0)  # `a` is older but used now: `b` goes
    assert reset == [[2]]
    assert rows == [1, 2, 2]
    m = space.id_map
    assert m.row_of("b") is None and m.row_of("d") == 2 and m.counts[2] == 2
    assert space.evicted == 1 and space.refused == 0


def test_a_full_table_admits_an_id_only_if_it_out_counts_the_victim() -> None:
    space = IdSpace(IdMap(4), ROWS)
    feed = Feed(space)
    feed(["a", "a", "b", "b", "c", "c"], ts=1.0)  # full: each held id seen twice
    assert feed(["x"], ts=2.0)[0] == [UNKNOWN_ROW]  # seen once: refused
    assert feed(["y", "z"], ts=2.0)[0] == [UNKNOWN_ROW] * 2
    assert space.refused == 3 and space.evicted == 0
    rows, _ = feed(["x", "x"], ts=3.0)  # now 3 times: beats a's 2 (the oldest of the fewest)
    assert rows == [1, 1] and space.id_map.row_of("a") is None and space.evicted == 1


def test_a_flood_of_one_off_ids_leaves_the_real_ids_their_rows() -> None:
    rng = np.random.default_rng(0)
    space = IdSpace(IdMap(2001))
    feed = Feed(space)
    real = [f"u{i}" for i in range(1000)]
    for step in range(200):  # each real id about twice per 10 batches, ten one-off ids per real
        batch = rng.choice(real, 100).tolist() + [f"flood{step}-{i}" for i in range(1000)]
        feed(batch, ts=float(step))
    kept = sum(space.id_map.row_of(k) is not None for k in real)
    assert kept >= 0.99 * len(real)
    assert space.refused > 100_000 and space.held == 2000


def test_a_batch_that_needs_more_rows_than_it_leaves_keeps_the_rest_unknown() -> None:
    space = IdSpace(IdMap(3), ROWS)
    feed = Feed(space)
    rows, _ = feed(["a", "b", "c"])
    assert rows == [1, 2, UNKNOWN_ROW]
    assert space.id_map.row_of("c") is None


def test_ids_unseen_for_the_span_of_event_time_are_evicted() -> None:
    reset: list[list[int]] = []
    space = IdSpace(
        IdMap(10),
        IdSpacePolicy(evict_after_s=100.0, cold_start=False),
        reset_rows=lambda r: reset.append(r.tolist()),
    )
    feed = Feed(space)
    feed(["a", "b"], ts=0.0)
    feed(["b"], ts=90.0)
    assert reset == []
    feed(["c"], ts=150.0)  # a: last seen at 0, more than 100 s before 150
    assert reset == [[1]]
    assert space.id_map.row_of("a") is None and space.id_map.row_of("b") == 2


def test_sync_rereads_a_loaded_map() -> None:
    space = IdSpace(IdMap(4), ROWS)
    feed = Feed(space)
    space.id_map.assign("x", 1)
    space.id_map.assign("y", 3)
    space.sync()
    assert feed(["z", "x"])[0] == [2, 1]


def test_numbers_follow_evictions_and_a_renumbering() -> None:
    space = IdSpace(IdMap(3), ROWS)
    feed = Feed(space)
    feed(["a", "b"], ts=1.0)
    feed(["a"], ts=2.0)
    assert feed(["c", "c"], ts=3.0)[0] == [2, 2]  # `b` (row 2) evicted: its number maps nowhere
    assert feed(["b", "b", "b", "a"], ts=4.0)[0] == [2, 2, 2, 1]  # `b` back in, `c` evicted
    space.renumber()
    feed.numbers.clear()
    assert feed(["a", "b", "q"], ts=5.0)[0] == [1, 2, 0]


def test_hash_mode_rows_counts_and_collisions() -> None:
    space = IdSpace(IdMap(4, hashed=True))
    feed = Feed(space)
    keys = [str(i) for i in range(20)]
    rows, prior = feed(keys)
    assert rows == hashed_rows(keys, 4).tolist()
    assert int(space.id_map.counts.sum()) == 20
    # 20 ids on 4 rows: every used row beyond its first id collides.
    used = len(set(rows))
    assert space.collided_rows == used
    assert space.collision_events == 20 - used
    assert len(space.id_map) == 0 and space.admitted == 0
    first = rows[0]
    assert prior[0] == 0 and prior[rows.index(first, 1)] == 1


def test_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="admit_after"):
        IdSpacePolicy(admit_after=0)
    with pytest.raises(ValueError, match="evict_after_s"):
        IdSpacePolicy(evict_after_s=0.0)


def test_a_batch_without_any_id_maps_to_the_unknown_row() -> None:
    for hashed in (False, True):
        space = IdSpace(IdMap(4, hashed=hashed))
        mapped = space.map(np.full(3, -1, dtype=np.int32), np.zeros(3))
        assert mapped.rows.tolist() == [0, 0, 0] and int(space.id_map.counts.sum()) == 0
