"""What a predict request's examples got wrong: one problem per invalid value, reported with its
place, capped, in FastAPI's validation-error shape (`{"loc", "msg", "type"}`), so a client sees
all its mistakes in one 422 and the report stays bounded whatever the body holds.

Both input checks use it: `server.feature_batch` (a model of encoded ids) and `server.raw_ids`
(a model trained from raw events).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from schemas.errors import BadDataError
from server.errors import shown_input

#: problems reported per request; the rest are summarised in one last entry.
MAX_REPORTED_ERRORS = 50


@dataclass(frozen=True)
class FeatureProblem:
    """One invalid value: where, what and a machine-readable type."""

    example: int | None
    feature: str | None
    message: str
    type: str

    def as_detail(self) -> dict[str, Any]:
        loc: list[str | int] = ["body", "examples"]
        if self.example is not None:
            loc.append(self.example)
        if self.feature is not None:
            loc.append(self.feature)
        return {"loc": loc, "msg": self.message, "type": self.type}


class FeatureValidationError(BadDataError, ValueError):
    """The examples do not match the served model's features; `.problems` says where."""

    def __init__(self, problems: list[FeatureProblem]) -> None:
        super().__init__(f"{len(problems)} invalid feature value(s): {problems[0].message}")
        self.problems = problems


class Problems:
    """The problems found so far: the first `MAX_REPORTED_ERRORS` in full, the rest counted."""

    def __init__(self) -> None:
        self.items: list[FeatureProblem] = []
        self.dropped = 0

    def add(self, example: int | None, feature: str | None, message: str, kind: str) -> None:
        if len(self.items) < MAX_REPORTED_ERRORS:
            self.items.append(FeatureProblem(example, feature, message, kind))
        else:
            self.dropped += 1

    def room(self) -> int:
        """Problems that will still be reported one by one."""
        return MAX_REPORTED_ERRORS - len(self.items)

    def add_unreported(self, count: int) -> None:
        self.dropped += count

    def raise_if_any(self) -> None:
        if not self.items:
            return
        if self.dropped:
            self.items.append(
                FeatureProblem(None, None, f"... and {self.dropped} more problems", "too_many")
            )
        raise FeatureValidationError(self.items)

    def check_names(
        self,
        i: int,
        example: Mapping[str, object],
        known: Collection[str],
        required: Collection[str],
    ) -> None:
        """Report the names of example `i` that are not `known`, and the `required` ones it
        lacks. Messages are built only for the problems reported: the work stays bounded by
        the example, not by its names times the model's."""
        unknown = [k for k in example if k not in known]
        shown = unknown[: max(0, self.room())]
        for name in shown:
            self.add(
                i,
                shown_input(name),
                f"unknown feature '{shown_input(name)}'; the model takes {sorted(known)}",
                "unknown_feature",
            )
        self.add_unreported(len(unknown) - len(shown))
        for name in sorted(n for n in required if n not in example):
            self.add(i, name, f"missing feature {name!r}", "missing_feature")
