"""The release gate's documents (docs/FORMAT.md section 9): RELEASED, release records, evaluations.

    RELEASED                      what the fleet serves by default: a version, its manifest, and
                                  the release record that moved it there (`sequence` S)
    releases/SSSSSSSSSSSS-T.json  one move of RELEASED (`ReleaseRecord`), linked to the previous
    evaluations/VVVVVVVVVVVV.json version V scored on the events after it, next to the released
    (`Evaluation`)                version, and the gate's decision

Each is UTF-8 JSON parsed by the JSON rule of every document (schemas/strict_json.py) and
validated by frozen pydantic models that forbid extra fields, like the manifest. Rules (MUST):

- keys a document names lie under the model's own prefix: `manifest` under `NAME/manifests/`,
  `record` and `previous` under `NAME/releases/`;
- every float is finite, and an interval's `low <= estimate <= high`;
- an evaluation has `released` iff it has a `baseline`, and paired differences only then.
"""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.errors import ManifestError
from schemas.manifest import check_model_name, parse_created_at, parse_document
from schemas.store_keys import check_key, is_manifest_key, is_release_record_key

#: the manifest `metrics` entry (1.0) of a version a release gate will judge: a released
#: follower serves nothing of such a model before RELEASED exists (docs/FORMAT.md 9.4).
RELEASE_GATE_METRIC = "release_gate"
#: the most bytes a reader takes for RELEASED, a release record or an evaluation.
MAX_RELEASE_BYTES = 64 * 1024
MAX_REASON_CHARS = 1024

Action = Literal["release", "rollback"]
Mover = Literal["gate", "person"]
Decision = Literal["release", "hold"]


