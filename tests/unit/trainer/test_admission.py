"""The frequency sketch of ids without a row: never under-counts, one-off ids stay at 1 (the
doorkeeper), ageing halves, memory fixed; and the reader's numbering restarts on its budget."""

from __future__ import annotations

import numpy as np
import pytest

from publisher.id_map import IdMap, key_hashes
from schemas.events import EventFields, encode_event
from trainer.admission import FrequencySketch
from trainer.id_space import IdSpace, IdSpacePolicy
from trainer.streams import event_columns
from trainer.streams.event_columns import RawEventsBuilder


def test_estimates_never_undercount_and_one_off_ids_read_one() -> None:
    sketch = FrequencySketch.for_capacity(1000)
    keys = [f"k{i % 50}" for i in range(500)] + [f"once{i}" for i in range(5000)]
    estimates = sketch.add(key_hashes(keys))
    truth = {f"k{i}": 10 for i in range(50)}
    after = sketch.estimate(key_hashes(list(truth)))
    assert (after >= 10).all()
    assert estimates[:500].min() >= 10  # repeats within one call count together
    once = sketch.estimate(key_hashes([f"once{i}" for i in range(5000)]))
    assert (once >= 1).all() and np.mean(once == 1) > 0.98
    assert sketch.estimate(key_hashes(["never"]))[0] in (0, 1)


def test_ageing_halves_counts_and_clears_the_doorkeeper() -> None:
    sketch = FrequencySketch(10, sample_size=100)
    sketch.add(key_hashes(["a"] * 9))
    assert sketch.estimate(key_hashes(["a"]))[0] == 9
    assert not sketch.tick(99) and sketch.tick(1)
    assert sketch.estimate(key_hashes(["a"]))[0] == 8 // 2  # the doorkeeper's 1 is gone
    assert sketch.agings == 1 and sketch.since_aging == 0


def test_memory_is_fixed_and_sizes_are_checked() -> None:
    sketch = FrequencySketch.for_capacity(100_000)
    nbytes = sketch.nbytes
    sketch.add(key_hashes([f"x{i}" for i in range(100_000)]))
    assert sketch.nbytes == nbytes == 3 * 2**20
    with pytest.raises(ValueError, match="width_log2"):
        FrequencySketch(40, sample_size=1)
    with pytest.raises(ValueError, match="sample_size"):
        FrequencySketch(12, sample_size=0)


def test_recency_admission_lets_any_new_id_take_the_oldest_row() -> None:
    space = IdSpace(IdMap(3), IdSpacePolicy(admission="recency", cold_start=False))
    space.learn(["a", "b", "c"])
    space.map(np.array([0, 0, 1, 1], np.int32), np.array([1.0, 1.0, 2.0, 2.0]))
    mapped = space.map(np.array([2], np.int32), np.array([3.0]))  # seen once: still admitted
    assert mapped.rows.tolist() == [1] and space.id_map.row_of("a") is None
    with pytest.raises(ValueError, match="admission"):
        IdSpacePolicy(admission="lottery")


def test_a_row_given_to_an_id_is_marked_dirty_even_when_cold_start_trains_row_0() -> None:
    marked: list[list[int]] = []
    space = IdSpace(IdMap(8), mark_rows=lambda rows: marked.append(rows.tolist()))
    space.learn(["a", "b"])
    mapped = space.map(np.array([0, 1], np.int32), np.array([1.0, 1.0]))
    assert mapped.rows.tolist() == [0, 0]  # neither row is looked up by this batch
    assert marked == [[1, 2]] and space.id_map.counts[1:3].tolist() == [1, 1]


def test_the_numbering_starts_over_at_its_character_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(event_columns, "MAX_KEY_CHARS", 500)
    builder = RawEventsBuilder(EventFields(singles=("user",), bags=()))
    for i in range(3):  # 3 x 200 characters of keys
        builder.add(encode_event(ts=1.0, label=0, ids={"user": f"{i:0200d}"}), 0, i)
    first = builder.take()
    builder.add(encode_event(ts=1.0, label=0, ids={"user": f"{0:0200d}"}), 0, 3)
    second = builder.take()
    assert first.epoch == 0 and second.epoch == 1
    assert second.singles[0][1].tolist() == [0] and len(second.singles[0][0]) == 1
