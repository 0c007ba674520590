"""Event time bounded (docs/FORMAT.md section 8.1): no event runs more than the lead ahead of
the reader's clock, no single event moves the stream clock, and a hostile time
neither keeps a row for good nor makes the id space evict the others."""

from __future__ import annotations

import numpy as np
import pytest

from publisher.id_map import IdMap
from trainer.event_clock import EventClock
from trainer.id_space import IdSpace, IdSpacePolicy

NOW = 1_800_000_000.0  # the reader's wall clock in these tests


def _clock(lead: float = 300.0, window: int = 1024) -> EventClock:
    return EventClock(lead, window=window, wall=lambda: NOW)


def test_a_time_far_ahead_is_lowered_and_does_not_move_the_stream_clock() -> None:
    clock = _clock()
    ts = np.full(64, NOW - 10.0)
    ts[7] = 1e300
    bounded = clock.bound(ts)
    assert bounded[7] == NOW + 300.0
    assert np.array_equal(np.delete(bounded, 7), np.delete(ts, 7))
    assert clock.now == NOW - 10.0 and clock.clamped == 1


def test_the_first_event_ever_is_bounded_by_the_readers_clock() -> None:
    clock = _clock()
    assert clock.bound(np.array([1e300]))[0] == NOW + 300.0
    assert clock.now == NOW + 300.0 and clock.clamped == 1


def test_a_replay_of_history_keeps_its_own_times() -> None:
    clock = _clock()
    day = 86_400.0
    for start in range(10):  # ten batches of 2001, each spanning a day, as a fast replay gives
        ts = 978_300_000.0 + day * (start + np.linspace(0.0, 1.0, 512))
        assert np.array_equal(clock.bound(ts), ts)
    assert clock.clamped == 0 and 978_300_000.0 + 8 * day < clock.now < 978_300_000.0 + 10 * day


def test_the_stream_clock_follows_a_jump_once_half_the_window_is_past_it() -> None:
    clock = _clock(window=100)
    clock.bound(np.full(100, 1000.0))
    clock.bound(np.full(49, 90_000.0))  # a day later: fewer than half the window so far
    assert clock.now == 1000.0 and clock.clamped == 0
    clock.bound(np.full(2, 90_000.0))
    assert clock.now > 1000.0  # the median is past the jump: the clock follows


def test_the_stream_clock_never_moves_back() -> None:
    clock = _clock(window=10)
    clock.bound(np.full(10, 5000.0))
    clock.bound(np.full(10, 100.0))  # late events: they keep their times
    assert clock.now == 5000.0


def test_nonsense_leads_and_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="max_lead_s"):
        EventClock(-1.0)
    with pytest.raises(ValueError, match="window"):
        EventClock(300.0, window=0)
    with pytest.raises(ValueError, match="max_event_lead_s"):
        IdSpacePolicy(max_event_lead_s=float("nan"))


def test_one_hostile_event_neither_keeps_a_row_nor_evicts_the_others() -> None:
    day = 86_400.0
    space = IdSpace(IdMap(100), IdSpacePolicy(evict_after_s=day))
    clock = _clock()
    real = [f"u{i}" for i in range(50)]
    space.learn([*real, "hostile"])
    numbers = np.arange(50, dtype=np.int32)

    def feed(numbers: np.ndarray, ts: np.ndarray) -> None:
        bounded = clock.bound(ts)
        space.map(numbers, bounded, now=clock.now)

    start = NOW - 10 * day
    feed(numbers, np.full(50, start))
    # one event 3 days ahead of the stream among its real ones, then the stream goes on
    feed(
        np.append(numbers, 50).astype(np.int32), np.append(np.full(50, start + 60), start + 3 * day)
    )
    assert space.evicted == 0 and space.held == 51  # nobody evicted as stale
    # a day and more of stream time later, with only the real ids seen: the hostile id is
    # stale once the stream passes its time (it held its row no longer than its time said)
    for hour in range(1, 24 * 5):
        feed(numbers, np.full(50, start + hour * 3600.0))
    assert space.id_map.row_of("hostile") is None and space.held == 50
    assert clock.clamped == 0  # its time was in the reader's past: kept as it came


def test_an_event_at_1e300_holds_its_row_no_longer_than_the_lead() -> None:
    day = 86_400.0
    space = IdSpace(IdMap(100), IdSpacePolicy(evict_after_s=day))
    wall = [NOW]
    clock = EventClock(300.0, wall=lambda: wall[0])  # a live stream: events arrive as made
    space.learn(["real", "hostile"])
    bounded = clock.bound(np.asarray([NOW, 1e300]))
    space.map(np.asarray([0, 1], dtype=np.int32), bounded, now=clock.now)
    assert space.id_map.last_seen[space.id_map.row_of("hostile")] == NOW + 300.0
    for hour in range(1, 30):  # the real id's events, a window's worth an hour
        wall[0] = NOW + hour * 3600.0
        bounded = clock.bound(np.full(1024, wall[0]))
        space.map(np.zeros(1024, dtype=np.int32), bounded, now=clock.now)
    assert space.id_map.row_of("hostile") is None and space.id_map.row_of("real") is not None
    assert space.evicted == 1 and clock.clamped == 1
