"""A sharded job on a live topic: how the partitions are split over the ranks, the plan the
ranks derive from their votes before each step, and the refusal of a dynamic id space."""

from __future__ import annotations

import pytest

from trainer.cli import main
from trainer.sharded.step_votes import Decision, RankVote, StepPlan, plan_step, rank_partitions


def test_each_partition_goes_to_the_rank_of_its_index_mod_the_world_size() -> None:
    assert rank_partitions([2, 0, 1], 0, 2) == (0, 2)
    assert rank_partitions([2, 0, 1], 1, 2) == (1,)
    # `?partitions=1,4,7`: indexes in the list, not partition numbers
    assert [rank_partitions([1, 4, 7], r, 3) for r in range(3)] == [(1,), (4,), (7,)]
    # more ranks than partitions: the last ones read nothing
    assert [rank_partitions([0, 1, 2], r, 5) for r in range(5)] == [(0,), (1,), (2,), (), ()]
    every = [p for r in range(4) for p in rank_partitions(range(10), r, 4)]
    assert sorted(every) == list(range(10))
    with pytest.raises(ValueError):
        rank_partitions([0], 2, 2)


def _votes(*votes: tuple[int, bool, bool]) -> list[RankVote]:
    return [RankVote(*v) for v in votes]


def test_the_ranks_step_on_whatever_any_of_them_holds_padded_to_the_largest_share() -> None:
    plan = plan_step(
        _votes((5, False, False), (0, True, False), (2, False, False)), stop_at_end=True
    )
    assert plan == StepPlan(Decision.STEP, (5, 0, 2))
    assert (plan.local_size, plan.global_size, plan.last) == (5, 7, False)


def test_with_nothing_anywhere_they_wait_unless_every_rank_is_at_its_end() -> None:
    waiting = _votes((0, True, False), (0, False, False))
    assert plan_step(waiting, stop_at_end=True).decision is Decision.WAIT
    ended = _votes((0, True, False), (0, True, False))
    assert plan_step(ended, stop_at_end=True).decision is Decision.STOP
    # without --stop-at-end a live job waits for events for ever
    assert plan_step(ended, stop_at_end=False).decision is Decision.WAIT


def test_a_stop_asked_on_any_rank_stops_all_of_them_even_with_events_in_hand() -> None:
    for stopping in range(3):
        votes = [RankVote(4, False, rank == stopping) for rank in range(3)]
        assert plan_step(votes, stop_at_end=False).decision is Decision.STOP


def test_the_step_that_reaches_the_sample_limit_takes_events_in_rank_order_and_is_last() -> None:
    votes = _votes((4, False, False), (4, False, False), (4, False, False))
    assert plan_step(votes, stop_at_end=False, remaining=13) == StepPlan(Decision.STEP, (4, 4, 4))
    assert plan_step(votes, stop_at_end=False, remaining=6) == StepPlan(
        Decision.STEP, (4, 2, 0), last=True
    )
    assert plan_step(votes, stop_at_end=False, remaining=12).last
    assert plan_step(votes, stop_at_end=False, remaining=0).decision is Decision.STOP


def test_vote_round_trips_through_its_tensor() -> None:
    vote = RankVote(17, True, False)
    assert RankVote.decode(vote.encode()) == vote


def test_a_named_count_feature_is_refused_for_a_hashed_sharded_live_job(
    capsys: pytest.CaptureFixture[str],
) -> None:
    command = ["train", "--nproc", "2", "--data", "kafka://127.0.0.1:1/events"]
    assert main([*command, "--id-space", "hash", "--count-features", "user"]) == 1
    assert "use --id-space dynamic" in capsys.readouterr().err
