"""Checkpoint policies (the paper's): which rows a checkpoint holds and when a baseline is due.

At every interval boundary the trainer hands `plan()` the rows modified in the interval; the plan
says whether the checkpoint is full or a delta and which rows to copy:

- `full`: every checkpoint holds every row (the reference everything is compared against).
- `one-shot`: one full baseline, then each delta holds every row modified since that baseline
  (restore = baseline + one delta; deltas grow over time).
- `consecutive`: each delta holds only the rows modified in the last interval
  (restore = baseline + the whole chain).
- `intermittent`: consecutive deltas, plus a new full baseline when a history-based predictor says
  the chain (what must be kept and read to restore) would cost more than a fresh baseline.

Row sets are measured in rows, not bytes: with one codec for full and delta, bytes are
proportional to rows (up to the small row-index overhead), and the policy can decide in the
training thread without waiting for the publisher.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from schemas.errors import BadDataError
from schemas.manifest import ServedLoss

POLICIES = ("full", "one-shot", "consecutive", "intermittent")


class PolicyError(BadDataError, ValueError):
    """Unknown policy or bad policy parameter."""


@dataclass(frozen=True)
class Plan:
    """What the next checkpoint holds. `rows[table]` is None for every row of the table."""

    kind: Literal["full", "delta"]
    relative_to: Literal["parent", "baseline"] | None
    rows: dict[str, np.ndarray | None]


class Policy(ABC):
    """Decides the content of each checkpoint from the rows modified in each interval."""

    name: str

    def __init__(self, table_rows: Mapping[str, int]) -> None:
        self.table_rows = dict(table_rows)
        self._started = False

    @abstractmethod
    def plan(self, dirty: Mapping[str, np.ndarray]) -> Plan:
        """The next checkpoint, given the sorted row ids modified since the last one."""

    def force_full(self) -> None:
        """Make the next plan a full baseline (e.g. after a restore, or when asked)."""
        self._started = False

    def _full(self) -> Plan:
        self._started = True
        return Plan("full", None, {name: None for name in self.table_rows})


class FullPolicy(Policy):
    name = "full"

    def plan(self, dirty: Mapping[str, np.ndarray]) -> Plan:
        return self._full()


class ConsecutivePolicy(Policy):
    name = "consecutive"

    def plan(self, dirty: Mapping[str, np.ndarray]) -> Plan:
        if not self._started:
            return self._full()
        return Plan("delta", "parent", {n: dirty.get(n, _EMPTY) for n in self.table_rows})


class OneShotPolicy(Policy):
    name = "one-shot"

    def __init__(self, table_rows: Mapping[str, int]) -> None:
        super().__init__(table_rows)
        self._since_baseline = {n: np.zeros(r, dtype=bool) for n, r in self.table_rows.items()}

    def plan(self, dirty: Mapping[str, np.ndarray]) -> Plan:
        if not self._started:
            for bitmap in self._since_baseline.values():
                bitmap[:] = False
            return self._full()
        rows: dict[str, np.ndarray | None] = {}
        for name, bitmap in self._since_baseline.items():
            bitmap[dirty.get(name, _EMPTY)] = True
            rows[name] = np.flatnonzero(bitmap).astype(np.int64)
        return Plan("delta", "baseline", rows)


class IntermittentPolicy(Policy):
    """Consecutive deltas with a new baseline when the chain would outgrow `budget` baselines.

    The predictor: the next delta's size is the median of the last `history` deltas. A baseline
    is taken when the chain kept since the last baseline plus that prediction exceeds
    `budget` x (one baseline). With budget 1.0, what must be kept and read to restore never
    exceeds about two baselines, while most checkpoints stay small deltas.
    """

    name = "intermittent"

    def __init__(
        self, table_rows: Mapping[str, int], budget: float = 1.0, history: int = 4
    ) -> None:
        super().__init__(table_rows)
        if budget <= 0:
            raise PolicyError(f"intermittent budget must be > 0, got {budget}")
        self.budget = budget
        self._total_rows = sum(self.table_rows.values())
        self._chain_rows = 0
        self._recent: deque[int] = deque(maxlen=history)

    def plan(self, dirty: Mapping[str, np.ndarray]) -> Plan:
        size = sum(len(dirty.get(n, _EMPTY)) for n in self.table_rows)
        predicted = float(np.median(list(self._recent))) if self._recent else size
        if not self._started or self._chain_rows + size + predicted > (
            self.budget * self._total_rows
        ):
            self._chain_rows = 0
            self._recent.clear()
            return self._full()
        self._chain_rows += size
        self._recent.append(size)
        return Plan("delta", "parent", {n: dirty.get(n, _EMPTY) for n in self.table_rows})


_EMPTY = np.zeros(0, dtype=np.int64)

#: The bit-width rule (the paper's: fewer expected restores allow fewer bits), as measured by
#: `checknrun bench accuracy` on MovieLens-1M and the synthetic stream: (expected restores at
#: most, codec), ascending; docs/benchmarks/bit_rule.json holds the measurements behind it.
#: One seed per point and AUC noise of ~0.01% between runs: measured thresholds, not a proof.
MEASURED_BIT_RULE: tuple[tuple[float, str], ...] = ((2, "int4"), (10, "int8"))
#: beyond the last measured threshold: close enough to lossless for any number of restores.
FALLBACK_CODEC = "fp16"
#: restores from checkpoints a run expects over its lifetime unless told (`--codec auto`'s
#: floor is the bit rule's codec for it: int4).
DEFAULT_EXPECTED_RESTORES = 2.0


def codec_for_expected_restores(
    expected: float, rule: Sequence[tuple[float, str]] = MEASURED_BIT_RULE
) -> str:
    """The fewest-bits codec measured to keep AUC within 0.01% for `expected` restores."""
    if expected < 0:
        raise PolicyError(f"expected restores must be >= 0, got {expected}")
    for max_restores, codec in rule:
        if expected <= max_restores:
            return codec
    return FALLBACK_CODEC


#: the codecs `--codec auto` moves between, fewest bits first (each a measured step: int4 and
#: int8 are the bit rule's, fp16 its fallback, fp32 what is left when even fp16 costs too much).
AUTO_CODEC_LADDER: tuple[str, ...] = ("int4", "int8", "fp16", "fp32")
#: the default budget of `--codec auto`: the paper's criterion, 0.01% relative AUC.
SERVED_LOSS_BUDGET = 1e-4
#: versions in a row measured within half the budget before `--codec auto` steps down.
STEP_DOWN_AFTER = 3
#: the most versions a step down waits for, however often one was undone.
MAX_STEP_DOWN_AFTER = 48


class ServedLossCodecRule:
    """`--codec auto`: the bits of each version from the served loss measured on the live run.

    Starts at `floor` (the bit rule's codec for the expected restores: measured loss never
    takes a run below what its restores need) on `AUTO_CODEC_LADDER`. After each version:

    - measured `auc_rel_loss` > `budget`: one step up (more bits), for this version too when
      the publisher asks `step_up_now` before committing it (it does: `CheckpointPublisher`);
    - within `budget / 2` for `patience` versions in a row: one step down, never below `floor`;
    - anything else, or no measurement: stay.

    The loss judged is the served loss's sure part by default (`judge="sure"`: the low end of
    its 95% interval, `ServedLoss.sure_auc_rel_loss`), so a loss the window cannot tell from
    noise adds no bits; `judge="estimate"` takes the point estimate.

    Hysteresis: between budget/2 and budget nothing moves, and a step down waits for
    `patience` calm versions. A step down undone by the very next measurement doubles
    `patience` (up to MAX_STEP_DOWN_AFTER), so a run whose loss sits at the edge settles on the
    safe codec instead of flapping. A step changes the rows written from the next version on;
    rows not rewritten since keep their codec until a baseline rewrites them. A full version
    starts from the floor whatever the rule's codec (`first_codec`).
    """

    def __init__(
        self,
        floor: str = AUTO_CODEC_LADDER[0],
        *,
        budget: float = SERVED_LOSS_BUDGET,
        patience: int = STEP_DOWN_AFTER,
        judge: Literal["sure", "estimate"] = "sure",
    ) -> None:
        if floor not in AUTO_CODEC_LADDER:
            raise PolicyError(
                f"--codec auto starts from one of {', '.join(AUTO_CODEC_LADDER)}, got {floor!r}"
            )
        if not budget > 0:
            raise PolicyError(f"the served-loss budget must be > 0, got {budget}")
        if patience < 1:
            raise PolicyError(f"patience must be >= 1 version, got {patience}")
        if judge not in ("sure", "estimate"):
            raise PolicyError(f"judge must be 'sure' or 'estimate', got {judge!r}")
        self.judge = judge
        self.floor = AUTO_CODEC_LADDER.index(floor)
        self.budget = budget
        self.patience = patience
        self._step = self.floor
        self._calm = 0
        self._just_stepped_down = False

    @property
    def codec(self) -> str:
        """The codec of the next version."""
        return AUTO_CODEC_LADDER[self._step]

    def judged(self, loss: ServedLoss) -> float:
        """The relative AUC loss this rule judges a measurement by (see the class docstring)."""
        return loss.sure_auc_rel_loss if self.judge == "sure" else loss.auc_rel_loss

    def first_codec(self, kind: str) -> str:
        """The codec a version of `kind` is encoded with first: `codec` for a delta, the floor
        for a full version. A full version is scored on the whole window (it carries every row:
        the least noisy measurement a run makes), and what it holds is most of what a restore
        reads until the next one, so it gets the fewest bits that measure within the budget
        (`step_up_now` climbs from there), not those a noisy delta left the rule at."""
        return AUTO_CODEC_LADDER[self.floor] if kind == "full" else self.codec

    def step_up_now(self, auc_rel_loss: float | None, tried: str | None = None) -> str | None:
        """A version measured at `tried` (default: `codec`) before its commit: when its loss is
        over the budget, the codec one step above `tried` to encode it again with; None when it
        is within the budget, not measured, or `tried` is the top of the ladder.

        When `tried` is at or above the rule's own codec, the rule steps up too (as `observe`
        would); a full version tried below it (`first_codec`) leaves the rule where it is.

        The publisher (`CheckpointPublisher`) encodes the version again with that codec and
        measures it again, so no version commits over the budget while more bits can help;
        the committed measurement then goes to `observe` as every other version's does.
        """
        if auc_rel_loss is None or not auc_rel_loss > self.budget:
            return None
        at = AUTO_CODEC_LADDER.index(self.codec if tried is None else tried)
        if at + 1 >= len(AUTO_CODEC_LADDER):
            return None
        if at >= self._step:
            self.observe(auc_rel_loss)
        return AUTO_CODEC_LADDER[at + 1]

    def observe(self, auc_rel_loss: float | None) -> str:
        """Take one version's measured loss (None: not measured); return the next codec."""
        stepped_down, self._just_stepped_down = self._just_stepped_down, False
        if auc_rel_loss is None:
            return self.codec
        if auc_rel_loss > self.budget:
            self._calm = 0
            if self._step + 1 < len(AUTO_CODEC_LADDER):
                self._step += 1
                if stepped_down:
                    self.patience = min(2 * self.patience, MAX_STEP_DOWN_AFTER)
        elif auc_rel_loss <= self.budget / 2:
            self._calm += 1
            if self._calm >= self.patience and self._step > self.floor:
                self._step -= 1
                self._calm = 0
                self._just_stepped_down = True
        else:
            self._calm = 0
        return self.codec