class ReleaseFormatError(ManifestError):
    """RELEASED, a release record or an evaluation that breaks docs/FORMAT.md section 9."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class _Document(_Frozen):
    """A stored document: its bytes, and parsed back from them (`_WHAT` names it in errors)."""

    _WHAT: ClassVar[str] = "document"

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes) -> Self:
        return parse_document(cls, data, MAX_RELEASE_BYTES, cls._WHAT, ReleaseFormatError)

    @field_validator("created_at", mode="before", check_fields=False)
    @classmethod
    def _created(cls, value: object) -> object:
        return parse_created_at(value)


def _check_keys(model: str, manifest: str, *records: str | None) -> None:
    try:
        check_model_name(model)
        check_key(model, manifest)
        for record in records:
            if record is not None:
                check_key(model, record)
    except ManifestError as exc:
        raise ValueError(str(exc)) from exc
    if not is_manifest_key(model, manifest):
        raise ValueError(f"{manifest!r} is not a manifest key of {model!r}")
    for record in records:
        if record is not None and not is_release_record_key(model, record):
            raise ValueError(f"{record!r} is not a release record key of {model!r}")


class Released(_Document):
    """The RELEASED pointer: the version the fleet serves by default (docs/FORMAT.md 9.1)."""

    _WHAT: ClassVar[str] = "RELEASED"

    schema_version: Literal[1] = 1
    model: str
    version: int = Field(ge=1)
    manifest: str
    sequence: int = Field(ge=1)
    record: str

    @model_validator(mode="after")
    def _keys(self) -> Released:
        _check_keys(self.model, self.manifest, self.record)
        return self


class ReleaseRecord(_Document):
    """One move of RELEASED (docs/FORMAT.md 9.2)."""

    _WHAT: ClassVar[str] = "release record"

    schema_version: Literal[1] = 1
    model: str
    sequence: int = Field(ge=1)
    version: int = Field(ge=1)
    manifest: str
    action: Action
    by: Mover
    reason: str = Field(min_length=1, max_length=MAX_REASON_CHARS)
    previous: str | None
    previous_version: int | None = Field(ge=1)
    created_at: datetime

    @model_validator(mode="after")
    def _consistent(self) -> ReleaseRecord:
        _check_keys(self.model, self.manifest, self.previous)
        if (self.previous is None) != (self.sequence == 1):
            raise ValueError(
                f"record {self.sequence} {'has' if self.previous else 'lacks'} a previous "
                "record: only the first has none"
            )
        return self


class Interval(_Frozen):
    """An estimate and its two-sided confidence interval, at the gate's `level`."""

    estimate: float = Field(allow_inf_nan=False)
    low: float = Field(allow_inf_nan=False)
    high: float = Field(allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> Interval:
        if not self.low <= self.estimate <= self.high:
            raise ValueError(
                f"interval {self.low} <= {self.estimate} <= {self.high} is not ordered"
            )
        return self


class Window(_Frozen):
    """The events a version was evaluated on: every one after `after_samples`."""

    after_samples: int = Field(ge=0)
    examples: int = Field(ge=1)
    positives: int = Field(ge=0)

    @model_validator(mode="after")
    def _positives(self) -> Window:
        if self.positives > self.examples:
            raise ValueError(f"{self.positives} positives among {self.examples} examples")
        return self


class Quality(_Frozen):
    """One model's figures on a window."""

    auc: float | None = Field(ge=0.0, le=1.0)
    #: the standard error of `auc` (None with it).
    auc_se: float | None = Field(ge=0.0, allow_inf_nan=False)
    logloss: float = Field(ge=0.0, allow_inf_nan=False)
    #: the standard error of `logloss` (what an unpaired comparison of windows needs).
    logloss_se: float = Field(ge=0.0, allow_inf_nan=False)
    #: mean score / positive rate (1.0: calibrated), None without positives.
    calibration: Interval | None


class Probation(_Frozen):
    """A released version `released` against the one released before it, `last_good`."""

    released: int = Field(ge=1)
    last_good: int = Field(ge=1)
    auc_diff: Interval | None
    logloss_diff: Interval


class GateRules(_Frozen):
    """The rules an evaluation was judged by (docs/FORMAT.md 9.3)."""

    level: float = Field(gt=0.0, lt=1.0)
    auc_tolerance: float = Field(ge=0.0, allow_inf_nan=False)
    logloss_tolerance: float = Field(ge=0.0, allow_inf_nan=False)
    calibration: tuple[float, float]
    drift_tolerance: float = Field(ge=0.0, allow_inf_nan=False)
    drift_auc_tolerance: float = Field(ge=0.0, allow_inf_nan=False)
    probation_windows: int = Field(ge=0)
    block_examples: int = Field(ge=1)

    @field_validator("calibration", mode="before")
    @classmethod
    def _pair(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _bounds(self) -> GateRules:
        low, high = self.calibration
        if not 0.0 <= low <= 1.0 <= high < float("inf"):
            raise ValueError(f"calibration bounds [{low}, {high}] must hold 1.0")
        return self


class Evaluation(_Document):
    """Version `version` scored on the window of events after it, next to the released version,
    and the gate's decision (docs/FORMAT.md 9.3)."""

    _WHAT: ClassVar[str] = "evaluation"

    schema_version: Literal[1] = 1
    model: str
    version: int = Field(ge=1)
    manifest: str
    window: Window
    baseline: int | None = Field(ge=1)
    candidate: Quality
    released: Quality | None
    auc_diff: Interval | None
    logloss_diff: Interval | None
    drift: Interval | None
    auc_drift: Interval | None
    #: the released version's figures on this window were away from its reference (the
    #: drift check failed): the next window must come back within half the tolerances.
    drifting: bool = False
    probation: Probation | None
    decision: Decision
    reason: str = Field(min_length=1, max_length=MAX_REASON_CHARS)
    gate: GateRules
    created_at: datetime

    @model_validator(mode="after")
    def _consistent(self) -> Evaluation:
        _check_keys(self.model, self.manifest)
        compared = self.baseline is not None
        if (self.released is not None) != compared:
            raise ValueError("`released` is given iff `baseline` is")
        if (self.auc_diff is not None or self.logloss_diff is not None) and not compared:
            raise ValueError("a paired difference without a `baseline`")
        if (self.drift is not None or self.auc_drift is not None) and not compared:
            raise ValueError("a drift without a `baseline`")
        return self
