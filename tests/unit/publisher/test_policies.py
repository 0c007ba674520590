"""Checkpoint policies on a synthetic Zipf stream: what each checkpoint holds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from publisher.write.policies import POLICIES, PolicyError, ServedLossCodecRule, make_policy

TABLES = {"a": 5000, "b": 300}


def zipf_intervals(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        dirty = {}
        for name, rows in TABLES.items():
            ids = np.minimum(rng.zipf(1.3, size=400) - 1, rows - 1)
            dirty[name] = np.unique(ids).astype(np.int64)
        out.append(dirty)
    return out


def sizes(policy_name: str, intervals: list[dict[str, np.ndarray]], **kw: float) -> list[int]:
    policy = make_policy(policy_name, TABLES, **kw)
    out = []
    for dirty in intervals:
        plan = policy.plan(dirty)
        n = sum(TABLES[t] if r is None else len(r) for t, r in plan.rows.items())
        assert (plan.kind == "full") == all(r is None for r in plan.rows.values())
        out.append(n)
    return out


def test_full_policy_writes_everything() -> None:
    assert sizes("full", zipf_intervals(5)) == [5300] * 5


def test_consecutive_writes_each_interval() -> None:
    intervals = zipf_intervals(6)
    got = sizes("consecutive", intervals)
    assert got[0] == 5300
    assert got[1:] == [sum(len(v) for v in d.values()) for d in intervals[1:]]


def test_one_shot_grows_as_the_union_since_baseline() -> None:
    intervals = zipf_intervals(8)
    got = sizes("one-shot", intervals)
    assert got[0] == 5300
    union = {t: np.zeros(0, dtype=np.int64) for t in TABLES}
    for dirty, n in zip(intervals[1:], got[1:], strict=True):
        union = {t: np.union1d(union[t], dirty[t]) for t in TABLES}
        assert n == sum(len(v) for v in union.values())
    assert got[1:] == sorted(got[1:])


def test_one_shot_plan_kinds() -> None:
    policy = make_policy("one-shot", TABLES)
    d = zipf_intervals(3)
    assert policy.plan(d[0]).kind == "full"
    plan = policy.plan(d[1])
    assert (plan.kind, plan.relative_to) == ("delta", "baseline")
    policy.force_full()
    assert policy.plan(d[2]).kind == "full"
    # After a new baseline the union restarts.
    assert sum(len(r) for r in policy.plan(d[0]).rows.values() if r is not None) == sum(
        len(v) for v in d[0].values()
    )


def test_intermittent_bounds_the_chain_and_takes_baselines() -> None:
    intervals = zipf_intervals(60, seed=1)
    policy = make_policy("intermittent", TABLES, budget=0.5)
    chain = 0
    fulls = 0
    for dirty in intervals:
        plan = policy.plan(dirty)
        if plan.kind == "full":
            fulls += 1
            chain = 0
        else:
            assert plan.relative_to == "parent"
            chain += sum(len(r) for r in plan.rows.values() if r is not None)
        assert chain <= 0.5 * sum(TABLES.values())
    assert 2 <= fulls < 30


def test_intermittent_restore_cost_below_consecutive() -> None:
    intervals = zipf_intervals(60, seed=2)
    consecutive = sizes("consecutive", intervals)
    intermittent = sizes("intermittent", intervals, budget=1.0)

    # What restoring the last version reads: the chain since the last full.
    def tail(s: list[int]) -> int:
        last_full = max(i for i, n in enumerate(s) if n == 5300)
        return sum(s[last_full:])

    assert tail(intermittent) < tail(consecutive)


def test_unknown_policy() -> None:
    assert set(POLICIES) == {"full", "one-shot", "consecutive", "intermittent"}
    with pytest.raises(PolicyError, match="unknown policy"):
        make_policy("sometimes", TABLES)
    with pytest.raises(PolicyError):
        make_policy("intermittent", TABLES, budget=0)


def test_bit_rule_from_measurements() -> None:
    from publisher.write.policies import codec_for_expected_restores

    assert codec_for_expected_restores(0) == "int4"
    assert codec_for_expected_restores(2) == "int4"
    assert codec_for_expected_restores(3) == "int8"
    assert codec_for_expected_restores(10) == "int8"
    assert codec_for_expected_restores(50) == "fp16"
    with pytest.raises(PolicyError):
        codec_for_expected_restores(-1)


def drive(rule: ServedLossCodecRule, losses: list[float | None]) -> list[str]:
    """The codec of each next version as the rule takes each synthetic measurement."""
    return [rule.observe(loss) for loss in losses]


def test_auto_codec_escalates_one_step_per_version_over_budget() -> None:
    rule = ServedLossCodecRule("int4", budget=1e-4)
    assert rule.codec == "int4"
    over = 2e-4
    assert drive(rule, [None, 5e-5, over, over, over, over]) == [
        "int4",  # not measured: stay
        "int4",  # within budget (not within half of it): stay
        "int8",
        "fp16",
        "fp32",
        "fp32",  # the top of the ladder
    ]


def test_auto_codec_steps_down_after_patience_calm_versions_never_below_its_floor() -> None:
    rule = ServedLossCodecRule("int8", budget=1e-4, patience=3)
    assert drive(rule, [2e-4, 2e-4]) == ["fp16", "fp32"]
    calm = 4e-5  # within budget / 2
    # 7e-5 is within budget but not half of it: the calm count starts over.
    assert drive(rule, [calm, calm, 7e-5, calm, calm, calm]) == ["fp32"] * 5 + ["fp16"]
    assert drive(rule, [calm, calm, calm]) == ["fp16", "fp16", "int8"]
    assert drive(rule, [calm] * 10) == ["int8"] * 10  # the floor: what restores need
    assert drive(rule, [-5e-4]) == ["int8"]  # served better than fp32 is calm too


def test_a_step_down_undone_at_once_doubles_the_patience() -> None:
    rule = ServedLossCodecRule("int4", budget=1e-4, patience=2)
    calm, over = 1e-5, 3e-4
    assert drive(rule, [over, calm, calm]) == ["int8", "int8", "int4"]
    assert drive(rule, [over]) == ["int8"]  # undone by the next measurement
    assert rule.patience == 4
    assert drive(rule, [calm] * 4) == ["int8"] * 3 + ["int4"]
    assert drive(rule, [calm, over]) == ["int4", "int8"]  # not at once: patience stays
    assert rule.patience == 4


def test_step_up_now_steps_as_observe_does_only_for_a_loss_over_the_budget() -> None:
    rule = ServedLossCodecRule("int4", budget=1e-4, patience=2)
    calm, over = 1e-5, 3e-4
    assert [rule.step_up_now(x) for x in (None, calm, 1e-4)] == [None, None, None]
    assert rule.codec == "int4"  # nothing within the budget moved the rule
    assert drive(rule, [over, calm, calm]) == ["int8", "int8", "int4"]
    assert rule.step_up_now(over) == "int8"  # a step down undone at once, before the commit
    assert rule.patience == 4
    assert drive(rule, [calm]) == ["int8"]  # the committed measurement, calm: one of four
    assert [rule.step_up_now(over) for _ in range(3)] == ["fp16", "fp32", None]
    assert rule.codec == "fp32"
    # Tried below the rule's codec (a full version starts at the floor): the rule stays.
    assert rule.first_codec("full") == "int4" and rule.first_codec("delta") == "fp32"
    assert rule.step_up_now(over, "int4") == "int8"
    assert rule.codec == "fp32"


@pytest.mark.parametrize(
    "kwargs", [{"floor": "int2"}, {"budget": 0.0}, {"budget": float("nan")}, {"patience": 0}]
)
def test_auto_codec_rejects_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(PolicyError):
        ServedLossCodecRule(**kwargs)