def make_policy(name: str, table_rows: Mapping[str, int], **params: float) -> Policy:
    """The policy called `name` (one of POLICIES)."""
    classes: dict[str, type[Policy]] = {
        "full": FullPolicy,
        "one-shot": OneShotPolicy,
        "consecutive": ConsecutivePolicy,
        "intermittent": IntermittentPolicy,
    }
    if name not in classes:
        raise PolicyError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    if name == "intermittent":
        return IntermittentPolicy(
            table_rows,
            budget=float(params.get("budget", 1.0)),
            history=int(params.get("history", 4)),
        )
    return classes[name](table_rows)


def auto_codec_rule(
    expected_restores: float | None = None,
    budget: float | None = None,
    judge: Literal["sure", "estimate"] = "sure",
) -> ServedLossCodecRule:
    """`--codec auto`'s rule: from the bit rule's codec for `expected_restores` (default
    DEFAULT_EXPECTED_RESTORES), stepping within `budget` (default SERVED_LOSS_BUDGET) as `judge`
    reads a loss; the same for one process and for a sharded job."""
    restores = DEFAULT_EXPECTED_RESTORES if expected_restores is None else expected_restores
    floor = codec_for_expected_restores(restores)
    return ServedLossCodecRule(
        floor, budget=SERVED_LOSS_BUDGET if budget is None else budget, judge=judge
    )
