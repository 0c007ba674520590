"""When a checkpoint is due: samples or seconds since the last one, counts kept across a resume."""

from __future__ import annotations

import pytest

from trainer.checkpoint_clock import CheckpointClock
from trainer.errors import CheckpointError


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_due_after_interval_samples_and_restart() -> None:
    clock = CheckpointClock(interval_samples=100)
    clock.step(60)
    assert not clock.due()
    clock.step(40)
    assert clock.due()
    clock.restart()
    assert not clock.due()
    assert clock.step_count == 2 and clock.samples_seen == 100  # totals survive a restart


def test_due_after_interval_seconds_whichever_comes_first() -> None:
    time = FakeTime()
    clock = CheckpointClock(interval_samples=1000, interval_seconds=5.0, now=time)
    clock.step(10)
    time.now += 4.9
    assert not clock.due()
    time.now += 0.1
    assert clock.due()
    clock.restart()
    assert not clock.due()
    clock.step(1000)
    assert clock.due()  # samples first this time


def test_no_interval_is_never_due() -> None:
    time = FakeTime()
    clock = CheckpointClock(now=time)
    clock.step(10**9)
    time.now += 10**9
    assert not clock.due()


def test_resume_continues_the_counts_and_starts_a_new_interval() -> None:
    time = FakeTime()
    clock = CheckpointClock(interval_samples=100, interval_seconds=10.0, now=time)
    clock.step(99)
    time.now += 9.0
    clock.resume_at(step=40, samples_seen=5120)
    assert (clock.step_count, clock.samples_seen) == (40, 5120)
    time.now += 9.0
    clock.step(99)
    assert not clock.due()
    clock.step(1)
    assert clock.due() and clock.samples_seen == 5220


@pytest.mark.parametrize(
    ("samples", "seconds", "match"),
    [(0, None, "interval_samples"), (None, 0.0, "interval_seconds"), (None, -1, "seconds")],
)
def test_bad_intervals_are_refused(samples: int | None, seconds: float | None, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        CheckpointClock(samples, seconds)
