"""`codec="auto"` as both checkpointers take it: its rule, first codec and samples window."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from publisher.write.policies import ServedLossCodecRule, auto_codec_rule
from trainer.errors import CheckpointError
from trainer.options import DEFAULT_SCORED_SAMPLES


def resolve_auto_codec(
    codec: str | Mapping[str, str],
    served_loss_samples: int | None,
    served_loss_budget: float | None,
    expected_restores: float | None,
    judge: Literal["sure", "estimate"] = "sure",
) -> tuple[str | Mapping[str, str], ServedLossCodecRule | None, int | None]:
    """(codec, rule, served_loss_samples): for "auto", the rule from the bit rule's floor for
    `expected_restores` within `served_loss_budget` (read as `judge` says: the loss beyond the
    window's noise, or its point estimate), the floor as the codec, and the default
    window when no sample count was given; any other codec as it is, without a rule (and
    CheckpointError if a budget or restores were given for it)."""
    if codec == "auto":
        rule = auto_codec_rule(expected_restores, served_loss_budget, judge)
        if served_loss_samples is None:
            served_loss_samples = DEFAULT_SCORED_SAMPLES
        return rule.codec, rule, served_loss_samples  # the floor, where it starts
    if served_loss_budget is not None or expected_restores is not None:
        raise CheckpointError(
            "served_loss_budget and expected_restores choose codec='auto''s codecs; "
            f"codec is {codec!r}"
        )
    return codec, None, served_loss_samples
